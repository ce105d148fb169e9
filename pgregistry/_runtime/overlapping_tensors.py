"""Tensors whose memory overlaps: views of one storage that share bytes.

Two parameters over one tensor, or grads that are overlapping views of one buffer, are one memory
read or written twice: a flat optimizer copying each into its own place unties them, and a norm
counts the shared elements twice while a clip scales them twice. Torch-free (the caller's tensors
answer for their storage).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["first_overlap"]


def first_overlap(tensors: Sequence[torch.Tensor]) -> tuple[int, int] | None:
    """Positions ``(i, j)``, ``i < j``, of two of ``tensors`` whose bytes in one storage overlap.

    ``None`` when none do. Each tensor is taken as the byte range from its first element to its
    last, so views that interleave (every other column of one matrix each) are read as
    overlapping, and disjoint views of one storage (those of a flat buffer) are not. Empty tensors
    hold no bytes. One sort: O(n log n), a few microseconds a tensor.
    """
    extents = []
    for index, tensor in enumerate(tensors):
        if tensor.numel() == 0:
            continue
        size = tensor.element_size()
        first = int(tensor.storage_offset()) * size
        reach = sum(
            (n - 1) * abs(step) for n, step in zip(tensor.shape, tensor.stride(), strict=True)
        )
        extents.append(
            (tensor.untyped_storage().data_ptr(), first, first + size * (1 + reach), index)
        )
    extents.sort()
    # (storage, end, position) of the extent reaching furthest so far
    furthest: tuple[int, int, int] | None = None
    for storage, first, last, index in extents:
        if furthest is not None and furthest[0] == storage and first < furthest[1]:
            return min(furthest[2], index), max(furthest[2], index)
        if furthest is None or furthest[0] != storage or last > furthest[1]:
            furthest = (storage, last, index)
    return None

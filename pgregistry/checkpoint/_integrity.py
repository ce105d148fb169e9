"""Per-tensor checksums: a rank file stores each tensor's CRC-32; a load checks those it reads.

``torch.load`` checks neither the zip records' CRCs nor anything else about tensor bytes: one
flipped byte in a stored tensor (a bad disk, a truncated copy patched up, a bit flip in transit)
loads as a silently different weight. CRC-32 detects every error of up to 32 consecutive bits and
runs at several GB/s (zlib's, over the tensor's bytes in place), a small fraction of the cost of
writing the same bytes (``benchmarks/checkpoint.py`` measures both). Each rank checks only the
tensors it loads, so memory-mapped files are never read whole.

The checksums mirror the stored state: a mapping or a list of them holds each tensor's CRC where the
state holds the tensor, and ``None`` for any other value.
"""

from __future__ import annotations

import ctypes
import zlib
from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["checksums_of", "find_damaged_tensors", "tensor_crc32"]


def tensor_crc32(tensor: torch.Tensor) -> int:
    """CRC-32 of ``tensor``'s elements as bytes in row-major order.

    A device tensor is copied to the host first.
    """
    flat = tensor.detach().to("cpu").contiguous()
    size = flat.numel() * flat.element_size()
    if size == 0:
        return zlib.crc32(b"")
    # The bytes in place (a memory-mapped tensor included): no copy, and no numpy, which torch does
    # not require.
    return zlib.crc32((ctypes.c_char * size).from_address(flat.data_ptr()))


def checksums_of(value: Any) -> Any:
    """``value``'s structure with each tensor replaced by its :func:`tensor_crc32`.

    Mappings, lists and tuples are walked; any other value becomes ``None``."""
    if isinstance(value, torch.Tensor):
        return tensor_crc32(value)
    if isinstance(value, Mapping):
        return {key: checksums_of(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [checksums_of(item) for item in value]
    return None


def find_damaged_tensors(value: Any, checksums: Any, label: str) -> list[str]:
    """The labels of the tensors under ``value`` whose bytes do not match ``checksums``.

    A label is ``label``, then ``/key`` or ``[index]`` per level; ``checksums`` are what
    :func:`checksums_of` gave at save. A tensor without a stored checksum is included."""
    if isinstance(value, torch.Tensor):
        return [] if checksums == tensor_crc32(value) else [label]
    if isinstance(value, Mapping):
        stored = checksums if isinstance(checksums, Mapping) else {}
        return [
            bad
            for key, item in value.items()
            for bad in find_damaged_tensors(item, stored.get(key), f"{label}/{key}")
        ]
    if isinstance(value, (list, tuple)):
        stored_items = (
            list(checksums) if isinstance(checksums, list) and len(checksums) == len(value) else []
        )
        return [
            bad
            for index, item in enumerate(value)
            for bad in find_damaged_tensors(
                item, stored_items[index] if stored_items else None, f"{label}[{index}]"
            )
        ]
    return []

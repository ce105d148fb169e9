"""A flat main buffer's *copies*: the tensors a flat step writes after it updates the buffer (the
low-precision model parameters of a mixed-precision optimizer, packed per dtype run; a sharded
optimizer's parameter shard), and the unfused way to write them.

Apart from :mod:`~pgregistry.optim._flat_step`, which steps the buffer, because the one-kernel step
(:mod:`~pgregistry.optim._fused_step`) writes copies too and :mod:`~pgregistry.optim._flat_step`
imports it: both read what a copy is from here, and neither imports the other back.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch

__all__ = ["Copy", "write_copies"]


@attrs.frozen(slots=True, eq=False)
class Copy:
    """After every step, ``out`` holds ``flat[start : start + out.numel()]`` rounded to its dtype.

    ``out`` is a contiguous 1-d tensor, of any floating dtype."""

    start: int
    out: torch.Tensor


def write_copies(flat: torch.Tensor, copies: Sequence[Copy]) -> None:
    """Write ``copies`` of ``flat`` (one ``_foreach_copy_``)."""
    if copies:
        sources = [flat.detach()[c.start : c.start + c.out.numel()] for c in copies]
        torch._foreach_copy_([c.out for c in copies], sources)

"""Decisions every rank of a checkpoint call takes alike, so that a fault on one rank raises on all of them.

Saving and loading are collective: a rank that raised alone would leave its peers waiting for ever in the next
collective (the next all-reduce of a check, the all-gather of restored shards, DCP's own exchanges). So each step
that can fail on one rank (reading its files, naming its parameters, writing its file) runs on every rank, and one
all-reduce of a failure flag then tells every rank whether any failed: the rank that failed raises its own error,
the others an error saying another rank failed (see its error). Outside a distributed world these are plain calls.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch
import torch.distributed as dist

from pgregistry.grad_stats import backend_device

__all__ = ["agreed", "max_over_ranks", "raise_on_every_rank", "world"]

T = TypeVar("T")


def world() -> tuple[int, int]:
    """``(rank, world size)`` of the default group; ``(0, 1)`` outside a distributed world."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def max_over_ranks(values: list[int]) -> list[int]:
    """The element-wise maximum of ``values`` over every rank (``values`` itself outside a distributed world).

    Every rank must call it with as many values; the checks built on it therefore raise on every rank alike.
    """
    if world()[1] == 1:
        return values
    tensor = torch.tensor(values, dtype=torch.int64, device=backend_device(None))
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return [int(v) for v in tensor.tolist()]


def raise_on_every_rank(error: BaseException | None, elsewhere: Exception) -> None:
    """Return when no rank has an error; otherwise raise ``error`` on the ranks that have one and ``elsewhere`` on
    the others. Collective: one all-reduce of a flag, so every rank must call it, failed or not."""
    if max_over_ranks([int(error is not None)])[0]:
        raise error if error is not None else elsewhere


def agreed(step: Callable[[], T], elsewhere: Exception) -> T:
    """``step()`` on this rank, raising on every rank when it raised on any: its own error where it raised,
    ``elsewhere`` on the others (the same one all-reduce as :func:`raise_on_every_rank`)."""
    try:
        result = step()
    except Exception:
        max_over_ranks([1])  # tell the other ranks before raising here
        raise
    raise_on_every_rank(None, elsewhere)
    return result

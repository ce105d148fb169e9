"""Helpers shared by the core tests that run inside gloo worlds (imported as ``core_support``)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["bits", "errors_of", "member_mask"]


def member_mask(group: Any) -> int:
    """Bit mask of ``group``'s members (bit r set for rank r), by a real all-reduce of ``1 << rank``."""
    mask = torch.tensor([1 << dist.get_rank()], dtype=torch.int64)
    dist.all_reduce(mask, group=group)
    return int(mask.item())


def bits(ranks: Iterable[int] | None) -> int:
    """The bit mask :func:`member_mask` must return for a group of ``ranks``."""
    assert ranks is not None
    return sum(1 << r for r in ranks)


def errors_of(calls: Mapping[str, Callable[[], object]]) -> dict[str, str]:
    """Label -> ``"<ExceptionType>: <message>"`` for each call that raises, ``"no error"`` otherwise.

    Run inside a world, so every rank's outcome of each misuse comes back to the test as plain text."""
    out = {}
    for label, call in calls.items():
        try:
            call()
            out[label] = "no error"
        except (ValueError, RuntimeError, LookupError, TypeError, AttributeError) as exc:
            out[label] = f"{type(exc).__name__}: {exc}"
    return out

"""Autograd-aware collectives for the demo model's tensor- and expert-parallel regions.

Each function is the identity when its group is ``None`` (the axis is off), so the same model code
runs on any layout. The forward/backward pairs are the standard ones of Megatron-style model
parallelism:

=====================  ===================================  ========================================
function               forward                              backward
=====================  ===================================  ========================================
``enter_sharded``      identity                             all-reduce (each rank: a partial grad)
``leave_sharded``      all-reduce (sum of partial outputs)  identity
``split_replicated``   this rank's chunk of dim 0           all-gather over dim 0
``gather_replicated``  all-gather over dim 0                own chunk (downstream is replicated)
``gather_distinct``    all-gather over dim 0                reduce-scatter (all ranks' grads summed)
``scatter_distinct``   reduce-scatter (sum, own chunk)      all-gather over dim 0
=====================  ===================================  ========================================

``*_replicated`` is for tensors whose downstream computation is repeated identically on every rank
of the group (TP), ``*_distinct`` for tensors each rank uses differently (EP token exchange).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from pgregistry.collection import group_rank, group_size

__all__ = [
    "enter_sharded",
    "gather_distinct",
    "gather_replicated",
    "leave_sharded",
    "scatter_distinct",
    "split_replicated",
]


def _all_reduce(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    out = x.contiguous().clone()
    dist.all_reduce(out, group=group)
    return out


def _all_gather(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(group_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=0)


def _chunk(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    return x.chunk(group_size(group), dim=0)[group_rank(group)].contiguous()


def _identity(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    return x.view_as(x)


def _reduce_scatter(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    return _chunk(_all_reduce(x, group), group)


Op = Callable[[torch.Tensor, ProcessGroup], torch.Tensor]


class _Paired(torch.autograd.Function):
    """``forward_op`` forward, ``backward_op`` on the incoming grad: one class for every pair in the
    table."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, group: ProcessGroup, forward_op: Op, backward_op: Op
    ) -> torch.Tensor:
        ctx.group, ctx.backward_op = group, backward_op
        return forward_op(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return ctx.backward_op(grad, ctx.group), None, None, None


def _apply(
    x: torch.Tensor, group: ProcessGroup | None, forward_op: Op, backward_op: Op
) -> torch.Tensor:
    if group is None or group_size(group) == 1:
        return x
    out: torch.Tensor = _Paired.apply(x, group, forward_op, backward_op)
    return out


def enter_sharded(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Input of a column-parallel layer: identity forward, all-reduce backward."""
    return _apply(x, group, _identity, _all_reduce)


def leave_sharded(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Output of a row-parallel layer: all-reduce forward, identity backward."""
    return _apply(x, group, _all_reduce, _identity)


def split_replicated(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """This rank's dim-0 chunk of a tensor replicated over ``group``."""
    return _apply(x, group, _chunk, _all_gather)


def gather_replicated(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Reassemble chunks into a tensor whose downstream use is replicated over ``group``."""
    return _apply(x, group, _all_gather, _chunk)


def gather_distinct(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """All-gather tokens that every rank then uses differently (expert dispatch)."""
    return _apply(x, group, _all_gather, _reduce_scatter)


def scatter_distinct(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Sum every rank's partial outputs and keep this rank's chunk (expert combine)."""
    return _apply(x, group, _reduce_scatter, _all_gather)

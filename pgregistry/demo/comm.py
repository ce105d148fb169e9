"""Autograd-aware collectives for the demo model's tensor- and expert-parallel regions.

Each function is the identity when its group is ``None`` (the axis is off), so the same model code runs on any
layout. The forward/backward pairs are the standard ones of Megatron-style model parallelism:

========================  =====================================  ==========================================
function                  forward                                backward
========================  =====================================  ==========================================
``enter_sharded``         identity                               all-reduce (each rank holds a partial grad)
``leave_sharded``         all-reduce (sum of partial outputs)    identity
``split_replicated``      this rank's chunk of dim 0             all-gather over dim 0
``gather_replicated``     all-gather over dim 0                  this rank's chunk (downstream is replicated)
``gather_distinct``       all-gather over dim 0                  reduce-scatter (sum of every rank's grads)
``scatter_distinct``      reduce-scatter (sum, own chunk)        all-gather over dim 0
========================  =====================================  ==========================================

``*_replicated`` is for tensors whose downstream computation is repeated identically on every rank of the
group (TP), ``*_distinct`` for tensors each rank uses differently (EP token exchange).
"""

from __future__ import annotations

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


class _EnterSharded(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_reduce(grad, ctx.group), None


class _LeaveSharded(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _SplitReplicated(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return _chunk(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_gather(grad, ctx.group), None


class _GatherReplicated(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return _all_gather(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _chunk(grad, ctx.group), None


class _GatherDistinct(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return _all_gather(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _chunk(_all_reduce(grad, ctx.group), ctx.group), None


class _ScatterDistinct(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return _chunk(_all_reduce(x, group), group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_gather(grad, ctx.group), None


def _apply(fn: type[torch.autograd.Function], x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    if group is None or group_size(group) == 1:
        return x
    out: torch.Tensor = fn.apply(x, group)
    return out


def enter_sharded(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Input of a column-parallel layer: identity forward, all-reduce backward."""
    return _apply(_EnterSharded, x, group)


def leave_sharded(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Output of a row-parallel layer: all-reduce forward, identity backward."""
    return _apply(_LeaveSharded, x, group)


def split_replicated(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """This rank's dim-0 chunk of a tensor replicated over ``group``."""
    return _apply(_SplitReplicated, x, group)


def gather_replicated(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Reassemble chunks into a tensor whose downstream use is replicated over ``group``."""
    return _apply(_GatherReplicated, x, group)


def gather_distinct(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """All-gather tokens that every rank then uses differently (expert dispatch)."""
    return _apply(_GatherDistinct, x, group)


def scatter_distinct(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Sum every rank's partial outputs and keep this rank's chunk (expert combine)."""
    return _apply(_ScatterDistinct, x, group)

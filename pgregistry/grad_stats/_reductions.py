"""Norms, zero counts and clipping of already-filtered grads, each group's share reduced over its group.

The reductions issue one all-reduce per distinct group, in an order every rank agrees on, and leave the result
on the grads' device (no host sync), so optimizers can call them every step; see ``docs/design/grad_stats_api.md``.

Local shares take one multi-tensor call per (device, dtype), never a launch per tensor from Python: on CUDA, with
triton, contiguous float32/bf16/fp16 grads are read by one kernel over a table of their addresses
(:mod:`pgregistry.grad_stats._fused`) for the 2-norm and the zero count; otherwise ``torch._foreach_norm``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar, cast

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from pgregistry.collection import group_size
from pgregistry.grad_stats._devices import reduction_device
from pgregistry.grad_stats._fused import one_read_applies, squares_and_zeros

__all__ = ["CLIP_EPSILON", "GradsByGroup", "clip_grads_", "norm_of_grads", "reduce_over_groups", "zeros_of_grads"]

CLIP_EPSILON = 1e-6
"""Added to the total norm before dividing, as Megatron-Core does: ``coeff = max_norm / (norm + 1e-6)``."""

GradsByGroup = Mapping[ProcessGroup | None, Sequence[torch.Tensor]]
"""Reduction group (``None``: no reduction) -> already-filtered grads."""

V = TypeVar("V")


def norm_of_grads(grads_by_group: GradsByGroup, norm_type: float = 2.0) -> torch.Tensor:
    """The ``norm_type``-norm of already-filtered grads, each group's share summed over its group.

    One all-reduce per distinct group (SUM of ``|g|^p``, MAX for the inf-norm), issued in an order every rank
    agrees on (by the group's ranks); ``None`` and single-rank groups issue none. Every rank of a group must
    pass that group as a key, with an empty list when it holds no grads for it. Returns a 0-dim float32 tensor
    on the grads' device, without a host sync. An empty mapping or empty lists give 0.
    """
    p = checked_norm_type(norm_type)
    device = _device_of(grads_by_group)
    infinite = math.isinf(p)
    total = torch.zeros((), dtype=torch.float32, device=device)
    op = dist.ReduceOp.MAX if infinite else dist.ReduceOp.SUM
    for share in reduce_over_groups(grads_by_group, lambda grads: local_share(grads, p, device), op):
        total = torch.maximum(total, share) if infinite else total + share
    return total if infinite else total.pow(1.0 / p)


def zeros_of_grads(grads_by_group: GradsByGroup) -> torch.Tensor:
    """The number of zero elements in already-filtered grads, summed over each group (a 0-dim int64 tensor)."""
    device = _device_of(grads_by_group)
    total = torch.zeros((), dtype=torch.int64, device=device)
    for share in reduce_over_groups(grads_by_group, lambda grads: local_zeros(grads, device), dist.ReduceOp.SUM):
        total += share
    return total


def reduce_over_groups(
    items_by_group: Mapping[ProcessGroup | None, V], local: Callable[[V], torch.Tensor], op: Any
) -> Iterator[torch.Tensor]:
    """Each group's local share ``local(items)``, all-reduced in place with ``op`` over its group.

    One collective per group of more than one rank (none for ``None``), issued in an order every rank agrees on
    (by the group's ranks, then its name): ranks that share two groups must reduce them in the same order. Every
    rank of a group must pass that group as a key. The statistics of :func:`norm_of_grads`,
    :func:`zeros_of_grads` and :mod:`pgregistry._grad_buffer` all reduce through this.
    """
    for group, items in _in_collective_order(items_by_group):
        share = local(items)
        _all_reduce(share, op, group)
        yield share


def local_zeros(grads: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Zero elements in ``grads`` as a 0-dim int64 tensor, one fused call per (device, dtype) and no mask the size
    of the grads (``count_nonzero`` allocates one per tensor on CUDA): the one-read kernel's exact count, else
    numel minus the L0 norms, accumulated in float64 (exact up to 2**53 elements)."""
    zeros = torch.zeros((), dtype=torch.int64, device=device)
    for (kind_device, dtype), same_kind in _by_kind(grads).items():
        read_once, rest = _one_read_split(kind_device, dtype, same_kind)
        if read_once:
            zeros += squares_and_zeros(read_once, checked=True)[1].to(device)
        if rest:
            nonzero = torch.stack(torch._foreach_norm(rest, 0, dtype=torch.float64)).sum()
            zeros += sum(grad.numel() for grad in rest) - nonzero.to(device=device, dtype=torch.int64)
    return zeros


def _one_read_split(
    device: torch.device, dtype: torch.dtype, grads: list[torch.Tensor]
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """``grads`` (one device and dtype) split into those the one-read kernel reads (plain contiguous tensors: it
    reads their memory directly) and the rest (tensor subclasses such as DTensor, non-contiguous views). The usual
    case, every grad a plain contiguous tensor, takes two passes at C speed; only a mixed list is split in Python."""
    if not one_read_applies(device, dtype):
        return [], _non_empty(grads)
    if set(map(type, grads)) == {torch.Tensor} and all(map(torch.Tensor.is_contiguous, grads)):
        return grads, []
    read_once: list[torch.Tensor] = []
    rest: list[torch.Tensor] = []
    for grad in grads:
        (read_once if type(grad) is torch.Tensor and grad.is_contiguous() else rest).append(grad)
    return read_once, _non_empty(rest)


def _non_empty(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """``grads`` without empty tensors, for torch's route (the inf-norm of an empty tensor is an error there); the
    one-read kernel reads empty tensors as nothing, so its route skips this pass."""
    return [grad for grad in grads if grad.numel()] if 0 in map(torch.Tensor.numel, grads) else grads


def clip_grads_(
    grads: Sequence[torch.Tensor],
    max_norm: float,
    total_norm: torch.Tensor | float,
    *,
    error_if_nonfinite: bool = False,
) -> torch.Tensor:
    """Scale ``grads`` in place by ``max_norm / (total_norm + 1e-6)`` where that is below 1.

    The coefficient is clamped at 1 as a tensor, so nothing waits on the device; scaling by exactly 1 leaves a
    grad unchanged. A NaN or infinite ``total_norm`` (an overflow, one NaN grad anywhere in the world) leaves
    every grad unscaled: its coefficient would be NaN, or 0 for an infinite norm, and would poison or erase the
    finite grads too; the caller sees the non-finite norm and skips the step. With ``error_if_nonfinite`` (as in
    ``torch.nn.utils.clip_grad_norm_``) a non-finite norm raises ``RuntimeError`` instead, which waits for the
    norm on the host. Returns the coefficient applied (a 0-dim float32 tensor).
    """
    if not max_norm > 0 or math.isinf(max_norm):
        raise ValueError(f"max_norm must be a positive finite number, got {max_norm!r}")
    device = grads[0].device if grads else _tensor_device(total_norm)
    norm = torch.as_tensor(total_norm, dtype=torch.float32, device=device)
    finite = torch.isfinite(norm)
    if error_if_nonfinite and not bool(finite):
        raise RuntimeError(
            f"the total grad norm is {float(norm)}, not finite, so the grads cannot be clipped (they are left as "
            "they are); pass error_if_nonfinite=False to leave them unscaled without raising"
        )
    clipped = torch.clamp(max_norm / (norm + CLIP_EPSILON), max=1.0)
    coeff = torch.where(finite, clipped, torch.ones_like(clipped))
    for (grad_device, _), same_kind in _by_kind(grads).items():
        torch._foreach_mul_(same_kind, coeff.to(grad_device))
    return coeff


def checked_norm_type(norm_type: float) -> float:
    """``norm_type`` as a float; ``ValueError`` unless it is positive (inf included)."""
    p = float(norm_type)
    if math.isnan(p) or p <= 0:
        raise ValueError(f"norm_type must be positive (or inf), got {norm_type!r}")
    return p


def local_share(grads: Sequence[torch.Tensor], p: float, device: torch.device) -> torch.Tensor:
    """Sum of ``|g|^p`` (max of ``|g|`` for the inf-norm) over ``grads``, as a 0-dim float32 tensor."""
    share = torch.zeros((), dtype=torch.float32, device=device)
    for (kind_device, dtype), same_kind in _by_kind(grads).items():
        if p == 2.0:
            read_once, same_kind = _one_read_split(kind_device, dtype, same_kind)
            if read_once:  # squares summed in float64 by the kernel's caller
                share = share + squares_and_zeros(read_once, checked=True)[0].to(device=device, dtype=torch.float32)
        else:
            same_kind = _non_empty(same_kind)
        if not same_kind:
            continue
        # One fused kernel per (device, dtype) instead of a launch per tensor; norms accumulate in float32 at least
        # (float64 grads stay float64 until their share is summed).
        accumulate = torch.promote_types(dtype, torch.float32)
        norms = torch.stack(torch._foreach_norm(same_kind, p, dtype=accumulate))
        part = norms.max() if math.isinf(p) else norms.pow(p).sum()
        part = part.to(device=device, dtype=torch.float32)
        share = torch.maximum(share, part) if math.isinf(p) else share + part
    return share


def _by_kind(grads: Sequence[torch.Tensor]) -> dict[tuple[torch.device, torch.dtype], list[torch.Tensor]]:
    """``grads`` by (device, dtype): the unit of one fused call (empty tensors included: each route drops them as
    it needs). Grouped by torch's own C++ helper (the one its optimizers use): a Python loop over 20,000 grads
    costs milliseconds per call."""
    grads = list(grads)
    if not grads:
        return {}
    grouped = torch._C._group_tensors_by_device_and_dtype([list[torch.Tensor | None](grads)], False)
    return {kind: cast("list[torch.Tensor]", lists[0]) for kind, (lists, _) in grouped.items()}


def _all_reduce(tensor: torch.Tensor, op: Any, group: ProcessGroup | None) -> None:
    # None is an axis that is off: nothing to reduce (and None would mean WORLD to torch.distributed).
    if group is not None and group_size(group) > 1:
        dist.all_reduce(tensor, op=op, group=group)


def _in_collective_order(items_by_group: Mapping[ProcessGroup | None, V]) -> list[tuple[ProcessGroup | None, V]]:
    """Items ordered identically on every rank: ranks that share two groups must reduce them in the same order."""

    def key(item: tuple[ProcessGroup | None, V]) -> tuple[int, tuple[int, ...], str]:
        group = item[0]
        if group is None:
            return (0, (), "")
        return (1, tuple(dist.get_process_group_ranks(group)), str(getattr(group, "group_name", "")))

    return sorted(items_by_group.items(), key=key)


def _device_of(grads_by_group: GradsByGroup) -> torch.device:
    return reduction_device((grad for grads in grads_by_group.values() for grad in grads), grads_by_group)


def _tensor_device(value: torch.Tensor | float) -> torch.device:
    return value.device if isinstance(value, torch.Tensor) else torch.device("cpu")

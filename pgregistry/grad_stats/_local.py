"""Local shares of lists of grads (plain tensors, DTensor local pieces), and scaling them: one read per (device, dtype).

Each (device, dtype) *kind* of a list is read by one route:

* CUDA with triton, float32/bf16/fp16, 2-norm or zero count: the one-read kernel (:mod:`pgregistry.grad_stats._fused`)
  over a table of the contiguous grads' addresses, one launch for the whole kind, both statistics in one read (the
  non-contiguous few go to torch's route);
* the host: torch's multi-tensor ops loop over the tensors there (a dispatch of a few microseconds each, which
  dominates for small grads), so the grads are copied, many small ones at a time (``torch.cat``: one dispatch), into
  one scratch block of :data:`HOST_BLOCK` elements in the accumulation dtype (float32; float64 for float64 grads),
  and each block is reduced for both statistics while it is in the cache; a grad that fills a block alone in that
  dtype is read in place. The extra memory is the block, whatever the grads' size;
* otherwise (CUDA float64, norms other than 2 without the kernel): ``torch._foreach_norm``.

How a kind is read depends only on its tensors' layout (sizes, contiguity, addresses), not on their values:
:func:`plan_kind` derives it and :mod:`pgregistry.grad_stats._plan` keeps it between calls for as long as that
layout stays the same. Shares accumulate in float64 (:mod:`pgregistry.grad_stats._reductions`).
"""

from __future__ import annotations

import math
from array import array
from bisect import bisect_right
from collections.abc import Sequence
from itertools import accumulate, compress
from typing import Final, cast

import attrs
import torch

from pgregistry.grad_stats import _fused
from pgregistry.grad_stats._fused import one_read_applies
from pgregistry.grad_stats._reductions import Wanted, make_part

__all__ = [
    "HOST_BLOCK",
    "HOST_ROW",
    "KindPlan",
    "by_kind",
    "parts_of",
    "plan_kind",
    "read_kind",
    "row_norms",
    "scale_kind",
]

HOST_BLOCK: Final = 1 << 18
"""Elements of the host's scratch block (1 MiB of float32): the bound on the statistics' temporary memory there."""

HOST_ROW: Final = 1 << 12
"""On the host, norms are taken over rows of this many elements in the grads' precision and the rows combined in
float64: a float32 reduction over a long block is one sequential sum per thread, which loses precision (a relative
error of 1.7e-4 measured over 8M elements); many short rows are as fast as one flat reduction."""


def by_kind(grads: Sequence[torch.Tensor]) -> dict[tuple[torch.device, torch.dtype], list[torch.Tensor]]:
    """``grads`` by (device, dtype): the unit of one read. Grouped by torch's own C++ helper (the one its optimizers
    use): a Python loop over 20,000 grads costs milliseconds per call."""
    grads = list(grads)
    if not grads:
        return {}
    grouped = torch._C._group_tensors_by_device_and_dtype([list[torch.Tensor | None](grads)], False)
    return {kind: cast("list[torch.Tensor]", lists[0]) for kind, (lists, _) in grouped.items()}


def _accumulation(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


@attrs.frozen(slots=True)
class KindPlan:
    """How one kind's tensors are read, by position in the list: those the kernel reads (``kernel``, with their
    addresses and sizes for its launch table), and the rest, read by torch on the device or through the host's
    scratch blocks (``blocks``: ``(first, stop, elements)`` runs of the rest)."""

    device: torch.device
    dtype: torch.dtype
    kernel: tuple[int, ...]
    sizes: tuple[array[int], array[int]] | None
    rest: tuple[int, ...]
    blocks: tuple[tuple[int, int, int], ...]


def plan_kind(tensors: Sequence[torch.Tensor], device: torch.device, dtype: torch.dtype) -> KindPlan:
    """How to read ``tensors`` (one device and dtype); a few passes at C speed, and Python work per host block."""
    everything = tuple(range(len(tensors)))
    if one_read_applies(device, dtype):
        contiguous = list(map(torch.Tensor.is_contiguous, tensors))
        kernel: tuple[int, ...]
        rest: tuple[int, ...]
        if all(contiguous):
            kernel, rest = everything, ()
        else:
            kernel = tuple(compress(everything, contiguous))
            rest = tuple(index for index in everything if not contiguous[index])
        read = [tensors[index] for index in kernel] if rest else tensors
        sizes = (array("q", list(map(torch.Tensor.data_ptr, read))), array("q", list(map(torch.Tensor.numel, read))))
        return KindPlan(device, dtype, kernel, sizes if kernel else None, rest, ())
    blocks: tuple[tuple[int, int, int], ...] = ()
    if device.type == "cpu":
        blocks = _host_blocks(list(map(torch.Tensor.numel, tensors)))
    return KindPlan(device, dtype, (), None, everything, blocks)


def _host_blocks(numels: list[int]) -> tuple[tuple[int, int, int], ...]:
    """Runs of consecutive tensors of at most :data:`HOST_BLOCK` elements in all (a larger tensor alone)."""
    ends = list(accumulate(numels))
    blocks = []
    first, done = 0, 0
    while first < len(numels):
        stop = max(bisect_right(ends, done + HOST_BLOCK, lo=first), first + 1)
        blocks.append((first, stop, ends[stop - 1] - done))
        first, done = stop, ends[stop - 1]
    return tuple(blocks)


def read_kind(
    tensors: Sequence[torch.Tensor], plan: KindPlan, wanted: Wanted, device: torch.device
) -> list[torch.Tensor]:
    """The parts (:func:`~pgregistry.grad_stats._reductions.make_part`, on ``device``) of one kind's ``tensors``."""
    parts = []
    rest = tensors if not plan.kernel else [tensors[index] for index in plan.rest]
    if plan.kernel:
        read = tensors if not plan.rest else [tensors[index] for index in plan.kernel]
        squares, zeros = _fused.squares_and_zeros(read, checked=True, sizes=plan.sizes)
        parts.append(make_part(squares if wanted.p == 2.0 else None, zeros if wanted.zeros else None, device))
    if plan.blocks:
        parts.append(_host_part(rest, plan, wanted, device))
        return parts
    # torch reads the norm of what the kernel did not (all of them for a norm it does not compute), and the zeros of
    # the rest.
    norm_over = [] if wanted.p is None else (rest if wanted.p == 2.0 else tensors)
    zeros_over = rest if wanted.zeros else []
    if norm_over or zeros_over:
        parts.append(_torch_part(norm_over, zeros_over, wanted, device))
    return parts


def _torch_part(
    norm_over: Sequence[torch.Tensor], zeros_over: Sequence[torch.Tensor], wanted: Wanted, device: torch.device
) -> torch.Tensor:
    """torch's multi-tensor norms (one fused call), the zero count as numel minus the L0 norms (float64: exact up to
    2**53 elements; no mask the size of the grads)."""
    share = zeros = None
    norm_over = _non_empty(norm_over)
    if norm_over and wanted.p is not None:
        accumulate_in = _accumulation(norm_over[0].dtype)
        norms = torch.stack(torch._foreach_norm(norm_over, wanted.p, dtype=accumulate_in)).to(torch.float64)
        share = norms.amax() if math.isinf(wanted.p) else norms.pow(wanted.p).sum()
    zeros_over = _non_empty(zeros_over)
    if zeros_over:
        nonzero = torch.stack(torch._foreach_norm(zeros_over, 0, dtype=torch.float64)).sum()
        zeros = sum(map(torch.Tensor.numel, zeros_over)) - nonzero
    return make_part(share, zeros, device)


def _non_empty(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``tensors`` without empty ones (the inf-norm of an empty tensor is an error in torch)."""
    tensors = list(tensors)
    return [t for t in tensors if t.numel()] if 0 in map(torch.Tensor.numel, tensors) else tensors


def _host_part(tensors: Sequence[torch.Tensor], plan: KindPlan, wanted: Wanted, device: torch.device) -> torch.Tensor:
    """Both statistics of host ``tensors``, a block at a time (see the module docstring): the tensors of a block
    flattened into one (``flatten_dense_tensors``: one dispatch, a block's memory), a tensor alone in its block read
    in place."""
    accumulate_in = _accumulation(plan.dtype)
    norms: list[torch.Tensor] = []
    nonzeros: list[torch.Tensor] = []
    numel = 0
    for first, stop, elements in plan.blocks:
        numel += elements
        if not elements:
            continue
        if stop - first == 1:
            block = tensors[first]
        else:
            block = torch._C._nn.flatten_dense_tensors(list(tensors[first:stop])).to(accumulate_in)
        if wanted.p is not None:
            rows = row_norms(block, wanted.p, accumulate_in).to(torch.float64)
            norms.append(rows.amax() if math.isinf(wanted.p) else rows.pow(wanted.p).sum())
        if wanted.zeros:
            nonzeros.append(torch.count_nonzero(block))
    share = zeros = None
    if wanted.p is not None and norms:
        stacked = torch.stack(norms)
        share = stacked.amax() if math.isinf(wanted.p) else stacked.sum()
    if wanted.zeros:
        counted = torch.stack(nonzeros).sum().to(torch.float64) if nonzeros else torch.zeros((), dtype=torch.float64)
        zeros = numel - counted
    return make_part(share, zeros, device)


def row_norms(tensor: torch.Tensor, p: float, accumulate_in: torch.dtype) -> torch.Tensor:
    """The ``p``-norms, in ``accumulate_in``, of consecutive rows of :data:`HOST_ROW` elements of ``tensor`` (the
    last one shorter); a non-contiguous tensor's norm as one row."""
    cast = None if tensor.dtype == accumulate_in else accumulate_in
    if not tensor.is_contiguous():
        return torch.linalg.vector_norm(tensor, p, dtype=cast).reshape(1)
    flat = tensor.reshape(-1)
    rows = flat.numel() // HOST_ROW
    parts = []
    if rows:
        parts.append(torch.linalg.vector_norm(flat[: rows * HOST_ROW].view(rows, HOST_ROW), p, dim=1, dtype=cast))
    if rows * HOST_ROW < flat.numel():
        parts.append(torch.linalg.vector_norm(flat[rows * HOST_ROW :], p, dtype=cast).reshape(1))
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def parts_of(grads: Sequence[torch.Tensor], wanted: Wanted, device: torch.device) -> list[torch.Tensor]:
    """The parts of ``grads`` (any devices and dtypes; plain tensors), one read per kind, planned afresh."""
    return [
        part
        for (kind_device, dtype), same_kind in by_kind(grads).items()
        for part in read_kind(same_kind, plan_kind(same_kind, kind_device, dtype), wanted, device)
    ]


def scale_kind(tensors: Sequence[torch.Tensor], plan: KindPlan | None, coeff: torch.Tensor) -> None:
    """Multiply one kind's ``tensors`` in place by ``coeff`` (0-dim float64, at most 1): the kernel over its launch
    table (nothing where ``coeff`` is 1, decided on the device), else ``torch._foreach_mul_`` (skipped where
    ``coeff``, on the host, is 1: scaling by exactly 1 changes no bit)."""
    if not tensors:
        return
    device = tensors[0].device
    if plan is None:
        plan = plan_kind(tensors, device, tensors[0].dtype)
    if plan.kernel:
        read = tensors if not plan.rest else [tensors[index] for index in plan.kernel]
        _fused.scale_(read, coeff, checked=True, sizes=plan.sizes)
    rest = tensors if not plan.kernel else [tensors[index] for index in plan.rest]
    if not rest or (coeff.device.type == "cpu" and not bool(coeff < 1.0)):
        return
    torch._foreach_mul_(list(rest), coeff.to(device))

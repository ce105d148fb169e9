"""A flat gradient buffer: every grad of one optimizer in one allocation, laid out by statistics class.

Torch's multi-tensor norm over many tensors is bound by kernel launches and host work, where one norm over a
contiguous tensor of the same bytes is bound by memory bandwidth (``benchmarks/grad_stats.py`` measures both;
``docs/performance.md``). A :class:`GradBuffer` keeps the grads of one optimizer in one contiguous tensor and orders the
parameters so that the grads counted in the statistics of each reduction group form one contiguous span; the
grads not counted (tensor- or GTP-parallel duplicates, shared copies) form one more span. Statistics then run over
a handful of span views, whatever the parameter count:

* parameters are classified once, here, with :func:`pgregistry.grad_stats.is_counted` and
  :func:`~pgregistry.grad_stats.reduce_group_of`, never again per step;
* grads live only in the buffer: each ``param.grad`` (same dtype) or ``param.main_grad`` (mixed precision) is a
  view into :attr:`GradBuffer.data`;
* on CUDA the local norm is one ``vector_norm`` per span, a reduction that allocates only its output (a
  bf16/fp16 span is cast inside the kernel when the output is float32). The per-span norms are reduced by
  :func:`reduce_norm_terms`: the p-norm of the span p-norms is the p-norm of the grads, and the reduction (one
  all-reduce per group) goes through the grad-stats module's own collective order;
* on CUDA the local zero count allocates no mask: ``count_nonzero`` would materialise ``self != 0`` (a byte per
  element), so a span is viewed as rows of at most 2**24 elements and reduced with ``vector_norm(ord=0)``, whose
  float32 count is exact per row (every partial sum is an integer below 2**24), and the row counts are summed in
  float64: two reductions per span;
* elsewhere (CPU) a float32 reduction is one sequential sum per thread, which loses precision (a relative error
  of 1.7e-4 measured over 8M elements), casts of bf16 are copies, and ``count_nonzero`` branches per element (3x
  slower than a mask on random zeros). There both statistics walk blocks of :data:`HOST_BLOCK` elements: the
  norm reduces rows of :data:`HOST_ROW` elements in float32 and accumulates them in float64, the zero count
  compares into one reused mask. The extra memory stays bounded by a block, whatever the buffer's size.

:func:`span_norms` and :func:`span_zero_counts` also accept arbitrary spans over :attr:`GradBuffer.data`, which is
how a sharded optimizer reduces only its shard (see :func:`class_spans`).

Both statistics at once (:func:`span_statistics`, :meth:`GradBuffer.norm_and_zeros`) read each span once on CUDA
for the 2-norm of float32/bf16/fp16 grads: one Triton kernel computes the sum of squares and the zero count
(:mod:`pgregistry.grad_stats._fused`), half the bytes of the two reductions. Elsewhere, and without triton, they are
the two reductions above.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import attrs
import torch
import torch.distributed as dist

from pgregistry.collection import UNSET, Unset, group_rank, group_size
from pgregistry.grad_stats import is_counted, reduce_group_of, reduce_over_groups
from pgregistry.grad_stats._devices import reduction_device
from pgregistry.grad_stats._fused import fused_stats_available, readable, span_squares_and_zeros
from pgregistry.grad_stats._reductions import checked_norm_type

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from pgregistry.grad_stats import StatsGroups

__all__ = [
    "HOST_BLOCK",
    "HOST_ROW",
    "SPAN_ALIGNMENT",
    "ZERO_COUNT_ROW",
    "GradBuffer",
    "GroupKey",
    "Span",
    "all_reduce_grads_",
    "class_spans",
    "count_nonzero_by_rows",
    "reduce_norm_terms",
    "reduce_zero_counts",
    "reduce_scatter_grads_",
    "span_norms",
    "span_statistics",
    "span_zero_counts",
]

SPAN_ALIGNMENT = 64
"""Every span starts at a multiple of this many elements (256 bytes in float32), so span kernels load aligned."""

ZERO_COUNT_ROW = 1 << 24
"""Longest row reduced in float32 by the CUDA zero count: below 2**24 every partial count is exact."""

HOST_ROW = 1 << 12
"""Off CUDA, the norm sums rows of this many elements in float32 and combines the rows in float64 (a 2-D
reduction over a few long rows is slow on CPU; many short ones are as fast as one flat reduction)."""

HOST_BLOCK = 1 << 18
"""Off CUDA, statistics handle this many elements at a time (the bound on their temporary memory)."""

GroupKey = Any
"""A reduction group as used in the statistics mappings: a ``ProcessGroup`` or ``None`` (no reduction)."""


@attrs.frozen(slots=True, eq=False)
class Span:
    """``data[start:stop]`` holds grads of one class: counted (reduced over ``group``) or not counted."""

    group: ProcessGroup | None
    counted: bool
    start: int
    stop: int

    @property
    def numel(self) -> int:
        return self.stop - self.start


def _class_of(tensor: torch.Tensor, groups: StatsGroups) -> tuple[bool, ProcessGroup | None]:
    counted = is_counted(tensor, groups)
    return counted, (reduce_group_of(tensor, groups) if counted else None)


def class_spans(
    entries: Iterable[tuple[torch.Tensor, int, int]],
    groups: StatsGroups,
    *,
    reduce_over: ProcessGroup | None | Unset = UNSET,
) -> tuple[Span, ...]:
    """Spans of ``entries`` (``(role tensor, start, stop)`` in increasing, non-overlapping order), classified by
    the role tensor's attributes; adjacent entries of one class merge into one span.

    ``reduce_over`` replaces the reduction group of every counted span (a sharded optimizer reduces over its whole
    instance). Classification happens here, once; callers keep the spans.
    """
    spans: list[Span] = []
    for tensor, start, stop in entries:
        counted, group = _class_of(tensor, groups)
        if counted and reduce_over is not UNSET:
            group = reduce_over
        last = spans[-1] if spans else None
        if last is not None and last.stop == start and last.counted == counted and last.group is group:
            spans[-1] = Span(group, counted, last.start, stop)
        elif stop > start:
            spans.append(Span(group, counted, start, stop))
    return tuple(spans)


def _align(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


class GradBuffer:
    """One contiguous grad tensor for ``params``, with one span per statistics class.

    ``params`` are the tensors whose role attributes classify them (for a mixed-precision optimizer, the float32
    main copies made with :func:`pgregistry.params.copy_param_roles`). The layout puts the counted grads of each
    reduction group together (groups in order of first appearance), then every uncounted grad; spans start at
    multiples of :data:`SPAN_ALIGNMENT`. The total length is padded to a multiple of
    ``SPAN_ALIGNMENT * shard_multiple`` so that ``shard_multiple`` equal shards exist (a sharded optimizer passes
    its data-parallel size). Padding is never part of a span and stays zero.
    """

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        groups: StatsGroups,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        shard_multiple: int = 1,
    ) -> None:
        if shard_multiple < 1:
            raise ValueError(f"shard_multiple must be positive, got {shard_multiple}")
        if not params and (dtype is None or device is None):
            raise ValueError("a GradBuffer without parameters needs an explicit dtype and device")
        dtype = dtype if dtype is not None else params[0].dtype
        device = torch.device(device) if device is not None else params[0].device
        classes = [_class_of(p, groups) for p in params]
        # Counted classes in order of first appearance, then one class for everything not counted.
        order: list[tuple[bool, ProcessGroup | None]] = []
        for cls in classes:
            if cls[0] and not any(o[1] is cls[1] for o in order):
                order.append(cls)
        order.append((False, None))
        offsets = [0] * len(params)
        spans: list[Span] = []
        cursor = 0
        for counted, group in order:
            start = cursor = _align(cursor, SPAN_ALIGNMENT)
            for index, (param, cls) in enumerate(zip(params, classes, strict=True)):
                if cls[0] == counted and cls[1] is group:
                    offsets[index] = cursor
                    cursor += param.numel()
            if cursor > start:
                spans.append(Span(group, counted, start, cursor))
        total = _align(cursor, SPAN_ALIGNMENT * shard_multiple)
        self.data: torch.Tensor = torch.zeros(total, dtype=dtype, device=device)
        """The grads, padding included; zero it to zero every grad at once."""
        self.params: tuple[torch.Tensor, ...] = tuple(params)
        self.offsets: tuple[int, ...] = tuple(offsets)
        """Start of each parameter's grad in :attr:`data`, in the order ``params`` were given."""
        self.spans: tuple[Span, ...] = tuple(spans)
        self.views: tuple[torch.Tensor, ...] = tuple(
            self.data[o : o + p.numel()].view(p.shape) for p, o in zip(params, offsets, strict=True)
        )
        """Each parameter's grad: a view of :attr:`data` shaped like the parameter."""

    @property
    def numel(self) -> int:
        return int(self.data.numel())

    def shard_range(self, group: ProcessGroup | None) -> tuple[int, int]:
        """``[start, stop)`` of this rank's equal shard of :attr:`data` over ``group`` (all of it when off)."""
        size = group_size(group)
        if self.numel % size:
            raise ValueError(f"a buffer of {self.numel} elements has no equal shards over {size} ranks")
        shard = self.numel // size
        start = group_rank(group) * shard
        return start, start + shard

    def local_norm_terms(self, norm_type: float = 2.0) -> dict[GroupKey, list[torch.Tensor]]:
        """Per-group local span norms of the counted grads (see :func:`span_norms`)."""
        return span_norms(self.data, self.spans, norm_type)

    def local_zero_counts(self) -> dict[GroupKey, list[torch.Tensor]]:
        """Per-group local zero counts of the counted grads (see :func:`span_zero_counts`)."""
        return span_zero_counts(self.data, self.spans)

    def grad_norm(self, norm_type: float = 2.0) -> torch.Tensor:
        """The norm of the counted grads, reduced over each span's group (0-dim float32, no host sync)."""
        return reduce_norm_terms(self.local_norm_terms(norm_type), norm_type)

    def count_zeros(self) -> torch.Tensor:
        """The number of zero elements among the counted grads, reduced over each span's group (0-dim int64)."""
        return reduce_zero_counts(self.local_zero_counts(), device=self.data.device)

    def norm_and_zeros(self, norm_type: float = 2.0) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`grad_norm` and :meth:`count_zeros` together, reading the buffer once where
        :func:`span_statistics` can."""
        terms, counts = span_statistics(self.data, self.spans, norm_type)
        return reduce_norm_terms(terms, norm_type), reduce_zero_counts(counts, device=self.data.device)


def span_norms(
    data: torch.Tensor, spans: Iterable[Span], norm_type: float = 2.0
) -> dict[GroupKey, list[torch.Tensor]]:
    """Reduction group -> local ``norm_type``-norms (float32, shape ``[1]``) of the counted spans of ``data``."""
    terms: dict[GroupKey, list[torch.Tensor]] = {}
    for span in spans:
        if span.counted:
            norm = _vector_norm(data[span.start : span.stop], norm_type)
            terms.setdefault(span.group, []).append(norm.reshape(1))
    return terms


def _float_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype statistics accumulate in: float64 for float64 grads, float32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _vector_norm(view: torch.Tensor, norm_type: float) -> torch.Tensor:
    """``norm_type``-norm of a 1-D contiguous ``view``, in float32 (float64 for float64); see the module docstring."""
    acc = _float_dtype(view.dtype)
    if view.device.type == "cuda":
        return torch.linalg.vector_norm(view, norm_type, dtype=acc)
    infinite = math.isinf(norm_type)
    total = torch.zeros((), dtype=torch.float64, device=view.device)
    for block in view.split(HOST_BLOCK):
        rows = _row_norms(block.to(acc), norm_type).to(torch.float64)
        total = torch.maximum(total, rows.max()) if infinite else total + rows.pow(norm_type).sum()
    return (total if infinite else total.pow(1.0 / norm_type)).to(acc)


def _row_norms(block: torch.Tensor, norm_type: float) -> torch.Tensor:
    """The norms of consecutive rows of :data:`HOST_ROW` elements of ``block`` (the last one shorter)."""
    rows = block.numel() // HOST_ROW
    parts = []
    if rows:
        parts.append(torch.linalg.vector_norm(block[: rows * HOST_ROW].view(rows, HOST_ROW), norm_type, dim=1))
    if rows * HOST_ROW < block.numel():
        parts.append(torch.linalg.vector_norm(block[rows * HOST_ROW :], norm_type).reshape(1))
    return torch.cat(parts)


def span_zero_counts(data: torch.Tensor, spans: Iterable[Span]) -> dict[GroupKey, list[torch.Tensor]]:
    """Reduction group -> local zero counts (int64, shape ``[1]``) of the counted spans of ``data``."""
    counts: dict[GroupKey, list[torch.Tensor]] = {}
    for span in spans:
        if span.counted:
            nonzero = _count_nonzero(data[span.start : span.stop])
            counts.setdefault(span.group, []).append((span.numel - nonzero).reshape(1))
    return counts


def _count_nonzero(view: torch.Tensor) -> torch.Tensor:
    """Non-zero elements of a 1-D contiguous ``view`` as a 0-dim int64 tensor, without a mask of its size."""
    if view.device.type == "cuda":
        return count_nonzero_by_rows(view, ZERO_COUNT_ROW)
    mask = torch.empty(min(view.numel(), HOST_BLOCK), dtype=torch.bool, device=view.device)
    total = torch.zeros((), dtype=torch.int64, device=view.device)
    for block in view.split(HOST_BLOCK):
        part = mask[: block.numel()]
        torch.ne(block, 0, out=part)
        total += part.sum()
    return total


def count_nonzero_by_rows(view: torch.Tensor, row: int) -> torch.Tensor:
    """Non-zero elements of a 1-D contiguous ``view``: ``vector_norm(ord=0)`` over rows of at most ``row``
    elements (exact in float32 for rows up to 2**24), row counts summed in float64. Two reductions whatever the
    length, and only the per-row outputs are allocated (on CUDA, bf16/fp16 are cast inside the kernel)."""
    acc = _float_dtype(view.dtype)
    rows = view.numel() // row
    bulk = rows * row
    total = torch.zeros((), dtype=torch.float64, device=view.device)
    if rows:
        per_row = torch.linalg.vector_norm(view[:bulk].view(rows, row), 0, dim=1, dtype=acc)
        total = total + per_row.sum(dtype=torch.float64)
    if bulk < view.numel():
        total = total + torch.linalg.vector_norm(view[bulk:], 0, dtype=acc)
    return total.to(torch.int64)


def span_statistics(
    data: torch.Tensor, spans: Iterable[Span], norm_type: float = 2.0, *, one_read: bool | None = None
) -> tuple[dict[GroupKey, list[torch.Tensor]], dict[GroupKey, list[torch.Tensor]]]:
    """:func:`span_norms` and :func:`span_zero_counts` of the counted spans of ``data``, both at once.

    ``one_read`` (default: where it applies, i.e. the 2-norm of float32/bf16/fp16 ``data`` on CUDA with triton
    importable) reads each span once with :func:`pgregistry.grad_stats._fused.span_squares_and_zeros`; otherwise the two
    reductions run. The norms are float32 as :func:`span_norms`'s, the counts int64.
    """
    if one_read is None:
        one_read = norm_type == 2.0 and readable(data) and fused_stats_available(data.device)
    if not one_read:
        return span_norms(data, spans, norm_type), span_zero_counts(data, spans)
    if norm_type != 2.0:
        raise ValueError(f"one read computes the 2-norm only, not the {norm_type}-norm")
    terms: dict[GroupKey, list[torch.Tensor]] = {}
    counts: dict[GroupKey, list[torch.Tensor]] = {}
    for span in spans:
        if span.counted:
            squares, zeros = span_squares_and_zeros(data[span.start : span.stop])
            terms.setdefault(span.group, []).append(squares.sqrt().to(torch.float32).reshape(1))
            counts.setdefault(span.group, []).append(zeros.reshape(1))
    return terms, counts


def reduce_norm_terms(terms: Mapping[GroupKey, Sequence[torch.Tensor]], norm_type: float = 2.0) -> torch.Tensor:
    """The global norm from per-group local norms (0-dim float32, no host sync): what
    :func:`~pgregistry.grad_stats.norm_of_grads` of the norms gives, reduced in its collective order.

    Exact, since the p-norm of p-norms of disjoint parts is the p-norm of the whole (max of maxima for inf). Each
    group's share is a few scalar operations on its handful of span norms: norms are not grads, so none of the
    grads' multi-tensor machinery (grouping, a kernel launch per kind) is spent on them, and the one-read statistics
    of a buffer stay a read of the buffer plus a few tiny kernels.
    """
    p = checked_norm_type(norm_type)
    infinite = math.isinf(p)
    device = reduction_device((term for parts in terms.values() for term in parts), terms)

    def local(parts: Sequence[torch.Tensor]) -> torch.Tensor:
        if not parts:
            return torch.zeros((), dtype=torch.float32, device=device)
        norms = parts[0].reshape(1) if len(parts) == 1 else torch.cat([part.reshape(1) for part in parts])
        share = norms.max() if infinite else norms.pow(p).sum()
        return share.to(device=device, dtype=torch.float32)

    op = dist.ReduceOp.MAX if infinite else dist.ReduceOp.SUM
    total = torch.zeros((), dtype=torch.float32, device=device)
    for share in reduce_over_groups(terms, local, op):
        total = torch.maximum(total, share) if infinite else total + share
    return total if infinite else total.pow(1.0 / p)


def reduce_zero_counts(
    counts: Mapping[GroupKey, Sequence[torch.Tensor]], *, device: torch.device | str
) -> torch.Tensor:
    """The global zero count (0-dim int64) from per-group local counts: one SUM all-reduce per group of more than
    one rank, in :func:`~pgregistry.grad_stats.reduce_over_groups`'s order (the one :func:`reduce_norm_terms`
    uses). Every rank of a group must pass it as a key, with an empty list when it counts nothing there."""
    total = torch.zeros((), dtype=torch.int64, device=device)

    def local(parts: Sequence[torch.Tensor]) -> torch.Tensor:
        return torch.cat([p.reshape(1).to(torch.int64) for p in parts]).sum() if parts else total.new_zeros(())

    for share in reduce_over_groups(counts, local, dist.ReduceOp.SUM):
        total = total + share
    return total


def all_reduce_grads_(
    buffer: GradBuffer, group: ProcessGroup | None, *, divide_by: int = 1, bucket_numel: int | None = None
) -> None:
    """Divide :attr:`GradBuffer.data` by ``divide_by``, then SUM all-reduce it over ``group``: one collective per
    bucket of at most ``bucket_numel`` elements (default: one bucket), never one per tensor; none when the group is
    off. Dividing first (as Megatron-Core does) keeps the sum in range; ``divide_by=size(group)`` averages."""
    _divide(buffer, divide_by)
    if group_size(group) == 1 or buffer.numel == 0:  # data-parallel replicas hold the same parameters: all skip
        return
    step = bucket_numel if bucket_numel else buffer.numel
    if step < 1:
        raise ValueError(f"bucket_numel must be positive, got {bucket_numel}")
    for start in range(0, buffer.numel, step):
        dist.all_reduce(buffer.data[start : start + step], op=dist.ReduceOp.SUM, group=group)


def reduce_scatter_grads_(buffer: GradBuffer, group: ProcessGroup | None, *, divide_by: int = 1) -> tuple[int, int]:
    """Divide :attr:`GradBuffer.data` by ``divide_by``, then reduce-scatter it over ``group`` in place (SUM, one
    collective): afterwards this rank's shard, returned as ``[start, stop)``, holds its reduced grads and the rest
    of the buffer is stale."""
    start, stop = buffer.shard_range(group)
    _divide(buffer, divide_by)
    if group_size(group) == 1 or buffer.numel == 0:
        return start, stop
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    reduce_scatter(buffer.data[start:stop], buffer.data, op=dist.ReduceOp.SUM, group=group)
    return start, stop


def _divide(buffer: GradBuffer, divide_by: int) -> None:
    if divide_by < 1:
        raise ValueError(f"divide_by must be a positive integer, got {divide_by}")
    if divide_by > 1:
        buffer.data.div_(divide_by)

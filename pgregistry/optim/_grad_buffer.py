"""A flat gradient buffer: every grad of one optimizer in one allocation, laid out by stats class.

Torch's multi-tensor norm over many tensors is bound by kernel launches and host work, where one
norm over a contiguous tensor of the same bytes is bound by memory bandwidth
(``benchmarks/grad_stats.py`` measures both; ``docs/performance.md``). A :class:`GradBuffer` keeps
the grads of one optimizer in one contiguous tensor and orders the parameters so that the grads
counted in the statistics of each reduction group form one contiguous span; the grads not counted
(tensor- or GTP-parallel duplicates, shared copies) form one more span per group (one in all for an
optimizer, whose grads have one group). Statistics then run over a handful of span views, whatever
the parameter count:

* parameters are classified once, here, with :func:`pgregistry.grad_stats.is_counted` and
  :func:`~pgregistry.grad_stats.reduce_group_of`, never again per step;
* grads live only in the buffer: each ``param.grad`` (same dtype) or ``param.main_grad`` (mixed
  precision) is a view into :attr:`GradBuffer.data`;
* a span is read into a *part* of its group's local share (:mod:`pgregistry.grad_stats._reductions`:
  ``sum |g|^p`` or ``max |g|`` in float64, and the zero count), and the shares are reduced by the
  grad statistics' one reducer, which an optimizer's chained children share: one all-reduce per
  group, in the one agreed order; an uncounted span is read into a seen part
  (:func:`~pgregistry.grad_stats._reductions.nonfinite_part`: its NaN or inf only) under its group,
  so a NaN in a duplicate makes the norm NaN wherever its counted copy's would;
* on CUDA the local norm is one ``torch._foreach_norm`` per span, a reduction that allocates only
  its output: each element is cast as it is read (to float64 for the 1- and 2-norm, so no ``|g|``
  or square over- or underflows, :func:`~pgregistry.grad_stats._reductions.accumulates_in`), where
  ``vector_norm(..., dtype=torch.float64)`` would first cast a copy of the whole span; a float64
  span's 2-norm goes by range (:func:`~pgregistry.grad_stats._reductions.squares_by_range`);
* on CUDA the local zero count allocates no mask: ``count_nonzero`` would materialise ``self != 0``
  (a byte per element), so a span is viewed as rows of at most 2**24 elements and reduced with
  ``vector_norm(ord=0)``, whose float32 count is exact per row (every partial sum is an integer
  below 2**24), and the row counts are summed in float64: two reductions per span;
* elsewhere (CPU) a float32 reduction is one sequential sum per thread, which loses precision (a
  relative error of 1.7e-4 measured over 8M elements), casts of bf16 are copies, and
  ``count_nonzero`` branches per element (3x slower than a mask on random zeros). There the
  statistics walk blocks: the norm reduces rows of :data:`HOST_ROW` elements a block at a time
  and accumulates them in float64 (:func:`~pgregistry.grad_stats._local.host_share`): the
  rows in float32, for the 1- and 2-norm of narrower grads first in float32 and again in float64
  where that sum over- or underflowed, as the lists' host reads do
  (:class:`~pgregistry.grad_stats._local.HostNormSum`), in float64 for float64 grads; the
  zero count compares :data:`HOST_BLOCK` elements at a time into one reused mask.
  The extra memory stays bounded by a block, whatever the buffer's size.

:func:`span_shares` accepts arbitrary spans over :attr:`GradBuffer.data`, which is how a sharded
optimizer reduces only its shard (see :func:`class_spans`).

On CUDA, for the 2-norm (or the zero count alone) of float32/bf16/fp16 grads, each span is read once
for both statistics: one Triton kernel computes the sum of squares and the zero count
(:mod:`pgregistry.grad_stats._fused`), half the bytes of the two reductions. Elsewhere, and without
triton, they are the two reductions above.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import attrs
import torch
import torch.distributed as dist

from pgregistry.collection import UNSET, Unset, group_rank, group_size
from pgregistry.grad_stats import is_counted, reduce_group_of
from pgregistry.grad_stats._arguments import Given
from pgregistry.grad_stats._fused import (
    can_run_fused_stats,
    is_kernel_readable,
    span_squares_and_zeros,
)
from pgregistry.grad_stats._local import (
    HOST_BLOCK,
    HOST_ROW,
    HostNormSum,
    host_share,
    share_over_divisor,
)
from pgregistry.grad_stats._reductions import (
    Reduced,
    Shares,
    Wanted,
    accumulates_in,
    make_part,
    nonfinite_part,
    reduce_shares,
    squares_by_range,
)
from pgregistry.optim._grad_statistics import GradStatistics

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from pgregistry.grad_stats import StatsGroups

__all__ = [
    "HOST_BLOCK",
    "HOST_ROW",
    "SPAN_ALIGNMENT",
    "ZERO_COUNT_ROW",
    "GradBuffer",
    "Span",
    "all_reduce_grads_",
    "class_spans",
    "count_nonzero_by_rows",
    "reduce_scatter_grads_",
    "span_shares",
]

SPAN_ALIGNMENT = 64
"""Every span starts at a multiple of this many elements (256 bytes in float32).

So span kernels load aligned.
"""

ZERO_COUNT_ROW = 1 << 24
"""Longest row the CUDA zero count reduces in float32: below 2**24 partial counts are exact."""


@attrs.frozen(slots=True, eq=False)
class Span:
    """``data[start:stop]`` holds grads of one class: counted here or not, and their ``group``.

    The group is the one their counted copies are reduced over; an uncounted span's NaN or inf is
    reduced over it too."""

    group: ProcessGroup | None
    counted: bool
    start: int
    stop: int

    @property
    def numel(self) -> int:
        return self.stop - self.start


def _class_of(tensor: torch.Tensor, groups: StatsGroups) -> tuple[bool, ProcessGroup | None]:
    return is_counted(tensor, groups), reduce_group_of(tensor, groups)


def class_spans(
    entries: Iterable[tuple[torch.Tensor, int, int]],
    groups: StatsGroups,
    *,
    reduce_over: ProcessGroup | None | Unset = UNSET,
) -> tuple[Span, ...]:
    """Spans of ``entries``, classified by the role tensor's attributes.

    ``entries`` are ``(role tensor, start, stop)`` in increasing, non-overlapping order; adjacent
    entries of one class merge into one span.

    ``reduce_over`` replaces the reduction group of every span (a sharded optimizer reduces over its
    whole instance). Classification happens here, once; callers keep the spans.
    """
    spans: list[Span] = []
    for tensor, start, stop in entries:
        counted, group = _class_of(tensor, groups)
        if reduce_over is not UNSET:
            group = reduce_over
        last = spans[-1] if spans else None
        if (
            last is not None
            and last.stop == start
            and last.counted == counted
            and last.group is group
        ):
            spans[-1] = Span(group, counted, last.start, stop)
        elif stop > start:
            spans.append(Span(group, counted, start, stop))
    return tuple(spans)


def _round_up_to_multiple(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


class GradBuffer(GradStatistics):
    """One contiguous grad tensor for ``params``, with one span per statistics class.

    ``params`` are the tensors whose role attributes classify them (for a mixed-precision optimizer,
    the float32 main copies made with :func:`pgregistry.params.copy_param_roles`). The layout puts
    the counted grads of each reduction group together (groups in order of first appearance), then
    the uncounted grads, likewise; spans start at multiples of :data:`SPAN_ALIGNMENT`. The total
    length is padded to a multiple of ``SPAN_ALIGNMENT * shard_multiple`` so that ``shard_multiple``
    equal shards exist (a sharded optimizer passes its data-parallel size). Padding is never part of
    a span and stays zero.
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
        # Counted classes in order of first appearance, then the uncounted ones.
        order: list[tuple[bool, ProcessGroup | None]] = []
        for counted in (True, False):
            for cls in classes:
                if cls[0] == counted and not any(o[0] == counted and o[1] is cls[1] for o in order):
                    order.append(cls)
        offsets = [0] * len(params)
        spans: list[Span] = []
        cursor = 0
        for counted, group in order:
            start = cursor = _round_up_to_multiple(cursor, SPAN_ALIGNMENT)
            for index, (param, cls) in enumerate(zip(params, classes, strict=True)):
                if cls[0] == counted and cls[1] is group:
                    offsets[index] = cursor
                    cursor += param.numel()
            if cursor > start:
                spans.append(Span(group, counted, start, cursor))
        total = _round_up_to_multiple(cursor, SPAN_ALIGNMENT * shard_multiple)
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
        """``[start, stop)`` of this rank's equal shard of :attr:`data` over ``group``.

        All of it when ``group`` is off.
        """
        size = group_size(group)
        if self.numel % size:
            raise ValueError(
                f"a buffer of {self.numel} elements has no equal shards over {size} ranks"
            )
        shard = self.numel // size
        start = group_rank(group) * shard
        return start, start + shard

    def local_shares(self, shares: Shares) -> None:
        """Add the parts of the counted grads to ``shares`` (see :func:`span_shares`)."""
        span_shares(self.data, self.spans, shares)

    def statistics(self, wanted: Wanted, given: Given | None = None) -> Reduced:
        """The counted grads' statistics, each span's part reduced over its group.

        No host sync for the 1-, 2- and inf-norm; another ``p`` reads whether its norm is exact
        (:func:`~pgregistry.grad_stats._reductions.reduce_shares`, which takes ``given``)."""
        return reduce_shares(self._fresh_shares(wanted), reread=self._fresh_shares, given=given)

    def _fresh_shares(self, wanted: Wanted) -> Shares:
        shares = Shares(wanted, self.data.device, (span.group for span in self.spans))
        self.local_shares(shares)
        return shares

    grad_norm = GradStatistics._grad_norm
    count_zeros = GradStatistics._count_zeros
    norm_and_zeros = GradStatistics._norm_and_zeros


def span_shares(
    data: torch.Tensor, spans: Iterable[Span], shares: Shares, *, one_read: bool | None = None
) -> None:
    """Add one part per counted span of ``data`` to ``shares``, under the span's group.

    When a norm is wanted, also one seen part per uncounted span (its NaN or inf only: the verdict
    covers every grad this rank holds).

    ``one_read`` (default: where it applies, i.e. the 2-norm or the zero count alone of
    float32/bf16/fp16 ``data`` on CUDA with triton importable) reads each span once for both
    statistics with :func:`pgregistry.grad_stats._fused.span_squares_and_zeros`; otherwise a norm
    and a zero count reduction.
    """
    wanted = shares.wanted
    if one_read is None:
        one_read = (
            wanted.p in (2.0, None)
            and wanted.divisor is None
            and is_kernel_readable(data)
            and can_run_fused_stats(data.device)
        )
    if one_read and (wanted.p not in (2.0, None) or wanted.divisor is not None):
        raise ValueError(f"one read computes the 2-norm only, not the {wanted.p}-norm or scaled")
    shares.widen(data.dtype)
    for span in spans:
        if not span.counted and (wanted.p is None or wanted.divisor is not None):
            continue  # a seen part is for the verdict, which the scaled read follows
        view = data[span.start : span.stop]
        share: torch.Tensor | None
        zeros: torch.Tensor | None
        count = wanted.zeros and span.counted
        if one_read:
            squares, zeros = span_squares_and_zeros(view)
            share = squares if wanted.p is not None else None
        else:
            share = _norm_share(view, wanted) if wanted.p is not None else None
            zeros = span.numel - _count_nonzero(view) if count else None
        part = make_part(share, zeros if count else None, shares.device)
        shares.add(span.group, part if span.counted else nonfinite_part(part))


def _float_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype statistics accumulate in: float64 for float64 grads, float32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _norm_share(view: torch.Tensor, wanted: Wanted) -> torch.Tensor:
    """``sum |x|^p`` (``max |x|`` for the inf-norm) of a 1-D contiguous ``view``, 0-dim float64.

    See the module docstring; with ``wanted.divisor``, :func:`share_over_divisor`'s; a float64
    view's 2-norm by range (:func:`~pgregistry.grad_stats._reductions.squares_by_range`)."""
    p = wanted.p
    assert p is not None
    if wanted.divisor is not None:
        return share_over_divisor([view], p, wanted.divisor)
    if view.device.type == "cpu":  # float32 first where that is exact, as the lists' host reads
        return HostNormSum.of_tensor(view, wanted)
    if wanted.ranged and view.dtype == torch.float64:
        return squares_by_range([view], HOST_BLOCK)
    if view.device.type == "cuda":  # torch's multi-tensor norm casts each element as it reads it
        (norm,) = torch._foreach_norm([view], p, dtype=accumulates_in(view.dtype, p))
        return norm.to(torch.float64) if math.isinf(p) else norm.to(torch.float64).pow(p)
    return host_share(view, p, accumulates_in(view.dtype, p))


def _count_nonzero(view: torch.Tensor) -> torch.Tensor:
    """Non-zero elements of 1-D contiguous ``view`` as a 0-dim int64, without a mask of its size."""
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
    """Non-zero elements of a 1-D contiguous ``view``, counted over rows of at most ``row``.

    ``vector_norm(ord=0)`` over rows of at most ``row`` elements (exact in float32 for rows up to
    2**24), row counts summed in float64. Two reductions whatever the length, and only the per-row
    outputs are allocated (on CUDA, bf16/fp16 are cast inside the kernel)."""
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


def all_reduce_grads_(
    buffer: GradBuffer,
    group: ProcessGroup | None,
    *,
    divide_by: int = 1,
    bucket_numel: int | None = None,
) -> None:
    """Divide :attr:`GradBuffer.data` by ``divide_by``, then SUM all-reduce it over ``group``.

    One collective per bucket of at most ``bucket_numel`` elements (default: one bucket), never one
    per tensor; none when the group is off. Dividing first (as Megatron-Core does) keeps the sum in
    range; ``divide_by=size(group)`` averages."""
    _divide_buffer(buffer, divide_by)
    if (
        group_size(group) == 1 or buffer.numel == 0
    ):  # data-parallel replicas hold the same parameters: all skip
        return
    step = bucket_numel if bucket_numel else buffer.numel
    if step < 1:
        raise ValueError(f"bucket_numel must be positive, got {bucket_numel}")
    for start in range(0, buffer.numel, step):
        dist.all_reduce(buffer.data[start : start + step], op=dist.ReduceOp.SUM, group=group)


def reduce_scatter_grads_(
    buffer: GradBuffer, group: ProcessGroup | None, *, divide_by: int = 1
) -> tuple[int, int]:
    """Divide :attr:`GradBuffer.data` by ``divide_by``, then reduce-scatter it over ``group``.

    In place (SUM, one collective): afterwards this rank's shard, returned as ``[start, stop)``,
    holds its reduced grads and the rest of the buffer is stale."""
    start, stop = buffer.shard_range(group)
    _divide_buffer(buffer, divide_by)
    if group_size(group) == 1 or buffer.numel == 0:
        return start, stop
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    reduce_scatter(buffer.data[start:stop], buffer.data, op=dist.ReduceOp.SUM, group=group)
    return start, stop


def _divide_buffer(buffer: GradBuffer, divide_by: int) -> None:
    if divide_by < 1:
        raise ValueError(f"divide_by must be a positive integer, got {divide_by}")
    if divide_by > 1:
        buffer.data.div_(divide_by)

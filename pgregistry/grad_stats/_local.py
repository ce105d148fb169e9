"""Local shares of lists of grads (plain tensors, DTensor local pieces), and scaling them.

One read per (device, dtype).

Each (device, dtype) *kind* of a list is read by one route:

* CUDA with triton, float32/bf16/fp16, 2-norm or zero count: the one-read kernel
  (:mod:`pgregistry.grad_stats._fused`) over a table of the contiguous grads' addresses, one launch
  for the whole kind, both statistics in one read (the non-contiguous few go to torch's route);
* the host: torch's multi-tensor ops loop over the tensors there (a dispatch of a few microseconds
  each, which dominates for small grads), so small grads are concatenated (one dispatch; by trailing
  shape, so that no view of each is made) into blocks of at most :data:`HOST_FLAT` elements, each
  reduced for both statistics while it is in the cache; a grad of more than :data:`HOST_SMALL`
  elements is read in place. Norms are taken over rows of :data:`HOST_ROW` elements,
  :data:`HOST_NORM_BLOCK` at a time, combined in float64 (:func:`host_share`; one float32 reduction
  over a long block loses precision), in the accumulation dtype
  (:func:`~pgregistry.grad_stats._reductions.accumulates_in`), except that the 1- and 2-norm of
  grads narrower than float64 are summed in float32 first and read again in float64 only where that
  sum over- or underflowed (:class:`HostNormSum`, the rule's one home). The extra
  memory is one block, whatever the grads' size;
* otherwise (CUDA float64, norms other than 2 without the kernel): ``torch._foreach_norm``.

Complex grads are read through their moduli (``|z|``, a real copy of each): their norm is ``(sum
|z|^p)^(1/p)`` and an element is a zero when ``z == 0``, as torch's ``clip_grad_norm_`` has it; they
are scaled in place by the real coefficient.

How a kind is read depends only on its tensors' layout (sizes, contiguity, addresses), not on their
values: :func:`plan_kind` derives it and :mod:`pgregistry.grad_stats._plan` keeps it between calls
for as long as that layout stays the same, and where only the addresses change makes only the
kernel's launch again (:func:`replan_launch`). Only the host's float64 second read of a float32
first sum depends on values (local arithmetic, the collectives after it the same). Shares accumulate
in float64 (:mod:`pgregistry.grad_stats._reductions`); the 1- and 2-norm from the first element
(torch's norms take ``dtype=torch.float64``, the kernel squares in float64; on the host a float32
first sum where it is exact), a float64 grad's 2-norm by range
(:func:`~pgregistry.grad_stats._reductions.squares_by_range`), so neither needs a device sync.
"""

from __future__ import annotations

import math
import operator
from bisect import bisect_right
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from functools import partial
from itertools import accumulate, compress
from typing import Final, cast

import attrs
import torch

from pgregistry.grad_stats import _fused
from pgregistry.grad_stats._fused import one_read_applies
from pgregistry.grad_stats._reductions import (
    Clipping,
    GroupKey,
    Shares,
    Wanted,
    accumulates_in,
    make_part,
    makes_norm_float64,
    squares_by_range,
)

__all__ = [
    "HOST_BLOCK",
    "HOST_FLAT",
    "HOST_NORM_BLOCK",
    "HOST_ROW",
    "HOST_SMALL",
    "HostNormSum",
    "KindPlan",
    "add_parts",
    "by_kind",
    "parts_of",
    "plan_kind",
    "read_kind",
    "replan_launch",
    "row_norms",
    "scale_kind",
    "share_over_divisor",
]

HOST_BLOCK: Final = 1 << 18
"""The most elements the host reads at once where it makes temporaries of what it reads (a float64
grad's squares by range, the exact norm's second read, the flat buffer's zero-count mask): the
bound on the statistics' temporary memory there (1 MiB of float32)."""

HOST_FLAT: Final = 1 << 15
"""Elements of one block of small grads flattened together on the host, and of one zero count there:
torch's grain size, below which a reduction runs on the calling thread (above it, ``count_nonzero``
on a loaded 2-core machine waited on its thread pool for milliseconds: 8 ms for 2**16 elements, 27
us on one thread)."""

HOST_SMALL: Final = 1 << 14
"""On the host, a tensor of more elements than this is read in place.

Smaller ones are flattened together.
"""

HOST_ROW: Final = 1 << 9
"""On the host, norms are taken over rows of this many elements in float32 (or the grads' dtype)
and the rows combined in float64: torch's float32 norm over a long row drifts (a relative error of
1.7e-4 measured over 8M elements in one reduction; over 8M bf16-valued elements, the 2-norm's rows
of 4,096 came out 4.9e-7 low on average, 8 float32 units, rows of 512 4.3e-8 low); many short rows
are as fast as one flat reduction (1.5 ms for 8M float32 elements on one thread)."""

HOST_NORM_BLOCK: Final = 1 << 20
"""Elements whose rows' norms :func:`host_share` holds at once before combining them in float64:
:data:`HOST_NORM_BLOCK` / :data:`HOST_ROW` float32 (8 KiB); shorter blocks cost a few dispatches
each (2^18: 1.8 ms for 8M float32 elements, 1.5 ms so)."""


def by_kind(
    grads: Sequence[torch.Tensor],
) -> dict[tuple[torch.device, torch.dtype], list[torch.Tensor]]:
    """``grads`` by (device, dtype): the unit of one read.

    Grouped by torch's own C++ helper (the one its optimizers use): a Python loop over 20,000 grads
    costs milliseconds per call."""
    grads = list(grads)
    if not grads:
        return {}
    grouped = torch._C._group_tensors_by_device_and_dtype([list[torch.Tensor | None](grads)], False)
    return {kind: cast("list[torch.Tensor]", lists[0]) for kind, (lists, _) in grouped.items()}


@attrs.frozen(slots=True)
class KindPlan:
    """How one kind's tensors are read, by position in the list: by the kernel, else by torch.

    Those the kernel reads (``kernel``, and the ``launch`` over them,
    :func:`~pgregistry.grad_stats._fused.launch_of`), and the rest, read by torch on the device or,
    on the host, in blocks (``blocks``: the tensors to concatenate, each block at most
    :data:`HOST_FLAT` elements of tensors of one trailing shape, so ``torch.cat`` takes them without
    a view each; or one large tensor, read in place)."""

    device: torch.device
    dtype: torch.dtype
    kernel: tuple[int, ...]
    launch: _fused.Launch | None
    rest: tuple[int, ...]
    blocks: tuple[int | Callable[[Sequence[torch.Tensor]], tuple[torch.Tensor, ...]], ...]


def plan_kind(
    tensors: Sequence[torch.Tensor], device: torch.device, dtype: torch.dtype
) -> KindPlan:
    """How to read ``tensors`` (one device and dtype).

    A few passes at C speed, and Python work per host block.
    """
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
        return KindPlan(device, dtype, kernel, _fused.launch_of(read) if kernel else None, rest, ())
    blocks: tuple[int | Callable[[Sequence[torch.Tensor]], tuple[torch.Tensor, ...]], ...] = ()
    if device.type == "cpu":
        blocks = _host_blocks(tensors)
    return KindPlan(device, dtype, (), None, everything, blocks)


def replan_launch(plan: KindPlan, tensors: Sequence[torch.Tensor]) -> KindPlan:
    """``plan`` for ``tensors`` that differ from those it was made for in their addresses only.

    Their element counts, contiguity, shapes, dtype and device are those ``plan`` was made for: of
    what :func:`plan_kind` derives, only the kernel's launch depends on addresses (its offsets; its
    program table, kept by sizes, is found again), so only it is made again (the host blocks depend
    on shapes, torch's route on nothing). ``plan`` itself where the kernel reads none of them."""
    if not plan.kernel:
        return plan
    read = tensors if not plan.rest else [tensors[index] for index in plan.kernel]
    return attrs.evolve(plan, launch=_fused.launch_of(read))


def _host_blocks(
    tensors: Sequence[torch.Tensor],
) -> tuple[int | Callable[[Sequence[torch.Tensor]], tuple[torch.Tensor, ...]], ...]:
    """The host's blocks (see :class:`KindPlan`).

    Tensors of more than :data:`HOST_SMALL` elements alone; the others by trailing shape (a
    concatenation along dim 0 needs no view of each tensor, as flattening them would: a microsecond
    and more a tensor), runs of at most :data:`HOST_FLAT` elements. Python work per tensor: made
    when the tensors' layout changes, kept while it does not."""
    classes: dict[tuple[int, ...], list[int]] = {}
    blocks: list[int | Callable[[Sequence[torch.Tensor]], tuple[torch.Tensor, ...]]] = []
    for index, tensor in enumerate(tensors):
        if tensor.numel() > HOST_SMALL:
            blocks.append(index)
        else:
            classes.setdefault((tensor.dim(), *tensor.shape[1:]), []).append(index)
    for positions in classes.values():
        numels = [tensors[index].numel() for index in positions]
        ends = list(accumulate(numels))
        first, done = 0, 0
        while first < len(positions):
            end = max(bisect_right(ends, done + HOST_FLAT, lo=first), first + 1)
            blocks.append(
                positions[first] if end == first + 1 else operator.itemgetter(*positions[first:end])
            )
            first, done = end, ends[end - 1]
    return tuple(blocks)


def read_kind(
    tensors: Sequence[torch.Tensor], plan: KindPlan, wanted: Wanted, device: torch.device
) -> list[torch.Tensor]:
    """The parts of one kind's ``tensors``.

    Made by :func:`~pgregistry.grad_stats._reductions.make_part`, on ``device``.
    """
    if (
        plan.dtype.is_complex
    ):  # through the moduli (module docstring): the plan's blocks are by shape, theirs too
        tensors = [tensor.abs() for tensor in tensors]
    if wanted.divisor is not None:  # the exact norm's second read: no zero count, no kernel
        assert wanted.p is not None
        return [make_part(share_over_divisor(tensors, wanted.p, wanted.divisor), None, device)]
    parts = []
    rest = tensors if not plan.kernel else [tensors[index] for index in plan.rest]
    if plan.kernel and (
        wanted.p == 2.0 or wanted.zeros
    ):  # it reads squares and zeros: nothing else it could give
        read = tensors if not plan.rest else [tensors[index] for index in plan.kernel]
        assert plan.launch is not None
        pair = _fused.read_over(read, plan.launch)  # [squares, zeros]: a 2-norm's part as it is
        parts.append(
            pair if wanted.p == 2.0 else make_part(None, pair[1] if wanted.zeros else None, device)
        )
    if plan.blocks:
        parts.append(_host_part(rest, plan, wanted, device))
        return parts
    # torch reads the norm of what the kernel did not (all of them for a norm it does not compute),
    # and the zeros of the rest.
    norm_over = [] if wanted.p is None else (rest if wanted.p == 2.0 else tensors)
    zeros_over = rest if wanted.zeros else []
    if norm_over or zeros_over:
        parts.append(_torch_part(norm_over, zeros_over, wanted, device))
    return parts


def _torch_part(
    norm_over: Sequence[torch.Tensor],
    zeros_over: Sequence[torch.Tensor],
    wanted: Wanted,
    device: torch.device,
) -> torch.Tensor:
    """torch's multi-tensor norms (one fused call), the zero count as numel minus the L0 norms.

    Float64: exact up to 2**53 elements; no mask the size of the grads. The 2-norm of float64 grads
    by range (:func:`~pgregistry.grad_stats._reductions.squares_by_range`)."""
    share = zeros = None
    norm_over = _non_empty(norm_over)
    if norm_over and wanted.ranged and makes_norm_float64(norm_over[0].dtype):
        share = squares_by_range(norm_over, HOST_BLOCK)
    elif norm_over and wanted.p is not None:
        accumulate_in = accumulates_in(norm_over[0].dtype, wanted.p)
        norms = torch.stack(torch._foreach_norm(norm_over, wanted.p, dtype=accumulate_in)).to(
            torch.float64
        )
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


def _host_part(
    tensors: Sequence[torch.Tensor], plan: KindPlan, wanted: Wanted, device: torch.device
) -> torch.Tensor:
    """Both statistics of host ``tensors``, a block at a time (see the module docstring).

    The tensors of a block are concatenated into one (one dispatch, a block's memory); a tensor
    alone in its block is read in place. The 2-norm of float64 grads by range
    (:func:`~pgregistry.grad_stats._reductions.squares_by_range`); the 1- and 2-norm of narrower
    grads summed in float32 first, read again in float64 where that sum does not hold
    (:class:`HostNormSum`)."""
    norm_sum = HostNormSum(plan.dtype, wanted) if wanted.p is not None else None
    nonzeros: list[torch.Tensor] = []
    numel = 0
    for block in _blocks_of(tensors, plan):
        numel += block.numel()
        if not block.numel():
            continue
        if norm_sum is not None:
            norm_sum.add(block)
        if wanted.zeros:
            nonzeros.append(_host_nonzero(block))
    zeros = None
    share = norm_sum.total(lambda: _blocks_of(tensors, plan)) if norm_sum is not None else None
    if wanted.zeros:
        counted = (
            torch.stack(nonzeros).sum().to(torch.float64)
            if nonzeros
            else torch.zeros((), dtype=torch.float64)
        )
        zeros = numel - counted
    return make_part(share, zeros, device)


def _blocks_of(tensors: Sequence[torch.Tensor], plan: KindPlan) -> Iterator[torch.Tensor]:
    """The host blocks of ``plan`` over ``tensors``, each made as it is read (:class:`KindPlan`).

    A tensor alone in its block as it is; the others of one trailing shape concatenated along dim 0
    (0-dim ones stacked), in the grads' dtype."""
    for take in plan.blocks:
        if isinstance(take, int):
            yield tensors[take]
        else:
            pieces = take(tensors)
            yield torch.cat(pieces) if pieces[0].dim() else torch.stack(pieces)


class HostNormSum:
    """The host's ``sum |g|^p`` (``max |g|`` for the inf-norm) of one dtype's grads, block by block.

    Each block read as it is added (:meth:`add`), so a caller reads its other statistics from the
    same block while it is in the cache (:func:`_host_part`'s zero count); :meth:`total` combines
    them. Float64 grads' 2-norm by range
    (:func:`~pgregistry.grad_stats._reductions.squares_by_range`); the 1- and 2-norm of narrower
    grads summed in float32 first (:func:`sums_float32_first`), and where that sum does not hold
    (:func:`float32_share_holds`) every block read again in float64 (the one place the host reads
    twice); others in their accumulation dtype
    (:func:`~pgregistry.grad_stats._reductions.accumulates_in`). The one home of the host's float32
    first rule: the lists' kinds and the optimizer's flat buffer (``optim/_grad_buffer``) both sum
    through it."""

    def __init__(self, dtype: torch.dtype, wanted: Wanted) -> None:
        assert wanted.p is not None
        self._p = wanted.p
        self._ranged = wanted.ranged and makes_norm_float64(dtype)
        self._accumulate_in = accumulates_in(dtype, wanted.p)
        self._float32_first = sums_float32_first(dtype, wanted.p)
        self._shares: list[torch.Tensor] = []
        self._numel = 0

    @classmethod
    def of_tensor(cls, tensor: torch.Tensor, wanted: Wanted) -> torch.Tensor:
        """The sum over one host tensor, read as one block (0 for no element)."""
        norm_sum = cls(tensor.dtype, wanted)
        norm_sum.add(tensor)
        total = norm_sum.total(lambda: [tensor])
        assert total is not None
        return total

    def add(self, block: torch.Tensor) -> None:
        """Read ``block`` (a host tensor of the dtype) into the sum."""
        self._numel += block.numel()
        if self._ranged:
            self._shares.append(squares_by_range([block], HOST_BLOCK))
        else:
            first = torch.float32 if self._float32_first else self._accumulate_in
            self._shares.append(host_share(block, self._p, first))

    def total(self, blocks_again: Callable[[], Iterable[torch.Tensor]]) -> torch.Tensor | None:
        """The sum of the blocks added, ``None`` for none.

        0-dim float64 (a range vector for squares by range); ``blocks_again`` gives the blocks anew
        for the float64 read, called only where the float32 sum does not hold."""
        if not self._shares:
            return None
        share = _combine_shares(self._shares, self._p)
        if self._float32_first and not float32_share_holds(share, self._numel):
            again = [
                host_share(b, self._p, self._accumulate_in) for b in blocks_again() if b.numel()
            ]
            share = _combine_shares(again, self._p)
        return share


def _combine_shares(shares: Sequence[torch.Tensor], p: float) -> torch.Tensor:
    """Shares of ``sum |x|^p`` (or ``max |x|``, or squares by range) combined into one."""
    if len(shares) == 1:
        return shares[0]
    stacked = torch.stack(list(shares))
    return stacked.amax() if math.isinf(p) else stacked.sum(0)


def _host_nonzero(tensor: torch.Tensor) -> torch.Tensor:
    """``count_nonzero`` a flat block at a time (see :data:`HOST_FLAT`)."""
    if tensor.numel() <= HOST_FLAT or not tensor.is_contiguous():
        return torch.count_nonzero(tensor)
    return torch.stack(
        [torch.count_nonzero(piece) for piece in tensor.reshape(-1).split(HOST_FLAT)]
    ).sum()


def sums_float32_first(dtype: torch.dtype, p: float | None) -> bool:
    """Whether the host sums ``dtype`` grads' ``sum |g|^p`` in float32 before float64.

    Where :func:`~pgregistry.grad_stats._reductions.accumulates_in` makes grads narrower than
    float64 accumulate in float64 (the 1- and 2-norm of float32, bf16, fp16 grads, complex64's
    moduli): torch's host reductions that cast each element to float64 run at a quarter of the
    float32 ones' speed (``docs/performance.md``), so the host sums in float32 first, over rows, and
    keeps that sum where :func:`float32_share_holds`; else it reads the grads again in float64."""
    return accumulates_in(dtype, p) == torch.float64 and not makes_norm_float64(dtype)


FLOAT32_SHARE_FLOOR: Final = 2.0**-96
"""Per element, the least ``sum |g|^p`` a float32 sum is kept at (:func:`float32_share_holds`)."""


def float32_share_holds(share: torch.Tensor, numel: int) -> bool:
    """Whether a float32 first sum of ``numel`` grads' ``|g|^p`` (0-dim float64, host) is exact.

    Exact to float32's rounding, as the float64 sum rounded to the grads' float32 norm: where it is
    finite, no square or row sum left float32's range (a sum of non-negative numbers that overflows
    stays infinite); where it is at least ``numel * 2**-96``, the squares below float32's normal
    range (2**-126, each off by less than that, flushed or not) change it by less than 2**-30
    relative. Otherwise (grads beyond 1.8e19 or of 1e-25, NaN or inf, all zero) the float64 read
    decides, which also gives NaN and inf their verdict. A host read of a host tensor: no device
    sync, and the collectives that follow are the same either way."""
    value = float(share)
    return math.isfinite(value) and value >= numel * FLOAT32_SHARE_FLOOR


def host_share(tensor: torch.Tensor, p: float, accumulate_in: torch.dtype) -> torch.Tensor:
    """``sum |x|^p`` (``max |x|`` for the inf-norm) of one host tensor, 0-dim float64.

    The norms of its rows (:func:`row_norms`, in ``accumulate_in``) combined in float64,
    :data:`HOST_NORM_BLOCK` elements at a time (a bf16 tensor's rows cast to float32 inside the
    reduction also run 8x slower over 8M elements at once than block by block); a 1-norm in float32
    through :func:`_magnitude_rows`, :data:`HOST_BLOCK` elements at a time; 0 for no element."""
    if not tensor.numel():
        return torch.zeros((), dtype=torch.float64, device=tensor.device)
    if not tensor.is_contiguous():
        norm = row_norms(tensor, p, accumulate_in)[0].to(torch.float64)
        return norm if math.isinf(p) else norm.pow(p)
    flat = tensor.reshape(-1)
    rows_of: Callable[[torch.Tensor], torch.Tensor]
    if p == 1.0 and accumulate_in == torch.float32:
        scratch = torch.empty(min(flat.numel(), HOST_BLOCK), dtype=torch.float32)
        blocks, rows_of = flat.split(HOST_BLOCK), partial(_magnitude_rows, scratch=scratch)
    else:
        blocks = flat.split(HOST_NORM_BLOCK)
        rows_of = partial(row_norms, p=p, accumulate_in=accumulate_in)
    # each block's rows freed before the next block's are made
    norms = [torch.linalg.vector_norm(rows_of(block), p, dtype=torch.float64) for block in blocks]
    norm = norms[0] if len(norms) == 1 else torch.linalg.vector_norm(torch.stack(norms), p)
    return norm if math.isinf(p) else norm.pow(p)


def _magnitude_rows(block: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
    """The float32 1-norms of the rows of a flat ``block``, its ``|x|`` written into ``scratch``.

    ``scratch`` is float32, at least as long; a narrower block is cast into it first. torch's
    float32 1-norm sums each row in one sequence (8.4 ms for 8M elements on one thread, up to 5e-7
    off over a row of 512), its sum pairwise (3 ms with the ``|x|`` written, 2e-10 off)."""
    magnitudes = scratch[: block.numel()]
    if block.dtype == torch.float32:
        torch.abs(block, out=magnitudes)
    else:
        magnitudes.copy_(block).abs_()
    bulk, tail = _rows_and_tail(magnitudes)
    parts = [] if bulk is None else [bulk.sum(1)]
    if tail is not None:
        parts.append(tail.sum().reshape(1))
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def _rows_and_tail(flat: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``flat``'s whole rows of :data:`HOST_ROW` elements as one 2-D view, and the shorter rest."""
    rows = flat.numel() // HOST_ROW
    bulk = flat[: rows * HOST_ROW].view(rows, HOST_ROW) if rows else None
    tail = flat[rows * HOST_ROW :] if rows * HOST_ROW < flat.numel() else None
    return bulk, tail


def row_norms(tensor: torch.Tensor, p: float, accumulate_in: torch.dtype) -> torch.Tensor:
    """The ``p``-norms, in ``accumulate_in``, of consecutive rows of :data:`HOST_ROW` elements.

    Rows of ``tensor``, the last one shorter; a non-contiguous tensor's norm as one row. Where
    ``accumulate_in`` is float64 and the tensor narrower (the float64 read of
    :func:`sums_float32_first`), pieces of :data:`HOST_FLAT` elements, one reduction each: torch's
    reduction that casts each element to float64 is slower over longer tensors (the 2-norm of 8M
    float32 elements on one thread: 30 ms at once, 6 ms so; 1.1 ms in float32 rows)."""
    cast = None if tensor.dtype == accumulate_in else accumulate_in
    if not tensor.is_contiguous():
        return torch.linalg.vector_norm(tensor, p, dtype=cast).reshape(1)
    flat = tensor.reshape(-1)
    if cast == torch.float64:
        return torch.stack(
            [torch.linalg.vector_norm(piece, p, dtype=cast) for piece in flat.split(HOST_FLAT)]
        )
    bulk, tail = _rows_and_tail(flat)
    parts = [] if bulk is None else [torch.linalg.vector_norm(bulk, p, dim=1, dtype=cast)]
    if tail is not None:
        parts.append(torch.linalg.vector_norm(tail, p, dtype=cast).reshape(1))
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def share_over_divisor(
    tensors: Sequence[torch.Tensor], p: float, divisor: torch.Tensor
) -> torch.Tensor:
    """``sum (|x| / divisor)^p`` over ``tensors`` (real), 0-dim float64 on ``divisor``'s device.

    The exact norm's second read (:func:`~pgregistry.grad_stats._reductions.reduce_shares`), where
    ``divisor`` is the largest ``|x|`` of every grad: each quotient is at most 1, so no power
    overflows, and one is 1, so the powers that underflow (below 2**-1074 each) are lost beside a
    sum of at least 1. Computed in float64 whatever the grads' dtype, :data:`HOST_BLOCK` elements
    at a time (a float64 copy of one block; a non-contiguous tensor is copied whole first): a rare
    path, read by torch only."""
    total = torch.zeros((), dtype=torch.float64, device=divisor.device)
    for tensor in tensors:
        on_device = divisor.to(tensor.device)
        for block in tensor.reshape(-1).split(HOST_BLOCK):
            share = block.to(torch.float64, copy=True).div_(on_device).abs_().pow_(p).sum()
            total += share.to(total.device)
    return total


def _kind_parts(
    kinds: Mapping[tuple[torch.device, torch.dtype], list[torch.Tensor]],
    wanted: Wanted,
    device: torch.device,
) -> Iterator[tuple[torch.dtype, list[torch.Tensor]]]:
    """Each kind's dtype and parts, one read per kind, planned afresh.

    ``kinds`` as :func:`by_kind` gives them."""
    for (kind_device, dtype), same_kind in kinds.items():
        yield dtype, read_kind(same_kind, plan_kind(same_kind, kind_device, dtype), wanted, device)


def parts_of(
    grads: Sequence[torch.Tensor], wanted: Wanted, device: torch.device
) -> list[torch.Tensor]:
    """The parts of ``grads`` (any device, dtype; plain tensors), a read per kind, planned anew."""
    return [part for _, parts in _kind_parts(by_kind(grads), wanted, device) for part in parts]


def add_parts(
    shares: Shares,
    group: GroupKey,
    kinds: Mapping[tuple[torch.device, torch.dtype], list[torch.Tensor]],
) -> None:
    """Add the parts of grads grouped by kind to ``shares`` under ``group``, noting dtypes.

    ``kinds`` as :func:`by_kind` gives them."""
    for dtype, parts in _kind_parts(kinds, shares.wanted, shares.device):
        shares.widen(dtype)
        for part in parts:
            shares.add(group, part)


def scale_kind(
    tensors: Sequence[torch.Tensor], plan: KindPlan | None, coeff: torch.Tensor | Clipping
) -> None:
    """Multiply one kind's ``tensors`` in place by ``coeff``.

    ``coeff`` is 0-dim float64, at most 1; or clipping's, made from the norm. The kernel over its
    launch table (nothing where the coefficient is 1, decided on the device), else
    ``torch._foreach_mul_`` (skipped where the coefficient, on the host, is 1: scaling by exactly 1
    changes no bit)."""
    if not tensors:
        return
    device = tensors[0].device
    if plan is None:
        plan = plan_kind(tensors, device, tensors[0].dtype)
    if plan.kernel:
        read = tensors if not plan.rest else [tensors[index] for index in plan.kernel]
        assert plan.launch is not None
        if isinstance(coeff, Clipping):
            _fused.clip_over_(read, plan.launch, coeff.max_norm, coeff.norm64.to(device))
        else:
            _fused.scale_over_(read, plan.launch, coeff)
    rest = tensors if not plan.kernel else [tensors[index] for index in plan.rest]
    if not rest:
        return
    factor = coeff.coefficient() if isinstance(coeff, Clipping) else coeff
    if factor.device.type == "cpu" and not bool(factor < 1.0):
        return
    torch._foreach_mul_(list(rest), factor.to(device))

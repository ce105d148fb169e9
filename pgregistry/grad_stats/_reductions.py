"""The one path reducing grad norms and zero counts: local shares per reduction group, one reducer.

Whatever reads the grads (lists of tensors, :mod:`pgregistry.grad_stats._local`; DTensor local
pieces, :mod:`pgregistry.grad_stats._plan`; flat-buffer spans, :mod:`pgregistry.optim._grad_buffer`)
turns them into *parts*: float64 pairs ``[sum of |g|^p (max |g| for the inf-norm), zero count]``
(the count read only by a call that wants it: the one-read kernel's pair is a part as it comes),
added to a :class:`Shares` under the group they are summed over. A chained optimizer's children add
their parts to one ``Shares``; nothing combines finished norms. :func:`reduce_shares` then issues
every collective of a call in the one agreed order and combines:

1. DTensor pieces sharded over a data-parallel group (FSDP2): one all-reduce per collection field,
   in field order, of a two-row block (the dense and the expert share), added to the parts of the
   two reduction groups;
2. one all-reduce per reduction group, in an order every rank agrees on (by the group's ranks, then
   its name; :func:`reduce_over_groups`), of the group's row: both statistics in one collective,
   a SUM of one width whatever the norm type (the inf-norm's maxima in a column per rank:
   :func:`_local_row`), so ranks given different norm types issue the same collectives, and a zero
   count alone makes rows of that width too. A call's checked arguments (``given``: ``norm_type``,
   a clip's ``max_norm`` or 0.0 without one and its ``error_if_nonfinite``, a refusal, and the
   statistics it reduces; a zero count alone carries
   :data:`~pgregistry.grad_stats._arguments.ZEROS_ALONE`) ride at the end of every row with peers,
   and wherever they differ the norm is NaN and the zero count -1
   (:class:`~pgregistry.grad_stats._arguments.Agreement`; :func:`check_arguments_after` raises it
   where no device sync is needed);
3. with ``verdict`` (clipping): the NaN / inf seen anywhere, over every rank that holds grads (the
   collection's ``intra_dist_opt``, and ``inter_dist_opt`` across optimizer instances), so every
   rank clips, skips or raises alike. One small all-reduce (MAX, with the arguments), none when a
   reduction group of step 2 already spans those ranks (the flags then ride in its row);
4. only for a ``p`` other than 1, 2 and inf (those are exact in steps 1-3:
   :attr:`Wanted.exact_in_one_reduction`), where the norm of steps 1-3 cannot be trusted (``sum
   |g|^p`` overflowed or underflowed the float range; a ``p`` beyond 2**126) and the caller can read
   the grads again: the inf-norm ``m`` over the same groups, then the shares again divided by ``m``,
   reduced as above (:func:`reduce_shares`): the norm ``m * (sum (|g| / m)^p)^(1/p)``, exact.

A SUM carries a NaN or an inf through by itself (a MAX may drop a NaN: gloo's keeps whichever comes
first), the inf-norm's too: its maxima are gathered, not compared, by the SUM. The grads a rank
holds but does not count (TP, expert TP and GTP duplicates, ``shared`` copies) are read too, into
*seen* parts
(:func:`nonfinite_part`: their NaN or inf, nothing else) under the group their counted copy is
summed over: whether the norm is finite is decided over every grad of every rank, in the rows that
already travel, while each element is still counted once. Shares accumulate in float64 whatever the
grads' dtype (float64 grads of 3e30 have a finite norm); the 1- and 2-norm from the first element
(:func:`accumulates_in`; on the host a float32 first sum where it is exact), a float64 grad's
squares by range in two more columns of the 2-norm's rows (:func:`squares_by_range`), so the 1-, 2-
and inf-norm wait on nothing: no device sync, as torch's ``clip_grad_norm_``. Another ``p`` reads
its norm on the host once, whether it is exact (:func:`reduce_shares`, which makes it so where ``sum
|g|^p`` over- or underflowed). Results are 0-dim tensors on the reduction device, the norm returned
in float64 where this rank holds a float64 (or complex128) grad, float32 otherwise
(:attr:`Reduced.norm`). A call issues a few small operations whatever the number of grads.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Final, TypeVar

import attrs
import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from pgregistry.collection import FIELD_NAMES, GroupName, group_size
from pgregistry.grad_stats._arguments import (
    AGREEMENT_WIDTH_SUM,
    CLIP_EPSILON,
    ZEROS_ALONE,
    Agreement,
    Given,
    check_max_norm,
    max_norm_scalar,
    norm_type_as_float,
)
from pgregistry.grad_stats._fused import can_run_fused_stats, finish_rows

__all__ = [
    "CLIP_EPSILON",
    "Clipping",
    "check_arguments_after",
    "zero_count_after",
    "GradsByGroup",
    "GroupKey",
    "Reduced",
    "Reread",
    "Shares",
    "Wanted",
    "check_max_norm",
    "norm_type_as_float",
    "clip_coefficient",
    "reduce_over_groups",
    "reduce_shares",
    "nonfinite_part",
    "makes_norm_float64",
]


GradsByGroup = Mapping[ProcessGroup | None, Sequence[torch.Tensor]]
"""Reduction group (``None``: no reduction) -> already-filtered grads."""

GroupKey = Any
"""A reduction group as a key of the shares: a ``ProcessGroup`` or ``None`` (no reduction)."""

V = TypeVar("V")

_NORM, _ZEROS = range(2)
"""A part's columns: the norm's share and the zero count."""

_LARGE, _SMALL = range(2, 4)
"""A 2-norm row's further columns: the squares of the float64 grads beyond the middle range, scaled
into it (:func:`squares_by_range`); the norm column then holds the squares of every other grad."""

_RANGED_WIDTH: Final = 4
"""A 2-norm row's width: the norm column, the zero count, the large and the small column."""

_RANGE_EDGE: Final = 2.0**256
"""Where :func:`squares_by_range` puts a float64 ``|g|``: at least this, the large column; below its
reciprocal, the small one; else the norm column (squares within ``[2**-512, 2**512)``)."""

_RANGE_SCALE: Final = 2.0**600
"""What the large column's ``|g|`` are divided by and the small column's multiplied by, exactly (a
power of two): every scaled square lies within ``[2**-948, 2**848]``, so neither column's sum
over- or underflows."""


@attrs.frozen(slots=True)
class Wanted:
    """What one call computes: the ``p``-norm (``None``: no norm) and whether the zero count.

    ``divisor`` (0-dim float64, the largest ``|g|`` of the grads read) asks the readers for ``sum
    (|g| / divisor)^p`` instead, in float64: the exact norm's second read (:func:`reduce_shares`),
    never the kernel's."""

    p: float | None
    zeros: bool
    divisor: torch.Tensor | None = attrs.field(default=None, eq=False)

    @classmethod
    def of(cls, norm_type: float, zeros: bool) -> Wanted:
        """The ``norm_type``-norm (checked), and the zero count when ``zeros``.

        ``None`` is no norm type (``TypeError``), not "no norm": a user's ``norm_type=None`` would
        reach the end of the reduction and fail there naming nothing."""
        return cls(norm_type_as_float(norm_type), zeros)

    @classmethod
    def zeros_only(cls) -> Wanted:
        """The zero count alone, no norm."""
        return cls(None, zeros=True)

    @property
    def infinite(self) -> bool:
        return self.p is not None and math.isinf(self.p)

    @property
    def ranged(self) -> bool:
        """Whether this is the 2-norm (its rows carry squares: :func:`squares_by_range`)."""
        return self.p == 2.0

    @property
    def exact_in_one_reduction(self) -> bool:
        """Whether the one reduction gives this norm exactly, for grads of any dtype (no host read).

        The inf-norm is a maximum. The 1- and 2-norm accumulate ``|g|`` and ``g * g`` in float64
        from the start (:func:`accumulates_in`): a float32, bf16 or fp16 value's square lies within
        ``[2**-298, 2**256]``, a normal float64, and a sum of up to ``2**60`` of them cannot leave
        float64's range; a float64 grad's squares go by range (:func:`squares_by_range`); a sum of
        ``|g|`` is only infinite where the norm is beyond float64. Every other ``p`` (and ``p`` >
        2**126) may need :func:`reduce_shares`' exact norm."""
        return self.p is not None and (self.infinite or self.p in (1.0, 2.0))


def nonfinite_part(part: torch.Tensor) -> torch.Tensor:
    """The part a read of grads this rank does not count adds: their NaN or inf.

    A share of ``sum |g|^p`` or ``max |g|`` is NaN or infinite exactly when one of the grads is;
    every finite entry and the zero count are 0. So the verdict on the norm covers every grad a rank
    holds while nothing is counted twice."""
    return torch.where(part.isfinite(), 0.0, part)


def makes_norm_float64(dtype: torch.dtype) -> bool:
    """Whether ``dtype`` grads make the norm float64 (:attr:`Reduced.norm`): float64, complex128."""
    return dtype in (torch.float64, torch.complex128)


def accumulates_in(dtype: torch.dtype, p: float | None) -> torch.dtype:
    """The dtype a ``p``-norm of ``dtype`` grads accumulates ``|g|^p`` in, from the first element.

    Float64 for float64 (complex128) grads and, whatever the grads' dtype, for the 1- and 2-norm
    (:attr:`Wanted.exact_in_one_reduction`); float32 otherwise (other ``p`` may over- or underflow
    there: :func:`reduce_shares` makes them exact; ``None``, a zero count alone, needs no more). On
    the host, narrower grads' 1- and 2-norm are summed in float32 first, kept where that sum is
    exact, else read in this dtype (:func:`~pgregistry.grad_stats._local.sums_float32_first`)."""
    return torch.float64 if makes_norm_float64(dtype) or p in (1.0, 2.0) else torch.float32


def squares_by_range(tensors: Iterable[torch.Tensor], block: int) -> torch.Tensor:
    """The squares of real float64 ``tensors`` by range: ``[middle, large, small]``, float64.

    A float64 square leaves float64's range (beyond ``|g|`` of 1.3e154, below 1.5e-154 it loses
    bits), so each ``|g|`` goes by range (:data:`_RANGE_EDGE`): the middle range squared as it
    is, the large ones divided by :data:`_RANGE_SCALE` first, the small ones multiplied by it:
    powers of two, exact. The three sums travel as columns of the row (:func:`reduce_shares`) and
    are combined after the reduction (:func:`_two_norm_from_ranges`): the 2-norm of float64 grads
    is exact with no host read and no second pass, on every rank alike. A NaN lands in the middle
    column, an inf in the large one. ``block`` elements at a time (a few temporaries of a block
    each): float64 grads only, a few passes over them. :func:`make_part` makes it a part."""
    columns = []
    for tensor in tensors:
        for piece in tensor.reshape(-1).split(block):
            size = piece.abs()
            large = size >= _RANGE_EDGE
            small = size < 1.0 / _RANGE_EDGE
            middle = torch.where(large | small, 0.0, size)
            columns.append(
                torch.stack(
                    [
                        torch.linalg.vector_norm(middle).square(),
                        torch.linalg.vector_norm(
                            torch.where(large, size, 0.0) / _RANGE_SCALE
                        ).square(),
                        torch.linalg.vector_norm(
                            torch.where(small, size, 0.0) * _RANGE_SCALE
                        ).square(),
                    ]
                )
            )
    if not columns:
        return _float64_zeros(3, torch.device("cpu"))
    return torch.stack(columns).sum(0) if len(columns) > 1 else columns[0]


def make_part(
    norm_share: torch.Tensor | None, zeros: torch.Tensor | None, device: torch.device
) -> torch.Tensor:
    """A part from a norm share and a zero count (0-dim tensors, either absent).

    The norm share is ``sum |g|^p``, or ``max |g|``, or the 2-norm's squares by range (a vector,
    :func:`squares_by_range`: the part is then a 2-norm row's four columns).
    """
    if norm_share is not None and norm_share.dim():  # by range: [middle, zeros, large, small]
        count = norm_share.new_zeros(()) if zeros is None else zeros.to(norm_share)
        return torch.cat([norm_share[:1], count.reshape(1), norm_share[1:]]).to(device)
    if norm_share is None or zeros is None:
        present = norm_share if norm_share is not None else zeros
        if present is None:
            return _float64_zeros(2, device)
        pair = [present.to(torch.float64), present.new_zeros((), dtype=torch.float64)]
        return torch.stack(pair if norm_share is not None else pair[::-1]).to(device)
    return torch.stack([norm_share.to(torch.float64), zeros.to(torch.float64)]).to(device)


@attrs.define(slots=True)
class _First:
    """The parts of DTensor pieces summed over one data-parallel collection field first, by slot.

    Slot 0 is dense, 1 expert; also the reduction groups each slot's total joins afterwards."""

    group: ProcessGroup | None
    targets: tuple[GroupKey, GroupKey]
    slots: tuple[list[torch.Tensor], list[torch.Tensor]] = attrs.field(factory=lambda: ([], []))


class Shares:
    """This rank's local shares of one statistics call by reduction group; see the module docstring.

    Every group a rank must reduce over is a key, with no part when it counts nothing there, so
    every rank of a group issues the same collectives (a pipeline stage without experts still joins
    the expert reduction).
    """

    def __init__(
        self, wanted: Wanted, device: torch.device, groups: Iterable[GroupKey] = ()
    ) -> None:
        self.wanted = wanted
        self.device = device
        self.wide = False
        """Whether a grad read into these shares is float64 (:func:`makes_norm_float64`): the norm
        is returned in float64."""
        self.by_group: dict[GroupKey, list[torch.Tensor]] = {group: [] for group in groups}
        self.first: dict[GroupName, _First] = {}

    def add(self, group: GroupKey, part: torch.Tensor | None = None) -> None:
        """Register ``group`` and, unless ``None``, add ``part`` to its share."""
        parts = self.by_group.setdefault(group, [])
        if part is not None:
            parts.append(part.to(self.device))

    def widen(self, dtype: torch.dtype) -> None:
        """Note that grads of ``dtype`` were read.

        The norm is float64 once one of them is (:func:`makes_norm_float64`)."""
        self.wide = self.wide or makes_norm_float64(dtype)

    def add_first(
        self,
        field: GroupName,
        group: ProcessGroup | None,
        targets: tuple[GroupKey, GroupKey],
        slot: int,
        part: torch.Tensor | None,
    ) -> None:
        """Register ``field`` and, unless ``None``, add ``part`` to ``slot`` (0 dense, 1 expert).

        The field's ``group`` is summed over before ``targets``, the dense and the expert reduction
        group."""
        first = self.first.setdefault(field, _First(group, targets))
        if part is not None:
            first.slots[slot].append(part.to(self.device))


@attrs.frozen(slots=True)
class Reduced:
    """The reduced statistics: ``norm64`` and ``zeros``, and whether a grad read was float64.

    ``norm64`` is float64, NaN / inf where one was seen (see :func:`reduce_shares`), ``zeros``
    int64, both 0-dim tensors on the reduction device, ``None`` when not wanted; ``wide``: whether a
    grad read was float64 (:func:`makes_norm_float64`)."""

    norm64: torch.Tensor | None
    zeros: torch.Tensor | None
    wide: bool = False
    narrow: torch.Tensor | None = None
    """:attr:`norm` made with ``norm64`` where not ``wide`` (:func:`_finish_in_one_launch`)."""
    clip_narrow: torch.Tensor | None = None
    """:attr:`clip_norm` made with ``norm64`` where not ``wide``."""
    agreement: Agreement | None = None
    """The clip's arguments reduced with the verdict (:func:`reduce_shares`' ``given``)."""

    @property
    def norm(self) -> torch.Tensor:
        """The norm as the statistics' API returns it: 0-dim, in the grads' precision.

        As torch's ``clip_grad_norm_``: float64 where a grad read was float64 (a norm of float64
        grads beyond float32's range stays finite), float32 otherwise (bf16 and fp16 grads too:
        their norm is no narrower than float32)."""
        if self.norm64 is None:
            raise ValueError("no norm was computed")
        if self.wide:
            return self.norm64
        return self.norm64.to(torch.float32) if self.narrow is None else self.narrow

    @property
    def clip_norm(self) -> torch.Tensor:
        """:attr:`norm` as a clip returns it: finite wherever the norm is.

        Where it is float32 (no float64 grad on this rank) and the norm finite but beyond float32's
        range (float64 grads on another rank), the largest float32, not inf: a clip made with a
        finite norm never reports a non-finite one (a training loop would skip the step on this rank
        alone)."""
        if self.norm64 is None or self.wide:
            return self.norm
        if self.clip_narrow is not None:
            return self.clip_narrow
        finite = self.norm64.clamp(max=torch.finfo(torch.float32).max)
        return torch.where(torch.isinf(self.norm64), self.norm64, finite).to(torch.float32)


def check_arguments_after(
    reduced: Reduced, given: Given, owner: str, error_if_nonfinite: object = False
) -> None:
    """Raise this rank's refused argument, then the ranks' disagreement where it costs no sync.

    After the reduction, which a refusing rank joined first (no peer waits); the disagreement as
    :func:`_raise_disagreement` reads it. A norm without a clip checks this too: its rows carry the
    arguments as a clip's do (:func:`reduce_shares`); so does a zero count alone
    (:func:`zero_count_after`)."""
    if given.refusal is not None:
        raise given.refusal
    _raise_disagreement(reduced, given, owner, error_if_nonfinite is True)


def zero_count_after(reduced: Reduced, owner: str, *, on_host: bool = False) -> torch.Tensor:
    """The zero count of a zero count alone's reduction, once its disagreement is raised.

    A peer that computed a norm instead (its rows carried other arguments than
    :data:`~pgregistry.grad_stats._arguments.ZEROS_ALONE`) is raised where it costs no device
    sync, as :func:`check_arguments_after` raises, and with ``on_host`` (the caller reads the count
    on the host anyway, returning an int) on a GPU too; on a GPU otherwise the count is -1 on this
    rank, the norm NaN on that peer. The one check of every entry point of a zero count alone."""
    zeros = reduced.zeros
    assert zeros is not None
    read = on_host and reduced.agreement is not None and int(zeros) < 0
    _raise_disagreement(reduced, ZEROS_ALONE, owner, read)
    return zeros


def _raise_disagreement(reduced: Reduced, given: Given, owner: str, read: bool) -> None:
    """Raise the arguments' disagreement across ranks, where it costs no device sync.

    Where the verdict lies on the host, or where the caller reads the result anyway (``read``: a
    clip's ``error_if_nonfinite``, with a non-finite norm; a zero count returned as an int).
    Elsewhere (a GPU) the norm is NaN on every rank, the zero count -1, and nothing is scaled."""
    agreement = reduced.agreement
    if agreement is None:
        return
    if agreement.columns.device.type != "cpu":
        norm = reduced.norm64
        if not read or (norm is not None and bool(torch.isfinite(norm))):
            return
    fault = agreement.fault(given, owner)
    if fault is not None:
        raise fault


Reread = Callable[[Wanted], Shares]
"""Reads the grads of a call again, into fresh shares of another :class:`Wanted`, under the same
groups: what :func:`reduce_shares` needs for an exact norm."""


def reduce_shares(
    shares: Shares,
    *,
    verdict: Sequence[ProcessGroup | None] = (),
    reread: Reread | None = None,
    given: Given | None = None,
) -> Reduced:
    """Reduce ``shares`` (see the module docstring; they are consumed) into the global statistics.

    ``verdict``: the groups that together span every rank holding grads (``intra_dist_opt``, then
    ``inter_dist_opt``); when given, a NaN or inf seen on any of those ranks makes the norm NaN or
    inf on all of them. Without it, only the ranks of a rank's own reduction groups contribute.

    ``reread``: given, a ``p``-norm the one reduction cannot be trusted with
    (:func:`_needs_exact_norm`: ``sum |g|^p`` overflowed or underflowed, or ``p`` beyond 2**126) is
    made exact from two reads more (:func:`_exact_norm`). The 1-, 2- and inf-norm never need it
    (:attr:`Wanted.exact_in_one_reduction`): nothing is read on the host for them, decided from
    ``p`` alone, the same on every rank (a rank's dtypes are not: a float64 stage beside a float32
    one). Another ``p`` reads the reduced norm on the host (a device sync on CUDA): every rank of
    the reduction groups holds the same norm, so every rank takes the same branch.

    ``given``: the call's arguments on this rank (:class:`~pgregistry.grad_stats._arguments.Given`).
    Where refused, this rank's shares are NaN (the norm is NaN on every rank of its groups); the
    arguments ride at the end of every row with peers (``Given.columns``; a plain norm's
    ``max_norm`` is 0.0) and, with ``verdict``, in the flags' all-reduce where no row spans its
    ranks; the norm is NaN on every rank where one was refused or the ranks' arguments
    differ (:attr:`Reduced.agreement` tells which; :func:`check_arguments_after` raises it)."""
    reduced = _reduce_once(shares, verdict, given)
    p = shares.wanted.p
    if reread is None or p is None or shares.wanted.exact_in_one_reduction:
        return reduced
    assert reduced.norm64 is not None
    if not _needs_exact_norm(reduced.norm64, p):
        return reduced
    return _exact_norm(reduced, p, reread, verdict)


_SMALLEST_TRUSTED_SHARE: Final = torch.finfo(torch.float32).tiny / torch.finfo(torch.float32).eps
"""2**-103: a ``sum |g|^p`` below it may have lost its bits (float32 powers below 2**-126 are
subnormal, with fewer bits than float32's 24, or 0), or be 0 while a grad is not."""

_LARGEST_TRUSTED_P: Final = 1.0 / torch.finfo(torch.float32).tiny
"""2**126: beyond it ``1/p`` is no normal float32, and torch raises a float32 tensor's ``sum |g|^p``
to it in float32 (0 for ``p`` of 1e300: every tensor's norm is then ``x^0 = 1``)."""


def _needs_exact_norm(norm64: torch.Tensor, p: float) -> bool:
    """Whether the one reduction's finite-grad ``norm64`` may be wrong (reads it on the host).

    Its ``sum |g|^p`` is infinite (an overflow, or an infinite grad: :func:`_exact_norm` tells them
    apart) or below :data:`_SMALLEST_TRUSTED_SHARE` (0 too: an underflow, or every grad zero); or
    ``p`` is beyond :data:`_LARGEST_TRUSTED_P`. A NaN is a NaN grad's verdict: kept."""
    norm = float(norm64)  # the one host read
    if math.isnan(norm):
        return False
    return p > _LARGEST_TRUSTED_P or math.isinf(norm) or norm < _SMALLEST_TRUSTED_SHARE ** (1.0 / p)


def _exact_norm(
    reduced: Reduced, p: float, reread: Reread, verdict: Sequence[ProcessGroup | None]
) -> Reduced:
    """``reduced`` with the norm ``m * (sum (|g| / m)^p)^(1/p)``, ``m`` the largest ``|g|``.

    ``m`` is the inf-norm, read and reduced over the same groups and ``verdict`` as the norm: a NaN
    or infinite ``m`` (a grad that is) keeps ``reduced``'s verdict, a 0 (every grad zero) is the
    norm. Otherwise every share is read again divided by ``m`` in float64 (at least one is 1,
    none above: ``sum`` lies in ``[1, numel]``, neither overflows nor underflows) and reduced once
    more. Every rank of the groups holds the same ``m``: all take the same branch."""
    peak = _reduce_once(reread(Wanted(math.inf, zeros=False)), verdict).norm64
    assert peak is not None
    finite, positive = torch.stack([peak.isfinite(), peak > 0]).tolist()
    if not finite:
        return reduced
    if not positive:
        return attrs.evolve(reduced, norm64=peak, narrow=None, clip_narrow=None)
    scaled = _reduce_once(reread(Wanted(p, zeros=False, divisor=peak)), ()).norm64
    assert scaled is not None
    return attrs.evolve(reduced, norm64=peak * scaled, narrow=None, clip_narrow=None)


def _reduce_blocks(shares: Shares, given: Given | None) -> list[tuple[GroupKey, torch.Tensor]]:
    """Step 1 of the module docstring: each field's block summed, its rows added to their groups.

    Returns the arguments each block of a field with peers carried (``given``'s, after a zero
    ``[seen]`` pair, as a row's tail: :func:`_tails_summed`), with the field's group: ranks sharded
    over a data-parallel field tell a norm type that differs there too."""
    wanted, device = shares.wanted, shares.device
    firsts: list[tuple[GroupKey, torch.Tensor]] = []
    for field in sorted(shares.first, key=FIELD_NAMES.index):
        first = shares.first[field]
        block = torch.stack(
            [_local_row(parts, wanted, device, first.group) for parts in first.slots]
        )
        if given is not None and group_size(first.group) > 1:  # the arguments ride in it too
            arguments = given.columns(summed=True, device=device)
            flat = torch.cat([block.reshape(-1), _float64_zeros(2, device), arguments])
            _all_reduce(flat, dist.ReduceOp.SUM, first.group)
            block = flat[: block.numel()].reshape(block.shape)
            firsts.append((first.group, flat[block.numel() :]))
        else:
            _all_reduce(block, dist.ReduceOp.SUM, first.group)
        for target, row in zip(first.targets, block, strict=True):
            shares.add(target, _as_part(row, wanted, first.group))
    return firsts


def _reduce_once(
    shares: Shares, verdict: Sequence[ProcessGroup | None], given: Given | None = None
) -> Reduced:
    """:func:`reduce_shares`' one reduction: the collectives of the module docstring."""
    wanted, device = shares.wanted, shares.device
    if given is not None and given.refusal is not None:
        for group in list(shares.by_group):
            shares.add(group, _poison_part(device))
    if wanted.p is None:  # the zero count alone: no verdict, its own arguments
        verdict, given = (), ZEROS_ALONE
    firsts = _reduce_blocks(shares, given)
    rows = {g: _local_row(parts, wanted, device, g) for g, parts in shares.by_group.items()}
    verdict_groups = [group for group in verdict if group is not None and group_size(group) > 1]
    seen = riding = carrier = agreement = None
    if verdict_groups:
        seen = _local_nonfinite_flags(rows, device)
        carrier = _same_ranks(verdict_groups[0], rows)
    shared = [group for group in rows if group_size(group) > 1]  # the rows with peers
    if shared and (seen is not None or given is not None):  # they end alike: [seen, arguments]
        tail = torch.cat(
            [
                _float64_zeros(2, device) if seen is None else seen,
                *([given.columns(summed=True, device=device)] if given is not None else []),
            ]
        )
        rows.update({group: torch.cat([rows[group], tail]) for group in shared})
    reduced = _reduce_each_group(rows, lambda row: row, dist.ReduceOp.SUM)
    if (shared or firsts) and (seen is not None or given is not None):
        carrying = [(group, reduced[group]) for group in shared] + firsts
        riding = _tails_summed([row for _, row in carrying], given)
        if given is not None:
            agreement = Agreement(riding[2:], sum(group_size(group) for group, _ in carrying))
    if carrier is not None and carrier is not _NO_GROUP:
        verdict_groups = verdict_groups[1:]  # the carrier's row spans the first
    if not verdict_groups:
        finished = _finish_in_one_launch(list(reduced.values()), riding, wanted, shares, agreement)
        if finished is not None:
            return finished
    zeros = None
    if wanted.zeros:
        zeros = _column_total(list(reduced.values()), _ZEROS, device).round().to(torch.int64)
    if wanted.p is None:
        if agreement is not None:
            zeros = _count_unless_disagreeing(zeros, agreement.disagrees())
        return Reduced(norm64=None, zeros=zeros, wide=shares.wide, agreement=agreement)
    if wanted.infinite:
        norm = _largest_peak(reduced, device)
    elif wanted.ranged:
        totals = list(reduced.values())
        norm = _two_norm_from_ranges(
            *(_column_total(totals, column, device) for column in (_NORM, _LARGE, _SMALL))
        )
    else:
        norm = _column_total(list(reduced.values()), _NORM, device).pow(1.0 / wanted.p)
    flags = []  # each [NaN, inf] (counts, never negative: set where positive)
    if seen is not None:
        if carrier is not _NO_GROUP:
            assert riding is not None
            flags.append(riding[:2])
        if verdict_groups:
            seen = torch.maximum(seen, _nonfinite_flags(norm))
            if given is not None:  # after the rows' (summed), or alone
                seen = torch.cat([seen, _maximum_form(agreement, given, device)])
            for group in verdict_groups:
                dist.all_reduce(seen, op=dist.ReduceOp.MAX, group=group)
            if given is not None:
                agreement, seen = Agreement(seen[2:], 0), seen[:2]
            flags.append(seen)
    if flags:
        nan, inf = flags[0] if len(flags) == 1 else torch.stack(flags).amax(0)
        norm = torch.where(nan > 0, math.nan, torch.where(inf > 0, math.inf, norm))
    if agreement is not None:
        disagrees = agreement.disagrees()
        norm = torch.where(disagrees, math.nan, norm)
        zeros = _count_unless_disagreeing(zeros, disagrees)
    return Reduced(norm64=norm, zeros=zeros, wide=shares.wide, agreement=agreement)


def _count_unless_disagreeing(
    zeros: torch.Tensor | None, disagrees: torch.Tensor
) -> torch.Tensor | None:
    """The zero count, -1 where the ranks' arguments or statistics disagree (no host sync).

    No count is -1: on a GPU, where nothing raises, a count its peers did not sum alike shows."""
    return None if zeros is None else torch.where(disagrees, -1, zeros)


def _finish_in_one_launch(
    rows: list[torch.Tensor],
    flags: torch.Tensor | None,
    wanted: Wanted,
    shares: Shares,
    agreement: Agreement | None,
) -> Reduced | None:
    """:func:`_reduce_once`'s results from its reduced ``rows`` in one kernel launch, where it can.

    On CUDA with the one-read kernels, for the 2-norm and the zero count (what training calls),
    one or two rows (the dense and the expert reduction group), ``flags`` the verdict's counts
    riding in the rows (followed by ``agreement``'s summed columns, where given: the rows' tails
    added up, :func:`_tails_summed`):
    :func:`~pgregistry.grad_stats._fused.finish_rows`, the same operations as the lines after this
    call in :func:`_reduce_once` and the same bits, in one launch instead of 20 to 30. ``None``
    elsewhere: those lines run."""
    if not (wanted.ranged or (wanted.p is None and wanted.zeros)) or not 1 <= len(rows) <= 2:
        return None
    if not can_run_fused_stats(shares.device) or not all(row.is_contiguous() for row in rows):
        return None
    finished = finish_rows(
        rows,
        flags,
        norm=wanted.ranged,
        zeros=wanted.zeros,
        narrow=not shares.wide,
        scale=_RANGE_SCALE,
        ranks=agreement.ranks if agreement is not None else 0,
    )
    return Reduced(
        finished.norm64,
        finished.zeros,
        shares.wide,
        finished.narrow,
        finished.clip_narrow,
        agreement,
    )


_NO_GROUP: Final = object()


def _float64_zeros(size: int | tuple[()], device: torch.device) -> torch.Tensor:
    return torch.zeros(size, dtype=torch.float64, device=device)


def _poison_part(device: torch.device) -> torch.Tensor:
    """The part a rank that refused its argument adds to each group: a NaN share, no zero."""
    part = _float64_zeros(2, device)
    part[_NORM] = math.nan
    return part


def _column_total(rows: Sequence[torch.Tensor], column: int, device: torch.device) -> torch.Tensor:
    """The sum of one column over ``rows`` (0-dim float64).

    With one row (one reduction group, the common case) its entry, with no operation to add it
    up."""
    if len(rows) == 1:
        return rows[0][column]
    return torch.stack([row[column] for row in rows]).sum() if rows else _float64_zeros((), device)


def _two_norm_from_ranges(
    middle: torch.Tensor, large: torch.Tensor, small: torch.Tensor
) -> torch.Tensor:
    """The 2-norm from :func:`squares_by_range`'s columns summed over every rank (0-dim float64).

    With a large square, ``sqrt(large + middle / S**2) * S`` (``S``: :data:`_RANGE_SCALE`; a small
    square is below a 2**-1024th of a large one: left out); else, with a middle one, ``sqrt(middle +
    small / S**2)``; else ``sqrt(small) / S``. Each quotient is a normal float64 or negligible
    beside the column it joins. ``S**2`` (2**1200) is no float64: each quotient divides by ``S``
    twice, exactly (a product ``S * S`` is inf, and a quotient by it 0: the middle column was
    dropped beside a large square, the small one beside a middle square, a norm of float64 grads on
    both sides of 2**256 or 2**-256 too small). A NaN or inf in a column (a grad that is one) is
    the norm."""
    exact = torch.where(
        large > 0,
        torch.sqrt(large + middle / _RANGE_SCALE / _RANGE_SCALE) * _RANGE_SCALE,
        torch.where(
            middle > 0,
            torch.sqrt(middle + small / _RANGE_SCALE / _RANGE_SCALE),
            small.sqrt() / _RANGE_SCALE,
        ),
    )
    every = middle + large + small
    return torch.where(every.isfinite(), exact, every)


def _nonfinite_flags(value: torch.Tensor) -> torch.Tensor:
    """``[NaN, inf]`` flags (1 or 0, float64) of a 0-dim tensor."""
    return torch.stack([value.isnan(), value.isinf()]).to(torch.float64)


def _local_nonfinite_flags(
    rows: Mapping[GroupKey, torch.Tensor], device: torch.device
) -> torch.Tensor:
    """Whether this rank's local rows hold a NaN or an inf, as ``[NaN, inf]`` flags.

    Only shares can be either (a zero count never is), whatever the norm type's columns."""
    if not rows:
        return _float64_zeros(2, device)
    values = torch.cat(list(rows.values()))
    return torch.stack([values.isnan().any(), values.isinf().any()]).to(torch.float64)


def _tails_summed(rows: Sequence[torch.Tensor], given: Given | None) -> torch.Tensor:
    """The reduced ``rows``' tails (``[seen, arguments]``, :func:`_reduce_once`) added up.

    Summed over the rows, the arguments' summed form covers every rank of every group, each counted
    once per group it shares with this rank (:class:`Agreement` over the sum of the groups' sizes:
    equal terms, by Cauchy-Schwarz, whatever their multiplicity); the flags stay counts."""
    width = 2 + (AGREEMENT_WIDTH_SUM if given is not None else 0)
    tails = [row[-width:] for row in rows]
    return tails[0] if len(tails) == 1 else torch.stack(tails).sum(0)


def _maximum_form(agreement: Agreement | None, given: Given, device: torch.device) -> torch.Tensor:
    """The arguments as the verdict's MAX all-reduce carries them: the rows', else this rank's."""
    if agreement is None:
        return given.columns(summed=False, device=device)
    return agreement.as_maximum_form(given)


def _largest_peak(reduced: Mapping[GroupKey, torch.Tensor], device: torch.device) -> torch.Tensor:
    """The inf-norm: the largest of every row's peak columns (a NaN where one is)."""
    peaks = [
        row[_RANGED_WIDTH : _RANGED_WIDTH + group_size(group)] for group, row in reduced.items()
    ]
    return torch.cat(peaks).amax() if peaks else _float64_zeros((), device)


def _same_ranks(group: ProcessGroup, rows: Mapping[GroupKey, torch.Tensor]) -> Any:
    """The key of ``rows`` that is ``group`` or holds the same ranks, else :data:`_NO_GROUP`."""
    ranks = dist.get_process_group_ranks(group)
    for key in rows:
        if key is group or (key is not None and dist.get_process_group_ranks(key) == ranks):
            return key
    return _NO_GROUP


def _as_part(row: torch.Tensor, wanted: Wanted, group: ProcessGroup | None) -> torch.Tensor:
    """A row reduced over a field first (over ``group``), as a part of its reduction group.

    The inf-norm's part is the largest of the row's peak columns (NaN where one is)."""
    if not wanted.infinite:
        return row[:_RANGED_WIDTH]
    peaks = row[_RANGED_WIDTH : _RANGED_WIDTH + group_size(group)]
    return torch.stack([peaks.amax(), row[_ZEROS]])


def _local_row(
    parts: Sequence[torch.Tensor], wanted: Wanted, device: torch.device, group: GroupKey
) -> torch.Tensor:
    """One group's row from its parts, to be summed over ``group`` whatever the norm type.

    ``[share, zeros, large, small, peak_0 .. peak_n-1]`` for a group of ``n`` ranks: a ``p``-norm's
    share in the first column (the 2-norm's by range, :func:`squares_by_range`); the inf-norm's
    ``max |g|`` in this rank's own peak column, every other rank's 0, so the SUM gathers each
    rank's maximum exactly, a NaN too (a MAX reduction may drop one). One width and one operation
    for every norm type and for the zero count alone (``[0, zeros, 0 ..]``): ranks given different
    ones issue the same collective (gloo aborted on a size mismatch, or a peer waited), and tell it
    from the arguments that ride at the row's end (:func:`_reduce_once`)."""
    width = _RANGED_WIDTH + group_size(group)
    if not wanted.infinite:
        if not parts:
            return _float64_zeros(width, device)
        widened = [_pad_to_width(part, width) for part in parts]
        return widened[0] if len(widened) == 1 else torch.stack(widened).sum(0)
    row = _float64_zeros(width, device)
    if parts:
        stacked = torch.stack(list(parts))
        row[_ZEROS] = stacked[:, _ZEROS].sum()
        row[_RANGED_WIDTH + _rank_in(group)] = stacked[:, _NORM].amax()
    return row


def _rank_in(group: GroupKey) -> int:
    """This rank's index in ``group`` (0 for none, or one of a single rank)."""
    if group is None or group_size(group) <= 1:
        return 0
    return dist.get_group_rank(group, dist.get_rank())


def _pad_to_width(part: torch.Tensor, width: int) -> torch.Tensor:
    """``part`` with zero columns appended up to ``width``.

    So a 2-norm part of grads that need no range (:func:`squares_by_range`) is a 2-norm row."""
    if part.shape[0] == width:
        return part
    return torch.nn.functional.pad(part, (0, width - part.shape[0]))


def _reduce_each_group(
    rows: Mapping[GroupKey, torch.Tensor], local: Callable[[torch.Tensor], torch.Tensor], op: Any
) -> dict[GroupKey, torch.Tensor]:
    """:func:`reduce_over_groups` of ``local(row)`` for each group, by group."""
    order: list[GroupKey] = []

    def note_group_and_read_local(item: tuple[GroupKey, torch.Tensor]) -> torch.Tensor:
        order.append(item[0])
        return local(item[1])

    reduced = {}
    for row in reduce_over_groups(
        {group: (group, row) for group, row in rows.items()}, note_group_and_read_local, op
    ):
        reduced[order[-1]] = row  # the group note_group_and_read_local() was given last
    return reduced


def reduce_over_groups(
    items_by_group: Mapping[ProcessGroup | None, V], local: Callable[[V], torch.Tensor], op: Any
) -> Iterator[torch.Tensor]:
    """Each group's local share ``local(items)``, all-reduced in place with ``op`` over its group.

    One collective per group of more than one rank (none for ``None``), issued in an order every
    rank agrees on (by the group's ranks, then its name): ranks that share two groups must reduce
    them in the same order. :func:`reduce_shares` reduces every statistic through this.

    Args:
        items_by_group: group -> what this rank holds for it. Every rank of a group must pass that
            group as a key.
        local: computes a group's local share (a tensor) from its items.
        op: the ``torch.distributed.ReduceOp``.

    Yields:
        Each group's reduced share, in the agreed order; its collective is issued as it is drawn.

    Example:
        >>> import torch
        >>> import torch.distributed as dist
        >>> def summed(items: list[float]) -> torch.Tensor:
        ...     return torch.tensor(sum(items))
        >>> list(reduce_over_groups({None: [3.0, 4.0]}, summed, dist.ReduceOp.SUM))  # None: no peer
        [tensor(7.)]
    """
    for group, items in _in_collective_order(items_by_group):
        share = local(items)
        _all_reduce(share, op, group)
        yield share


@attrs.define(slots=True)
class Clipping:
    """Clipping to ``max_norm`` of grads of total norm ``norm64``, its coefficient not made yet.

    ``norm64`` is 0-dim float64. The one-read scale kernel makes the coefficient on the device, from
    these two, with the bits of :func:`clip_coefficient`
    (:func:`~pgregistry.grad_stats._fused.clip_over_`: no operations on the host); torch's route
    takes :meth:`coefficient`, made once."""

    max_norm: float = attrs.field(converter=max_norm_scalar)
    norm64: torch.Tensor
    _coefficient: torch.Tensor | None = attrs.field(default=None, init=False)

    def coefficient(self) -> torch.Tensor:
        if self._coefficient is None:
            self._coefficient = clip_coefficient(self.max_norm, self.norm64)
        return self._coefficient


def clip_coefficient(max_norm: float, norm64: torch.Tensor) -> torch.Tensor:
    """``max_norm / (norm + 1e-6)`` clamped at 1 (float64, no host sync); 1 for a non-finite norm.

    A NaN or infinite norm's coefficient would be NaN or 0 and would poison or erase the finite
    grads too; a negative one (no norm: a caller's, on a device) would flip every grad's sign."""
    clipped = torch.clamp(max_norm_scalar(max_norm) / (norm64 + CLIP_EPSILON), max=1.0)
    a_norm = torch.isfinite(norm64) & (norm64 >= 0)
    return torch.where(a_norm, clipped, torch.ones_like(clipped))


def _all_reduce(tensor: torch.Tensor, op: Any, group: ProcessGroup | None) -> None:
    # None is an axis that is off: nothing to reduce (and None would mean WORLD to
    # torch.distributed).
    if group is not None and group_size(group) > 1:
        dist.all_reduce(tensor, op=op, group=group)


def _in_collective_order(
    items_by_group: Mapping[ProcessGroup | None, V],
) -> list[tuple[ProcessGroup | None, V]]:
    """Items ordered alike on every rank.

    Ranks that share two groups must reduce them in the same order.
    """

    def collective_order_key(
        item: tuple[ProcessGroup | None, V],
    ) -> tuple[int, tuple[int, ...], str]:
        group = item[0]
        if group is None:
            return (0, (), "")
        return (
            1,
            tuple(dist.get_process_group_ranks(group)),
            str(getattr(group, "group_name", "")),
        )

    return sorted(items_by_group.items(), key=collective_order_key)

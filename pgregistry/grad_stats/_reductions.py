"""The one reduction path of grad norms and zero counts: local shares per reduction group, then one reducer.

Whatever reads the grads (lists of tensors, :mod:`pgregistry.grad_stats._local`; DTensor local pieces,
:mod:`pgregistry.grad_stats._plan`; flat-buffer spans, :mod:`pgregistry._grad_buffer`) turns them into *parts*:
float64 rows ``[sum of |g|^p (max |g| for the inf-norm), zero count, NaN seen, inf seen]``, added to a
:class:`Shares` under the group they are summed over. A chained optimizer merges its children's shares
(:meth:`Shares.merge`); nothing combines finished norms. :func:`reduce_shares` then issues every collective of a call
in the one agreed order and combines:

1. DTensor pieces sharded over a data-parallel group (FSDP2): one all-reduce per collection field, in field order,
   of a two-row block (the dense and the expert share), added to the parts of the two reduction groups;
2. one all-reduce per reduction group, in an order every rank agrees on (by the group's ranks, then its name;
   :func:`reduce_over_groups`), of the group's row: both statistics in one collective (SUM), or, for the inf-norm
   (MAX) with the zero count, two;
3. with ``verdict`` (clipping): the NaN / inf seen anywhere, over every rank that holds grads (the collection's
   ``intra_dist_opt``, and ``inter_dist_opt`` across optimizer instances), so every rank clips, skips or raises
   alike. One 2-element all-reduce, none when a reduction group of step 2 already spans those ranks (the flags
   then ride in its row).

Shares accumulate in float64 whatever the grads' dtype (float64 grads of 3e30 have a finite norm), and nothing
waits on the device: results are 0-dim tensors on the reduction device.
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

__all__ = [
    "CLIP_EPSILON",
    "GradsByGroup",
    "GroupKey",
    "Reduced",
    "Shares",
    "Wanted",
    "check_max_norm",
    "checked_norm_type",
    "clip_coefficient",
    "reduce_over_groups",
    "reduce_shares",
]

CLIP_EPSILON = 1e-6
"""Added to the total norm before dividing, as Megatron-Core does: ``coeff = max_norm / (norm + 1e-6)``."""

GradsByGroup = Mapping[ProcessGroup | None, Sequence[torch.Tensor]]
"""Reduction group (``None``: no reduction) -> already-filtered grads."""

GroupKey = Any
"""A reduction group as a key of the shares: a ``ProcessGroup`` or ``None`` (no reduction)."""

V = TypeVar("V")

_NORM, _ZEROS, _NAN, _INF = range(4)
_WIDTH: Final = 4
"""A part's columns: the norm's share, the zero count, NaN seen, inf seen."""


def checked_norm_type(norm_type: float) -> float:
    """``norm_type`` as a float; ``ValueError`` unless it is positive (inf included)."""
    p = float(norm_type)
    if math.isnan(p) or p <= 0:
        raise ValueError(f"norm_type must be positive (or inf), got {norm_type!r}")
    return p


@attrs.frozen(slots=True)
class Wanted:
    """What one call computes: the ``p``-norm (``None``: no norm) and whether the zero count."""

    p: float | None
    zeros: bool

    @classmethod
    def of(cls, norm_type: float | None, zeros: bool) -> Wanted:
        return cls(None if norm_type is None else checked_norm_type(norm_type), zeros)

    @property
    def infinite(self) -> bool:
        return self.p is not None and math.isinf(self.p)


def make_part(norm_share: torch.Tensor | None, zeros: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """A part from a norm share (``sum |g|^p``, or ``max |g|``) and a zero count (0-dim tensors, either absent)."""
    part = _zeros(_WIDTH, device)
    if norm_share is not None:
        part[_NORM] = norm_share.to(device=device, dtype=torch.float64)
    if zeros is not None:
        part[_ZEROS] = zeros.to(device=device, dtype=torch.float64)
    return part


@attrs.define(slots=True)
class _First:
    """The parts of DTensor pieces summed over one data-parallel collection field first, by slot (0: dense, 1:
    expert), and the reduction groups each slot's total joins afterwards."""

    group: ProcessGroup | None
    targets: tuple[GroupKey, GroupKey]
    slots: tuple[list[torch.Tensor], list[torch.Tensor]] = attrs.field(factory=lambda: ([], []))


class Shares:
    """This rank's local shares of one statistics call, by reduction group; see the module docstring.

    Every group a rank must reduce over is a key, with no part when it counts nothing there, so every rank of a
    group issues the same collectives (a pipeline stage without experts still joins the expert reduction).
    """

    def __init__(self, wanted: Wanted, device: torch.device, groups: Iterable[GroupKey] = ()) -> None:
        self.wanted = wanted
        self.device = device
        self.by_group: dict[GroupKey, list[torch.Tensor]] = {group: [] for group in groups}
        self.first: dict[GroupName, _First] = {}

    def add(self, group: GroupKey, part: torch.Tensor | None = None) -> None:
        """Register ``group`` and, unless ``None``, add ``part`` to its share."""
        parts = self.by_group.setdefault(group, [])
        if part is not None:
            parts.append(part.to(self.device))

    def add_first(
        self,
        field: GroupName,
        group: ProcessGroup | None,
        targets: tuple[GroupKey, GroupKey],
        slot: int,
        part: torch.Tensor | None,
    ) -> None:
        """Register ``field`` (its ``group`` summed over before ``targets``, the dense and the expert reduction
        group) and, unless ``None``, add ``part`` to its ``slot`` (0 dense, 1 expert)."""
        first = self.first.setdefault(field, _First(group, targets))
        if part is not None:
            first.slots[slot].append(part.to(self.device))


@attrs.frozen(slots=True)
class Reduced:
    """The reduced statistics: ``norm64`` (float64, NaN / inf where one was seen; see :func:`reduce_shares`) and
    ``zeros`` (int64), 0-dim tensors on the reduction device, ``None`` when not wanted."""

    norm64: torch.Tensor | None
    zeros: torch.Tensor | None

    @property
    def norm(self) -> torch.Tensor:
        """The norm as the statistics' API returns it: 0-dim float32."""
        if self.norm64 is None:
            raise ValueError("no norm was computed")
        return self.norm64.to(torch.float32)


def reduce_shares(shares: Shares, *, verdict: Sequence[ProcessGroup | None] = ()) -> Reduced:
    """Reduce ``shares`` (see the module docstring; they are consumed) into the global statistics.

    ``verdict``: the groups that together span every rank holding grads (``intra_dist_opt``, then
    ``inter_dist_opt``); when given, a NaN or inf seen on any of those ranks makes the norm NaN or inf on all of
    them. Without it, only the ranks of a rank's own reduction groups contribute.
    """
    wanted, device = shares.wanted, shares.device
    for field in sorted(shares.first, key=FIELD_NAMES.index):
        first = shares.first[field]
        block = torch.stack([_combined(parts, wanted, device) for parts in first.slots])
        _reduce_block(block, first.group, wanted)
        for target, row in zip(first.targets, block, strict=True):
            shares.add(target, row)
    rows = {group: _combined(parts, wanted, device) for group, parts in shares.by_group.items()}
    verdict_groups = [group for group in verdict if group is not None and group_size(group) > 1]
    if wanted.p is None:
        verdict_groups = []
    seen = _zeros(2, device)
    if verdict_groups:
        if rows:
            seen = torch.stack(list(rows.values()))[:, _NAN:].amax(0)
        carrier = _same_ranks(verdict_groups[0], rows)
        if carrier is not _NO_GROUP:  # the flags ride in that group's row
            rows[carrier][_NAN:] = seen
            verdict_groups = verdict_groups[1:]
    total = torch.stack([_zeros(_WIDTH, device), *_reduced_rows(rows, wanted)])
    if verdict_groups:
        flags = torch.maximum(seen, total[:, _NAN:].amax(0))
        for group in verdict_groups:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
        total = torch.cat([total, torch.cat([_zeros(2, device), flags]).reshape(1, _WIDTH)])
    return Reduced(
        norm64=_norm_of(total, wanted.p) if wanted.p is not None else None,
        zeros=total[:, _ZEROS].sum().round().to(torch.int64) if wanted.zeros else None,
    )


_NO_GROUP: Final = object()


def _zeros(size: int, device: torch.device) -> torch.Tensor:
    return torch.zeros(size, dtype=torch.float64, device=device)


def _same_ranks(group: ProcessGroup, rows: Mapping[GroupKey, torch.Tensor]) -> Any:
    """The key of ``rows`` that is ``group`` or holds the same ranks, else :data:`_NO_GROUP`."""
    ranks = dist.get_process_group_ranks(group)
    for key in rows:
        if key is group or (key is not None and dist.get_process_group_ranks(key) == ranks):
            return key
    return _NO_GROUP


def _combined(parts: Sequence[torch.Tensor], wanted: Wanted, device: torch.device) -> torch.Tensor:
    """One row from a group's parts: norm shares summed (max for the inf-norm), counts summed, flags set where a
    share is NaN or inf (a NaN share then counts as 0: the flag carries it, as MAX reductions drop NaN)."""
    if not parts:
        return _zeros(_WIDTH, device)
    rows = torch.stack(list(parts))
    share = rows[:, _NORM]
    nan = share.isnan()
    clean = torch.where(nan, 0.0, share)
    return torch.stack([
        clean.amax() if wanted.infinite else clean.sum(),
        rows[:, _ZEROS].sum(),
        torch.maximum(rows[:, _NAN], nan.to(torch.float64)).amax(),
        torch.maximum(rows[:, _INF], share.isinf().to(torch.float64)).amax(),
    ])


def _reduced_rows(rows: Mapping[GroupKey, torch.Tensor], wanted: Wanted) -> Iterator[torch.Tensor]:
    """Each group's row reduced over its group, in the agreed order: one SUM of the whole row (flags summed: set
    when positive); for the inf-norm one MAX of the norm and the flags, then, with the zero count, one SUM of it.
    The rows come back in collective order, which their sum and maximum do not depend on."""
    if not wanted.infinite:
        yield from reduce_over_groups(rows, lambda row: row, dist.ReduceOp.SUM)
        return
    for peak in reduce_over_groups(rows, _max_columns, dist.ReduceOp.MAX):
        yield torch.cat([peak[:1], _zeros(1, peak.device), peak[1:]])
    if wanted.zeros:
        for count in reduce_over_groups(rows, lambda row: row[_ZEROS : _ZEROS + 1].clone(), dist.ReduceOp.SUM):
            yield torch.cat([_zeros(1, count.device), count, _zeros(2, count.device)])


def _max_columns(row: torch.Tensor) -> torch.Tensor:
    return torch.cat([row[_NORM:_ZEROS], row[_NAN:]])


def _reduce_block(block: torch.Tensor, group: ProcessGroup | None, wanted: Wanted) -> None:
    """All-reduce the rows of ``block`` in place over ``group`` (step 1 of :func:`reduce_shares`)."""
    if group is None or group_size(group) <= 1:
        return
    if not wanted.infinite:
        dist.all_reduce(block, op=dist.ReduceOp.SUM, group=group)
        return
    peaks = torch.cat([block[:, _NORM:_ZEROS], block[:, _NAN:]], dim=1)
    dist.all_reduce(peaks, op=dist.ReduceOp.MAX, group=group)
    block[:, _NORM] = peaks[:, 0]
    block[:, _NAN:] = peaks[:, 1:]
    if wanted.zeros:
        counts = block[:, _ZEROS].clone()
        dist.all_reduce(counts, op=dist.ReduceOp.SUM, group=group)
        block[:, _ZEROS] = counts


def _norm_of(total: torch.Tensor, p: float) -> torch.Tensor:
    """The norm from the reduced rows: shares summed (max for inf) and rooted, NaN where a NaN was seen, inf where
    an inf was (and no NaN)."""
    share = total[:, _NORM]
    norm = share.amax() if math.isinf(p) else share.sum().pow(1.0 / p)
    flags = total[:, _NAN:].amax(0)
    norm = torch.where(flags[1] > 0, math.inf, norm)
    return torch.where(flags[0] > 0, math.nan, norm)


def reduce_over_groups(
    items_by_group: Mapping[ProcessGroup | None, V], local: Callable[[V], torch.Tensor], op: Any
) -> Iterator[torch.Tensor]:
    """Each group's local share ``local(items)``, all-reduced in place with ``op`` over its group.

    One collective per group of more than one rank (none for ``None``), issued in an order every rank agrees on
    (by the group's ranks, then its name): ranks that share two groups must reduce them in the same order. Every
    rank of a group must pass that group as a key. :func:`reduce_shares` reduces every statistic through this.
    """
    for group, items in _in_collective_order(items_by_group):
        share = local(items)
        _all_reduce(share, op, group)
        yield share


def check_max_norm(max_norm: float) -> None:
    """``ValueError`` unless ``max_norm`` is a positive finite number."""
    if not max_norm > 0 or math.isinf(max_norm):
        raise ValueError(f"max_norm must be a positive finite number, got {max_norm!r}")


def clip_coefficient(max_norm: float, norm64: torch.Tensor) -> torch.Tensor:
    """``max_norm / (norm + 1e-6)`` clamped at 1 (float64, no host sync); 1 for a NaN or infinite norm, whose
    coefficient would be NaN or 0 and would poison or erase the finite grads too."""
    check_max_norm(max_norm)
    clipped = torch.clamp(max_norm / (norm64 + CLIP_EPSILON), max=1.0)
    return torch.where(torch.isfinite(norm64), clipped, torch.ones_like(clipped))


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

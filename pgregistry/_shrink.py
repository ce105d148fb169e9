"""Which ranks must leave with lost ones, and the smaller layout the survivors go on with (pure rank arithmetic).

A rank holds state that differs from its peers along every axis but data parallelism: its TP, CP, GTP-remat and
pipeline peers hold other shards of the dense model or other parts of the sequence, its expert TP, EP and expert
GTP-remat peers other experts or other shards of them. A lost rank therefore takes with it every rank of its
*dense replica* (the ranks of its data-parallel coordinate ``dp``: TP x GTP-remat x CP x PP) and of its *expert
replica* (its ``expt_dp`` coordinate: expert TP x EP x expert GTP-remat x PP). An expert replica usually spans
several dense replicas (EP runs across data-parallel ranks), and a dense replica may reach into several expert
replicas, so the ranks that leave are the closure of both relations. What is left is whole dense and whole expert
replicas: the same layout with fewer data-parallel replicas (``dp`` and ``expt_dp`` smaller, every other size the
same), over the survivors renumbered in their old order. A mixed-radix rank keeps its order when whole values of
one digit are removed, so renumbering in order maps each surviving group onto a group of the smaller layout, with
the same members: their communicators can be kept. Only groups that reach across replicas (the data-parallel
kinds) lose members.

Torch-free: it reads the layout's coordinates only (:meth:`~pgregistry.layout.ParallelLayout.coords`), and builds
the smaller layout with :func:`attrs.evolve`, so the layout module can delegate to it without a circular import.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

import attrs

if TYPE_CHECKING:
    from pgregistry.layout import ParallelLayout

__all__ = ["Shrunk", "shrink_layout"]


@attrs.frozen(slots=True, kw_only=True)
class Shrunk:
    """What losing ``lost`` does to a layout: who leaves, the layout the survivors go on with, and their new ranks."""

    lost: tuple[int, ...]
    """The lost ranks, sorted."""
    leaving: tuple[int, ...]
    """The lost ranks and every rank that must leave with them (their whole replicas), sorted."""
    layout: ParallelLayout
    """The layout over the survivors: ``dp`` and ``expt_dp`` smaller, every other size, the order and the
    ``rank_offset`` the same."""
    rank_map: Mapping[int, int]
    """Old rank -> new rank, for every survivor (in old order: the survivors renumbered from ``rank_offset``)."""
    dense_replicas_left: tuple[int, ...]
    """The data-parallel coordinates (``dp``) of the dense replicas that leave."""
    expert_replicas_left: tuple[int, ...]
    """The expert data-parallel coordinates (``expt_dp``) of the expert replicas that leave."""

    @property
    def survivors(self) -> tuple[int, ...]:
        """The old ranks that go on, in order."""
        return tuple(self.rank_map)


def shrink_layout(layout: ParallelLayout, lost: Iterable[int], *, sharded_optimizer: bool = False) -> Shrunk:
    """:meth:`ParallelLayout.shrink <pgregistry.layout.ParallelLayout.shrink>`: see there."""
    lost_ranks = _checked_lost(layout, lost)
    first, stop = layout.rank_range()
    ranks = range(first, stop)
    coords = {rank: layout.coords(rank) for rank in ranks}
    dense_gone = {coords[rank]["dp"] for rank in lost_ranks}
    expert_gone = {coords[rank]["expt_dp"] for rank in lost_ranks}
    # Closure: a rank leaves with its dense replica or its expert replica; each leaving rank takes both of its own.
    while True:
        leaving = [r for r in ranks if coords[r]["dp"] in dense_gone or coords[r]["expt_dp"] in expert_gone]
        dense_now = {coords[r]["dp"] for r in leaving}
        expert_now = {coords[r]["expt_dp"] for r in leaving}
        if dense_now == dense_gone and expert_now == expert_gone:
            break
        dense_gone, expert_gone = dense_now, expert_now
    survivors = [r for r in ranks if coords[r]["dp"] not in dense_gone]
    if lost_ranks and sharded_optimizer:
        raise ValueError(
            f"losing rank(s) {_ranks_text(lost_ranks)} loses the sharded optimizer's shards on rank(s) "
            f"{_ranks_text(leaving)}: each data-parallel replica holds its own shard, kept nowhere else. Reload a "
            "checkpoint (or train with a replicated optimizer to survive the loss of a replica)"
        )
    if not survivors:
        raise ValueError(
            f"losing rank(s) {_ranks_text(lost_ranks)} leaves no copy of the model: their replicas "
            f"({_replicas_text(layout, sorted(dense_gone), sorted(expert_gone))}) cover every rank "
            f"{first}-{stop - 1}, so some shard is held by no survivor. Reload a checkpoint"
        )
    smaller = _smaller_layout(layout, lost_ranks, len(survivors))
    rank_map = {old: first + i for i, old in enumerate(survivors)}
    _check_groups_kept(layout, smaller, coords, rank_map, sorted(dense_gone), sorted(expert_gone))
    return Shrunk(
        lost=lost_ranks,
        leaving=tuple(leaving),
        layout=smaller,
        rank_map=rank_map,
        dense_replicas_left=tuple(sorted(dense_gone)),
        expert_replicas_left=tuple(sorted(expert_gone)),
    )


def _checked_lost(layout: ParallelLayout, lost: Iterable[int]) -> tuple[int, ...]:
    """The lost ranks, sorted and deduplicated: ``TypeError`` for a non-integer (a bool too), ``ValueError`` for a
    rank outside the layout's span."""
    if isinstance(lost, str | bytes) or not isinstance(lost, Iterable):
        raise TypeError(f"lost must be an iterable of ranks, got {type(lost).__name__}")
    out = {layout._check_rank(rank, "lost rank") for rank in lost}
    return tuple(sorted(out))


def _smaller_layout(layout: ParallelLayout, lost: tuple[int, ...], num_ranks: int) -> ParallelLayout:
    """The layout with every size but the data-parallel ones unchanged, over ``num_ranks`` ranks; a ``ValueError``
    naming the lost ranks when no such layout is valid (an order rule the smaller data-parallel sizes break)."""
    if num_ranks == layout.num_ranks:
        return layout
    try:
        return attrs.evolve(layout, num_ranks=num_ranks)
    except ValueError as error:
        raise ValueError(
            f"losing rank(s) {_ranks_text(lost)} leaves {num_ranks} ranks, on which no layout with the same sizes "
            f"and order fits: {error}. Reload a checkpoint on a layout that fits the survivors"
        ) from error


def _check_groups_kept(
    old: ParallelLayout,
    new: ParallelLayout,
    coords: Mapping[int, Mapping[str, int]],
    rank_map: Mapping[int, int],
    dense_gone: list[int],
    expert_gone: list[int],
) -> None:
    """Every survivor keeps its coordinates on the smaller layout, data-parallel ones renumbered in order: then
    every group keeps its members. Holds whenever whole replicas leave (see the module docstring); checked rather
    than assumed, because the dense and expert grids interleave their axes in ways the order string chooses."""
    dense_kept = [d for d in range(old.dp) if d not in dense_gone]
    expert_kept = [e for e in range(old.expt_dp) if e not in expert_gone]
    for rank, new_rank in rank_map.items():
        want = dict(coords[rank])
        want["dp"] = dense_kept.index(want["dp"])
        want["expt_dp"] = expert_kept.index(want["expt_dp"])
        got = new.coords(new_rank)
        if got != want:
            raise ValueError(
                f"no layout over the survivors keeps rank {rank}'s groups: renumbered {new_rank} on {new!r} it "
                f"would sit at {got}, not {want}. Reload a checkpoint on a layout that fits the survivors"
            )


def _ranks_text(ranks: Iterable[int]) -> str:
    ranks = list(ranks)
    shown = ", ".join(str(r) for r in ranks[:16])
    return shown + (f", ... ({len(ranks)} ranks)" if len(ranks) > 16 else "")


def _replicas_text(layout: ParallelLayout, dense: list[int], expert: list[int]) -> str:
    parts = [f"dense replica(s) dp={_ranks_text(dense)} of {layout.dp}"]
    if layout.ep > 1 or layout.expt_dp != layout.dp:
        parts.append(f"expert replica(s) expt_dp={_ranks_text(expert)} of {layout.expt_dp}")
    return "; ".join(parts)

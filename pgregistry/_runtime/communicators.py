"""Which communicators a layout needs, and which ones two layouts share.

The registry creates one communicator per distinct rank set of more than one rank: two kinds naming
the same ranks (``dp`` and ``dp_cp`` when cp is 1) or two layouts on the same world (the policy and
the reference model of an RL job) share one ProcessGroup. :func:`kinds_by_communicator` lists those
rank sets with the kinds naming them, and :func:`compare_layouts` tells which of them two layouts
share, so a user choosing the second model's sizes sees how many communicators (and how much
communicator memory) the second model adds. The layouts may span different parts of the world
(``rank_offset``, ``num_ranks``: two modules of one job): rank sets are global ranks, so only where
the spans overlap can a communicator be shared. Arithmetic only; no process group is created and
torch is imported only by the layout's own enumeration.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import TYPE_CHECKING

import attrs

from pgregistry._runtime.integers import positive_int
from pgregistry.layout import GROUP_KINDS, RankGroup

if TYPE_CHECKING:
    from pgregistry.layout import ParallelLayout

__all__ = [
    "LayoutComparison",
    "SharedCommunicators",
    "communicators_per_rank",
    "compare_layouts",
    "kinds_by_communicator",
    "span_text",
]


def kinds_by_communicator(layout: ParallelLayout) -> dict[RankGroup, tuple[str, ...]]:
    """Every rank set of over one rank that some kind of ``layout`` names -> the kinds naming it.

    Rank sets are sorted tuples (the registry's keys). Size-1 groups are left out: the registry
    creates no communicator for them (the axis is off).
    """
    out: dict[RankGroup, list[str]] = {}
    for kind in GROUP_KINDS:
        for group in layout.groups(kind):
            if len(group) > 1:
                out.setdefault(tuple(sorted(group)), []).append(kind)
    return {ranks: tuple(kinds) for ranks, kinds in out.items()}


def communicators_per_rank(comms: Mapping[RankGroup, object], ranks: range) -> list[int]:
    """How many of the communicators ``comms`` each rank of ``ranks`` joins, in ``ranks``' order.

    ``ranks`` is a range of global ranks: a layout's span, or the whole world; ``ValueError`` for a
    communicator reaching outside it."""
    counts = [0] * len(ranks)
    for group in comms:
        for rank in group:
            if rank not in ranks:
                raise ValueError(
                    f"communicator over ranks {list(group)} reaches rank {rank}, outside ranks "
                    f"{ranks.start}-{ranks.stop - 1}"
                )
            counts[rank - ranks.start] += 1
    return counts


@attrs.frozen(slots=True, kw_only=True)
class SharedCommunicators:
    """Communicators two layouts share, grouped by the kinds that name them on each side."""

    kinds_a: tuple[str, ...]
    kinds_b: tuple[str, ...]
    size: int
    """Ranks per communicator."""
    count: int
    """How many communicators of this class the layouts share."""


@attrs.frozen(slots=True, kw_only=True)
class LayoutComparison:
    """Two layouts of one world of ``world_size`` ranks: their communicators and those shared."""

    layout_a: ParallelLayout
    layout_b: ParallelLayout
    world_size: int
    """Ranks in the world both layouts lie in."""
    a: Mapping[RankGroup, tuple[str, ...]]
    """The communicators of ``layout_a`` (rank set -> kinds naming it)."""
    b: Mapping[RankGroup, tuple[str, ...]]
    """The communicators of ``layout_b``."""

    @property
    def overlap(self) -> range:
        """The ranks both layouts span (empty when their spans are disjoint: they share nothing)."""
        first_a, stop_a = self.layout_a.rank_range()
        first_b, stop_b = self.layout_b.rank_range()
        first = max(first_a, first_b)
        return range(first, max(first, min(stop_a, stop_b)))

    @property
    def shared(self) -> frozenset[RankGroup]:
        """Rank sets both layouts create a communicator for: the registry builds them once."""
        return frozenset(self.a.keys() & self.b.keys())

    def differences(self) -> list[tuple[str, str, str]]:
        """What the two layouts declare differently, as ``(what, in A, in B)``.

        ``"ranks"`` (their spans), then each axis size (``dp`` and ``expt_dp`` included), then
        ``"order"``; empty for one layout given twice."""
        out = []
        spans = [span_text(layout) for layout in (self.layout_a, self.layout_b)]
        if spans[0] != spans[1]:
            out.append(("ranks", spans[0], spans[1]))
        sizes_a, sizes_b = self.layout_a.axis_sizes(), self.layout_b.axis_sizes()
        out += [
            (axis, str(sizes_a[axis]), str(sizes_b[axis]))
            for axis in sizes_a
            if sizes_a[axis] != sizes_b[axis]
        ]
        if self.layout_a.order != self.layout_b.order:
            out.append(("order", self.layout_a.order, self.layout_b.order))
        return out

    def communicators_per_rank(self) -> list[int]:
        """How many communicators each rank joins for both layouts together (a shared one once)."""
        return communicators_per_rank({**self.a, **self.b}, range(self.world_size))

    def group_shared_by_kinds(self) -> list[SharedCommunicators]:
        """The shared communicators by (kinds of A, kinds of B, size), largest classes first."""
        classes = Counter((self.a[ranks], self.b[ranks], len(ranks)) for ranks in self.shared)
        rows = [
            SharedCommunicators(kinds_a=a, kinds_b=b, size=size, count=count)
            for (a, b, size), count in classes.items()
        ]
        return sorted(
            rows, key=lambda row: (GROUP_KINDS.index(row.kinds_a[0]), row.kinds_b, row.size)
        )


def span_text(layout: ParallelLayout) -> str:
    """The ranks ``layout`` spans, as ``first-last``."""
    first, stop = layout.rank_range()
    return f"{first}-{stop - 1}"


def compare_layouts(
    a: ParallelLayout, b: ParallelLayout, *, world_size: int | None = None
) -> LayoutComparison:
    """Compare the communicators of two layouts of one world of ``world_size`` ranks.

    ``world_size`` defaults to where the later span ends. The layouts may span different ranks;
    ``ValueError`` when ``world_size`` is not a positive integer or a layout's span ends past it
    (naming the layout: ``a`` or ``b``)."""
    if world_size is None:
        world = max(a.rank_range()[1], b.rank_range()[1])
    else:
        world = positive_int(world_size, "world_size")
    for name, layout in (("a", a), ("b", b)):
        first, stop = layout.rank_range()
        if stop > world:
            raise ValueError(
                f"layout {name} spans ranks {first}-{stop - 1} (rank_offset {first} + "
                f"num_ranks {layout.num_ranks}), past the end of the world (world_size {world})"
            )
    return LayoutComparison(
        layout_a=a,
        layout_b=b,
        world_size=world,
        a=kinds_by_communicator(a),
        b=kinds_by_communicator(b),
    )

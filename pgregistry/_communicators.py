"""Which communicators a layout needs, and which ones two layouts share.

The registry creates one communicator per distinct rank set of more than one rank: two kinds naming the same ranks
(``dp`` and ``dp_cp`` when cp is 1) or two layouts on the same world (the policy and the reference model of an RL
job) share one ProcessGroup. :func:`communicators` lists those rank sets with the kinds naming them, and
:func:`compare_layouts` tells which of them two layouts share, so a user choosing the second model's sizes sees how
many communicators (and how much communicator memory) the second model adds. Arithmetic only; no process group is
created and torch is imported only by the layout's own enumeration.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import TYPE_CHECKING

import attrs

from pgregistry.layout import GROUP_KINDS, RankGroup

if TYPE_CHECKING:
    from pgregistry.layout import ParallelLayout

__all__ = ["LayoutComparison", "SharedCommunicators", "communicators", "communicators_per_rank", "compare_layouts"]


def communicators(layout: ParallelLayout) -> dict[RankGroup, tuple[str, ...]]:
    """Every rank set of more than one rank that some kind of ``layout`` names -> the kinds naming it.

    Rank sets are sorted tuples (the registry's keys). Size-1 groups are left out: the registry creates no
    communicator for them (the axis is off).
    """
    out: dict[RankGroup, list[str]] = {}
    for kind in GROUP_KINDS:
        for group in layout.groups(kind):
            if len(group) > 1:
                out.setdefault(tuple(sorted(group)), []).append(kind)
    return {ranks: tuple(kinds) for ranks, kinds in out.items()}


def communicators_per_rank(comms: Mapping[RankGroup, object], num_ranks: int) -> list[int]:
    """How many of the communicators ``comms`` each rank of the world joins."""
    counts = [0] * num_ranks
    for ranks in comms:
        for rank in ranks:
            counts[rank] += 1
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
    """Two layouts of one world: their communicators and the ones they share."""

    layout_a: ParallelLayout
    layout_b: ParallelLayout
    a: Mapping[RankGroup, tuple[str, ...]]
    """The communicators of ``layout_a`` (rank set -> kinds naming it)."""
    b: Mapping[RankGroup, tuple[str, ...]]
    """The communicators of ``layout_b``."""

    @property
    def num_ranks(self) -> int:
        return self.layout_a.num_ranks

    @property
    def shared(self) -> frozenset[RankGroup]:
        """Rank sets both layouts create a communicator for: the registry builds them once."""
        return frozenset(self.a.keys() & self.b.keys())

    def shared_by_kinds(self) -> list[SharedCommunicators]:
        """The shared communicators grouped by (kinds of A, kinds of B, size), largest classes first."""
        classes = Counter((self.a[ranks], self.b[ranks], len(ranks)) for ranks in self.shared)
        rows = [
            SharedCommunicators(kinds_a=a, kinds_b=b, size=size, count=count)
            for (a, b, size), count in classes.items()
        ]
        return sorted(rows, key=lambda row: (GROUP_KINDS.index(row.kinds_a[0]), row.kinds_b, row.size))


def compare_layouts(a: ParallelLayout, b: ParallelLayout) -> LayoutComparison:
    """Compare the communicators of two layouts of the same world; ``ValueError`` when the worlds differ (the
    registry builds every layout over the whole job, so two layouts of one job have one world size)."""
    if a.num_ranks != b.num_ranks:
        raise ValueError(
            f"the layouts to compare have different world sizes ({a.num_ranks} and {b.num_ranks}); layouts "
            "built in one job span the same world"
        )
    return LayoutComparison(layout_a=a, layout_b=b, a=communicators(a), b=communicators(b))

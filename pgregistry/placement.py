"""Node placement: which nodes each group of a layout lands on, and which groups leave a node.

Launchers fill nodes with consecutive ranks (torchrun, and Slurm's default block distribution): with ``N`` GPUs per
node, rank ``r`` runs on node ``r // N``. A group whose ranks share a node talks over NVLink; a group that spans
nodes sends its collectives over the network. Tensor, expert-tensor and context parallelism exchange activations
inside every layer, so a layout whose TP, expert-TP or CP groups cross a node boundary is usually a mistake made
while choosing sizes or the order string, and it shows up only as a slow job. :func:`place` finds it before launch.

This module does arithmetic only: it imports no torch itself (the layout's group enumeration does, lazily) and
creates no process group.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Final

import attrs

from pgregistry.layout import GROUP_KINDS, RankGroup

if TYPE_CHECKING:
    from pgregistry.layout import ParallelLayout

__all__ = ["DEFAULT_INTRA_NODE_KINDS", "KindPlacement", "Placement", "node_of", "place"]

DEFAULT_INTRA_NODE_KINDS: Final[tuple[str, ...]] = ("tp", "expt_tp", "cp")
"""Kinds whose collectives run inside every layer, so their groups should stay on one node."""


def node_of(rank: int, gpus_per_node: int) -> int:
    """The node ``rank`` runs on when a launcher fills nodes with consecutive ranks."""
    return rank // gpus_per_node


@attrs.frozen(slots=True, kw_only=True)
class KindPlacement:
    """How the groups of one kind sit on the nodes."""

    kind: str
    num_groups: int
    group_size: int
    min_nodes: int
    """Fewest nodes one group of the kind spans."""
    max_nodes: int
    """Most nodes one group of the kind spans."""
    crossing_groups: int
    """How many groups span more than one node."""
    first_crossing: RankGroup | None
    """The first group (in enumeration order) that spans more than one node; ``None`` when none does."""
    should_stay_intra_node: bool
    """Whether this kind was asked to stay on one node (:data:`DEFAULT_INTRA_NODE_KINDS` by default)."""

    @property
    def within_node(self) -> bool:
        """Every group of the kind lies on one node."""
        return self.crossing_groups == 0

    @property
    def violated(self) -> bool:
        """The kind should stay on one node and some group of it does not."""
        return self.should_stay_intra_node and not self.within_node

    @property
    def verdict(self) -> str:
        """One line for tables: off, within a node, or how many groups cross nodes (and that they should not)."""
        if self.group_size == 1:
            return "off (one rank per group)"
        if self.within_node:
            return "within a node"
        crossing = f"crosses nodes ({self.crossing_groups} of {self.num_groups} groups)"
        return f"{crossing}; should stay on one node" if self.violated else crossing

    def warning(self, gpus_per_node: int) -> str:
        """The message a user sees when :attr:`violated`."""
        group = self.first_crossing
        assert group is not None, "warning() is for kinds whose groups cross nodes"
        nodes = sorted({node_of(r, gpus_per_node) for r in group})
        return (
            f"{self.kind} groups cross nodes: {self.crossing_groups} of {self.num_groups} groups of "
            f"{self.group_size} ranks span up to {self.max_nodes} nodes of {gpus_per_node} GPUs (first: ranks "
            f"{list(group)} on nodes {nodes}); their collectives leave NVLink"
        )


@attrs.frozen(slots=True, kw_only=True)
class Placement:
    """Every group kind of a layout placed on nodes of ``gpus_per_node`` consecutive ranks."""

    layout: ParallelLayout
    gpus_per_node: int
    kinds: tuple[KindPlacement, ...]
    """One entry per kind, in :data:`~pgregistry.layout.GROUP_KINDS` order."""

    @property
    def num_ranks(self) -> int:
        return self.layout.num_ranks

    @property
    def num_nodes(self) -> int:
        return self.num_ranks // self.gpus_per_node

    def describe_nodes(self) -> str:
        """``"4 nodes of 8 GPUs"``, for headings."""
        nodes = "1 node" if self.num_nodes == 1 else f"{self.num_nodes} nodes"
        return f"{nodes} of {self.gpus_per_node} GPU{'' if self.gpus_per_node == 1 else 's'}"

    def kind(self, name: str) -> KindPlacement:
        """The placement of kind ``name``; ``ValueError`` for an unknown kind."""
        for entry in self.kinds:
            if entry.kind == name:
                return entry
        raise ValueError(f"unknown group kind {name!r}; known kinds: {', '.join(GROUP_KINDS)}")

    def violations(self) -> tuple[KindPlacement, ...]:
        """The kinds that should stay on one node but cross nodes."""
        return tuple(entry for entry in self.kinds if entry.violated)

    def warnings(self) -> list[str]:
        """One message per violated kind (empty when the placement is fine)."""
        return [entry.warning(self.gpus_per_node) for entry in self.violations()]


def place(
    layout: ParallelLayout,
    gpus_per_node: int,
    intra_node_kinds: Iterable[str] = DEFAULT_INTRA_NODE_KINDS,
) -> Placement:
    """Place every group kind of ``layout`` on nodes of ``gpus_per_node`` consecutive ranks.

    ``ValueError`` when ``gpus_per_node`` is not a positive integer dividing the world size (launchers put the same
    number of ranks on every node) or when ``intra_node_kinds`` names an unknown kind.
    """
    if not isinstance(gpus_per_node, int) or isinstance(gpus_per_node, bool) or gpus_per_node < 1:
        raise ValueError(f"gpus_per_node must be a positive integer, got {gpus_per_node!r}")
    if layout.num_ranks % gpus_per_node:
        raise ValueError(
            f"num_ranks {layout.num_ranks} is not a multiple of gpus_per_node {gpus_per_node}: launchers start "
            "the same number of ranks on every node"
        )
    stay = tuple(intra_node_kinds)
    unknown = [kind for kind in stay if kind not in GROUP_KINDS]
    if unknown:
        raise ValueError(f"unknown group kind {unknown[0]!r} among intra-node kinds; known: {', '.join(GROUP_KINDS)}")
    return Placement(
        layout=layout,
        gpus_per_node=gpus_per_node,
        kinds=tuple(_place_kind(layout, kind, gpus_per_node, kind in stay) for kind in GROUP_KINDS),
    )


def _place_kind(layout: ParallelLayout, kind: str, gpus_per_node: int, should_stay: bool) -> KindPlacement:
    groups = layout.groups_tensor(kind)  # [num_groups, group_size]: one tensor even at 100k+ ranks
    nodes = (groups // gpus_per_node).sort(dim=1).values
    spans = 1 + (nodes[:, 1:] != nodes[:, :-1]).sum(dim=1)
    crossing = (spans > 1).nonzero().flatten()
    first = tuple(groups[int(crossing[0])].tolist()) if len(crossing) else None
    return KindPlacement(
        kind=kind,
        num_groups=int(groups.shape[0]),
        group_size=int(groups.shape[1]),
        min_nodes=int(spans.min()),
        max_nodes=int(spans.max()),
        crossing_groups=len(crossing),
        first_crossing=first,
        should_stay_intra_node=should_stay,
    )

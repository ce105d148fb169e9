"""Node placement: which nodes each group of a layout lands on, and which groups leave a node.

Launchers fill nodes with consecutive ranks (torchrun, and Slurm's default block distribution): with
``N`` GPUs per node, rank ``r`` runs on node ``r // N``. A group whose ranks share a node talks over
NVLink; a group that spans nodes sends its collectives over the network. Tensor, expert-tensor and
context parallelism exchange activations inside every layer, so a layout whose TP, expert-TP or CP
groups cross a node boundary is usually a mistake made while choosing sizes or the order string, and
it shows up only as a slow job. :func:`place` finds it before launch.

A layout over a span of the world (``rank_offset``) is placed by its global ranks: the launcher
knows nothing of spans, so a span that starts or ends mid-node shares those nodes with ranks outside
it, and a group across the boundary is counted as crossing, like any other.

This module does arithmetic only: it imports no torch itself (the layout's group enumeration does,
lazily) and creates no process group.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Final

import attrs

from pgregistry._runtime.integers import non_negative_int, positive_int
from pgregistry.layout import GROUP_KINDS, RankGroup, require_layout

if TYPE_CHECKING:
    from pgregistry.layout import ParallelLayout

__all__ = ["DEFAULT_INTRA_NODE_KINDS", "KindPlacement", "Placement", "node_of", "place"]

DEFAULT_INTRA_NODE_KINDS: Final[tuple[str, ...]] = ("tp", "expt_tp", "cp")
"""Kinds whose collectives run inside every layer, so their groups should stay on one node."""


def node_of(rank: int, gpus_per_node: int) -> int:
    """The node ``rank`` runs on when a launcher fills nodes with consecutive ranks.

    Args:
        rank: a global rank.
        gpus_per_node: ranks per node.

    Returns:
        ``rank // gpus_per_node``.

    Raises:
        ValueError: ``rank`` no integer 0 or more, ``gpus_per_node`` no positive integer (a
            negative one answered a negative node, a float a float).

    Example:
        >>> node_of(13, gpus_per_node=8)
        1
    """
    return non_negative_int(rank, "rank") // positive_int(gpus_per_node, "gpus_per_node")


@attrs.frozen(slots=True, kw_only=True)
class KindPlacement:
    """How the groups of one kind sit on the nodes.

    One row of a :func:`place` result (its ``kind(name)``): whether the kind's collectives stay on
    NVLink, and the first group that leaves it, for the warning. The fields not described below
    are the kind's name, how many groups it has and their size.

    Example:
        >>> from pgregistry.layout import ParallelLayout
        >>> dp_first = ParallelLayout(num_ranks=16, tp=2, order="dp-tp-cp-ep-pp")
        >>> tp = place(dp_first, gpus_per_node=8).kind("tp")
        >>> tp.num_groups, tp.group_size, tp.crossing_groups, tp.first_crossing, tp.violated
        (8, 2, 8, (0, 8), True)
    """

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
    """The first group (in enumeration order) spanning more than one node; ``None`` if none."""
    should_stay_intra_node: bool
    """Whether this kind should stay on one node (default: :data:`DEFAULT_INTRA_NODE_KINDS`)."""

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
        """One line for tables: off, in a node, or how many groups cross nodes (they should not)."""
        if self.group_size == 1:
            return "off (one rank per group)"
        if self.within_node:
            return "within a node"
        crossing = f"crosses nodes ({self.crossing_groups} of {self.num_groups} groups)"
        return f"{crossing}; should stay on one node" if self.violated else crossing

    def warning(self, gpus_per_node: int) -> str:
        """The message a user sees when :attr:`violated`.

        Args:
            gpus_per_node: the node size the placement was made for (it names the nodes).

        Returns:
            One line: how many groups cross nodes, the first one and its nodes.

        Example:
            >>> from pgregistry.layout import ParallelLayout
            >>> dp_first = ParallelLayout(num_ranks=16, tp=2, order="dp-tp-cp-ep-pp")
            >>> print(place(dp_first, gpus_per_node=8).kind("tp").warning(8))
            tp groups cross nodes: 8 of 8 groups of 2 ranks span up to 2 nodes of 8 GPUs (first: ...
        """
        group = self.first_crossing
        assert group is not None, "warning() is for kinds whose groups cross nodes"
        nodes = sorted({node_of(r, gpus_per_node) for r in group})
        return (
            f"{self.kind} groups cross nodes: {self.crossing_groups} of {self.num_groups} groups "
            f"of {self.group_size} ranks span up to {self.max_nodes} nodes of {gpus_per_node} "
            f"GPUs (first: ranks {list(group)} on nodes {nodes}); their collectives leave NVLink"
        )


@attrs.frozen(slots=True, kw_only=True)
class Placement:
    """Every group kind of a layout placed on nodes of consecutive ranks: what :func:`place` gives.

    Example:
        >>> from pgregistry.layout import ParallelLayout
        >>> span = ParallelLayout(num_ranks=4, tp=2, rank_offset=2)
        >>> placement = place(span, gpus_per_node=4, world_size=8)
        >>> placement.describe_nodes()
        'ranks 2-5 on nodes 0-1 of 4 GPUs, sharing node 0 with ranks 0-1 and node 1 with ranks 6-7'
        >>> placement.kind("tp").verdict
        'within a node'
    """

    layout: ParallelLayout
    gpus_per_node: int
    world_size: int
    """Ranks in the world: the layout's span ends at or before it (whole nodes)."""
    kinds: tuple[KindPlacement, ...]
    """One entry per kind, in :data:`~pgregistry.layout.GROUP_KINDS` order."""

    @property
    def num_ranks(self) -> int:
        """Ranks of the layout (its span)."""
        return self.layout.num_ranks

    @property
    def first_node(self) -> int:
        """The node of the layout's first rank."""
        return node_of(self.layout.rank_offset, self.gpus_per_node)

    @property
    def last_node(self) -> int:
        """The node of the layout's last rank."""
        return node_of(self.layout.rank_offset + self.layout.num_ranks - 1, self.gpus_per_node)

    @property
    def num_nodes(self) -> int:
        """Nodes holding some rank of the layout (those shared with ranks outside it included)."""
        return self.last_node - self.first_node + 1

    @property
    def shared_nodes(self) -> tuple[int, ...]:
        """The nodes the layout shares with ranks outside it.

        The one a span starts in mid-node and the one it ends in mid-node (none for a layout over
        whole nodes)."""
        first, stop = self.layout.rank_range()
        g = self.gpus_per_node
        shared = {self.first_node} if first % g else set()
        if stop % g:
            shared.add(self.last_node)
        return tuple(sorted(shared))

    def describe_nodes(self) -> str:
        """Where the layout's ranks lie, in words, for headings.

        Returns:
            ``"4 nodes of 8 GPUs"`` for a layout over the whole world, else where its span lies,
            e.g. ``"ranks 2-5 on nodes 0-1 of 4 GPUs, sharing node 0 with ranks 0-1 and node 1 with
            ranks 6-7"`` (the class example).
        """
        gpus = f"{self.gpus_per_node} GPU{'' if self.gpus_per_node == 1 else 's'}"
        first, stop = self.layout.rank_range()
        if (first, stop) == (0, self.world_size):
            nodes = "1 node" if self.num_nodes == 1 else f"{self.num_nodes} nodes"
            return f"{nodes} of {gpus}"
        where = (
            f"node {self.first_node}"
            if self.num_nodes == 1
            else f"nodes {self.first_node}-{self.last_node}"
        )
        text = f"ranks {first}-{stop - 1} on {where} of {gpus}"
        shared = [
            f"node {node} with {_outside_ranks(self.layout, node, self.gpus_per_node)}"
            for node in self.shared_nodes
        ]
        return text + (f", sharing {' and '.join(shared)}" if shared else "")

    def kind(self, name: str) -> KindPlacement:
        """The placement of kind ``name``; ``ValueError`` for an unknown kind.

        Args:
            name: a :data:`~pgregistry.layout.GROUP_KINDS` name.

        Returns:
            Its :class:`KindPlacement`.

        Raises:
            ValueError: an unknown ``name``, listing the known ones.
        """
        for entry in self.kinds:
            if entry.kind == name:
                return entry
        raise ValueError(f"unknown group kind {name!r}; known kinds: {', '.join(GROUP_KINDS)}")

    def violations(self) -> tuple[KindPlacement, ...]:
        """The kinds that should stay on one node but cross nodes.

        Returns:
            Their :class:`KindPlacement` entries, in :data:`~pgregistry.layout.GROUP_KINDS` order;
            empty when the placement is fine.

        Example:
            >>> from pgregistry.layout import ParallelLayout
            >>> dp_first = ParallelLayout(num_ranks=16, tp=2, order="dp-tp-cp-ep-pp")
            >>> [entry.kind for entry in place(dp_first, gpus_per_node=8).violations()]
            ['tp', 'expt_tp']
        """
        return tuple(entry for entry in self.kinds if entry.violated)

    def warnings(self) -> list[str]:
        """One message per violated kind (empty when the placement is fine).

        Returns:
            :meth:`KindPlacement.warning` of each of :meth:`violations`, in their order.
        """
        return [entry.warning(self.gpus_per_node) for entry in self.violations()]


def _outside_ranks(layout: ParallelLayout, node: int, gpus_per_node: int) -> str:
    """The ranks of ``node`` outside ``layout``'s span, as ``"ranks 0-1"`` / ``"rank 0"``.

    ``" and "`` between the ranks before and after a span that lies inside one node."""
    first, stop = layout.rank_range()
    start, end = node * gpus_per_node, (node + 1) * gpus_per_node
    parts = []
    for low, high in ((start, min(first, end)), (max(stop, start), end)):
        if low < high:
            parts.append(f"rank {low}" if high - low == 1 else f"ranks {low}-{high - 1}")
    return " and ".join(parts)


def place(
    layout: ParallelLayout,
    gpus_per_node: int,
    intra_node_kinds: Iterable[str] = DEFAULT_INTRA_NODE_KINDS,
    *,
    world_size: int | None = None,
) -> Placement:
    """Place every group kind of ``layout`` on nodes of ``gpus_per_node`` consecutive ranks.

    Args:
        layout: the layout to place, by its global ranks.
        gpus_per_node: ranks per node (launchers put the same number on every node).
        intra_node_kinds: the kinds whose groups should stay on one node (a violation is reported,
            not raised).
        world_size: ranks in the job (default: where the layout's span ends, ``rank_offset +
            num_ranks``); the span must end within it, and may start and end mid-node.

    Returns:
        The :class:`Placement`: per kind, how many nodes its groups span and whether it stays where
        it should.

    Raises:
        TypeError: ``layout`` no :class:`~pgregistry.layout.ParallelLayout`; ``intra_node_kinds`` a
            str (its letters are no kinds).
        ValueError: ``gpus_per_node`` not a positive integer (of any integer type) dividing the
            world size, a span ending past ``world_size``, or an unknown kind in
            ``intra_node_kinds``.

    Example:
        >>> from pgregistry.layout import ParallelLayout
        >>> dp_first = ParallelLayout(num_ranks=16, tp=2, order="dp-tp-cp-ep-pp")
        >>> crossing = place(dp_first, gpus_per_node=8)
        >>> crossing.kind("tp").verdict
        'crosses nodes (8 of 8 groups); should stay on one node'
        >>> [entry.kind for entry in crossing.violations()]
        ['tp', 'expt_tp']
    """
    require_layout(layout)
    gpus_per_node = positive_int(gpus_per_node, "gpus_per_node")
    if world_size is not None:
        world_size = positive_int(world_size, "world_size")
    if isinstance(intra_node_kinds, str):
        raise TypeError(
            "intra_node_kinds must be a sequence of group kinds, got the str "
            f"{intra_node_kinds!r}: pass ({intra_node_kinds!r},)"
        )
    first, stop = layout.rank_range()
    if world_size is None:
        world = stop
    elif stop > world_size:
        raise ValueError(
            f"the layout spans ranks {first}-{stop - 1} (rank_offset {first} + "
            f"num_ranks {layout.num_ranks}), past the end of the world (world_size {world_size})"
        )
    else:
        world = world_size
    if world % gpus_per_node:
        if (first, world_size) == (0, None):
            whose = f"num_ranks {layout.num_ranks}"
        elif world_size is None:
            whose = (
                f"the world, taken to end where the layout does (rank_offset {first} + num_ranks "
                f"{layout.num_ranks} = {world} ranks; give world_size when it is larger),"
            )
        else:
            whose = f"world_size {world_size}"
        raise ValueError(
            f"{whose} is not a multiple of gpus_per_node {gpus_per_node}: "
            "launchers start the same number of ranks on every node"
        )
    stay = tuple(intra_node_kinds)
    unknown = [kind for kind in stay if kind not in GROUP_KINDS]
    if unknown:
        raise ValueError(
            f"unknown group kind {unknown[0]!r} among "
            f"intra-node kinds; known: {', '.join(GROUP_KINDS)}"
        )
    return Placement(
        layout=layout,
        gpus_per_node=gpus_per_node,
        world_size=world,
        kinds=tuple(_place_kind(layout, kind, gpus_per_node, kind in stay) for kind in GROUP_KINDS),
    )


def _place_kind(
    layout: ParallelLayout, kind: str, gpus_per_node: int, should_stay: bool
) -> KindPlacement:
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

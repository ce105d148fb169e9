"""Node placement of a layout over a span of the world: nodes from global ranks (``rank // gpus_per_node``), the
nodes a span shares with ranks outside it, and the world it must fit in. Oracles: hand-worked examples and node
membership the test computes itself over the layout's rank sets (which tests/megatron checks against
Megatron-Core's HyperCommGrid)."""

from __future__ import annotations

import pytest

from pgregistry.layout import GROUP_KINDS, ParallelLayout
from pgregistry.placement import place

SPANS = [
    (ParallelLayout(num_ranks=4, tp=2, pp=2, rank_offset=4), 4, 8),
    (ParallelLayout(num_ranks=4, tp=2, ep=2, expt_tp=1, rank_offset=2), 4, 8),
    (ParallelLayout(num_ranks=8, tp=2, cp=2, ep=4, expt_tp=1, rank_offset=6), 4, 16),
    (ParallelLayout(num_ranks=12, tp=2, pp=2, order="tp-pp-dp", rank_offset=5), 8, 24),
    (ParallelLayout(num_ranks=6, tp=3, rank_offset=1), 2, 8),
]


@pytest.mark.parametrize(("layout", "gpus_per_node", "world_size"), SPANS, ids=repr)
def test_every_kind_is_placed_by_global_ranks(layout: ParallelLayout, gpus_per_node: int, world_size: int) -> None:
    placement = place(layout, gpus_per_node, intra_node_kinds=GROUP_KINDS, world_size=world_size)
    for entry in placement.kinds:
        groups = layout.groups(entry.kind)
        spans = [len({rank // gpus_per_node for rank in group}) for group in groups]
        assert (entry.min_nodes, entry.max_nodes) == (min(spans), max(spans)), entry.kind
        assert entry.crossing_groups == sum(span > 1 for span in spans), entry.kind
        assert entry.violated == (max(spans) > 1)
    first, stop = layout.rank_range()
    nodes = sorted({rank // gpus_per_node for rank in range(first, stop)})
    assert (placement.first_node, placement.last_node, placement.num_nodes) == (nodes[0], nodes[-1], len(nodes))
    assert placement.world_size == world_size
    outside = [node for node in nodes
               if any(not first <= r < stop for r in range(node * gpus_per_node, (node + 1) * gpus_per_node))]
    assert placement.shared_nodes == tuple(outside)


def test_a_span_starting_mid_node_splits_the_tp_group_across_the_boundary() -> None:
    # tp 2 from rank 1 on nodes of 4: tp groups [1, 2] and [3, 4]; [3, 4] straddles nodes 0 and 1.
    layout = ParallelLayout(num_ranks=4, tp=2, rank_offset=1)
    placement = place(layout, 4, world_size=8)
    tp = placement.kind("tp")
    assert (tp.crossing_groups, tp.num_groups, tp.first_crossing, tp.max_nodes) == (1, 2, (3, 4), 2)
    assert [v.kind for v in placement.violations()] == ["tp", "expt_tp"]
    assert placement.warnings()[0] == (
        "tp groups cross nodes: 1 of 2 groups of 2 ranks span up to 2 nodes of 4 GPUs (first: ranks [3, 4] on nodes "
        "[0, 1]); their collectives leave NVLink"
    )
    # The same sizes from rank 2, or from rank 0, keep every tp group on one node.
    assert place(ParallelLayout(num_ranks=4, tp=2, rank_offset=2), 4, world_size=8).violations() == ()
    assert place(ParallelLayout(num_ranks=4, tp=2), 4, world_size=8).violations() == ()


def test_a_span_on_whole_nodes_is_placed_like_a_world_of_its_own_shifted() -> None:
    # Ranks 8-23 on nodes of 8 are nodes 1-2: the same node spans per kind as ranks 0-15 on nodes 0-1.
    sizes = {"num_ranks": 16, "tp": 2, "ep": 4, "expt_tp": 1, "order": "dp-tp-cp-ep-pp"}
    shifted = place(ParallelLayout(**sizes, rank_offset=8), 8, world_size=32)  # type: ignore[arg-type]
    alone = place(ParallelLayout(**sizes), 8)  # type: ignore[arg-type]
    assert (shifted.first_node, shifted.num_nodes, shifted.shared_nodes) == (1, 2, ())
    for a, b in zip(shifted.kinds, alone.kinds, strict=True):
        assert (a.min_nodes, a.max_nodes, a.crossing_groups) == (b.min_nodes, b.max_nodes, b.crossing_groups)
        assert a.first_crossing is None or a.first_crossing == tuple(r + 8 for r in b.first_crossing or ())


@pytest.mark.parametrize(
    ("layout", "gpus_per_node", "world_size", "text"),
    [
        (ParallelLayout(num_ranks=16), 8, None, "2 nodes of 8 GPUs"),
        (ParallelLayout(num_ranks=4, tp=2, pp=2, rank_offset=4), 4, 8, "ranks 4-7 on node 1 of 4 GPUs"),
        (ParallelLayout(num_ranks=4, rank_offset=4), 4, None, "ranks 4-7 on node 1 of 4 GPUs"),
        (ParallelLayout(num_ranks=4), 4, 8, "ranks 0-3 on node 0 of 4 GPUs"),
        (ParallelLayout(num_ranks=4, rank_offset=2), 4, 8,
         "ranks 2-5 on nodes 0-1 of 4 GPUs, sharing node 0 with ranks 0-1 and node 1 with ranks 6-7"),
        (ParallelLayout(num_ranks=2, rank_offset=5), 4, 8, "ranks 5-6 on node 1 of 4 GPUs, sharing node 1 with "
         "rank 4 and rank 7"),
        (ParallelLayout(num_ranks=9, rank_offset=3), 4, 12,
         "ranks 3-11 on nodes 0-2 of 4 GPUs, sharing node 0 with ranks 0-2"),
    ],
)
def test_describe_nodes_says_where_a_span_lies(
    layout: ParallelLayout, gpus_per_node: int, world_size: int | None, text: str,
) -> None:
    assert place(layout, gpus_per_node, world_size=world_size).describe_nodes() == text


@pytest.mark.parametrize(
    ("layout", "world_size", "message"),
    [
        (ParallelLayout(num_ranks=4, rank_offset=6), 8,
         "the layout spans ranks 6-9 (rank_offset 6 + num_ranks 4), past the end of the world (world_size 8)"),
        (ParallelLayout(num_ranks=4, rank_offset=2), 6,
         "world_size 6 is not a multiple of gpus_per_node 4: launchers start the same number of ranks on every node"),
        (ParallelLayout(num_ranks=4, rank_offset=2), None,
         "the world, taken to end where the layout does (rank_offset 2 + num_ranks 4 = 6 ranks; give world_size "
         "when it is larger), is not a multiple of gpus_per_node 4"),
        (ParallelLayout(num_ranks=4), 0, "world_size must be a positive integer, got 0"),
        (ParallelLayout(num_ranks=4), True, "world_size must be a positive integer, got True"),
    ],
)
def test_a_span_that_does_not_fit_the_world_is_refused(
    layout: ParallelLayout, world_size: int | None, message: str,
) -> None:
    with pytest.raises(ValueError) as info:
        place(layout, 4, world_size=world_size)
    assert str(info.value).startswith(message)

"""Node placement against node membership the test computes itself: node = rank // gpus_per_node over every rank set
of the layout, then the number of distinct nodes per group."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pgregistry.layout import GROUP_KINDS, ParallelLayout
from pgregistry.placement import DEFAULT_INTRA_NODE_KINDS, place

LAYOUTS = [
    {"num_ranks": 16, "tp": 2, "pp": 2, "ep": 4, "expt_tp": 1},
    {"num_ranks": 16, "tp": 2, "ep": 4, "expt_tp": 1, "order": "dp-tp-cp-ep-pp"},  # tp groups [r, r + 8]
    {"num_ranks": 32, "tp": 4, "cp": 2, "pp": 2, "ep": 2, "expt_tp": 2},
    {"num_ranks": 48, "tp": 2, "cp": 2, "pp": 2, "ep": 3, "expt_tp": 1, "gtp_remat": 2, "expt_gtp_remat": 2},
    {"num_ranks": 64, "tp": 8, "cp": 2, "ep": 8, "expt_tp": 1, "order": "tp-cp-ep-dp-pp"},
]


def _nodes_per_group(layout: ParallelLayout, kind: str, gpus_per_node: int) -> list[int]:
    return [len({rank // gpus_per_node for rank in group}) for group in layout.groups(kind)]


@pytest.mark.parametrize("sizes", LAYOUTS)
@pytest.mark.parametrize("gpus_per_node", [1, 2, 4, 8, 16])
def test_every_kind_matches_node_membership(sizes: dict[str, object], gpus_per_node: int) -> None:
    layout = ParallelLayout(**sizes)  # type: ignore[arg-type]
    if layout.num_ranks % gpus_per_node:
        pytest.skip("launchers put the same number of ranks on every node")
    placement = place(layout, gpus_per_node)
    assert [entry.kind for entry in placement.kinds] == list(GROUP_KINDS)
    assert placement.num_nodes == layout.num_ranks // gpus_per_node
    for entry in placement.kinds:
        spans = _nodes_per_group(layout, entry.kind, gpus_per_node)
        groups = layout.groups(entry.kind)
        assert (entry.num_groups, entry.group_size) == (len(groups), len(groups[0]))
        assert (entry.min_nodes, entry.max_nodes) == (min(spans), max(spans)), entry.kind
        assert entry.crossing_groups == sum(span > 1 for span in spans), entry.kind
        crossing = [group for group, span in zip(groups, spans, strict=True) if span > 1]
        assert entry.first_crossing == (crossing[0] if crossing else None)
        assert entry.within_node == (max(spans) == 1)
        should_stay = entry.kind in DEFAULT_INTRA_NODE_KINDS
        assert entry.should_stay_intra_node == should_stay
        assert entry.violated == (should_stay and max(spans) > 1)
        if len(groups[0]) == 1:
            assert entry.verdict == "off (one rank per group)"
        elif crossing:
            assert entry.verdict.startswith(f"crosses nodes ({len(crossing)} of {len(groups)} groups)")
            assert entry.verdict.endswith("; should stay on one node") == entry.violated
        else:
            assert entry.verdict == "within a node"
    assert [v.kind for v in placement.violations()] == [
        kind for kind in GROUP_KINDS
        if kind in DEFAULT_INTRA_NODE_KINDS and max(_nodes_per_group(layout, kind, gpus_per_node)) > 1
    ]


@settings(max_examples=40, deadline=None)
@given(
    tp=st.sampled_from([1, 2, 4]), cp=st.sampled_from([1, 2]), pp=st.sampled_from([1, 2]),
    ep=st.sampled_from([1, 2, 4]), expt_tp=st.sampled_from([1, 2]), dp=st.sampled_from([1, 2, 3]),
    gpus_per_node=st.sampled_from([1, 2, 4, 8]),
)
def test_random_layouts_match_node_membership(
    tp: int, cp: int, pp: int, ep: int, expt_tp: int, dp: int, gpus_per_node: int,
) -> None:
    world = tp * cp * pp * dp
    if world % (expt_tp * ep * pp) or world % gpus_per_node:
        return
    layout = ParallelLayout(num_ranks=world, tp=tp, cp=cp, pp=pp, ep=ep, expt_tp=expt_tp)
    placement = place(layout, gpus_per_node, intra_node_kinds=GROUP_KINDS)
    for entry in placement.kinds:
        spans = _nodes_per_group(layout, entry.kind, gpus_per_node)
        assert (entry.min_nodes, entry.max_nodes, entry.crossing_groups) == (
            min(spans), max(spans), sum(s > 1 for s in spans),
        )
        assert entry.violated == (max(spans) > 1)


def test_tp_placed_across_nodes_by_the_order_string_is_reported() -> None:
    # tp varies slowest but one: its two ranks are 8 apart, on different nodes of 8 GPUs.
    layout = ParallelLayout(num_ranks=16, tp=2, order="dp-tp-cp-ep-pp")
    placement = place(layout, 8)
    assert [v.kind for v in placement.violations()] == ["tp", "expt_tp"]
    (tp_warning, _) = placement.warnings()
    assert tp_warning.startswith("tp groups cross nodes: 8 of 8 groups of 2 ranks span up to 2 nodes of 8 GPUs")
    assert "(first: ranks [0, 8] on nodes [0, 1])" in tp_warning
    # The same sizes in the default order keep tp on a node.
    assert place(ParallelLayout(num_ranks=16, tp=2), 8).violations() == ()


def test_tp_larger_than_a_node_is_reported() -> None:
    placement = place(ParallelLayout(num_ranks=32, tp=16, expt_tp=1), 8)
    assert [v.kind for v in placement.violations()] == ["tp"]
    assert placement.kind("tp").max_nodes == 2


def test_intra_node_kinds_are_configurable() -> None:
    layout = ParallelLayout(num_ranks=16, tp=2, ep=8, expt_tp=1)
    assert place(layout, 4).violations() == ()
    assert [v.kind for v in place(layout, 4, intra_node_kinds=("ep", "tp_ep")).violations()] == ["ep", "tp_ep"]
    assert place(ParallelLayout(num_ranks=16, tp=16), 8, intra_node_kinds=()).violations() == ()


@pytest.mark.parametrize(
    ("gpus_per_node", "kinds", "message"),
    [
        (0, DEFAULT_INTRA_NODE_KINDS, "gpus_per_node must be a positive integer, got 0"),
        (True, DEFAULT_INTRA_NODE_KINDS, "gpus_per_node must be a positive integer, got True"),
        (3, DEFAULT_INTRA_NODE_KINDS, "num_ranks 16 is not a multiple of gpus_per_node 3"),
        (8, ("tp", "tensor"), "unknown group kind 'tensor' among intra-node kinds"),
    ],
)
def test_bad_input_raises_naming_the_culprit(gpus_per_node: int, kinds: tuple[str, ...], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("[", r"\[")):
        place(ParallelLayout(num_ranks=16, tp=2), gpus_per_node, intra_node_kinds=kinds)


def test_unknown_kind_lookup_raises() -> None:
    with pytest.raises(ValueError, match="unknown group kind 'tensor'"):
        place(ParallelLayout(num_ranks=8), 8).kind("tensor")


def test_describe_nodes_counts_in_words() -> None:
    assert place(ParallelLayout(num_ranks=8), 8).describe_nodes() == "1 node of 8 GPUs"
    assert place(ParallelLayout(num_ranks=8), 1).describe_nodes() == "8 nodes of 1 GPU"
    assert place(ParallelLayout(num_ranks=32, tp=8), 8).describe_nodes() == "4 nodes of 8 GPUs"

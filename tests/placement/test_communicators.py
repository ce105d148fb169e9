"""Communicators of a layout and the ones two layouts share, against per-rank views of the layout
(``groups_of(rank)``, a different path from the whole-kind enumeration the module uses)."""

from __future__ import annotations

from collections import defaultdict

import pytest

from pgregistry._runtime.communicators import (
    communicators_per_rank,
    compare_layouts,
    kinds_by_communicator,
)
from pgregistry.layout import GROUP_KINDS, ParallelLayout

LAYOUTS = [
    {"num_ranks": 16, "tp": 2, "pp": 2, "ep": 4, "expt_tp": 1},
    {"num_ranks": 16, "tp": 4},
    {"num_ranks": 48, "tp": 2, "cp": 2, "pp": 2, "ep": 3, "expt_tp": 1, "gtp_remat": 2, "expt_gtp_remat": 2},
]


def _from_rank_views(layout: ParallelLayout) -> dict[tuple[int, ...], set[str]]:
    out: dict[tuple[int, ...], set[str]] = defaultdict(set)
    for rank in range(*layout.rank_range()):
        for kind, group in layout.groups_of(rank).items():
            if group is not None and len(group) > 1:
                out[tuple(sorted(group))].add(kind)
    return dict(out)


@pytest.mark.parametrize("sizes", LAYOUTS)
def test_communicators_match_every_ranks_view(sizes: dict[str, object]) -> None:
    layout = ParallelLayout(**sizes)  # type: ignore[arg-type]
    comms = kinds_by_communicator(layout)
    expected = _from_rank_views(layout)
    assert {ranks: set(kinds) for ranks, kinds in comms.items()} == expected
    for kinds in comms.values():
        assert list(kinds) == sorted(kinds, key=GROUP_KINDS.index)
    counts = communicators_per_rank(comms, range(layout.num_ranks))
    assert counts == [sum(rank in ranks for ranks in expected) for rank in range(layout.num_ranks)]


def test_kinds_naming_the_same_ranks_share_one_communicator() -> None:
    # cp and GTP off and etp == tp: dp, dp_cp, expt_dp and their GTP-spanning kinds are the same rank sets.
    comms = kinds_by_communicator(ParallelLayout(num_ranks=8, tp=2))
    assert comms[(0, 2, 4, 6)] == ("dp", "dp_cp", "dp_cp_gtp_remat", "expt_dp", "expt_dp_gtp_remat")


@pytest.mark.parametrize(("sizes_a", "sizes_b"), [(LAYOUTS[0], LAYOUTS[1]), (LAYOUTS[1], LAYOUTS[0])])
def test_compare_shares_exactly_the_common_rank_sets(sizes_a: dict[str, object], sizes_b: dict[str, object]) -> None:
    a = ParallelLayout(**sizes_a)  # type: ignore[arg-type]
    b = ParallelLayout(**sizes_b)  # type: ignore[arg-type]
    comparison = compare_layouts(a, b)
    view_a, view_b = _from_rank_views(a), _from_rank_views(b)
    assert comparison.shared == view_a.keys() & view_b.keys()
    rows = comparison.group_shared_by_kinds()
    assert sum(row.count for row in rows) == len(comparison.shared)
    for row in rows:
        members = [r for r in comparison.shared if set(view_a[r]) == set(row.kinds_a)
                   and set(view_b[r]) == set(row.kinds_b) and len(r) == row.size]
        assert len(members) == row.count


def test_policy_and_reference_share_the_blocks_of_four() -> None:
    # Policy: tp 2, pp 2, ep 4 with etp 1, so its expert groups are blocks of 4 consecutive ranks; the reference
    # model's tp 4 groups are the same blocks: the registry creates them once.
    comparison = compare_layouts(ParallelLayout(**LAYOUTS[0]), ParallelLayout(**LAYOUTS[1]))  # type: ignore[arg-type]
    blocks = {tuple(range(start, start + 4)) for start in range(0, 16, 4)}
    assert comparison.shared == blocks
    (row,) = comparison.group_shared_by_kinds()
    assert (row.kinds_a, row.count, row.size) == (("ep", "tp_ep"), 4, 4)
    assert row.kinds_b == ("tp", "tp_cp", "mp", "expt_tp", "tp_ep", "tp_ep_pp", "tp_ep_pp_with_egtp_remat")


# ------------------------------------------------------------------------------------------------ spans

SPANS = [
    {"num_ranks": 8, "tp": 2, "pp": 2, "ep": 2, "expt_tp": 1, "rank_offset": 4},
    {"num_ranks": 6, "tp": 3, "rank_offset": 1},
    {"num_ranks": 6, "pp": 3, "rank_offset": 2},  # the middle stage joins no embedding group: counts differ by rank
    {"num_ranks": 12, "tp": 2, "cp": 2, "ep": 3, "expt_tp": 1, "gtp_remat": 1, "rank_offset": 9},
]


@pytest.mark.parametrize("sizes", SPANS)
def test_a_spans_communicators_are_its_ranks_views(sizes: dict[str, object]) -> None:
    layout = ParallelLayout(**sizes)  # type: ignore[arg-type]
    comms = kinds_by_communicator(layout)
    expected = _from_rank_views(layout)
    assert {ranks: set(kinds) for ranks, kinds in comms.items()} == expected
    span = range(*layout.rank_range())
    assert communicators_per_rank(comms, span) == [sum(rank in ranks for ranks in expected) for rank in span]
    # Counted over a larger world, the ranks outside the span join none of them.
    world = range(layout.rank_range()[1] + 2)
    counts = communicators_per_rank(comms, world)
    assert counts[: span.start] == [0] * span.start and counts[span.stop:] == [0, 0]
    assert counts[span.start: span.stop] == communicators_per_rank(comms, span)


def test_counting_over_ranks_that_miss_a_communicator_is_refused() -> None:
    comms = kinds_by_communicator(ParallelLayout(num_ranks=4, tp=2, rank_offset=4))
    with pytest.raises(ValueError, match=r"communicator over ranks \[4, 5\] reaches rank 4, outside ranks 0-3"):
        communicators_per_rank(comms, range(4))


@pytest.mark.parametrize(
    ("sizes_a", "sizes_b"),
    [
        ({"num_ranks": 8, "tp": 4}, {"num_ranks": 4, "tp": 4, "rank_offset": 4}),  # B is A's second half
        ({"num_ranks": 8, "tp": 2, "rank_offset": 2}, {"num_ranks": 8, "tp": 2, "ep": 2, "expt_tp": 1}),
        ({"num_ranks": 16}, {"num_ranks": 8}),  # different sizes from rank 0
        ({"num_ranks": 4, "tp": 2}, {"num_ranks": 4, "tp": 2, "rank_offset": 4}),  # disjoint: nothing shared
    ],
)
def test_compare_spans_shares_exactly_the_common_rank_sets(
    sizes_a: dict[str, object], sizes_b: dict[str, object],
) -> None:
    a = ParallelLayout(**sizes_a)  # type: ignore[arg-type]
    b = ParallelLayout(**sizes_b)  # type: ignore[arg-type]
    comparison = compare_layouts(a, b)
    view_a, view_b = _from_rank_views(a), _from_rank_views(b)
    assert comparison.shared == view_a.keys() & view_b.keys()
    world = max(a.rank_range()[1], b.rank_range()[1])
    assert comparison.world_size == world
    both = set(view_a) | set(view_b)
    assert comparison.communicators_per_rank() == [sum(rank in ranks for ranks in both) for rank in range(world)]
    in_both = [r for r in range(world) if r in range(*a.rank_range()) and r in range(*b.rank_range())]
    assert list(comparison.overlap) == in_both
    if not in_both:
        assert comparison.shared == frozenset()


def test_the_second_half_shares_its_tp_group_with_the_whole() -> None:
    comparison = compare_layouts(ParallelLayout(num_ranks=8, tp=4), ParallelLayout(num_ranks=4, tp=4, rank_offset=4))
    assert (4, 5, 6, 7) in comparison.shared and (0, 1, 2, 3) not in comparison.shared
    assert comparison.differences() == [("ranks", "0-7", "4-7"), ("dp", "2", "1"), ("expt_dp", "2", "1")]
    assert comparison.overlap == range(4, 8)


def test_differences_name_span_sizes_and_order() -> None:
    a = ParallelLayout(num_ranks=8, tp=2, order="tp-pp-dp")
    assert compare_layouts(a, a).differences() == []
    b = ParallelLayout(num_ranks=8, tp=2, rank_offset=8)
    assert compare_layouts(a, b).differences() == [("ranks", "0-7", "8-15"), ("order", "tp-pp-dp", "tp-cp-ep-dp-pp")]


@pytest.mark.parametrize(
    ("world_size", "message"),
    [
        (8, "layout b spans ranks 4-11 (rank_offset 4 + num_ranks 8), past the end of the world (world_size 8)"),
        (0, "world_size must be a positive integer, got 0"),
    ],
)
def test_compare_refuses_a_span_past_the_world(world_size: int, message: str) -> None:
    with pytest.raises(ValueError) as info:
        compare_layouts(ParallelLayout(num_ranks=8), ParallelLayout(num_ranks=8, rank_offset=4), world_size=world_size)
    assert str(info.value) == message

"""Communicators of a layout and the ones two layouts share, against per-rank views of the layout
(``groups_of(rank)``, a different path from the whole-kind enumeration the module uses)."""

from __future__ import annotations

from collections import defaultdict

import pytest

from pgregistry._communicators import communicators, communicators_per_rank, compare_layouts
from pgregistry.layout import GROUP_KINDS, ParallelLayout

LAYOUTS = [
    {"num_ranks": 16, "tp": 2, "pp": 2, "ep": 4, "expt_tp": 1},
    {"num_ranks": 16, "tp": 4},
    {"num_ranks": 48, "tp": 2, "cp": 2, "pp": 2, "ep": 3, "expt_tp": 1, "gtp_remat": 2, "expt_gtp_remat": 2},
]


def _from_rank_views(layout: ParallelLayout) -> dict[tuple[int, ...], set[str]]:
    out: dict[tuple[int, ...], set[str]] = defaultdict(set)
    for rank in range(layout.num_ranks):
        for kind, group in layout.groups_of(rank).items():
            if group is not None and len(group) > 1:
                out[tuple(sorted(group))].add(kind)
    return dict(out)


@pytest.mark.parametrize("sizes", LAYOUTS)
def test_communicators_match_every_ranks_view(sizes: dict[str, object]) -> None:
    layout = ParallelLayout(**sizes)  # type: ignore[arg-type]
    comms = communicators(layout)
    expected = _from_rank_views(layout)
    assert {ranks: set(kinds) for ranks, kinds in comms.items()} == expected
    for kinds in comms.values():
        assert list(kinds) == sorted(kinds, key=GROUP_KINDS.index)
    counts = communicators_per_rank(comms, layout.num_ranks)
    assert counts == [sum(rank in ranks for ranks in expected) for rank in range(layout.num_ranks)]


def test_kinds_naming_the_same_ranks_share_one_communicator() -> None:
    # cp and GTP off and etp == tp: dp, dp_cp, expt_dp and their GTP-spanning kinds are the same rank sets.
    comms = communicators(ParallelLayout(num_ranks=8, tp=2))
    assert comms[(0, 2, 4, 6)] == ("dp", "dp_cp", "dp_cp_gtp_remat", "expt_dp", "expt_dp_gtp_remat")


@pytest.mark.parametrize(("sizes_a", "sizes_b"), [(LAYOUTS[0], LAYOUTS[1]), (LAYOUTS[1], LAYOUTS[0])])
def test_compare_shares_exactly_the_common_rank_sets(sizes_a: dict[str, object], sizes_b: dict[str, object]) -> None:
    a = ParallelLayout(**sizes_a)  # type: ignore[arg-type]
    b = ParallelLayout(**sizes_b)  # type: ignore[arg-type]
    comparison = compare_layouts(a, b)
    view_a, view_b = _from_rank_views(a), _from_rank_views(b)
    assert comparison.shared == view_a.keys() & view_b.keys()
    rows = comparison.shared_by_kinds()
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
    (row,) = comparison.shared_by_kinds()
    assert (row.kinds_a, row.count, row.size) == (("ep", "tp_ep"), 4, 4)
    assert row.kinds_b == ("tp", "tp_cp", "mp", "expt_tp", "tp_ep", "tp_ep_pp", "tp_ep_pp_with_egtp_remat")


def test_compare_refuses_different_worlds() -> None:
    with pytest.raises(ValueError, match="different world sizes \\(16 and 8\\)"):
        compare_layouts(ParallelLayout(num_ranks=16), ParallelLayout(num_ranks=8))

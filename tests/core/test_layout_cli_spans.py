"""``pgregistry layout`` and ``seed-plan`` for a layout over a span of the world (``--rank-offset``, ``--world-size``):
global ranks in the table, ``--json``, ``--rank``, the placement, the picture and ``--compare``; bad spans exit 2
naming the option. Oracles: hand-worked ranks of the issue's example, node membership computed here (rank // N), and
the layout's rank sets (checked against Megatron-Core's HyperCommGrid in tests/megatron)."""

from __future__ import annotations

import json
import re
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from pgregistry.cli import main
from pgregistry.layout import GROUP_KINDS, ParallelLayout
from pgregistry.rng import seed_plan

_SVG = "{http://www.w3.org/2000/svg}"
_ISSUE = ["layout", "--num-ranks", "4", "--tp", "2", "--pp", "2", "--rank-offset", "4"]  # ranks 4-7


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def _row(out: str, kind: str) -> str:
    (line,) = [line for line in out.splitlines() if line.split()[:1] == [kind]]
    return line


def test_table_shows_the_spans_global_ranks(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(_ISSUE, capsys)
    assert code == 0
    assert out.startswith("layout: 4 ranks (ranks 4-7), order tp-cp-ep-dp-pp; tp 2, gtp_remat 1, cp 1, dp 1, pp 2,")
    # tp varies fastest from rank 4, pp slowest: tp groups [4, 5] [6, 7], pp groups [4, 6] [5, 7].
    assert re.fullmatch(r"tp +dense tp +2 +2  \[4, 5\] \[6, 7\]", _row(out, "tp"))
    assert re.fullmatch(r"pp +dense pp +2 +2  \[4, 6\] \[5, 7\]", _row(out, "pp"))
    assert re.fullmatch(r"mp +dense tp-gtp_remat-pp +1 +4  \[4, 5, 6, 7\]", _row(out, "mp"))
    assert re.fullmatch(r"embd +pp first\+last +2 +2  \[4, 6\] \[5, 7\]", _row(out, "embd"))
    code, out, _ = _run([*_ISSUE, "--world-size", "16"], capsys)
    assert out.startswith("layout: 4 ranks (ranks 4-7 of the 16-rank world), order")


def test_json_and_rank_view_use_global_ranks(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run([*_ISSUE, "--json", "--show", "9", "--rank", "6", "--gpus-per-node", "4",
                         "--world-size", "12"], capsys)
    assert code == 0
    report = json.loads(out)
    layout = ParallelLayout(num_ranks=4, tp=2, pp=2, rank_offset=4)
    assert {k: report["layout"][k] for k in ("num_ranks", "rank_offset", "world_size")} == {
        "num_ranks": 4, "rank_offset": 4, "world_size": 12,
    }
    for kind in GROUP_KINDS:
        assert report["kinds"][kind]["first"] == [list(g) for g in layout.groups(kind)], kind
    assert report["rank"]["rank"] == 6 and report["rank"]["node"] == 1  # 6 // 4
    assert report["rank"]["coords"]["tp"] == 0 and report["rank"]["coords"]["pp"] == 1  # rank 6 = 4 + 0 + 2 * 1
    assert report["rank"]["groups"]["tp"] == [6, 7] and report["rank"]["groups"]["pp"] == [4, 6]
    assert report["rank"]["groups"]["pos_embd"] is None  # the last stage holds no position embedding


def test_placement_of_a_span_starting_mid_node(capsys: pytest.CaptureFixture[str]) -> None:
    # tp 2 over ranks 1-4 on nodes of 4: tp groups [1, 2] (node 0) and [3, 4] (nodes 0 and 1).
    argv = ["layout", "--num-ranks", "4", "--tp", "2", "--rank-offset", "1", "--world-size", "8",
            "--gpus-per-node", "4"]
    code, out, err = _run(argv, capsys)
    assert code == 0
    assert ("\nplacement: ranks 1-4 on nodes 0-1 of 4 GPUs, sharing node 0 with rank 0 and node 1 with ranks 5-7 "
            "(rank r on node r // 4); each rank of the layout joins ") in out
    tp_row = _row(out.split("\nplacement: ")[1], "tp")
    assert tp_row.endswith("1-2  crosses nodes (1 of 2 groups); should stay on one node")
    assert "warning: tp groups cross nodes: 1 of 2 groups of 2 ranks span up to 2 nodes of 4 GPUs (first: ranks " \
           "[3, 4] on nodes [0, 1])" in err
    assert main([*argv, "--check"]) == 1
    aligned = ["layout", "--num-ranks", "4", "--tp", "2", "--rank-offset", "2", "--world-size", "8",
               "--gpus-per-node", "4", "--check"]
    assert main(aligned) == 0  # [2, 3] and [4, 5]: each on one node
    capsys.readouterr()

    code, out, _ = _run([*argv, "--json"], capsys)
    placement = json.loads(out)["placement"]
    assert {k: placement[k] for k in ("world_size", "num_nodes", "first_node", "shared_nodes")} == {
        "world_size": 8, "num_nodes": 2, "first_node": 0, "shared_nodes": [0, 1],
    }
    layout = ParallelLayout(num_ranks=4, tp=2, rank_offset=1)
    distinct = {tuple(sorted(g)) for kind in GROUP_KINDS for g in layout.groups(kind) if len(g) > 1}
    joined = [sum(rank in group for group in distinct) for rank in range(1, 5)]
    assert placement["communicators_per_rank"] == {"min": min(joined), "max": max(joined)}
    for kind, info in placement["kinds"].items():
        spans = [len({rank // 4 for rank in group}) for group in layout.groups(kind)]
        assert (info["min_nodes"], info["max_nodes"]) == (min(spans), max(spans)), kind


def _classes(element: ET.Element) -> set[str]:
    return set(element.get("class", "").split())


def _groups(root: ET.Element, cls: str) -> list[ET.Element]:
    return [g for g in root.iter(f"{_SVG}g") if cls in _classes(g)]


def test_picture_of_a_span_draws_its_nodes_and_marks_the_ranks_outside(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    svg = tmp_path / "span.svg"
    argv = ["layout", "--num-ranks", "4", "--tp", "2", "--ep", "2", "--expt-tp", "1", "--rank-offset", "2",
            "--world-size", "8", "--gpus-per-node", "4", "--svg", str(svg)]
    assert main(argv) == 0
    capsys.readouterr()
    root = ET.parse(svg).getroot()
    texts = ["".join(t.itertext()) for t in root.iter(f"{_SVG}text")]
    assert "pgregistry layout: ranks 2-5 of a world of 8 ranks" in texts
    assert "ranks 2-5 on nodes 0-1 of 4 GPUs, sharing node 0 with ranks 0-1 and node 1 with ranks 6-7" in texts
    layout = ParallelLayout(num_ranks=4, tp=2, ep=2, expt_tp=1, rank_offset=2)
    (rank_map,) = _groups(root, "rank-map")
    assert [int(node.get("data-node", -1)) for node in _groups(rank_map, "node")] == [0, 1]
    cells = {int(c.get("data-rank", -1)): c for c in _groups(rank_map, "rank")}
    assert sorted(cells) == list(range(8))
    assert [r for r, c in cells.items() if "outside" in _classes(c)] == [0, 1, 6, 7]
    for panel in _groups(root, "kind-panel"):
        kind = panel.get("data-kind", "")
        members: dict[str, set[int]] = {}
        for cell in _groups(panel, "rank"):
            rank = int(cell.get("data-rank", -1))
            outside = not 2 <= rank < 6
            assert ("outside" in _classes(cell)) == outside and (cell.get("data-group") is None) == outside
            if not outside:
                members.setdefault(cell.get("data-group", ""), set()).add(rank)
        assert sorted(map(sorted, members.values())) == sorted(map(sorted, layout.groups(kind))), kind


def test_compare_two_spans_says_what_differs_and_what_is_shared(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    # The whole 8-rank world at tp 4, and its second half (ranks 4-7) at tp 4: that tp group is one communicator.
    svg = tmp_path / "compare.svg"
    argv = ["layout", "--num-ranks", "8", "--compare", "whole:tp=4", "half:tp=4,num_ranks=4,rank_offset=4",
            "--gpus-per-node", "4", "--svg", str(svg)]
    code, out, _ = _run(argv, capsys)
    assert code == 0
    assert out.startswith("compare on 8 ranks:\n  whole: tp 4, dp 2, expt_tp 4, expt_dp 2; order tp-cp-ep-dp-pp\n"
                          "  half: ranks 4-7; tp 4, expt_tp 4; order tp-cp-ep-dp-pp\n"
                          "differ in: ranks (0-7 / 4-7), dp (2 / 1), expt_dp (2 / 1)\n")
    assert "shared: 1 (the registry creates 7, not 8)" in out
    assert "\nhalf placement: ranks 4-7 on node 1 of 4 GPUs (rank r on node r // 4)" in out
    root = ET.parse(svg).getroot()
    for panel in _groups(root, "kind-panel"):
        for cell in _groups(panel, "rank"):
            rank = int(cell.get("data-rank", -1))
            assert ("outside" in _classes(cell)) == (panel.get("data-side") == "b" and rank < 4)

    code, out, _ = _run(["layout", "--num-ranks", "4", "--compare", "a:tp=2", "b:tp=2,rank_offset=4", "--json"],
                        capsys)
    report = json.loads(out)
    assert (report["world_size"], report["overlap"], report["shared"]) == (8, None, 0)
    assert report["differences"] == [{"what": "ranks", "a": "0-3", "b": "4-7"}]
    assert report["layouts"]["b"]["rank_offset"] == 4 and report["layouts"]["b"]["num_ranks"] == 4
    code, out, _ = _run(["layout", "--num-ranks", "4", "--compare", "a:tp=2", "b:tp=2,rank_offset=4"], capsys)
    assert "\ntheir spans are disjoint: no communicator can be shared\n" in out
    assert "shared: 0 (the registry creates 10)" in out
    # --rank-offset is the default span of both specs.
    code, out, _ = _run(["layout", "--num-ranks", "4", "--rank-offset", "4", "--compare", "a:tp=2", "b:tp=4",
                         "--json"], capsys)
    assert {name: info["rank_offset"] for name, info in json.loads(out)["layouts"].items()} == {"a": 4, "b": 4}


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--num-ranks", "4", "--rank-offset", "-1"],
         "--rank-offset must be a non-negative integer (the layout's first rank), got -1"),
        (["--num-ranks", "0"], "--num-ranks must be a positive integer, got 0"),
        (["--num-ranks", "4", "--world-size", "0"], "--world-size must be a positive integer, got 0"),
        (["--num-ranks", "4", "--rank-offset", "6", "--world-size", "8"],
         "the layout spans ranks 6-9 (--rank-offset 6 + --num-ranks 4), past the end of --world-size 8"),
        (["--num-ranks", "4", "--rank-offset", "2", "--gpus-per-node", "4"],
         "the world, taken to end where the layout does (--rank-offset 2 + --num-ranks 4 = 6 ranks; give "
         "--world-size when larger), is not a multiple of --gpus-per-node 4"),
        (["--num-ranks", "4", "--rank-offset", "2", "--world-size", "6", "--gpus-per-node", "4"],
         "--world-size 6 is not a multiple of --gpus-per-node 4: launchers start the same number of ranks on every"),
        (["--num-ranks", "4", "--rank-offset", "4", "--rank", "1"], "rank 1 is outside ranks 4..7 of this layout"),
        (["--num-ranks", "8", "--world-size", "8", "--compare", "a:tp=2", "b:rank_offset=4"],
         "layout spec 'b:rank_offset=4': the layout spans ranks 4-11 (rank_offset 4 + num_ranks 8), past the end "
         "of --world-size 8"),
        (["--num-ranks", "8", "--compare", "a:", "b:rank_offset=-2"],
         "layout spec 'b:rank_offset=-2': rank_offset must be a non-negative integer"),
        (["--num-ranks", "8", "--compare", "a:", "b:num_ranks=0"], "layout spec 'b:num_ranks=0': num_ranks must be"),
        (["--num-ranks", "8", "--rank-offset", "-1", "--compare", "a:", "b:"],
         "--rank-offset must be a non-negative integer"),
        (["--num-ranks", "8", "--compare", "a:num_ranks=4", "b:rank_offset=2", "--gpus-per-node", "4"],
         "the world, taken to end where the later layout does (10 ranks; give --world-size when larger), is not a "
         "multiple of --gpus-per-node 4"),
        (["--num-ranks", "8", "--compare", "a:", "b:rank_offset=2,rank_offset=3"],
         "layout spec 'b:rank_offset=2,rank_offset=3' gives rank_offset twice"),
    ],
)
def test_bad_spans_exit_2_naming_the_option(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, err = _run(["layout", *argv], capsys)
    assert (code, out) == (2, "")
    assert err.startswith("pgregistry layout: error: ") and err.count("\n") == 1
    assert message in err, err


def test_seed_plan_of_a_span_lists_its_global_ranks(capsys: pytest.CaptureFixture[str]) -> None:
    base = ["seed-plan", "--num-ranks", "4", "--tp", "2", "--pp", "2", "--seed", "1234"]
    code, out, _ = _run([*base, "--rank-offset", "4", "--json"], capsys)
    assert code == 0
    plan = json.loads(out)
    # The span's ranks hold the coordinates of ranks 0-3 of the same layout from rank 0: the same seeds.
    alone = seed_plan(ParallelLayout(num_ranks=4, tp=2, pp=2), 1234)
    assert plan == {str(rank + 4): seeds for rank, seeds in alone.items()}
    assert plan["7"]["model-parallel-rng"] == 1234 + 100 * 1 + 2718 + 1  # pp 1, tp 1
    code, out, _ = _run([*base, "--rank-offset", "4"], capsys)
    assert [line.split()[0] for line in out.splitlines()] == ["rank", "4", "5", "6", "7"]
    code, out, _ = _run([*base, "--rank-offset", "4", "--check"], capsys)
    assert (code, out) == (0, "no seed collisions in 4 ranks (ranks 4-7)\n")
    code, out, err = _run([*base, "--rank-offset", "-4"], capsys)
    assert code == 2 and "pgregistry seed-plan: error: --rank-offset must be a non-negative integer" in err
    code, out, err = _run([*base, "--rank-offset", "4", "--world-size", "6"], capsys)
    assert code == 2 and "the layout spans ranks 4-7 (--rank-offset 4 + --num-ranks 4), past the end of " \
                         "--world-size 6" in err

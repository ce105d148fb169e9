"""``pgregistry layout --gpus-per-node / --check / --svg / --html / --compare``: output against node membership the
test computes (rank // N over the layout's rank sets), exit codes 0 / 1 / 2, pictures written whole."""

from __future__ import annotations

import json
import re
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from pgregistry.cli import main
from pgregistry.layout import GROUP_KINDS, ParallelLayout

_CROSSING_TP = ["layout", "--num-ranks", "16", "--tp", "2", "--order", "dp-tp-cp-ep-pp"]


def _spans(layout: ParallelLayout, kind: str, gpus_per_node: int) -> list[int]:
    return [len({rank // gpus_per_node for rank in group}) for group in layout.groups(kind)]


def test_placement_table_and_warning(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*_CROSSING_TP, "--gpus-per-node", "8"]) == 0  # a warning, not a failure, without --check
    out, err = capsys.readouterr()
    layout = ParallelLayout(num_ranks=16, tp=2, order="dp-tp-cp-ep-pp")
    table = out.split("\nplacement: ")[1]
    assert table.startswith("2 nodes of 8 GPUs (rank r on node r // 8); each rank joins 3 communicators;")
    rows = {m[0]: m[1:] for m in re.findall(r"^(\w+) +(\d+) +(\d+) +([\d-]+)  (.+)$", table, flags=re.M)}
    assert list(rows) == list(GROUP_KINDS)
    for kind, (groups, size, nodes, verdict) in rows.items():
        spans = _spans(layout, kind, 8)
        assert (int(groups), int(size)) == (len(spans), len(layout.groups(kind)[0]))
        assert nodes == (str(min(spans)) if min(spans) == max(spans) else f"{min(spans)}-{max(spans)}")
        assert ("should stay on one node" in verdict) == (kind in ("tp", "expt_tp", "cp") and max(spans) > 1)
    assert err.count("warning:") == 2
    assert "pgregistry layout: warning: tp groups cross nodes: 8 of 8 groups" in err


def test_check_exits_1_only_when_an_intra_node_kind_crosses(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*_CROSSING_TP, "--gpus-per-node", "8", "--check"]) == 1
    assert main([*_CROSSING_TP, "--gpus-per-node", "16", "--check"]) == 0  # one node holds everything
    assert main(["layout", "--num-ranks", "16", "--tp", "2", "--gpus-per-node", "8", "--check"]) == 0
    assert main([*_CROSSING_TP, "--gpus-per-node", "8", "--check", "--intra-node", "cp"]) == 0
    assert main(["layout", "--num-ranks", "16", "--ep", "4", "--gpus-per-node", "2", "--check",
                 "--intra-node", "ep"]) == 1
    capsys.readouterr()


def test_json_placement_matches_node_membership(capsys: pytest.CaptureFixture[str]) -> None:
    sizes = {"num_ranks": 32, "tp": 4, "cp": 2, "pp": 2, "ep": 2, "expt_tp": 2}
    argv = ["layout", "--json", "--gpus-per-node", "4"]
    for key, value in sizes.items():
        argv += [f"--{key.replace('_', '-')}", str(value)]
    assert main(argv) == 0
    placement = json.loads(capsys.readouterr().out)["placement"]
    layout = ParallelLayout(**sizes)
    assert (placement["gpus_per_node"], placement["num_nodes"]) == (4, 8)
    for kind, info in placement["kinds"].items():
        spans = _spans(layout, kind, 4)
        assert (info["min_nodes"], info["max_nodes"]) == (min(spans), max(spans))
        assert info["crossing_groups"] == sum(s > 1 for s in spans)
    assert [w.split(" groups")[0] for w in placement["warnings"]] == ["cp"]  # tp 4 fits, cp spans two nodes
    distinct = {group for kind in GROUP_KINDS for group in layout.groups(kind) if len(group) > 1}
    joined = [sum(rank in group for group in distinct) for rank in range(32)]
    assert placement["communicators_per_rank"] == {"min": min(joined), "max": max(joined)}


def test_svg_and_html_are_written(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    svg, html = tmp_path / "layout.svg", tmp_path / "layout.html"
    assert main([*_CROSSING_TP, "--gpus-per-node", "8", "--svg", str(svg), "--html", str(html),
                 "--highlight", "tp,dp"]) == 0
    root = ET.parse(svg).getroot()
    panels = [g.get("data-kind") for g in root.iter("{http://www.w3.org/2000/svg}g")
              if g.get("class") == "kind-panel"]
    assert panels == ["tp", "dp"]
    assert html.read_text().startswith("<!DOCTYPE html>")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["layout.html", "layout.svg"]  # no temporary left
    capsys.readouterr()


def test_compare_lists_the_shared_communicators(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    svg = tmp_path / "compare.svg"
    argv = ["layout", "--num-ranks", "16", "--compare", "policy:tp=2,pp=2,ep=4,expt_tp=1", "reference:tp=4",
            "--gpus-per-node", "8", "--svg", str(svg)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "policy: 40 communicators, reference: 9, shared: 4 (the registry creates 45, not 49)" in out
    assert re.search(r"^ +4 +4  ep, tp_ep +tp, tp_cp, mp, expt_tp, tp_ep, tp_ep_pp, tp_ep_pp_with_egtp_remat$", out,
                     flags=re.M)
    assert "\npolicy placement: 2 nodes of 8 GPUs" in out and "\nreference placement: " in out
    assert ET.parse(svg).getroot().tag == "{http://www.w3.org/2000/svg}svg"
    assert main([*argv[:6], "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["shared"] == 4 and report["layouts"]["reference"]["communicators"] == 9
    assert report["shared_by_kinds"] == [
        {"count": 4, "size": 4, "policy": ["ep", "tp_ep"],
         "reference": ["tp", "tp_cp", "mp", "expt_tp", "tp_ep", "tp_ep_pp", "tp_ep_pp_with_egtp_remat"]},
    ]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--svg", "x.svg"], "--svg needs --gpus-per-node"),
        (["--check"], "--check needs --gpus-per-node"),
        (["--gpus-per-node", "3"], "--num-ranks 16 is not a multiple of --gpus-per-node 3"),
        (["--gpus-per-node", "0"], "--gpus-per-node must be a positive integer, got 0"),
        (["--gpus-per-node", "8", "--intra-node", "tp,tensor"], "unknown group kind 'tensor' among intra-node"),
        (["--gpus-per-node", "8", "--highlight", "tp"], "--highlight chooses the panels of --svg/--html"),
        (["--gpus-per-node", "8", "--svg", "/nonexistent-dir/x.svg"], "cannot write /nonexistent-dir/x.svg"),
        (["--tp", "2", "--compare", "tp=2", "ep=2"], "--compare takes both layouts as specs; drop --tp"),
        (["--compare", "a:tp=3", "b:"], "layout spec 'a:tp=3': num_ranks 16 is not divisible by tp"),
        (["--compare", "a:tq=2", "b:"], "layout spec 'a:tq=2': 'tq=2' is not KEY=VALUE"),
        (["--compare", "a:tp=x", "b:"], "layout spec 'a:tp=x': tp must be an integer, got 'x'"),
        (["--compare", "x:tp=2", "x:ep=2"], "both layouts are named 'x'"),
        (["--compare", "a:", "b:", "--rank", "1"], "--rank shows one layout"),
    ],
)
def test_bad_input_exits_2(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["layout", "--num-ranks", "16", *argv]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("command", "options"),
    [
        ("layout", ("--gpus-per-node", "--intra-node", "--check", "--svg", "--html", "--highlight", "--compare")),
        ("verify", ("--gpus-per-node", "--intra-node")),
    ],
)
def test_every_new_option_has_help(
    command: str, options: tuple[str, ...], capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        main([command, "--help"])
    text = capsys.readouterr().out
    for option in options:
        # The option's line, then its help text (on the same line or the next, indented).
        assert re.search(re.escape(option) + r"[^\n]*?(\s{2,}|\n\s+)[a-z(]", text), option


def test_docs_example_picture_is_current(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """docs/layout_example.svg is what the command printed under it in docs/layout.md draws today."""
    docs = Path(__file__).parents[2] / "docs"
    (command,) = re.findall(r"\(`pgregistry (layout [^`]+) --svg docs/layout_example\.svg`\)",
                            (docs / "layout.md").read_text())
    fresh = tmp_path / "example.svg"
    assert main([*command.split(), "--svg", str(fresh)]) == 0
    capsys.readouterr()
    assert fresh.read_text() == (docs / "layout_example.svg").read_text()


def test_rank_view_names_its_node(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["layout", "--num-ranks", "16", "--tp", "2", "--rank", "13", "--gpus-per-node", "4"]) == 0
    assert "\nrank 13 (node 3): tp 1," in capsys.readouterr().out  # 13 // 4
    assert main(["layout", "--num-ranks", "16", "--rank", "13", "--gpus-per-node", "8", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["rank"]["node"] == 1


def test_a_reader_closing_the_output_first_ends_the_command_with_141_and_no_traceback() -> None:
    """``pgregistry layout ... | head``: the pipe's reader is gone before the table is written. Python ignores
    SIGPIPE, so the write raises ``BrokenPipeError``; without the command line's handling that is a traceback
    and exit 1 (a failed check's code), and again at exit when Python flushes standard output."""
    import os
    import subprocess
    import sys

    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader left before the first byte
    try:
        done = subprocess.run(
            [sys.executable, "-m", "pgregistry", "layout", "--num-ranks", "64", "--tp", "2"],
            stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=60, check=False,
        )
    finally:
        os.close(write_end)
    assert (done.returncode, done.stderr) == (141, "")

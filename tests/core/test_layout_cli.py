"""``pgregistry layout``: table, --rank, --json against the layout itself, exit 2 on bad input, torch-free import."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from pgregistry.cli import main
from pgregistry.layout import GROUP_KINDS, ParallelLayout

_ARGS = ["layout", "--num-ranks", "8", "--tp", "2", "--pp", "2", "--order", "tp-pp-dp"]


def test_table_lists_every_kind(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(_ARGS) == 0
    out = capsys.readouterr().out
    assert out.startswith("layout: 8 ranks, order tp-pp-dp; tp 2, gtp_remat 1, cp 1, dp 2, pp 2, expt_tp 2, ep 1,")
    rows = {line.split()[0]: line for line in out.splitlines()[3:] if line.strip()}
    assert set(rows) == set(GROUP_KINDS)
    # kind, spans, number of groups, size, the first three groups (the REFERENCE example's dp groups).
    assert re.fullmatch(r"dp +dense dp +4 +2  \[0, 4\] \[1, 5\] \[2, 6\] \.\.\.", rows["dp"])
    assert re.fullmatch(r"mp +dense tp-gtp_remat-pp +2 +4  \[0, 1, 2, 3\] \[4, 5, 6, 7\]", rows["mp"])
    assert re.fullmatch(r"embd +pp first\+last +4 +2  \[0, 2\] \[1, 3\] \[4, 6\] \.\.\.", rows["embd"])


def test_rank_shows_coords_and_groups(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*_ARGS, "--rank", "6", "--show", "1"]) == 0
    out = capsys.readouterr().out
    assert "\nrank 6: tp 0, gtp_remat 0, cp 0, dp 1, pp 1, expt_tp 0, ep 0, expt_gtp_remat 0, expt_dp 1\n" in out
    groups = dict(re.findall(r"^(\w+) +(\[[\d, ]+\]|-)$", out.split("\nrank 6:")[1], flags=re.M))
    assert groups["dp"] == "[2, 6]" and groups["pp"] == "[4, 6]" and groups["embd"] == "[4, 6]"
    assert groups["pos_embd"] == "-"
    assert re.search(r"^tp +dense tp +4 +2  \[0, 1\] \.\.\.$", out, flags=re.M)


def test_long_groups_are_abbreviated_in_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["layout", "--num-ranks", "64", "--tp", "2", "--show", "1"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^dp +dense dp +2 +32  \[0, 2, 4, 6, 8, 10, \.\.\., 62\]\(32\) \.\.\.$", out, flags=re.M)


@pytest.mark.parametrize(
    "sizes",
    [
        {"num_ranks": 8, "tp": 2, "pp": 2, "order": "tp-pp-dp"},
        {"num_ranks": 48, "tp": 2, "cp": 2, "pp": 2, "ep": 3, "expt_tp": 1, "gtp_remat": 2, "expt_gtp_remat": 2},
    ],
)
def test_json_matches_the_layout(sizes: dict[str, object], capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["layout", "--json", "--show", "2", "--rank", "5"]
    for key, value in sizes.items():
        argv += [f"--{key.replace('_', '-')}", str(value)]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    layout = ParallelLayout(**sizes)  # type: ignore[arg-type]
    assert report["layout"] == {
        "num_ranks": layout.num_ranks, "rank_offset": 0, "world_size": None, "order": layout.order,
        **layout.axis_sizes(), "fingerprint": layout.fingerprint(),
    }
    assert list(report["kinds"]) == list(GROUP_KINDS)
    for kind, info in report["kinds"].items():
        groups = layout.groups(kind)
        assert (info["groups"], info["size"]) == (len(groups), len(groups[0])), kind
        assert info["first"] == [list(g) for g in groups[:2]], kind
    assert report["rank"]["rank"] == 5
    assert report["rank"]["coords"] == layout.coords(5)
    assert report["rank"]["groups"] == {k: None if g is None else list(g) for k, g in layout.groups_of(5).items()}


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--num-ranks", "12", "--tp", "8"], "num_ranks 12 is not divisible by tp*gtp_remat*cp*pp"),
        (["--num-ranks", "8", "--tp", "0"], "tp must be a positive integer, got 0"),
        (["--num-ranks", "8", "--order", "tp-xp-dp"], "unknown axis 'xp' in order 'tp-xp-dp'"),
        (["--num-ranks", "8", "--ep", "16"], "expt_tp*ep*expt_gtp_remat*pp = 1*16*1*1 = 16 does not divide"),
        (["--num-ranks", "8", "--rank", "8"], "rank 8 is outside the 8 ranks of this layout"),
        (["--num-ranks", "8", "--show", "-1"], "--show must be non-negative, got -1"),
    ],
)
def test_bad_input_exits_2_with_the_message(
    extra: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["layout", *extra]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("pgregistry layout: error: ") and captured.err.count("\n") == 1
    assert message in captured.err


def test_usage_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["layout", "--num-ranks", "eight"], ["layout", "--tp", "2"]):
        with pytest.raises(SystemExit) as info:
            main(argv)
        assert info.value.code == 2
    assert "--num-ranks" in capsys.readouterr().err


def test_command_line_entry_point_and_torch_free_import() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "pgregistry", "layout", "--num-ranks", "6", "--tp", "4"],
        capture_output=True, text=True, timeout=60,
    )
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr.strip() == (
        "pgregistry layout: error: num_ranks 6 is not divisible by tp*gtp_remat*cp*pp = 4*1*1*1 = 4"
    )
    code = (
        "import argparse, sys\n"
        "import pgregistry.cli._layout as m\n"
        "m.add_command(argparse.ArgumentParser().add_subparsers())\n"
        "assert 'torch' not in sys.modules\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr

"""Bad option values of every command exit 2 with ``pgregistry COMMAND: error: ...`` naming the option.

The classes swept: an empty value (``--svg "$OUT"`` with the variable unset) that passed as the option left out
(``layout --svg ''`` drew nothing, ``--compare '' ''`` compared two default layouts, ``verify --json ''`` wrote no
JSON), a NaN, infinite or negative number, and a size given to a layout option that named the layout's argument
(``tp``) instead of the option (``--tp``). The allowlist's own options are swept in
``tests/allowlist/test_allowlist_base.py``. Run in-process through the command table (the exit code is what
``python -m pgregistry`` exits with, argparse's own errors included), and a few end to end in a subprocess.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pgregistry.cli import main

_EMPTY = '{option} is empty (an unset variable, as in {option} "$VAR"?): set it to '

_LAYOUT = ["layout", "--num-ranks", "8"]
_PLACED = [*_LAYOUT, "--gpus-per-node", "4"]
_SEEDS = ["seed-plan", "--num-ranks", "8", "--seed", "1"]

CASES = [
    ([*_LAYOUT, "--tp", "-2"], "pgregistry layout: error: --tp must be a positive integer, got -2"),
    ([*_LAYOUT, "--expt-gtp-remat", "0"], "pgregistry layout: error: --expt-gtp-remat must be a positive integer"),
    ([*_LAYOUT, "--order", ""], "pgregistry layout: error: " + _EMPTY.format(option="--order")),
    ([*_PLACED, "--svg", ""], "pgregistry layout: error: " + _EMPTY.format(option="--svg")),
    ([*_PLACED, "--html", " "], "pgregistry layout: error: " + _EMPTY.format(option="--html")),
    ([*_PLACED, "--svg", "OUT", "--highlight", ""], "pgregistry layout: error: " + _EMPTY.format(option="--highlight")),
    ([*_LAYOUT, "--compare", "tp=2", ""], "pgregistry layout: error: " + _EMPTY.format(option="--compare")),
    (["layout", "--num-ranks", "nan"], "pgregistry layout: error: argument --num-ranks: invalid int value: 'nan'"),
    ([*_SEEDS, "--order", ""], "pgregistry seed-plan: error: " + _EMPTY.format(option="--order")),
    ([*_SEEDS, "--cp", "-1"], "pgregistry seed-plan: error: --cp must be a positive integer, got -1"),
    (
        [*_SEEDS, "--time-limit", "nan"],
        "pgregistry seed-plan: error: argument --time-limit: must be a finite number, 0 or more, got nan",
    ),
    ([*_SEEDS, "--time-limit", "-1"], "pgregistry seed-plan: error: argument --time-limit: must be a finite number"),
    ([*_SEEDS, "--progress", "inf"], "pgregistry seed-plan: error: argument --progress: must be a finite number"),
    ([*_SEEDS, "--progress", "soon"], "pgregistry seed-plan: error: argument --progress: not a number: 'soon'"),
    (["verify", "--json", ""], "pgregistry verify: error: " + _EMPTY.format(option="--json")),
    (["verify", "--timeout", "nan"], "pgregistry verify: error: argument --timeout: must be a positive number"),
]


def _exit_code(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as exc:  # argparse's own errors
        return int(exc.code or 0)


@pytest.mark.parametrize(("argv", "message"), CASES, ids=[" ".join(argv[:1] + argv[-2:]) for argv, _ in CASES])
def test_a_bad_option_value_exits_2_naming_the_option(
    argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("RANK", raising=False)
    assert _exit_code(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert message in captured.err, captured.err
    assert list(tmp_path.iterdir()) == []  # nothing drawn, written or half-written


@pytest.mark.parametrize(
    "argv", [["layout", "--num-ranks", "8", "--gpus-per-node", "4", "--svg", ""], ["verify", "--json", ""]]
)
def test_end_to_end_an_empty_value_exits_2(argv: list[str], tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "pgregistry", *argv], cwd=tmp_path, capture_output=True, text=True, timeout=60,
    )
    assert (done.returncode, done.stdout) == (2, ""), done.stderr
    assert done.stderr.startswith(f"pgregistry {argv[0]}: error: --{argv[-2].lstrip('-')} is empty"), done.stderr


ABBREVIATED = [
    # seed-plan has no --rank: argparse read it as --rank-offset, and printed the seeds of a layout moved to ranks 2-9
    ([*_SEEDS, "--rank", "2"], "unrecognized arguments: --rank 2"),
    (["layout", "--num", "8"], "the following arguments are required: --num-ranks"),
    ([*_LAYOUT, "--rank-off", "8", "--world-size", "16"], "unrecognized arguments: --rank-off 8"),
    ([*_SEEDS, "--data-parallel", "--check"], "unrecognized arguments: --data-parallel"),
    (["allowlist", "check", "--allow", "x"], "unrecognized arguments: --allow"),  # x: a PATH
]


@pytest.mark.parametrize(("argv", "message"), ABBREVIATED, ids=[" ".join(argv[-2:]) for argv, _ in ABBREVIATED])
def test_an_abbreviated_option_is_refused_not_read_as_a_longer_one(
    argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """argparse's prefix matching read ``seed-plan --rank 2`` (an option of ``layout``, not of ``seed-plan``) as
    ``--rank-offset 2`` and exited 0 with another layout's plan; any prefix was taken for the option it begins."""
    monkeypatch.chdir(tmp_path)
    assert _exit_code(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert message in captured.err, captured.err


def test_the_standalone_allowlist_command_refuses_an_abbreviated_option(capsys: pytest.CaptureFixture[str]) -> None:
    from pgregistry.allowlist import main as allowlist

    with pytest.raises(SystemExit) as exited:
        allowlist(["check", "--allow", "x"])
    assert exited.value.code == 2
    assert "unrecognized arguments: --allow" in capsys.readouterr().err

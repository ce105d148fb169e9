"""The MoE example (``python -m examples.moe_demo``, what ``make demo`` runs) end to end, and its command line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from examples.moe_demo.job import DemoConfig, build_parser, main, run_demo

# run_demo's world has the deadline of a user's run of any length (300 s, and 30 s to start): this module's tests
# may run that long before pytest-timeout, so that a hung demo fails with run_world's diagnosis.
pytestmark = pytest.mark.timeout(360)


def test_demo_passes_every_check_and_writes_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "demo.json"
    assert run_demo(DemoConfig(steps=2), str(out)) == 0
    printed = capsys.readouterr().out
    payload = json.loads(out.read_text())
    # One float64 check, two per step (norm, parameters), the TP filter, the zero count, two checkpoint checks and
    # two fallback checks: every one there (an empty list would pass any all()), and every one passed.
    checks = payload["checks"]
    assert len(checks) == 1 + 2 * 2 + 1 + 1 + 2 + 2, [check["name"] for check in checks]
    assert [check["name"] for check in checks if not check["passed"]] == []
    assert f"\n{len(checks)} passed, 0 failed\n" in printed
    rank0 = payload["ranks"][0]
    assert len(rank0["steps"]) == 2
    # The second model's grid shares communicators with the first wherever rank sets coincide.
    assert "tp_dp_cp" in rank0["shared_with_second"]
    assert rank0["checkpoint"]["duplicates"] == 0


def test_demo_runs_on_a_chosen_world_and_layouts(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--world-size", "4", "--tp", "2", "--ep", "2", "--second-tp", "1", "--second-ep", "4",
                 "--steps", "1"]) == 0
    assert "4 ranks (gloo), model on TP 2 x EP 2 x ETP 1, second model on TP 1 x EP 4" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--ep", "3"], "does not divide num_ranks"),
        (["--world-size", "6", "--tp", "4"], "is not divisible"),
        (["--world-size", "16", "--ep", "16", "--tp", "1"], "do not split over EP 16"),
        (["--steps", "0"], "--steps must be at least 1"),
    ],
)
def test_demo_refuses_what_it_cannot_run(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_demo_with_dense_tp_1_has_no_dense_tp_filter_undercount(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--world-size", "4", "--tp", "1", "--ep", "4", "--second-tp", "2", "--steps", "1"]) == 0
    assert "with dense TP 1 the dense-TP-only filter agrees" in capsys.readouterr().out


def test_every_option_has_help() -> None:
    actions = [a for a in build_parser()._actions if a.option_strings]
    assert actions and all((a.help or "").strip() for a in actions)


def test_runs_as_a_module_from_the_repository_root() -> None:
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-m", "examples.moe_demo", "--steps", "0"], cwd=root, capture_output=True, text=True,
        timeout=90,
    )
    assert (done.returncode, done.stderr.strip()) == (2, "moe_demo: error: --steps must be at least 1, got 0")


@pytest.mark.parametrize(
    ("where", "message"),
    [("missing/out.json", "directory {tmp}/missing does not exist"), (".", "--json {tmp} is a directory")],
)
def test_an_unwritable_json_path_is_refused_before_the_run(
    tmp_path: Path, where: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The path used to be checked only after the whole run, which then died on the write."""
    path = (tmp_path / where).resolve() if where == "." else tmp_path / where
    assert main(["--steps", "1", "--json", str(path)]) == 2
    captured = capsys.readouterr()
    assert message.format(tmp=tmp_path) in captured.err
    assert captured.out == ""  # nothing ran

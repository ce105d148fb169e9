"""``pgregistry demo`` end to end (a short run) and its command line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pgregistry.cli import main
from pgregistry.demo.job import DemoConfig, run_demo


def test_demo_passes_every_check_and_writes_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "demo.json"
    assert run_demo(DemoConfig(steps=2), str(out)) == 0
    printed = capsys.readouterr().out
    assert "0 failed" in printed
    payload = json.loads(out.read_text())
    assert all(check["passed"] for check in payload["checks"])
    rank0 = payload["ranks"][0]
    assert len(rank0["steps"]) == 2
    # The second model's grid shares communicators with the first wherever rank sets coincide.
    assert "tp_dp_cp" in rank0["shared_with_second"]
    assert rank0["checkpoint"]["duplicates"] == 0


def test_demo_rejects_a_bad_step_count(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--steps", "0"]) == 2
    assert "--steps" in capsys.readouterr().err

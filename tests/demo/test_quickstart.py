"""The README's example (examples/quickstart.py) runs on eight ranks and agrees on one global norm."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

from pgregistry.testing import run_world

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "quickstart.py"


def _train_step() -> tuple[float, float]:
    spec = importlib.util.spec_from_file_location("quickstart", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    loss, norm = module.train_step()
    return loss, norm


def test_quickstart_runs_on_eight_ranks() -> None:
    norms = [norm for _, norm in run_world(8, _train_step)]
    assert all(math.isfinite(n) and n > 0 for n in norms)
    assert max(norms) == min(norms)  # one global norm, the same on every rank

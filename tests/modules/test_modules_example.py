"""The MIMO-style example (``python -m examples.mimo_modules [--colocated]``) end to end in 8-rank gloo worlds.

Each rank's job-wide norm at every step must match the float64 oracle of both modules' full grads, each module's
checkpoint must reload into fresh models and a fresh optimizer that take the same next step, and no two modules may
share an RNG seed: the example's own checks, asserted present before they are asserted to pass.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from examples.mimo_modules import STEPS, failures, run
from pgregistry.testing import run_world


@pytest.mark.parametrize("colocated", [False, True])
def test_the_example_trains_checkpoints_and_matches_the_float64_oracle(colocated: bool, tmp_path: Path) -> None:
    results = run_world(8, run, colocated, tmp_path, timeout=60)
    here = [tuple(got["here"]) for got in results]
    if colocated:
        assert here == [("encoder", "language")] * 8
    else:
        assert here == [("encoder",)] * 4 + [("language",)] * 4
    for got in results:
        assert len(got["norms"]) == len(got["oracle"]) == STEPS
        assert got["loaded_same"] is not None and len(got["next_norms"]) == 2
    assert failures(results) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["encoder", "language"]


def test_the_checks_can_fail() -> None:
    """A norm off the oracle, a reload that differs and a shared seed are each reported."""
    good = {"rank": 0, "here": ["encoder"], "norms": [1.0], "oracle": [1.0], "loaded_same": True,
            "next_same": True, "next_norms": [2.0, 2.0], "seeds": {"encoder": 5}}
    assert failures([good]) == []
    bad = {**good, "norms": [1.001], "loaded_same": False, "seeds": {"encoder": 5, "language": 5}}
    problems = failures([bad])
    assert len(problems) == 4, problems


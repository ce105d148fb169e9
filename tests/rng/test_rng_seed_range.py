"""`seed-plan --check` flags exactly the seeds `model_parallel_manual_seed` refuses (outside [0, 2**64)).

It used to report "no seed collisions" for a job seed whose Megatron-Core offsets carry some tracker seeds past
2**64, a plan every rank then fails on at start-up. The oracle is the real call on each rank of a 4-rank world.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from rng_support import oracle_seeds

from pgregistry import registry
from pgregistry.cli import main
from pgregistry.layout import ParallelLayout
from pgregistry.rng import RNGStatesTracker, check_seed_plan, model_parallel_manual_seed
from pgregistry.testing import run_world

_LAYOUT = ParallelLayout(num_ranks=4, tp=2, pp=2)
# The largest seed of this layout is rank 3's model-parallel one, seed + 100 * pp_rank + 2718 + tp_rank
# = seed + 2819: exactly 2**64 here, one past the range; every other seed of the plan is in range.
_SEED = 2**64 - 2819


def _seed_on_rank(seed: int) -> str:
    """The real seeding on this rank: "ok", or the error it raises."""
    pgc = registry.build(_LAYOUT, name="seeds")
    try:
        model_parallel_manual_seed(seed, pgc, tracker=RNGStatesTracker())
    except ValueError as exc:
        return str(exc)
    return "ok"


def test_check_flags_exactly_the_ranks_whose_seeding_fails() -> None:
    outcomes = run_world(4, _seed_on_rank, _SEED)
    assert outcomes[:3] == ["ok", "ok", "ok"]
    assert "must be an integer in [0, 2**64), got 18446744073709551616" in outcomes[3]
    flagged = [c for c in check_seed_plan(_LAYOUT, _SEED) if c.kind == "out_of_range"]
    assert [(c.trackers, c.ranks, c.seed) for c in flagged] == [(("model-parallel-rng",), (3,), 2**64)]
    # The oracle's plan agrees: rank 3's model-parallel seed is the only one at or past 2**64.
    out_of_range = {
        (rank, name) for rank in range(4) for name, s in oracle_seeds(_LAYOUT, rank, _SEED).items() if s >= 2**64
    }
    assert out_of_range == {(3, "model-parallel-rng")}
    assert [c for c in check_seed_plan(_LAYOUT, _SEED - 1) if c.kind == "out_of_range"] == []


def test_a_pipeline_offset_past_the_range_is_flagged_not_raised() -> None:
    """A job seed in range whose pipeline offset carries a rank's base seed past 2**64: flagged on those ranks."""
    flagged = {c.trackers[0]: c.ranks for c in check_seed_plan(_LAYOUT, 2**64 - 50) if c.kind == "out_of_range"}
    assert flagged["data-parallel-rng"] == (2, 3)  # pp rank 1: 2**64 - 50 + 100
    assert flagged["model-parallel-rng"] == (0, 1, 2, 3)


def test_cli_check_exits_1_naming_the_rank_and_tracker() -> None:
    argv = ["seed-plan", "--num-ranks", "4", "--tp", "2", "--pp", "2", "--seed", str(_SEED), "--check"]
    done = subprocess.run([sys.executable, "-m", "pgregistry", *argv], capture_output=True, text=True, timeout=90)
    assert done.returncode == 1, done.stdout + done.stderr
    assert done.stdout.splitlines() == [
        "seed 18446744073709551616 of tracker model-parallel-rng on rank 3 is outside [0, 2**64), which "
        "model_parallel_manual_seed refuses: use a smaller seed"
    ]



def test_cli_without_check_refuses_a_plan_with_seeds_out_of_range_before_printing(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Without --check, the same plan was printed as a table (or JSON), exit 0, with 18446744073709551616 in it: a
    # seed every rank 3 then fails on at start-up. It is now refused, exit 2, with --check's message and no plan.
    base = ["seed-plan", "--num-ranks", "4", "--tp", "2", "--pp", "2"]
    for extra in ([], ["--json"]):
        assert main([*base, "--seed", str(_SEED), *extra]) == 2
        out, err = capsys.readouterr()
        assert out == ""
        assert err.splitlines() == [
            "pgregistry seed-plan: error: seed 18446744073709551616 of tracker model-parallel-rng on rank 3 is "
            "outside [0, 2**64), which model_parallel_manual_seed refuses: use a smaller seed"
        ]
    assert main([*base, "--seed", str(_SEED - 1)]) == 0
    assert "18446744073709551615" in capsys.readouterr().out

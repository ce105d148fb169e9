"""Seed formulas, whole-layout seed plans and their collision check, and the ``seed-plan`` command.

Oracles: Megatron-Core's formulas (``model_parallel_cuda_manual_seed``) written out in ``rng_support.oracle_seeds``,
with coordinates from ``ParallelLayout.coords``, and a brute-force pairwise scan for collisions.
"""

from __future__ import annotations

import argparse
import itertools
import json
import subprocess
import sys
from typing import Any

import pytest
from rng_support import oracle_seeds

from pgregistry import cli
from pgregistry.cli import _seed_plan as seed_plan_command
from pgregistry.layout import ParallelLayout
from pgregistry.rng import (
    DATA_PARALLEL_RNG,
    EGTP_REMAT_RNG,
    EXPERT_PARALLEL_RNG,
    GTP_REMAT_RNG,
    MODEL_PARALLEL_RNG,
    RNGStatesTracker,
    SeedCollision,
    check_seed_plan,
    seed_plan,
    tracker_seeds,
)

LAYOUTS = [
    ParallelLayout(num_ranks=8, tp=2, ep=2),
    ParallelLayout(num_ranks=8, tp=2, pp=2, ep=2, expt_tp=1),
    ParallelLayout(num_ranks=16, tp=2, cp=2, pp=2, ep=4, expt_tp=1),
    ParallelLayout(num_ranks=16, tp=2, gtp_remat=2, ep=2, expt_gtp_remat=2, expt_tp=2),
    ParallelLayout(num_ranks=12, tp=3, pp=2, ep=2, expt_tp=1, order="tp-cp-ep-dp-pp"),
    ParallelLayout(num_ranks=126, tp=7, ep=18, expt_tp=1),
]


def test_megatron_example_seeds() -> None:
    seeds = tracker_seeds(1234, tp_rank=1, ep_rank=2, expt_tp_rank=0)
    assert seeds == {DATA_PARALLEL_RNG: 1234, MODEL_PARALLEL_RNG: 3953, EXPERT_PARALLEL_RNG: 2458}


def test_gtp_trackers_only_when_their_axis_has_more_than_one_rank() -> None:
    assert set(tracker_seeds(1, gtp_remat_rank=0, gtp_remat_size=1)) == {
        DATA_PARALLEL_RNG, MODEL_PARALLEL_RNG, EXPERT_PARALLEL_RNG,
    }
    seeds = tracker_seeds(1, tp_rank=1, gtp_remat_rank=1, gtp_remat_size=2, expt_gtp_remat_rank=2,
                          expt_gtp_remat_size=3, ep_rank=1)
    assert seeds[GTP_REMAT_RNG] == 1 + 2718 + 1 + 65536 * 2
    assert seeds[EGTP_REMAT_RNG] == 1 + 1024 + 100 + 32768 + 65536 * 3


@pytest.mark.parametrize("layout", LAYOUTS, ids=repr)
@pytest.mark.parametrize("dp_init", [False, True])
def test_seed_plan_matches_the_formulas(layout: ParallelLayout, dp_init: bool) -> None:
    plan = seed_plan(layout, 1234, data_parallel_random_init=dp_init)
    assert list(plan) == list(range(layout.num_ranks))
    for rank, seeds in plan.items():
        assert seeds == oracle_seeds(layout, rank, 1234, dp_init)


_MUST_DIFFER = {
    DATA_PARALLEL_RNG: ("pp",),
    MODEL_PARALLEL_RNG: ("pp", "tp"),
    EXPERT_PARALLEL_RNG: ("pp", "ep", "expt_tp"),
    GTP_REMAT_RNG: ("pp", "tp", "gtp_remat"),
    EGTP_REMAT_RNG: ("pp", "ep", "expt_tp", "expt_gtp_remat"),
}


def _brute_force(layout: ParallelLayout, seed: int, dp_init: bool) -> tuple[set[Any], set[Any]]:
    """(tracker, seed) pairs shared by two ranks that must differ; (trackers, seed, rank) shared on one rank."""
    seeds = {r: oracle_seeds(layout, r, seed, dp_init) for r in range(layout.num_ranks)}
    coords = {r: layout.coords(r) for r in range(layout.num_ranks)}
    across = set()
    for a, b in itertools.combinations(range(layout.num_ranks), 2):
        for tracker, axes in _MUST_DIFFER.items():
            axes = axes + (("dp",) if dp_init else ())
            if tracker not in seeds[a]:
                continue
            differ = any(coords[a][x] != coords[b][x] for x in axes)
            if differ and seeds[a][tracker] == seeds[b][tracker]:
                across.add((tracker, seeds[a][tracker]))
    within = set()
    for r, per_rank in seeds.items():
        for (t1, s1), (t2, s2) in itertools.combinations(per_rank.items(), 2):
            if s1 == s2:
                within.add(((t1, t2), s1, r))
    return across, within


@pytest.mark.parametrize("layout", LAYOUTS[:5], ids=repr)
@pytest.mark.parametrize("dp_init", [False, True])
def test_check_seed_plan_agrees_with_a_brute_force_scan(layout: ParallelLayout, dp_init: bool) -> None:
    collisions = check_seed_plan(layout, 1234, data_parallel_random_init=dp_init)
    across, within = _brute_force(layout, 1234, dp_init)
    assert {(c.trackers[0], c.seed) for c in collisions if c.kind == "across_ranks"} == across
    assert {(c.trackers, c.seed, r) for c in collisions if c.kind == "within_rank" for r in c.ranks} == within
    plan = seed_plan(layout, 1234, data_parallel_random_init=dp_init)
    for c in collisions:
        if c.kind == "across_ranks":
            assert len(c.ranks) == len(set(c.coords)) >= 2
            assert all(plan[r][c.trackers[0]] == c.seed for r in c.ranks)
            for rank, key in zip(c.ranks, c.coords, strict=True):
                assert tuple(layout.coords(rank)[a] for a in c.axes) == key


def test_pipeline_and_expert_offsets_collide_across_ranks() -> None:
    # 100 * pp_rank (caller) + 100 * ep_rank (expert formula): stage 1's expert 0 draws as stage 0's expert 1.
    layout = ParallelLayout(num_ranks=8, tp=2, pp=2, ep=2, expt_tp=1)
    collisions = [c for c in check_seed_plan(layout, 1234) if c.kind == "across_ranks"]
    assert collisions
    for c in collisions:
        assert c.trackers == (EXPERT_PARALLEL_RNG,)
        pp_ep = {(layout.coords(r)["pp"], layout.coords(r)["ep"]) for r in c.ranks}
        assert pp_ep == {(0, 1), (1, 0)}


def test_model_and_expert_seeds_collide_on_one_rank_with_megatron_offsets() -> None:
    # Megatron-Core's offsets: 100 * ep + expt_tp == 1694 + tp at tp=6, ep=17 (expt_tp=0). tp=7, ep=18 (expt_tp 1)
    # contains that rank.
    layout = ParallelLayout(num_ranks=126, tp=7, ep=18, expt_tp=1)
    expected = {
        r for r in range(layout.num_ranks)
        if 1024 + 100 * layout.coords(r)["ep"] + layout.coords(r)["expt_tp"] == 2718 + layout.coords(r)["tp"]
    }
    assert expected and all((layout.coords(r)["tp"], layout.coords(r)["ep"]) == (6, 17) for r in expected)
    collisions = check_seed_plan(layout, 1234)
    assert collisions == [
        SeedCollision(
            kind="within_rank",
            seed=1234 + 2718 + 6,
            trackers=(MODEL_PARALLEL_RNG, EXPERT_PARALLEL_RNG),
            ranks=tuple(sorted(expected)),
        )
    ]
    assert "on rank" in collisions[0].describe()
    # ... which the tracker refuses when that rank seeds itself.
    rank = min(expected)
    tracker = RNGStatesTracker()
    with pytest.raises(ValueError, match="already used by RNG tracker 'model-parallel-rng'"):
        for name, seed in seed_plan(layout, 1234)[rank].items():
            tracker.add(name, seed)


def test_collision_records_are_json_ready() -> None:
    layout = ParallelLayout(num_ranks=8, tp=2, pp=2, ep=2, expt_tp=1)
    for c in check_seed_plan(layout, 1):
        record = json.loads(json.dumps(c.to_dict()))
        assert record["kind"] == c.kind and record["ranks"] == list(c.ranks)
        assert "must differ" in c.describe()


# --------------------------------------------------------------------------------------------------- CLI


def _run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    parser = argparse.ArgumentParser()
    seed_plan_command.add_command(parser.add_subparsers())
    args = parser.parse_args(argv)
    code = args.handler(args)
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_is_registered() -> None:
    assert "pgregistry.cli._seed_plan" in cli._COMMAND_MODULES


def test_cli_prints_a_table(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run_cli(["seed-plan", "--num-ranks", "4", "--tp", "2", "--ep", "2", "--seed", "1234"], capsys)
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split()[-3:] == [DATA_PARALLEL_RNG, MODEL_PARALLEL_RNG, EXPERT_PARALLEL_RNG]
    layout = ParallelLayout(num_ranks=4, tp=2, ep=2)
    for rank, line in enumerate(lines[1:]):
        oracle = oracle_seeds(layout, rank, 1234, False)
        assert [int(x) for x in line.split()[-3:]] == list(oracle.values())


def test_cli_json_plan(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["seed-plan", "--num-ranks", "8", "--tp", "2", "--pp", "2", "--seed", "7", "--json",
            "--data-parallel-random-init"]
    code, out, _ = _run_cli(argv, capsys)
    layout = ParallelLayout(num_ranks=8, tp=2, pp=2)
    assert code == 0
    assert json.loads(out) == {str(r): oracle_seeds(layout, r, 7, True) for r in range(8)}


def test_cli_check_finds_the_reference_collision(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["seed-plan", "--num-ranks", "126", "--tp", "7", "--ep", "18", "--expt-tp", "1", "--seed", "0", "--check"]
    code, out, _ = _run_cli(argv, capsys)
    assert code == 1
    assert "model-parallel-rng, expert-parallel-rng" in out
    code, out, _ = _run_cli([*argv, "--json"], capsys)
    assert code == 1
    assert [c["seed"] for c in json.loads(out)["collisions"]] == [2724]


def test_cli_check_passes_a_clean_layout(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run_cli(["seed-plan", "--num-ranks", "8", "--tp", "2", "--ep", "4", "--seed", "1", "--check"],
                            capsys)
    assert (code, out.strip()) == (0, "no seed collisions in 8 ranks")


@pytest.mark.parametrize("argv", [["--num-ranks", "6", "--tp", "4"], ["--num-ranks", "8", "--ep", "3"],
                                  ["--num-ranks", "0"], ["--num-ranks", "4", "--order", "tp-xx"]])
def test_cli_bad_sizes_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run_cli(["seed-plan", *argv, "--seed", "1"], capsys)
    assert code == 2 and out == "" and err.startswith("pgregistry seed-plan: error:")


def test_cli_module_does_not_import_torch() -> None:
    code = "import sys, argparse, pgregistry.cli._seed_plan as m; "
    code += "m.add_command(argparse.ArgumentParser().add_subparsers()); assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_console_command_end_to_end() -> None:
    argv = ["seed-plan", "--num-ranks", "72", "--tp", "8", "--ep", "18", "--expt-tp", "2", "--seed", "1234", "--check"]
    done = subprocess.run([sys.executable, "-m", "pgregistry", *argv], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1, done.stderr
    # tp=6/expt_tp=0 and tp=7/expt_tp=1 at ep=17: ranks 70 and 71 of this layout.
    assert done.stdout.splitlines() == [
        "seed 3958 is used by trackers model-parallel-rng, expert-parallel-rng on rank 70",
        "seed 3959 is used by trackers model-parallel-rng, expert-parallel-rng on rank 71",
    ]
    layout = ParallelLayout(num_ranks=72, tp=8, ep=18, expt_tp=2)
    assert [(layout.coords(r)["tp"], layout.coords(r)["ep"], layout.coords(r)["expt_tp"]) for r in (70, 71)] == [
        (6, 17, 0), (7, 17, 1),
    ]

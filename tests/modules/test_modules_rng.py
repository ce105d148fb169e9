"""Per-module RNG streams in 8-rank jobs: distinct per module (colocated modules too), Megatron's rules inside each
module, the same on every run.

Each rank seeds the modules it runs from one job seed and draws from every stream of every module's tracker. With
the job's seed given to every module as it is, the encoder on ranks 0-3 and the language model's first stage on
ranks 4-5 would draw the same numbers (both pipeline rank 0, TP rank 0), as would two colocated modules.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from modules_support import JOBS

from pgregistry import modules as mm
from pgregistry.modules._rng import module_seed
from pgregistry.rng import DATA_PARALLEL_RNG, MODEL_PARALLEL_RNG, seed_plan
from pgregistry.testing import run_world

SEED = 1234


def _draws(job: str) -> dict[str, Any]:
    modules = mm.build_modules(JOBS[job])
    trackers = mm.seed_modules(SEED, modules)
    default = torch.rand(3).tolist()  # outside any fork: the first module's data-parallel stream
    out: dict[str, Any] = {"default": default, "modules": {}}
    for name, tracker in trackers.items():
        draws = {}
        for stream in tracker.names():
            with tracker.fork(stream):
                draws[stream] = torch.rand(3).tolist()
        out["modules"][name] = {"seeds": tracker.seeds(), "draws": draws}
    out["after"] = torch.rand(3).tolist()  # the forks left the default stream where it was
    generator = torch.Generator().manual_seed(next(iter(trackers.values())).seeds()[DATA_PARALLEL_RNG])
    out["expected_default"] = torch.rand(6, generator=generator).tolist()
    out["rank"] = dist.get_rank()
    return out


@pytest.mark.parametrize("job", ["disjoint", "colocated"])
def test_module_streams_are_distinct_follow_megatron_inside_and_reproduce(job: str) -> None:
    first = run_world(8, _draws, job, timeout=60)
    again = run_world(8, _draws, job, timeout=60)
    assert first == again  # reproducible: the same seeds and draws on every run
    plans = {name: seed_plan(layout, module_seed(SEED, name)) for name, layout in JOBS[job].items()}
    seen: dict[tuple[float, ...], tuple[str, str, int]] = {}
    for got in first:
        rank = got["rank"]
        assert got["default"] + got["after"] == got["expected_default"], rank
        for name, module in got["modules"].items():
            # The module's seeds are its layout's plan from its own seed (Megatron's offsets inside the module).
            assert module["seeds"] == plans[name][rank], (rank, name)
            for stream, draw in module["draws"].items():
                key = tuple(draw)
                owner = seen.setdefault(key, (name, stream, rank))
                assert owner[0] == name, f"rank {rank} {name} {stream} draws what {owner} draws"
    # Inside a module Megatron's rules hold: TP ranks differ on the model-parallel stream, DP replicas agree.
    language = {got["rank"]: got["modules"]["language"]["draws"] for got in first if "language" in got["modules"]}
    ranks = sorted(language)
    assert language[ranks[0]][MODEL_PARALLEL_RNG] != language[ranks[1]][MODEL_PARALLEL_RNG]  # TP 0 and 1
    assert language[ranks[0]][DATA_PARALLEL_RNG] == language[ranks[1]][DATA_PARALLEL_RNG]
    encoder = [got["modules"]["encoder"]["draws"] for got in first if "encoder" in got["modules"]]
    assert all(draws == encoder[0] for draws in encoder)  # the encoder is data-parallel only


def test_module_seeds_are_stable_and_distinct() -> None:
    assert module_seed(SEED, "encoder") == module_seed(SEED, "encoder") < 2**48
    assert len({module_seed(SEED, name) for name in ("encoder", "language", "audio", "vision")}) == 4
    assert module_seed(SEED, "encoder") != module_seed(SEED + 1, "encoder")
    with pytest.raises(ValueError, match=r"the job's seed must be an integer in \[0, 2\*\*64\), got -1"):
        module_seed(-1, "encoder")

"""model_parallel_manual_seed in real gloo worlds: streams per TP / EP / ETP / GTP rank, fallbacks, fork restore.

Oracle: every stream must equal a fresh ``torch.Generator`` seeded with Megatron-Core's formula evaluated on the
rank's coordinates from ``ParallelLayout.coords`` (written out in ``rng_support``).
"""

from __future__ import annotations

import itertools
import warnings
from typing import Any

import pytest
import torch
from rng_support import oracle_seeds

from pgregistry import ProcessGroupCollection, ProcessGroupFallbackWarning
from pgregistry.global_grid import initialize_global_grid
from pgregistry.layout import ParallelLayout
from pgregistry.registry import build
from pgregistry.rng import (
    DATA_PARALLEL_RNG,
    EGTP_REMAT_RNG,
    EXPERT_PARALLEL_RNG,
    GTP_REMAT_RNG,
    MODEL_PARALLEL_RNG,
    RNGStatesTracker,
    model_parallel_manual_seed,
)
from pgregistry.testing import run_world

N = 16


def _expected(seed: int) -> torch.Tensor:
    generator = torch.Generator()
    generator.manual_seed(seed)
    return torch.rand(N, generator=generator)


def _seed_and_draw(layout: ParallelLayout, seed: int, dp_init: bool) -> dict[str, Any]:
    pgc = build(layout)
    tracker = RNGStatesTracker()
    with warnings.catch_warnings():
        warnings.simplefilter("error", ProcessGroupFallbackWarning)  # a complete collection never falls back
        seeds = model_parallel_manual_seed(seed, pgc, data_parallel_random_init=dp_init, tracker=tracker)
    draws = {DATA_PARALLEL_RNG + " (default)": torch.rand(N)}
    restored = True
    for name in tracker.names():
        before = torch.get_rng_state()
        with tracker.fork(name):
            draws[name] = torch.rand(N)
        restored &= torch.equal(torch.get_rng_state(), before)
    return {"seeds": seeds, "tracker_seeds": tracker.seeds(), "draws": draws, "restored": restored}


@pytest.mark.parametrize(
    "layout",
    [
        ParallelLayout(num_ranks=8, tp=2, ep=4, expt_tp=1),
        ParallelLayout(num_ranks=8, tp=2, pp=2, ep=2, expt_tp=2),
    ],
    ids=repr,
)
@pytest.mark.parametrize("dp_init", [False, True])
def test_streams_follow_tp_ep_etp_ranks(layout: ParallelLayout, dp_init: bool) -> None:
    results = run_world(layout.num_ranks, _seed_and_draw, layout, 1234, dp_init)
    for rank, result in enumerate(results):
        oracle = oracle_seeds(layout, rank, 1234, dp_init)
        assert result["seeds"] == oracle == result["tracker_seeds"]
        assert result["restored"]
        assert torch.equal(result["draws"][DATA_PARALLEL_RNG + " (default)"], _expected(oracle[DATA_PARALLEL_RNG]))
        for name, seed in oracle.items():
            assert torch.equal(result["draws"][name], _expected(seed)), (rank, name)

    def draws(rank: int, name: str) -> torch.Tensor:
        return results[rank]["draws"][name]

    for group in layout.groups("tp"):
        for a, b in itertools.combinations(group, 2):
            # One TP group: the same data-parallel stream, different model-parallel streams.
            assert torch.equal(draws(a, DATA_PARALLEL_RNG), draws(b, DATA_PARALLEL_RNG))
            assert not torch.equal(draws(a, MODEL_PARALLEL_RNG), draws(b, MODEL_PARALLEL_RNG))
    for a, b in itertools.combinations(range(layout.num_ranks), 2):
        ca, cb = layout.coords(a), layout.coords(b)
        if ca["pp"] != cb["pp"]:
            # Pipeline stages draw differently, as in Megatron-Core's training (the seed plus 100 per stage), and the
            # seed plan calls that right (test_rng_seeds has where the offsets collide).
            assert not torch.equal(draws(a, MODEL_PARALLEL_RNG), draws(b, MODEL_PARALLEL_RNG)), (a, b)
            continue
        same_expert_shard = (ca["ep"], ca["expt_tp"]) == (cb["ep"], cb["expt_tp"]) and (
            not dp_init or ca["dp"] == cb["dp"]
        )
        assert torch.equal(draws(a, EXPERT_PARALLEL_RNG), draws(b, EXPERT_PARALLEL_RNG)) == same_expert_shard
        same_tp_shard = ca["tp"] == cb["tp"] and (not dp_init or ca["dp"] == cb["dp"])
        assert torch.equal(draws(a, MODEL_PARALLEL_RNG), draws(b, MODEL_PARALLEL_RNG)) == same_tp_shard


def test_gtp_remat_streams_in_a_world() -> None:
    layout = ParallelLayout(num_ranks=8, tp=2, gtp_remat=2, ep=2, expt_tp=1, expt_gtp_remat=2)
    results = run_world(layout.num_ranks, _seed_and_draw, layout, 99, False)
    for rank, result in enumerate(results):
        oracle = oracle_seeds(layout, rank, 99)
        assert set(oracle) >= {GTP_REMAT_RNG, EGTP_REMAT_RNG}
        assert result["seeds"] == oracle
        for name, seed in oracle.items():
            assert torch.equal(result["draws"][name], _expected(seed))
    for group in layout.groups("gtp_remat"):
        gtp_draws = [results[r]["draws"][GTP_REMAT_RNG] for r in group]
        assert not torch.equal(gtp_draws[0], gtp_draws[1])


def _fallbacks() -> dict[str, Any]:
    layout = ParallelLayout(num_ranks=4, tp=2, ep=2, expt_tp=1)
    grid = initialize_global_grid(layout)
    out: dict[str, Any] = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out["no_collection"] = model_parallel_manual_seed(7, tracker=RNGStatesTracker())
    out["no_collection_warned"] = [
        str(w.message) for w in caught if issubclass(w.category, ProcessGroupFallbackWarning)
    ]
    out["explicit"] = model_parallel_manual_seed(7, grid, tracker=RNGStatesTracker())
    partial = ProcessGroupCollection(ep=grid.ep, expt_tp=grid.expt_tp)  # tp, pp and the GTP axes left UNSET
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out["partial"] = model_parallel_manual_seed(7, partial, tracker=RNGStatesTracker())
    out["partial_warned"] = sorted(
        str(w.message).split("'")[1] for w in caught if issubclass(w.category, ProcessGroupFallbackWarning)
    )
    # The seed-003 bug class: the global grid has TP 2, the model's own collection turns TP off.
    off = ProcessGroupCollection(
        tp=None, pp=None, ep=grid.ep, expt_tp=grid.expt_tp, gtp_remat=None, expt_gtp_remat=None
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error", ProcessGroupFallbackWarning)
        out["tp_off"] = model_parallel_manual_seed(7, off, tracker=RNGStatesTracker())
    with warnings.catch_warnings():
        warnings.simplefilter("error", ProcessGroupFallbackWarning)
        try:
            model_parallel_manual_seed(7, tracker=RNGStatesTracker())
            out["error_filter_raised"] = False
        except ProcessGroupFallbackWarning:
            out["error_filter_raised"] = True
    return out


def test_fallback_to_the_global_grid_warns_and_none_means_off() -> None:
    layout = ParallelLayout(num_ranks=4, tp=2, ep=2, expt_tp=1)
    for rank, out in enumerate(run_world(4, _fallbacks)):
        oracle = oracle_seeds(layout, rank, 7)
        assert out["no_collection"] == out["explicit"] == out["partial"] == oracle
        # No collection at all: one warning, for the whole collection (the door).
        [warned] = out["no_collection_warned"]
        assert warned.startswith("model_parallel_manual_seed was not given a ProcessGroupCollection")
        # Every omitted field warns, the one-rank GTP axes of this grid too: a fallback is a fallback.
        assert out["partial_warned"] == ["expt_gtp_remat", "gtp_remat", "pp", "tp"]
        assert out["tp_off"][MODEL_PARALLEL_RNG] == 7 + 2718  # rank 0 of an axis that is off
        assert out["error_filter_raised"]


def test_without_any_grid_a_missing_collection_is_an_error() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ProcessGroupFallbackWarning)
        missing = "model_parallel_manual_seed was not given a ProcessGroupCollection .*no global grid"
        with pytest.raises(RuntimeError, match=missing):
            model_parallel_manual_seed(1, tracker=RNGStatesTracker([torch.Generator()]))
    off = ProcessGroupCollection(tp=None, ep=None, expt_tp=None, gtp_remat=None, expt_gtp_remat=None, pp=None)
    tracker = RNGStatesTracker([torch.Generator()])
    assert model_parallel_manual_seed(5, off, tracker=tracker) == {
        DATA_PARALLEL_RNG: 5, MODEL_PARALLEL_RNG: 5 + 2718, EXPERT_PARALLEL_RNG: 5 + 1024,
    }

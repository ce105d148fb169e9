"""The RNG seeding refuses a flag, rank or state it cannot use, naming it, instead of seeding other streams.

Found by the third hostile-input round: ``data_parallel_random_init="no"`` (or ``"False"``, ``1``) was read as true,
so ``seed_plan`` listed seeds with the data-parallel offsets and ``model_parallel_manual_seed`` seeded each
data-parallel replica differently (replicas initialised apart); ``tracker_seeds(seed, tp_rank=-1)`` (torch's rank of
a process outside a group) answered rank 0's model-parallel seed minus one; NumPy integers were refused as "must be
an integer"; a saved state of another generator's size was taken and failed at the stream's first fork in torch's
words. The oracles are Megatron-Core's formulas written out here.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from pgregistry.collection import FIELD_NAMES, ProcessGroupCollection
from pgregistry.layout import ParallelLayout
from pgregistry.modules._rng import module_seed
from pgregistry.rng import (
    RNGStatesTracker,
    check_seed_plan,
    check_seed_plan_size,
    model_parallel_manual_seed,
    seed_plan,
    tracker_seeds,
)

SEED = 1234
TWO_REPLICAS = ParallelLayout(num_ranks=2)  # data-parallel ranks 0 and 1 of one stage
NOT_FLAGS: list[Any] = ["no", "False", 1, None]


def _one_rank_collection() -> ProcessGroupCollection:
    return ProcessGroupCollection(**dict.fromkeys(FIELD_NAMES))


def _seed_with(flag: Any) -> object:
    return model_parallel_manual_seed(SEED, _one_rank_collection(), data_parallel_random_init=flag,
                                      tracker=RNGStatesTracker([torch.Generator()]))


@pytest.mark.parametrize("flag", NOT_FLAGS, ids=repr)
@pytest.mark.parametrize("call", [
    lambda flag: seed_plan(TWO_REPLICAS, SEED, data_parallel_random_init=flag),
    lambda flag: check_seed_plan(TWO_REPLICAS, SEED, data_parallel_random_init=flag),
    lambda flag: check_seed_plan_size(TWO_REPLICAS, SEED, data_parallel_random_init=flag),
    _seed_with,
], ids=["seed_plan", "check_seed_plan", "check_seed_plan_size", "model_parallel_manual_seed"])
def test_a_data_parallel_random_init_that_is_no_bool_is_refused_not_read_as_true(call: Any, flag: Any) -> None:
    with pytest.raises(TypeError, match=f"data_parallel_random_init must be True or False, got {flag!r}"):
        call(flag)
    # Both replicas draw the job's seed on the data-parallel stream unless asked otherwise (Megatron: seed + 10 *
    # dp_rank only with data_parallel_random_init).
    assert [seeds["data-parallel-rng"] for seeds in seed_plan(TWO_REPLICAS, SEED).values()] == [SEED, SEED]


@pytest.mark.parametrize(("ranks", "message"), [
    ({"tp_rank": -1}, "tp_rank must be a non-negative integer, got -1"),
    ({"ep_rank": 1.5}, "ep_rank must be a non-negative integer, got 1.5"),
    ({"expt_tp_rank": True}, "expt_tp_rank must be a non-negative integer, got True"),
    ({"gtp_remat_rank": 2, "gtp_remat_size": 2}, "gtp_remat_rank 2 is not a rank of a group of size 2"),
    ({"expt_gtp_remat_size": "2"}, "expt_gtp_remat_size must be a positive integer, got '2'"),
    ({"gtp_remat_size": 0}, "gtp_remat_size must be a positive integer, got 0"),
], ids=["tp_rank=-1", "ep_rank=1.5", "expt_tp_rank=True", "gtp_remat_rank=2", "expt_gtp_remat_size='2'",
        "gtp_remat_size=0"])
def test_tracker_seeds_refuses_a_rank_or_size_that_is_none(ranks: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        tracker_seeds(SEED, **ranks)


def test_numpy_integers_are_taken_as_their_values() -> None:
    oracle = {"data-parallel-rng": SEED, "model-parallel-rng": SEED + 2718 + 1,
              "expert-parallel-rng": SEED + 1024 + 100 * 1 + 0}
    assert tracker_seeds(np.int64(SEED), tp_rank=np.int64(1), ep_rank=np.int32(1)) == oracle
    assert seed_plan(TWO_REPLICAS, np.int64(SEED)) == seed_plan(TWO_REPLICAS, SEED)
    assert module_seed(np.int64(5), "encoder") == module_seed(5, "encoder")
    numpy_seeded, int_seeded = RNGStatesTracker([torch.Generator()]), RNGStatesTracker([torch.Generator()])
    numpy_seeded.add("stream", np.int64(7))
    int_seeded.add("stream", 7)
    with numpy_seeded.fork("stream"):
        drawn = torch.rand(3, generator=numpy_seeded.generators[0])
    with int_seeded.fork("stream"):
        assert torch.equal(drawn, torch.rand(3, generator=int_seeded.generators[0]))
    assert numpy_seeded.seeds() == {"stream": 7} and type(numpy_seeded.seeds()["stream"]) is int


@pytest.mark.parametrize("state", [torch.zeros(3, dtype=torch.uint8), torch.zeros(5056)], ids=["size", "dtype"])
def test_a_state_of_another_generator_is_refused_naming_the_stream(state: torch.Tensor) -> None:
    tracker = RNGStatesTracker([torch.Generator()])
    tracker.add("kept", 11)
    before = tracker.get_states()
    with pytest.raises(ValueError, match=r"state of RNG tracker 'loaded' for generator 0 \(cpu\) is a .* but that "
                                         r"generator's state is torch.uint8 of shape \(5056,\)"):
        tracker.set_states({"kept": before["kept"], "loaded": (state,)})
    assert tracker.names() == ("kept",)
    assert torch.equal(tracker.get_states()["kept"][0], before["kept"][0])

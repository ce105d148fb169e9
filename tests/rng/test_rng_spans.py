"""The seed plan of a layout over a span of the world is what its members' trackers get in a real gloo world.

Two spans of an 8-rank world are built with ``pgregistry.build``; on every member, ``model_parallel_manual_seed`` reads
its ranks from the span's real groups. The oracle is Megatron-Core's formula (``rng_support``) on the coordinates of
the same sizes laid out from rank 0, at ``rank - rank_offset``: a span is that world shifted. ``seed_plan`` of the
span must list exactly those seeds under the global ranks, and a rank outside the span must be refused.
"""

from __future__ import annotations

from typing import Any

import pytest
from rng_support import oracle_seeds

from pgregistry.layout import ParallelLayout
from pgregistry.registry import build
from pgregistry.rng import RNGStatesTracker, model_parallel_manual_seed, seed_plan
from pgregistry.testing import run_world

WORLD = 8
SEED = 1234
SPANS = {
    "upper": ParallelLayout(num_ranks=4, tp=2, pp=2, rank_offset=4),
    "middle": ParallelLayout(num_ranks=6, tp=2, ep=3, expt_tp=1, gtp_remat=1, rank_offset=2),
    "gtp": ParallelLayout(num_ranks=4, gtp_remat=2, ep=2, expt_tp=1, expt_gtp_remat=2, rank_offset=1),
}


def _seeds_on_rank() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, layout in SPANS.items():
        collection = build(layout, name=name)
        try:
            out[name] = model_parallel_manual_seed(SEED, collection, tracker=RNGStatesTracker())
        except ValueError as exc:
            out[name] = f"ValueError: {exc}"
    return out


@pytest.mark.parametrize("dp_init", [False, True])
def test_seed_plan_of_a_span_is_its_shifted_world(dp_init: bool) -> None:
    for name, layout in SPANS.items():
        alone = ParallelLayout(**{**_sizes(layout), "rank_offset": 0})
        first, stop = layout.rank_range()
        plan = seed_plan(layout, SEED, data_parallel_random_init=dp_init)
        assert list(plan) == list(range(first, stop)), name
        for rank, seeds in plan.items():
            assert seeds == oracle_seeds(alone, rank - first, SEED, dp_init), (name, rank)


def test_members_of_a_span_are_seeded_as_its_plan_says() -> None:
    for rank, seeds in enumerate(run_world(WORLD, _seeds_on_rank, timeout=60)):
        for name, layout in SPANS.items():
            first, stop = layout.rank_range()
            if first <= rank < stop:
                assert seeds[name] == seed_plan(layout, SEED)[rank], (name, rank)
            else:
                assert str(seeds[name]).startswith(
                    f"ValueError: model_parallel_manual_seed was given layout {name!r} {layout!r}, which spans ranks "
                    f"{first}-{stop - 1}; this rank ({rank}) is not one of them"
                ), (name, rank, seeds[name])


def _sizes(layout: ParallelLayout) -> dict[str, Any]:
    return {key: getattr(layout, key) for key in (
        "num_ranks", "tp", "cp", "pp", "ep", "expt_tp", "gtp_remat", "expt_gtp_remat", "order",
    )}

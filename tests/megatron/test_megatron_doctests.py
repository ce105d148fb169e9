"""The docstring examples that need the installed Megatron-Core run and print what they show.

Each runs on every rank of a 2- or 4-rank gloo world, as its docstring says, with Megatron-Core's
globals cleared after each object's examples (``destroy_model_parallel``), as pgregistry's builds
are. ``seed_megatron_rng``'s example stays a code block: Megatron-Core's seeding needs CUDA
(``scripts/megatron_parity.py`` checks the seeds on a GPU).
"""

from __future__ import annotations

import pytest
from fixtures.docstring_examples import run_examples_of
from megatron_support import require_megatron

from pgregistry.testing import run_world

require_megatron()

EXAMPLES_IN_A_WORLD = {
    "pgregistry.interop._megatron_grids.from_hyper_comm_grid": 4,
    "pgregistry.interop.megatron.check_config": 2,
    "pgregistry.interop.megatron.from_megatron": 2,
    "pgregistry.interop.megatron.mark_megatron_experts": 2,
    "pgregistry.interop.megatron.megatron_config_kwargs": 2,
    "pgregistry.interop.megatron.megatron_initialize_kwargs": 2,
    "pgregistry.interop.megatron.to_megatron": 2,
    "pgregistry.registry.adopt": 2,
}
"""Dotted name -> the size of the world its examples run in (``megatron_config_kwargs``' needs
none: it runs in the 2-rank world with the others)."""


def _examples_with_megatron_cleared(names: list[str]) -> tuple[dict[str, int], int, str]:
    from megatron.core import parallel_state

    return run_examples_of(names, clean_up=parallel_state.destroy_model_parallel)


@pytest.mark.parametrize("size", sorted(set(EXAMPLES_IN_A_WORLD.values())))
def test_the_megatron_examples_print_what_they_show_on_every_rank(size: int) -> None:
    names = [name for name, wanted in EXAMPLES_IN_A_WORLD.items() if wanted == size]
    outcomes = run_world(size, _examples_with_megatron_cleared, names, timeout=60)
    for rank, (counts, failures, report) in enumerate(outcomes):
        assert all(counts.values()), f"rank {rank}: no docstring example: {counts}"
        assert failures == 0, f"rank {rank}:\n{report}"

"""Per-module RNG streams.

:func:`seed_modules` seeds each module's trackers from the job's seed and the module.

Megatron-Core's multimodal (MIMO) jobs seed each module's RNG in its builder, from the job's seed
and that module's own groups (its pipeline, tensor- and expert-parallel ranks), so each module's
streams follow Megatron's rules inside the module. With the job's seed alone, two modules whose
ranks sit at the same coordinates (the first pipeline stage of an encoder and of the language model,
or two colocated modules) would draw the same numbers: an encoder initialised with the language
model's dropout masks. Here each module gets a seed of its own, derived from the job's seed and its
name (:func:`module_seed`), and its own :class:`~pgregistry.rng.RNGStatesTracker`, seeded by
:func:`pgregistry.rng.model_parallel_manual_seed` on the module's collection; the seeds of every
module, over every rank of its span, are checked to be disjoint from every other module's.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Final

from pgregistry._runtime.integers import as_integer
from pgregistry.modules._collection import MultiModuleCollection, require_multi_module_collection
from pgregistry.rng import RNGStatesTracker, model_parallel_manual_seed, seed_plan

__all__ = ["module_seed", "seed_modules"]

_MODULE_SEED_BITS: Final = 48
"""A module's seed is below 2**48, which leaves Megatron-Core's offsets (at most a few million for
any layout pgregistry can build) far below torch's limit of 2**64."""


def module_seed(seed: int, name: str) -> int:
    """Module ``name``'s seed from the job's ``seed``: 48 bits of ``sha256("<seed>/<name>")``.

    The same on every rank and every run; a module's seed does not change when modules are added or
    reordered. ``ValueError`` unless ``seed`` is an integer in ``[0, 2**64)``."""
    number = as_integer(seed)  # np.int64(1234) is 1234: the same text, the same module seeds
    if number is None or not 0 <= number < 2**64:
        raise ValueError(f"the job's seed must be an integer in [0, 2**64), got {seed!r}")
    digest = hashlib.sha256(f"{number}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> (64 - _MODULE_SEED_BITS)


def seed_modules(
    seed: int, modules: MultiModuleCollection, *, data_parallel_random_init: bool = False
) -> dict[str, RNGStatesTracker]:
    """Module name -> its RNG tracker, for each module this rank runs, seeded from ``seed``.

    Each module's tracker holds Megatron-Core's streams (``data-parallel-rng``,
    ``model-parallel-rng``, ``expert-parallel-rng``, ...) for this rank, computed by
    :func:`pgregistry.rng.model_parallel_manual_seed` on the module's collection from
    :func:`module_seed` ``(seed, name)``: the seeds are those :func:`pgregistry.rng.seed_plan` lists
    for the module's layout and that seed. The default generators (outside any fork) are left seeded
    with the data-parallel stream of the first module this rank runs, in declaration order, as a
    single-model job leaves them (they are left as they were on a rank that runs no module). Local:
    no collective.

    Args:
        seed: the job's seed.
        modules: the job's :class:`MultiModuleCollection`.
        data_parallel_random_init: as for :func:`pgregistry.rng.model_parallel_manual_seed`.

    Returns:
        Module name -> its :class:`~pgregistry.rng.RNGStatesTracker`; draw a module's numbers inside
        its tracker's ``fork(...)``.

    Raises:
        TypeError: ``modules`` not a :class:`MultiModuleCollection`.
        ValueError: on every rank alike (every rank computes every module's seeds), a seed of one
            module (on any rank of its span, in any stream) that is a seed of another module, naming
            both (it would take a collision of 48-bit hashes).

    Example:
        On every rank of a 2-rank world (as :func:`pgregistry.testing.run_world` starts it):

        >>> import torch
        >>> from pgregistry import ParallelLayout
        >>> from pgregistry.modules import build_modules
        >>> modules = build_modules({"encoder": ParallelLayout(num_ranks=2, tp=2)})
        >>> trackers = seed_modules(1234, modules)
        >>> with trackers["encoder"].fork():  # the encoder's model-parallel stream
        ...     x = torch.nn.functional.dropout(torch.ones(4), p=0.5)
        >>> sorted(trackers)
        ['encoder']
    """
    require_multi_module_collection(modules, "seed_modules")
    seeds = {name: module_seed(seed, name) for name in modules}
    _check_disjoint_streams(modules, seeds, data_parallel_random_init)
    trackers: dict[str, RNGStatesTracker] = {}
    for name in reversed(
        modules.here()
    ):  # the first module's seeding is the last: its stream is the default one
        tracker = RNGStatesTracker()
        model_parallel_manual_seed(
            seeds[name],
            modules[name],
            data_parallel_random_init=data_parallel_random_init,
            tracker=tracker,
        )
        trackers[name] = tracker
    return {name: trackers[name] for name in modules.here()}


def _check_disjoint_streams(
    modules: MultiModuleCollection, seeds: Mapping[str, int], data_parallel_random_init: bool
) -> None:
    owner: dict[int, str] = {}
    for name, layout in modules.layouts().items():
        plan = seed_plan(layout, seeds[name], data_parallel_random_init=data_parallel_random_init)
        for rank_seeds in plan.values():
            for tracker_seed in rank_seeds.values():
                other = owner.setdefault(tracker_seed, name)
                if other != name:
                    raise ValueError(
                        f"modules {other!r} and {name!r} would share RNG seed {tracker_seed} "
                        f"(their seeds {seeds[other]} and {seeds[name]} from the job's seed "
                        "are too close for their layouts): rename a module or use another seed"
                    )

"""The seed oracle shared by the RNG tests (imported as ``rng_support``).

Megatron-Core's formulas written out independently of :mod:`pgregistry.rng` (from ``model_parallel_cuda_manual_seed`` in
``megatron/core/tensor_parallel/random.py``), on coordinates from
``ParallelLayout.coords``.
"""

from __future__ import annotations

from pgregistry.layout import ParallelLayout
from pgregistry.rng import (
    DATA_PARALLEL_RNG,
    EGTP_REMAT_RNG,
    EXPERT_PARALLEL_RNG,
    GTP_REMAT_RNG,
    MODEL_PARALLEL_RNG,
)

__all__ = ["oracle_seeds"]


def oracle_seeds(layout: ParallelLayout, rank: int, seed: int, dp_init: bool = False) -> dict[str, int]:
    """Tracker name -> seed of ``rank``, with the caller-side pipeline (and data-parallel) offsets."""
    c = layout.coords(rank)
    base = seed + 100 * c["pp"] + (10 * c["dp"] if dp_init else 0)
    model = base + 2718 + c["tp"]
    expert = base + 1024 + 100 * c["ep"] + c["expt_tp"]
    out = {DATA_PARALLEL_RNG: base, MODEL_PARALLEL_RNG: model, EXPERT_PARALLEL_RNG: expert}
    if layout.gtp_remat > 1:
        out[GTP_REMAT_RNG] = model + 65536 * (1 + c["gtp_remat"])
    if layout.expt_gtp_remat > 1:
        out[EGTP_REMAT_RNG] = expert + 32768 + 65536 * (1 + c["expt_gtp_remat"])
    return out

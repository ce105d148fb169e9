"""The modules of the tests' jobs, their unsharded float64 gradients and the job-wide oracles.

Every module is the toy model of :mod:`pgregistry.testing._toy_models` (its shards on the module's layout); each module
draws its own gradients, seeded by the module's name, so no two modules have the same. The oracles work on the
unsharded float64 gradients of every module, concatenated, with none of pgregistry's code.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable
from typing import Any

import torch

from pgregistry.layout import ParallelLayout
from pgregistry.testing._toy_models import model_specs

__all__ = ["JOBS", "error_of", "job_grads", "module_grads", "oracle_clip_coeff", "oracle_norm", "oracle_zeros"]

JOBS: dict[str, dict[str, ParallelLayout]] = {
    # An encoder on ranks 0-3 at DP 4, the language model on ranks 4-7 at TP 2 x PP 2 (MIMO's non-colocated job).
    "disjoint": {
        "encoder": ParallelLayout(num_ranks=4),
        "language": ParallelLayout(num_ranks=4, tp=2, pp=2, rank_offset=4),
    },
    # Both on every rank, each with its own layout (MIMO's colocated job with heterogeneous TP/DP).
    "colocated": {
        "encoder": ParallelLayout(num_ranks=8),
        "language": ParallelLayout(num_ranks=8, tp=2, pp=2),
    },
    # Three modules: a vision encoder with experts on ranks 0-3, an audio encoder on ranks 2-3 (inside the vision
    # encoder's span), the language model with experts on ranks 4-7.
    "mixed": {
        "vision": ParallelLayout(num_ranks=4, tp=2, ep=2, expt_tp=1),
        "audio": ParallelLayout(num_ranks=2, rank_offset=2),
        "language": ParallelLayout(num_ranks=4, tp=2, pp=2, ep=2, expt_tp=1, rank_offset=4),
    },
    # Ranks 6 and 7 run no module: they still take part in every job-wide call, contributing nothing.
    "idle": {
        "encoder": ParallelLayout(num_ranks=4),
        "language": ParallelLayout(num_ranks=2, tp=2, rank_offset=4),
    },
}


def module_grads(module: str, kind: str = "random") -> dict[str, torch.Tensor]:
    """Module ``module``'s unsharded float64 gradients: ``random`` (about 30% of the elements zero, values
    float32-representable so float32 shards are exact, seeded by the module's and the parameter's names) or
    ``ones``."""
    grads = {}
    for spec in model_specs():
        if kind == "ones":
            grads[spec.name] = torch.ones(spec.shape, dtype=torch.float64)
            continue
        generator = torch.Generator().manual_seed(zlib.crc32(f"{module}/{spec.name}".encode()))
        values = torch.randn(spec.shape, generator=generator, dtype=torch.float32)
        values[torch.rand(spec.shape, generator=generator) < 0.3] = 0.0
        grads[spec.name] = values.to(torch.float64)
    return grads


def job_grads(job: str) -> dict[str, dict[str, torch.Tensor]]:
    """Module name -> its unsharded gradients, for every module of ``job``."""
    return {module: module_grads(module) for module in JOBS[job]}


def _flat(grads: dict[str, dict[str, torch.Tensor]]) -> torch.Tensor:
    return torch.cat([g.flatten() for module in grads.values() for g in module.values()])


def oracle_norm(grads: dict[str, dict[str, torch.Tensor]], p: float) -> float:
    """The ``p``-norm of every module's unsharded gradients as one vector."""
    flat = _flat(grads).abs()
    return float(flat.max()) if math.isinf(p) else float(flat.pow(p).sum().pow(1.0 / p))


def oracle_zeros(grads: dict[str, dict[str, torch.Tensor]]) -> int:
    """How many elements of every module's unsharded gradients are zero."""
    return int((_flat(grads) == 0).sum())


def oracle_clip_coeff(grads: dict[str, dict[str, torch.Tensor]], max_norm: float) -> float:
    """Megatron-Core's clipping coefficient for the job-wide 2-norm: ``max_norm / (norm + 1e-6)``, at most 1."""
    return min(max_norm / (oracle_norm(grads, 2.0) + 1e-6), 1.0)


def error_of(call: Callable[[], Any]) -> str:
    """What ``call`` raised, as ``"Type: message"`` (a ValueError, TypeError or RuntimeError), or ``"no error"``:
    a rank's outcome as text, so a test can compare every rank's."""
    try:
        call()
    except (ValueError, TypeError, RuntimeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"

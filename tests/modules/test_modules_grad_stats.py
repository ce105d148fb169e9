"""Job-wide grad norm, zero count and clipping over the modules of 8-rank jobs, against the float64 oracle.

Four jobs (``modules_support.JOBS``): two modules on disjoint spans (an encoder on ranks 0-3 at DP 4, the
language model on ranks 4-7 at TP 2 x PP 2), the same two colocated on all 8 ranks, three modules of which two
overlap (one with experts inside another's span), and two modules that leave ranks 6 and 7 without any. Every
module is the toy model sharded on its own layout, with its own gradients; the oracle is the norm of every
module's unsharded float64 gradients as one vector, so a module counted on the ranks outside it, or counted once
per rank that runs it (a SUM over the world where each module's value must be taken once), or a module missing,
fails.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch.distributed as dist
from modules_support import JOBS, job_grads, oracle_clip_coeff, oracle_norm, oracle_zeros

from pgregistry import modules as mm
from pgregistry.grad_stats import CLIP_EPSILON
from pgregistry.testing import run_world
from pgregistry.testing._toy_models import local_model

REL = 1e-6


def _models(job: str, modules: mm.MultiModuleCollection) -> tuple[dict[str, Any], dict[str, Any]]:
    """This rank's model and shards of each module it runs, with its gradients."""
    rank = dist.get_rank()
    grads = job_grads(job)
    models, shards = {}, {}
    for name in modules.here():
        models[name], shards[name] = local_model(JOBS[job][name], rank, grads[name])
    return models, shards


def _statistics(job: str, max_norm: float) -> dict[str, Any]:
    modules = mm.build_modules(JOBS[job], language_model="language")
    models, shards = _models(job, modules)
    out: dict[str, Any] = {
        "here": modules.here(),
        "norm2": float(mm.grad_norm(models, modules)),
        "norm_inf": float(mm.grad_norm(models, modules, norm_type=math.inf)),
        "norm3": float(mm.grad_norm(models, modules, norm_type=3)),
        "zeros": mm.count_zeros(models, modules),
    }
    before = {name: {k: p.grad.clone() for k, p in model.named_parameters()} for name, model in models.items()}
    out["clip_norm"] = float(mm.clip_grad_norm_(models, max_norm, modules))
    # Every local grad must be its unclipped value times the oracle's coefficient (the tests compare the ratio).
    worst = 0.0
    coeff = oracle_clip_coeff(job_grads(job), max_norm)
    for name, model in models.items():
        for key, param in model.named_parameters():
            want = before[name][key].double() * coeff
            worst = max(worst, float((param.grad.double() - want).abs().max()))
    out["clip_worst_abs"] = worst
    return out


@pytest.mark.parametrize("job", list(JOBS))
def test_job_wide_statistics_match_the_float64_oracle_of_every_module(job: str) -> None:
    grads = job_grads(job)
    norm2 = oracle_norm(grads, 2.0)
    max_norm = norm2 / 3
    results = run_world(8, _statistics, job, max_norm, timeout=60)
    for rank, got in enumerate(results):
        where = f"{job} rank {rank} ({got['here']})"
        assert got["norm2"] == pytest.approx(norm2, rel=REL), where
        assert got["norm_inf"] == pytest.approx(oracle_norm(grads, math.inf), rel=REL), where
        assert got["norm3"] == pytest.approx(oracle_norm(grads, 3.0), rel=REL), where
        assert got["zeros"] == oracle_zeros(grads), where
        assert got["clip_norm"] == pytest.approx(norm2, rel=REL), where
        assert got["clip_worst_abs"] < 1e-6, where
    # Every rank of a disjoint job runs one module; every rank of the colocated one runs both.
    here = [tuple(got["here"]) for got in results]
    if job == "disjoint":
        assert here == [("encoder",)] * 4 + [("language",)] * 4
    elif job == "colocated":
        assert here == [("encoder", "language")] * 8
    elif job == "mixed":
        assert here == [("vision",)] * 2 + [("vision", "audio")] * 2 + [("language",)] * 4
    else:
        assert here == [("encoder",)] * 4 + [("language",)] * 2 + [()] * 2


def test_the_oracles_tell_the_modules_apart() -> None:
    """Each module's share is far from zero and from the others', so a module dropped or counted twice shows."""
    grads = job_grads("mixed")
    shares = [oracle_norm({name: module}, 2.0) ** 2 for name, module in grads.items()]
    total = oracle_norm(grads, 2.0) ** 2
    assert min(shares) > 0.2 * total / len(shares)
    assert len({round(share, 6) for share in shares}) == len(shares)


def _nonfinite(poison: float, module: str) -> dict[str, Any]:
    """The job-wide norm and clip when one rank of ``module`` holds a non-finite grad; whether grads changed."""
    modules = mm.build_modules(JOBS["disjoint"])
    models, _ = _models("disjoint", modules)
    layout = JOBS["disjoint"][module]
    if dist.get_rank() == layout.rank_range()[0] and module in models:
        next(iter(models[module].parameters())).grad.view(-1)[0] = poison
    before = [p.grad.clone() for model in models.values() for p in model.parameters()]
    norm = float(mm.grad_norm(models, modules))
    clipped = float(mm.clip_grad_norm_(models, 1e-3, modules))
    after = [p.grad for model in models.values() for p in model.parameters()]
    unchanged = all(((a == b) | (a.isnan() & b.isnan())).all() for a, b in zip(after, before, strict=True))
    try:
        mm.clip_grad_norm_(models, 1e-3, modules, error_if_nonfinite=True)
        message = ""
    except RuntimeError as exc:
        message = str(exc)
    return {"norm": norm, "clipped": clipped, "unchanged": bool(unchanged), "message": message}


@pytest.mark.parametrize(("poison", "module"), [(math.nan, "language"), (math.inf, "encoder"), (-math.inf, "language")])
def test_a_non_finite_grad_in_one_module_makes_the_job_wide_norm_non_finite_on_every_rank(
    poison: float, module: str
) -> None:
    """Never dropped by a MAX all-reduce (gloo's MAX keeps or drops a NaN depending on which rank holds it, as
    torch 2.13 shows): the norm is NaN or infinite on the ranks of the other module too, and no grad anywhere is
    scaled."""
    for rank, got in enumerate(run_world(8, _nonfinite, poison, module, timeout=60)):
        where = f"rank {rank}"
        assert (math.isnan(got["norm"]) if math.isnan(poison) else got["norm"] == math.inf), where
        assert (math.isnan(got["clipped"]) if math.isnan(poison) else got["clipped"] == math.inf), where
        assert got["unchanged"], where
        assert got["message"].startswith("the job-wide grad norm is "), where


def test_clip_epsilon_is_megatron_cores() -> None:
    assert CLIP_EPSILON == 1e-6  # the oracle's coefficient above assumes it

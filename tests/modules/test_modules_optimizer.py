"""One optimizer over the modules of 8-rank jobs: steps against a float64 reference update, the job-wide verdict
on a non-finite grad, state dicts per module name.

Each module is the toy model on its layout, starting from its own weights; each step writes the raw per-rank grads
that the modules' ``sync_grads`` turn into the shards of that step's unsharded gradients. The reference trains
the unsharded float64 weights of every module with the same rule (Adam), clipped by the job-wide norm of every
module's gradients: a module clipped by its own norm, a norm counting a module on the ranks outside it, or a step
taken on some ranks only, fails.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch
import torch.distributed as dist
from modules_support import JOBS, module_grads, oracle_norm, oracle_zeros

from pgregistry import modules as mm
from pgregistry.layout import ParallelLayout
from pgregistry.testing import run_world
from pgregistry.testing._toy_models import local_model, set_main_grads

STEPS, LR = 3, 0.05
EPS = 1e-8


def _weights(module: str) -> dict[str, torch.Tensor]:
    return module_grads(f"{module}/weights")


def _step_grads(module: str, step: int) -> dict[str, torch.Tensor]:
    """Step ``step``'s unsharded gradients of ``module`` (each step its own; the second is large, so it is
    clipped)."""
    scale = 10.0 if step == 1 else 1.0
    return {name: grad * scale for name, grad in module_grads(f"{module}/step{step}").items()}


def _reference(job: str, max_norm: float) -> tuple[dict[str, dict[str, torch.Tensor]], list[float], list[int]]:
    """Every module's unsharded float64 weights after STEPS of Adam with the job-wide clip; the norm and zero
    count before clipping at each step."""
    weights = {m: {k: v.clone().requires_grad_() for k, v in _weights(m).items()} for m in JOBS[job]}
    params = [p for module in weights.values() for p in module.values()]
    adam = torch.optim.Adam(params, lr=LR, eps=EPS)
    norms, zeros = [], []
    for step in range(STEPS):
        grads = {m: _step_grads(m, step) for m in JOBS[job]}
        norms.append(oracle_norm(grads, 2.0))
        zeros.append(oracle_zeros(grads))
        coeff = min(max_norm / (norms[-1] + 1e-6), 1.0)
        for m, module in weights.items():
            for k, p in module.items():
                p.grad = grads[m][k] * coeff
        adam.step()
    return {m: {k: v.detach() for k, v in module.items()} for m, module in weights.items()}, norms, zeros


def _setup(job: str) -> tuple[mm.MultiModuleCollection, dict[str, Any], dict[str, Any], mm.MultiModuleOptimizer]:
    rank = dist.get_rank()
    modules = mm.build_modules(JOBS[job], language_model="language")
    models, shards = {}, {}
    for name in modules.here():
        models[name], shards[name] = local_model(JOBS[job][name], rank, _weights(name))
        params = dict(models[name].named_parameters())
        with torch.no_grad():
            for shard in shards[name]:
                params[shard.local_name].copy_(shard.take(_weights(name)[shard.full_name]))
                params[shard.local_name].grad = None
    optimizer = mm.build_optimizer(models, modules, optimizer="adam", lr=LR, eps=EPS, mixed_precision=False)
    return modules, models, shards, optimizer


def _write_grads(job: str, models: dict[str, Any], shards: dict[str, Any], step: int) -> None:
    for name, model in models.items():
        set_main_grads(model, shards[name], _step_grads(name, step), JOBS[job][name])


def _train(job: str, max_norm: float, reference: dict[str, dict[str, torch.Tensor]]) -> dict[str, Any]:
    modules, models, shards, optimizer = _setup(job)
    steps = []
    for step in range(STEPS):
        _write_grads(job, models, shards, step)
        optimizer.sync_grads()
        steps.append(optimizer.step(max_norm, count_zeros=True))
        optimizer.zero_grad()
    worst = 0.0
    for name, model in models.items():
        params = dict(model.named_parameters())
        for shard in shards[name]:
            want = shard.take(reference[name][shard.full_name])
            got = params[shard.local_name].detach().double()
            worst = max(worst, float((got - want).abs().max() / want.abs().max().clamp_min(1e-30)))
    return {"steps": steps, "worst": worst, "here": modules.here(), "state_keys": sorted(optimizer.state_dict())}


@pytest.mark.parametrize("job", ["disjoint", "colocated", "mixed", "idle"])
def test_the_optimizer_steps_every_module_like_the_float64_reference(job: str) -> None:
    max_norm = oracle_norm({m: _step_grads(m, 0) for m in JOBS[job]}, 2.0) * 2  # steps 0 and 2 unclipped, 1 clipped
    reference, norms, zeros = _reference(job, max_norm)
    for rank, got in enumerate(run_world(8, _train, job, max_norm, reference, timeout=60)):
        where = f"{job} rank {rank}"
        for step, (stepped, norm, count) in enumerate(got["steps"]):
            assert stepped, where
            assert norm == pytest.approx(norms[step], rel=1e-6), where
            assert count == zeros[step], where
        assert got["worst"] < 1e-5, where
        assert got["state_keys"] == sorted(got["here"]), where
    assert norms[1] > max_norm > norms[0]  # the clip scales step 1 only


def _skip(job: str, poison: float) -> dict[str, Any]:
    """Step 0 normally, then a step where the first rank of the language model has a non-finite grad."""
    modules, models, shards, optimizer = _setup(job)
    _write_grads(job, models, shards, 0)
    optimizer.sync_grads()
    first = optimizer.step(1e6)
    before = {n: [p.detach().clone() for p in m.parameters()] for n, m in models.items()}
    _write_grads(job, models, shards, 1)
    if dist.get_rank() == JOBS[job]["language"].rank_range()[0]:  # TP rank 0: its copy is the one counted
        next(iter(models["language"].parameters())).main_grad.view(-1)[0] = poison
    optimizer.sync_grads()
    grads = {n: [p.main_grad.clone() for p in m.parameters()] for n, m in models.items()}
    second = optimizer.step(1e-3)
    unchanged_params = all(
        torch.equal(p.detach(), b) for n, m in models.items() for p, b in zip(m.parameters(), before[n], strict=True)
    )
    unchanged_grads = all(
        bool(((p.main_grad == g) | (p.main_grad.isnan() & g.isnan())).all())
        for n, m in models.items()
        for p, g in zip(m.parameters(), grads[n], strict=True)
    )
    return {"first": first[0], "second": second, "params": unchanged_params, "grads": unchanged_grads}


@pytest.mark.parametrize(("job", "poison"), [("disjoint", math.nan), ("colocated", math.inf)])
def test_a_non_finite_grad_in_one_module_skips_the_step_on_every_rank(job: str, poison: float) -> None:
    for rank, got in enumerate(run_world(8, _skip, job, poison, timeout=60)):
        stepped, norm, _ = got["second"]
        assert got["first"] and not stepped, f"rank {rank}"
        assert (math.isnan(norm) if math.isnan(poison) else norm == math.inf), f"rank {rank}: {norm}"
        assert got["params"] and got["grads"], f"rank {rank}: a parameter or grad changed"


def _resume(job: str, max_norm: float) -> dict[str, Any]:
    """Two steps; the state dict into a fresh optimizer over a copy of the weights; the third step of both."""
    _, models, shards, optimizer = _setup(job)
    for step in range(2):
        _write_grads(job, models, shards, step)
        optimizer.sync_grads()
        optimizer.step(max_norm)
    state = optimizer.state_dict()
    weights = {n: [p.detach().clone() for p in m.parameters()] for n, m in models.items()}
    _, fresh_models, fresh_shards, fresh = _setup(job)
    with torch.no_grad():
        for name, model in fresh_models.items():
            for param, saved in zip(model.parameters(), weights[name], strict=True):
                param.copy_(saved)
    fresh.load_state_dict(state)
    for opt, ms, sh in ((optimizer, models, shards), (fresh, fresh_models, fresh_shards)):
        _write_grads(job, ms, sh, 2)
        opt.sync_grads()
        opt.step(max_norm)
    same = all(
        torch.equal(a, b)
        for name in models
        for a, b in zip(models[name].parameters(), fresh_models[name].parameters(), strict=True)
    )
    # Another rank's state (this rank's without a module it runs) is refused on every rank.
    rank = dist.get_rank()
    stray = {} if rank == 0 else state
    try:
        fresh.load_state_dict(stray)
        refused = "no error"
    except ValueError as exc:
        refused = str(exc)
    # A moment of another shape in rank 0's state of its first module: refused on every rank, nothing loaded.
    misshapen = copy.deepcopy(state)
    if rank == 0:
        moments = next(iter(misshapen.values()))["children"][0]["inner"]["state"][0]
        moments["exp_avg"] = moments["exp_avg"].reshape(1, -1)
    before = _tensors(fresh.state_dict())
    try:
        fresh.load_state_dict(misshapen)
        misfit = "no error"
    except ValueError as exc:
        misfit = str(exc)
    unchanged = all(torch.equal(a, b) for a, b in zip(before, _tensors(fresh.state_dict()), strict=True))
    return {"same": same, "refused": refused, "misfit": misfit, "unchanged": unchanged}


def _tensors(state: Any) -> list[torch.Tensor]:
    """Every tensor of a nested state dict, cloned, in a fixed order."""
    if isinstance(state, dict):
        return [t for key in sorted(state, key=str) for t in _tensors(state[key])]
    if isinstance(state, list):
        return [t for item in state for t in _tensors(item)]
    return [state.detach().clone()] if isinstance(state, torch.Tensor) else []


def test_state_dicts_per_module_name_resume_exactly_and_refuse_another_ranks_state() -> None:
    for rank, got in enumerate(run_world(8, _resume, "disjoint", 1.0, timeout=60)):
        assert got["same"], f"rank {rank}"
        assert "ranks [0] were given bad input (rank 0: no state for module 'encoder' (ranks 0-3)" in got["refused"]
        want = "ranks [0] were given bad input (rank 0: module 'encoder': its optimizer on rank 0: "
        assert want in got["misfit"], rank
        assert "state 'exp_avg' of " in got["misfit"] and "has shape (1, " in got["misfit"], got["misfit"]
        assert got["unchanged"], f"rank {rank}"


def _refusals() -> dict[str, str]:
    from pgregistry import build
    from pgregistry.optim import build_optimizer

    rank = dist.get_rank()
    modules, models, _, good = _setup("disjoint")
    other = build(ParallelLayout(num_ranks=4, pp=2, rank_offset=4), name="other")  # the language model's span
    on_other = build_optimizer(models["language"], other, optimizer="sgd", lr=0.1) if rank >= 4 else None
    mine = dict(good.optimizers)

    def made(optimizers: dict[str, Any]) -> str:
        try:
            mm.MultiModuleOptimizer(optimizers, modules)
        except (ValueError, TypeError) as exc:
            return str(exc)
        return "no error"

    return {
        "elsewhere": made({**mine, "language": mine["encoder"]} if rank == 0 else mine),
        "other": made({"language": on_other} if rank == 5 else mine),
        "not_chained": made({"encoder": torch.optim.SGD(models["encoder"].parameters())} if rank == 2 else mine),
        "good": made(mine),
    }


def test_an_optimizer_for_another_module_or_collection_is_refused_on_every_rank() -> None:
    for rank, got in enumerate(run_world(8, _refusals, timeout=60)):
        elsewhere = "ranks [0] were given bad input (rank 0: an optimizer for module 'language', which runs on ranks"
        assert elsewhere in got["elsewhere"], (rank, got["elsewhere"])
        assert "rank 5: module 'language': its optimizer was built on layout 'other'" in got["other"], (rank, got)
        assert "rank 2: module 'encoder': expected a pgregistry ChainedOptimizer" in got["not_chained"], (rank, got)
        assert got["good"] == "no error", rank

"""A tensor in the models of two modules on one rank is refused on every rank, not counted and clipped twice.

Before: a layer shared by two colocated modules (or one model given for both) was counted in each module's
statistic: ``grad_norm`` answered ``sqrt(10)`` where the distinct grads' norm is ``sqrt(6)``, ``count_zeros`` counted
its zeros twice, and ``clip_grad_norm_`` scaled its grad once per module (by the square of the coefficient), turning
the clipped grads away from the direction of the unclipped ones; two parameters, one in each module's model, holding
one grad tensor are refused by the clip alike (before: on the rank holding it only, after the job-wide norm, by
``clip_grads_``). Two ranks: module ``a`` on both, module ``b`` on rank 0 alone, so only rank 0 holds the shared
tensor and rank 1 must raise as well (else it would wait in the job's all-reduce).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from torch import nn

from pgregistry import modules as mm
from pgregistry.layout import ParallelLayout
from pgregistry.testing import run_world


def _grads(layer: nn.Linear, value: float) -> nn.Linear:
    layer.weight.grad = torch.full_like(layer.weight, value)
    return layer


def _calls() -> dict[str, str]:
    modules = mm.build_modules({"a": ParallelLayout(num_ranks=2), "b": ParallelLayout(num_ranks=1)})
    shared = _grads(nn.Linear(2, 2, bias=False), 1.0)
    own = _grads(nn.Linear(2, 1, bias=False), 1.0)
    models = {"a": nn.Sequential(shared)}
    if dist.get_rank() == 0:
        models["b"] = nn.Sequential(shared, own)
    out: dict[str, str] = {}
    calls = {
        "grad_norm": lambda: mm.grad_norm(models, modules),
        "count_zeros": lambda: mm.count_zeros(models, modules),
        "clip_grad_norm_": lambda: mm.clip_grad_norm_(models, 1.0, modules),
    }
    for label, call in calls.items():
        try:
            out[label] = f"no error: {float(call())}"
        except ValueError as error:
            out[label] = str(error)
    # Two parameters, one in each module's model, holding one grad tensor: the clip would scale it once per module.
    twin = nn.Linear(2, 2, bias=False)
    twin.weight.grad = shared.weight.grad
    if dist.get_rank() == 0:
        models["b"] = nn.Sequential(twin, own)
    try:
        out["clip of a grad in two modules"] = f"no error: {float(mm.clip_grad_norm_(models, 1.0, modules))}"
    except ValueError as error:
        out["clip of a grad in two modules"] = str(error)
    out["grads unchanged"] = repr(bool((shared.weight.grad == 1).all()) and bool((own.weight.grad == 1).all()))
    # Its own copy for module b: each tensor in one model; the norm counts a's tensor over both ranks once (a's
    # ranks hold replicas) and b's two.
    if dist.get_rank() == 0:
        models["b"] = nn.Sequential(_grads(nn.Linear(2, 2, bias=False), 1.0), own)
    out["norm with copies"] = repr(float(mm.grad_norm(models, modules)))
    return out


def test_a_tensor_in_two_modules_models_is_refused_on_every_rank_naming_it() -> None:
    results = run_world(2, _calls, timeout=60)
    for rank, out in enumerate(results):
        for label in ("grad_norm", "count_zeros", "clip_grad_norm_"):
            assert "parameter '0.weight' of module 'b' is also in the model of module 'a'" in out[label], (
                rank, label, out[label])
            assert "ranks [0]" in out[label]  # the rank holding it, named on rank 1 too
        message = out["clip of a grad in two modules"]
        assert "module 'b': the grad of parameter '0.weight' is also a grad in the model of module 'a'" in message, (
            rank, message)
        assert "ranks [0]" in message
        assert out["grads unchanged"] == "True"
    oracle = math.sqrt(torch.ones(4 + 4 + 2, dtype=torch.float64).square().sum().item())
    assert [float(out["norm with copies"]) for out in results] == [pytest.approx(oracle, rel=1e-6)] * 2

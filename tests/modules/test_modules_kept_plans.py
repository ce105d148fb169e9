"""A steady-state job-wide statistic walks no model: each module's kept plan is checked, read and (for the clip)
scaled through, as the single-model statistics do.

Before: every call of ``pgregistry.modules.grad_norm``, ``count_zeros`` and ``clip_grad_norm_`` walked each model for
the experts' classification (``check_expert_classification``), and the clip walked them again for their grads and
planned their scaling anew (``clip_grads_``): on two colocated modules of 10,000 parameters each, most of a call
(``docs/performance.md``). Traced with ``sys.setprofile`` over the second of two real calls (the plans kept), one
rank, two colocated modules and a lone one; then a parameter added to a kept model is counted and clipped at once
(the plan is made anew), against a float64 oracle computed from the grads by hand.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from types import FrameType
from typing import Any

import torch
from torch import nn

from pgregistry import modules as mm
from pgregistry.layout import ParallelLayout
from pgregistry.testing import run_world

WALKS = frozenset({
    "modules", "named_modules", "parameters", "named_parameters", "children", "named_children", "_named_members",
})
"""``nn.Module``'s methods that walk a model."""
REPLANS = frozenset({"check_expert_classification", "require_classified_experts", "clip_grads_", "plan_kind"})
"""pgregistry's functions that check the experts' classification or plan a scaling: a kept plan's work."""


def _walks(call: Callable[[], Any]) -> list[str]:
    """The model walks and replanning functions entered during ``call``."""
    entered: list[str] = []

    def profile(frame: FrameType, event: str, arg: object) -> None:
        name = frame.f_code.co_name
        if event == "call" and (name in REPLANS or (name in WALKS and "torch/nn/modules" in frame.f_code.co_filename)):
            entered.append(name)

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    return entered


def _model(scale: float) -> nn.Module:
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    for index, param in enumerate(model.parameters()):
        param.grad = torch.full_like(param, scale * (index + 1))
    return model


def _oracle(models: dict[str, nn.Module]) -> float:
    return math.sqrt(sum(float(p.grad.double().square().sum()) for m in models.values() for p in m.parameters()))


def _job(names: tuple[str, ...]) -> dict[str, Any]:
    """What the steady-state calls over modules ``names`` (each on the one rank) walk, then a model changed."""
    out: dict[str, Any] = {}
    modules = mm.build_modules({name: ParallelLayout(num_ranks=1) for name in names})
    models = {name: _model(0.5 + index) for index, name in enumerate(names)}
    calls: dict[str, Callable[[], Any]] = {
        "grad_norm": lambda: mm.grad_norm(models, modules),
        "count_zeros": lambda: mm.count_zeros(models, modules),
        "clip_grad_norm_": lambda: mm.clip_grad_norm_(models, 1e3, modules),  # scales nothing: a steady state
    }
    for label, call in calls.items():
        call()  # the plans made
        out[label] = _walks(call)
    # A parameter added to a kept model: the plan is stale, made anew, the new grad counted and clipped.
    models[names[0]].append(nn.Linear(2, 1))
    models[names[0]][-1].weight.grad = torch.full((1, 2), 7.0)
    models[names[0]][-1].bias.grad = torch.full((1,), 7.0)
    want = _oracle(models)
    before = {name: [p.grad.double().clone() for p in m.parameters()] for name, m in models.items()}
    out["norm"] = (float(mm.grad_norm(models, modules)), want)
    out["clip norm"] = (float(mm.clip_grad_norm_(models, 1.0, modules)), want)
    coeff = 1.0 / (want + 1e-6)
    out["clip worst"] = max(
        float((p.grad.double() - was * coeff).abs().max() / (was * coeff).abs().max())
        for name, m in models.items()
        for p, was in zip(m.parameters(), before[name], strict=True)
    )
    return out


def _routes() -> dict[str, dict[str, Any]]:
    return {"colocated": _job(("a", "b")), "lone": _job(("a",))}


def test_a_steady_state_job_wide_statistic_walks_no_model_and_a_changed_model_is_replanned() -> None:
    (out,) = run_world(1, _routes, timeout=60)
    for job, got in out.items():
        for label in ("grad_norm", "count_zeros", "clip_grad_norm_"):
            assert got[label] == [], (job, label, got[label])
        for label in ("norm", "clip norm"):
            norm, want = got[label]
            assert math.isclose(norm, want, rel_tol=1e-6), (job, label, norm, want)
        assert got["clip worst"] < 1e-6, (job, got["clip worst"])

"""Grads (or a state dict's copies) given where parameters go are refused, not read as parameters without grads.

Megatron-Core's ``get_grad_norm_fp32`` and torch's ``get_total_norm`` take the grads; given the same list,
``grad_norm`` read each grad's own ``.grad`` (``None``) and answered 0.0, ``count_zeros`` 0, and ``clip_grad_norm_``
clipped nothing and returned 0.0, on every rank, without a word; ``model.state_dict()`` (detached copies) alike. Each
entry point now raises on every rank, before any collective, naming the first tensor and what to pass. A 2-rank gloo
world: a check that came after the first collective would show as a hang or as another error.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from pgregistry import registry
from pgregistry.grad_stats import clip_grad_norm_, count_zeros, grad_norm, grad_norm_and_zeros
from pgregistry.layout import ParallelLayout
from pgregistry.testing import run_world


def _model() -> nn.Module:
    model = nn.Linear(3, 2)
    for param in model.parameters():
        param.grad = torch.ones_like(param)
    return model


def _refusals() -> dict[str, str]:
    collection = registry.build(ParallelLayout(num_ranks=2))
    model = _model()
    grads = [param.grad for param in model.parameters()]
    calls = {
        "grad_norm(grads)": lambda: grad_norm(grads, collection),
        "count_zeros(grads)": lambda: count_zeros(grads, collection),
        "clip_grad_norm_(grads)": lambda: clip_grad_norm_(grads, 1.0, collection),
        "grad_norm_and_zeros(grads)": lambda: grad_norm_and_zeros(grads, collection),
        "grad_norm(state_dict)": lambda: grad_norm(model.state_dict(), collection),
    }
    out = {}
    for label, call in calls.items():
        try:
            call()
            out[label] = "no error"
        except ValueError as error:
            out[label] = str(error)
    # The parameters themselves still give the norm the float64 oracle gives, and the grads are left alone.
    out["norm of the parameters"] = repr(float(grad_norm(list(model.parameters()), collection)))
    out["grads unchanged"] = repr(all(bool((g == 1).all()) for g in grads))
    return out


def test_grads_or_a_state_dict_given_as_parameters_are_refused_on_every_rank_naming_them() -> None:
    results = run_world(2, _refusals, timeout=60)
    assert results[0] == results[1]
    out = results[0]
    for label in ("grad_norm(grads)", "count_zeros(grads)", "clip_grad_norm_(grads)", "grad_norm_and_zeros(grads)"):
        assert "'param[0]' is a Tensor of shape (2, 3)" in out[label], (label, out[label])
        assert "Pass the parameters" in out[label] and "norm_of_grads" in out[label]
    assert "'weight' is a Tensor of shape (2, 3)" in out["grad_norm(state_dict)"]
    oracle = math.sqrt(torch.ones(8, dtype=torch.float64).square().sum().item())
    assert float(out["norm of the parameters"]) == pytest.approx(oracle, rel=1e-6)
    assert out["grads unchanged"] == "True"


def test_tensors_that_can_hold_a_grad_are_read_as_before() -> None:
    """A main copy whose grad is set by hand (requires_grad=False), and a leaf requiring grad without one yet."""
    collection = ParallelLayout(num_ranks=1)

    def norms() -> list[float]:
        pg = registry.build(collection)
        main = torch.zeros(2)
        main.grad = torch.full((2,), 3.0)
        waiting = torch.zeros(2, requires_grad=True)
        return [float(grad_norm([main], pg)), float(grad_norm([waiting], pg))]

    assert run_world(1, norms, timeout=60)[0] == [pytest.approx(math.sqrt(18.0)), 0.0]


def test_named_parameters_given_as_parameters_say_what_to_pass() -> None:
    """``grad_norm(model.named_parameters(), pg)`` said only "param[0] is a tuple, not a tensor or parameter"."""

    def refusal() -> str:
        pg = registry.build(ParallelLayout(num_ranks=1))
        with pytest.raises(TypeError) as caught:
            grad_norm(_model().named_parameters(), pg)
        return str(caught.value)

    message = run_world(1, refusal, timeout=60)[0]
    assert "param[0] is a tuple" in message and "'weight'" in message
    assert "pass dict(model.named_parameters())" in message

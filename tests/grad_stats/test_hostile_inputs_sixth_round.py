"""Hostile but plausible inputs to the grad statistics' public paths (docs/reliability.md, hostile inputs, sixth
round), in a 2-rank gloo world of two pipeline stages, against the float64 oracle of both stages' grads.

- grads made with ``create_graph=True`` (a gradient penalty, meta-learning): the norm came back with an autograd
  graph (``requires_grad`` true), kept alive by every logged norm, where torch's ``get_total_norm`` and
  ``clip_grad_norm_`` run without grad;
- a ``max_norm`` tensor that requires grad (a parameter, a schedule's output) given to ``clip_grads_`` or an
  optimizer's ``clip_grad_norm``: every grad it scaled joined its graph (``requires_grad`` true, a ``grad_fn``),
  the next backward accumulating into a graph grown at each step;
- ``error_if_nonfinite='False'`` (a string from a configuration) was true: a non-finite norm raised where the
  caller meant to skip the step. Now refused, naming it, on every rank (the refusal rides in the clip's verdict).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from torch import nn

from pgregistry import ParallelLayout, clip_grad_norm_, grad_norm, grad_norm_and_zeros, registry
from pgregistry.grad_stats import CLIP_EPSILON, clip_grads_
from pgregistry.optim import build_optimizer
from pgregistry.testing import run_world

INPUT = torch.tensor([[0.5, -1.0, 2.0], [1.5, 0.25, -0.75]])


def _stage() -> tuple[nn.Module, object]:
    """Stage ``rank``'s layer (fixed weights, scaled by the rank) and the collection of two stages."""
    pgc = registry.build(ParallelLayout(num_ranks=2, pp=2))
    layer = nn.Linear(3, 2)
    with torch.no_grad():
        layer.weight.copy_(torch.arange(6.0).reshape(2, 3) / 4 * (dist.get_rank() + 1))
        layer.bias.copy_(torch.tensor([0.5, -1.0]))
    return layer, pgc


def _grads_with_a_graph(layer: nn.Module) -> list[torch.Tensor]:
    """``layer``'s grads of a squared output, made with ``create_graph=True`` and set as its ``.grad``."""
    grads = torch.autograd.grad(layer(INPUT).square().sum(), list(layer.parameters()), create_graph=True)
    for param, grad in zip(layer.parameters(), grads, strict=True):
        param.grad = grad
    return [grad.detach().clone() for grad in grads]


def _with_graphs_on_rank() -> dict[str, object]:
    layer, pgc = _stage()
    grads = _grads_with_a_graph(layer)
    norm = grad_norm(layer, pgc)
    both = grad_norm_and_zeros(layer, pgc)[0]
    clipped = clip_grad_norm_(layer, 1.0, pgc)
    return {
        "grads": grads,
        "norms": [float(norm), float(both), float(clipped)],
        "with a graph": [value.requires_grad for value in (norm, both, clipped)],
        "after": [p.grad.detach().clone() for p in layer.parameters()],
    }


def _oracle(grads_by_rank: list[list[torch.Tensor]]) -> float:
    return float(torch.cat([g.double().flatten() for grads in grads_by_rank for g in grads]).norm())


def test_grads_made_with_create_graph_give_a_norm_without_a_graph_as_torch() -> None:
    results = run_world(2, _with_graphs_on_rank, timeout=30.0)
    want = _oracle([result["grads"] for result in results])
    coefficient = 1.0 / (want + CLIP_EPSILON)
    assert want > 1.0
    for rank, result in enumerate(results):
        assert result["with a graph"] == [False, False, False], rank
        assert result["norms"] == pytest.approx([want] * 3, rel=1e-6), rank
        for got, before in zip(result["after"], result["grads"], strict=True):
            torch.testing.assert_close(got.double(), before.double() * coefficient, rtol=1e-6, atol=0)


def _clip_by_a_tensor_on_rank(path: str) -> dict[str, object]:
    layer, pgc = _stage()
    optimizer = build_optimizer(layer, pgc, optimizer="sgd", lr=0.1) if path == "optimizer" else None
    for param in layer.parameters():
        if param.grad is None:
            param.grad = param.detach() * 3 + 1
        else:  # the optimizer's view of its buffer
            param.grad.copy_(param.detach() * 3 + 1)
    grads = [p.grad.clone() for p in layer.parameters()]
    max_norm = nn.Parameter(torch.tensor(2.0))  # learnable, or a schedule's output
    if path == "clip_grad_norm_":
        norm = float(clip_grad_norm_(layer, max_norm, pgc))
    elif path == "optimizer":
        norm = float(optimizer.clip_grad_norm(max_norm))  # type: ignore[union-attr]
    else:  # the list path, given the job's norm
        norm = float(grad_norm(layer, pgc))
        clip_grads_([p.grad for p in layer.parameters()], max_norm, norm)
    return {
        "grads": grads,
        "norm": norm,
        "joined its graph": [p.grad.requires_grad or p.grad.grad_fn is not None for p in layer.parameters()],
        "after": [p.grad.detach().clone() for p in layer.parameters()],
    }


@pytest.mark.parametrize("path", ["clip_grad_norm_", "optimizer", "clip_grads_"])
def test_a_max_norm_that_requires_grad_scales_the_grads_without_joining_its_graph(path: str) -> None:
    results = run_world(2, _clip_by_a_tensor_on_rank, path, timeout=30.0)
    want = _oracle([result["grads"] for result in results])
    coefficient = 2.0 / (want + CLIP_EPSILON)
    assert coefficient < 1.0
    for rank, result in enumerate(results):
        assert result["joined its graph"] == [False, False], rank
        assert result["norm"] == pytest.approx(want, rel=1e-6)
        for got, before in zip(result["after"], result["grads"], strict=True):
            torch.testing.assert_close(got.double(), before.double() * coefficient, rtol=1e-6, atol=0)


def _flag_on_rank(flags: dict[int, object]) -> tuple[str, bool]:
    layer, pgc = _stage()
    for param in layer.parameters():
        param.grad = torch.full_like(param, math.nan)  # a non-finite norm: the flag decides
    try:
        clip_grad_norm_(layer, 1.0, pgc, error_if_nonfinite=flags[dist.get_rank()])  # type: ignore[arg-type]
        return "", all(bool(p.grad.isnan().all()) for p in layer.parameters())
    except (TypeError, ValueError, RuntimeError) as exc:
        return f"{type(exc).__name__}: {exc}", all(bool(p.grad.isnan().all()) for p in layer.parameters())


def test_error_if_nonfinite_given_as_a_string_is_refused_on_every_rank_not_taken_as_true() -> None:
    (peer, peer_left), (given, given_left) = run_world(2, _flag_on_rank, {0: False, 1: "False"}, timeout=30.0)
    assert given == "TypeError: error_if_nonfinite must be True or False, got 'False' (str)", given
    assert "another rank holding grads refused its max_norm, norm_type or error_if_nonfinite" in peer, peer
    assert peer_left and given_left


def _beyond_floats_on_rank() -> dict[str, object]:
    layer, pgc = _stage()
    for param in layer.parameters():
        param.grad = param.detach() * 3 + 1
    out: dict[str, object] = {
        "grads": [p.grad.clone() for p in layer.parameters()],
        "norm of p 10**400": float(grad_norm(layer, pgc, norm_type=10**400)),
        "inf-norm": float(grad_norm(layer, pgc, norm_type=math.inf)),
    }
    try:
        clip_grad_norm_(layer, 10**400 if dist.get_rank() == 1 else 1.0, pgc)
        out["clip"] = ""
    except (TypeError, ValueError, OverflowError) as exc:
        out["clip"] = f"{type(exc).__name__}: {exc}"
    out["unchanged"] = all(bool((p.grad == g).all()) for p, g in zip(layer.parameters(), out["grads"], strict=True))
    return out


def test_numbers_beyond_floats_range_are_infinities_not_a_bare_overflow_on_one_rank() -> None:
    """``float(10**400)`` raised a bare ``OverflowError`` before any collective on the rank given it (its peers then
    waited): now an infinity, so ``max_norm=10**400`` is refused by name on every rank and ``norm_type=10**400`` is
    the inf-norm (a p-norm's limit)."""
    results = run_world(2, _beyond_floats_on_rank, timeout=30.0)
    largest = max(float(g.abs().max()) for result in results for g in result["grads"])
    for rank, result in enumerate(results):
        assert result["norm of p 10**400"] == result["inf-norm"] == pytest.approx(largest, rel=1e-6), rank
        assert result["unchanged"], rank
    assert results[1]["clip"].startswith("ValueError: max_norm must be a positive, finite number, got 1000")
    assert "another rank holding grads refused its max_norm" in results[0]["clip"], results[0]["clip"]

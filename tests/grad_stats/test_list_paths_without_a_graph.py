"""The list paths (``norm_of_grads``, ``clip_grads_``) given grads made with ``create_graph=True`` run without grad,
as torch's ``get_total_norm`` and ``clip_grads_with_norm_`` do, and as the model paths do since the sixth round.

Reported in docs/reliability.md (hostile inputs, sixth round, left undone there): ``norm_of_grads`` still returned a
norm with an autograd graph (``requires_grad`` true) for such grads, kept alive by every logged norm; and
``clip_grads_`` recorded its in-place scaling in the grads' graph, so a gradient penalty taken through the clipped
grads was scaled too (torch's clip leaves it as through the unclipped ones). Two gloo ranks, the grads' group both of
them, against the float64 oracle of both ranks' grads and torch's penalty gradient.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from pgregistry.grad_stats import CLIP_EPSILON, clip_grads_, norm_of_grads
from pgregistry.testing import run_world

INPUT = torch.tensor([[0.5, -1.0, 2.0], [1.5, 0.25, -0.75]])


def _grads_with_a_graph(layer: nn.Module) -> list[torch.Tensor]:
    return list(torch.autograd.grad(layer(INPUT).square().sum(), list(layer.parameters()), create_graph=True))


def _penalty_gradient(layer: nn.Module, grads: list[torch.Tensor]) -> torch.Tensor:
    """The gradient of a penalty on ``grads`` with respect to the weight, through their graph."""
    return torch.autograd.grad(sum(grad.sum() for grad in grads), layer.weight)[0]


def _on_rank() -> dict[str, object]:
    both = dist.new_group([0, 1])
    layer = nn.Linear(3, 2)
    with torch.no_grad():
        layer.weight.copy_(torch.arange(6.0).reshape(2, 3) / 4 * (dist.get_rank() + 1))
        layer.bias.copy_(torch.tensor([0.5, -1.0]))
    grads = _grads_with_a_graph(layer)
    before = [grad.detach().clone() for grad in grads]
    norm = norm_of_grads({both: grads})
    coefficient = clip_grads_(grads, 1.0, norm)
    return {
        "before": before,
        "norm": float(norm),
        "with a graph": [value.requires_grad for value in (norm, coefficient)],
        "penalty": _penalty_gradient(layer, grads),
        "torch's penalty": _penalty_gradient(layer, _grads_with_a_graph(layer)),  # no clip in the graph
        "after": [grad.detach().clone() for grad in grads],
    }


def test_grads_with_a_graph_give_a_norm_and_a_scaling_without_one_as_torch() -> None:
    results = run_world(2, _on_rank, timeout=30.0)
    want = float(torch.cat([g.double().flatten() for result in results for g in result["before"]]).norm())
    assert want > 1.0
    for rank, result in enumerate(results):
        assert result["with a graph"] == [False, False], rank
        torch.testing.assert_close(result["penalty"], result["torch's penalty"], rtol=0, atol=0)
        assert result["norm"] == pytest.approx(want, rel=1e-6), rank
        for got, grad in zip(result["after"], result["before"], strict=True):
            torch.testing.assert_close(got.double(), grad.double() / (want + CLIP_EPSILON), rtol=1e-6, atol=0)

"""A NaN or infinite global grad norm never scales a grad, and sparse grads are refused by name.

Before: ``clip_grad_norm_`` multiplied every grad, the finite ones on every other rank too, by NaN (NaN norm) or
by 0 (infinite norm). Two pipeline stages in a real gloo world: the global norm covers both ranks' grads, so a
non-finite grad on one rank makes the norm non-finite on both. The finite case is checked against a float64
oracle over the grads of both stages.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from torch import nn

import pgregistry
from pgregistry import ParallelLayout, ProcessGroupCollection, clip_grad_norm_, count_zeros, grad_norm, registry
from pgregistry.grad_stats import CLIP_EPSILON
from pgregistry.testing import run_world


def _grads(rank: int) -> list[torch.Tensor]:
    """Stage ``rank``'s grads: a 2x3 weight and a bias of 2, from fixed numbers."""
    weight = torch.arange(6, dtype=torch.float32).reshape(2, 3) * (rank + 1) / 4
    bias = torch.tensor([1.5, -2.0]) * (rank + 1)
    return [weight, bias]


def _stage(poison: float | None) -> tuple[nn.Module, ProcessGroupCollection]:
    pgc = registry.build(ParallelLayout(num_ranks=2, pp=2))
    stage = nn.Linear(3, 2)
    for param, grad in zip(stage.parameters(), _grads(dist.get_rank()), strict=True):
        param.grad = grad.clone()
    if poison is not None and dist.get_rank() == 1:
        stage.bias.grad[0] = poison
    return stage, pgc


def _clip_on_rank(poison: float | None, error_if_nonfinite: bool) -> tuple[float, list[torch.Tensor], str]:
    stage, pgc = _stage(poison)
    before = [p.grad.clone() for p in stage.parameters()]
    try:
        # The default call unless asked: the non-finite cases then fail on the code before the option existed.
        options = {"error_if_nonfinite": True} if error_if_nonfinite else {}
        norm = clip_grad_norm_(stage, 1.0, pgc, **options)
    except RuntimeError as exc:
        return math.nan, [p.grad - b for p, b in zip(stage.parameters(), before, strict=True)], str(exc)
    return float(norm), [p.grad for p in stage.parameters()], ""


def test_a_finite_norm_clips_like_the_float64_oracle() -> None:
    every = torch.cat([g.double().flatten() for rank in (0, 1) for g in _grads(rank)])
    norm = float(every.norm())
    assert norm > 1.0  # so the grads are scaled
    for rank, (got_norm, grads, _) in enumerate(run_world(2, _clip_on_rank, None, False)):
        assert got_norm == pytest.approx(norm, rel=1e-6)
        for got, original in zip(grads, _grads(rank), strict=True):
            torch.testing.assert_close(got.double(), original.double() * (1.0 / (norm + CLIP_EPSILON)))


@pytest.mark.parametrize("poison", [math.nan, math.inf, -math.inf])
def test_a_non_finite_norm_leaves_every_grad_unscaled_on_every_rank(poison: float) -> None:
    for rank, (got_norm, grads, _) in enumerate(run_world(2, _clip_on_rank, poison, False)):
        assert (math.isnan(got_norm) if math.isnan(poison) else got_norm == math.inf), got_norm
        expected = _grads(rank)
        if rank == 1:
            expected[1][0] = poison
        for got, original in zip(grads, expected, strict=True):
            assert torch.equal(got, original) or torch.allclose(got, original, equal_nan=True)


def test_error_if_nonfinite_raises_on_every_rank_and_scales_nothing() -> None:
    for got_norm, changes, message in run_world(2, _clip_on_rank, math.nan, True):
        assert message.startswith("the total grad norm is nan, not finite, so the grads cannot be clipped")
        assert all(torch.nan_to_num(change).abs().max() == 0 for change in changes)
        assert math.isnan(got_norm)


def _optimizer_clip_on_rank() -> tuple[float, bool, str]:
    from pgregistry.optim import build_optimizer

    stage, pgc = _stage(None)
    pgregistry.attach(stage, pgc)
    optimizer = build_optimizer(stage, pgc, optimizer="sgd", lr=0.1)
    for param, grad in zip(stage.parameters(), _grads(dist.get_rank()), strict=True):
        param.grad.copy_(grad)
    if dist.get_rank() == 1:
        stage.bias.grad[0] = math.inf
    before = [p.grad.clone() for p in stage.parameters()]
    norm = float(optimizer.clip_grad_norm(1.0))
    unchanged = all(torch.equal(p.grad, b) for p, b in zip(stage.parameters(), before, strict=True))
    try:
        optimizer.clip_grad_norm(1.0, error_if_nonfinite=True)
    except RuntimeError as exc:
        return norm, unchanged, str(exc)
    return norm, unchanged, ""


def test_the_optimizer_clip_leaves_grads_unscaled_or_raises() -> None:
    for norm, unchanged, message in run_world(2, _optimizer_clip_on_rank):
        assert norm == math.inf and unchanged
        assert message.startswith("the total grad norm is inf, not finite")


def test_sparse_grads_are_refused_naming_the_parameter() -> None:
    off = ProcessGroupCollection(tp=None, pp=None, mp=None, tp_ep_pp=None, gtp_remat=None, expt_gtp_remat=None,
                                 ep=None, expt_tp=None)
    model = nn.Module()
    model.embedding = nn.Embedding(10, 4, sparse=True)
    model.embedding(torch.tensor([1, 2])).sum().backward()
    for call in (lambda: grad_norm(model, off), lambda: count_zeros(model, off),
                 lambda: clip_grad_norm_(model, 1.0, off)):
        with pytest.raises(TypeError, match=r"the grad of 'embedding\.weight' is torch\.sparse_coo .*need dense"):
            call()

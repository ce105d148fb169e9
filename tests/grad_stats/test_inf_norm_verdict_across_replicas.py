"""The inf-norm's non-finite verdict reaches every data-parallel replica, as the 2-norm's does (issue 41, item 12).

Two data-parallel replicas (a real 2-rank gloo world, nothing model-parallel) hold the same grads, but rank 1 has a
NaN (or an inf) in one element: not synchronised yet, or arising after the sync. The inf-norm's reductions are MAX
all-reduces, which may drop a NaN (gloo keeps whichever operand comes first), so its NaN travels as a flag; the
clip's verdict over ``intra_dist_opt`` must carry that flag too, or rank 0 (whose grads are finite) clips while
rank 1 skips, or rank 1 raises and rank 0 goes on into the next collective. Every entry point that clips by the
inf-norm is called in one world: ``clip_grad_norm_`` (with and without ``error_if_nonfinite``),
``grad_norm_and_zeros`` with ``max_norm``, and the optimizer's ``clip_grad_norm``; the finite case is checked
against the oracle (the largest |g| of the grads, computed here) and torch's clip coefficient.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
from torch import nn

from pgregistry import ParallelLayout, clip_grad_norm_, grad_norm_and_zeros, registry
from pgregistry.grad_stats import CLIP_EPSILON
from pgregistry.optim import build_optimizer
from pgregistry.testing import run_world

MAX_NORM = 1.0
GRADS = (torch.arange(6, dtype=torch.float32).reshape(2, 3) / 4, torch.tensor([1.5, -2.0]))
"""Both replicas' grads (weight, bias): the largest |g| is 2.0."""


def _clip_each_way(poison: float | None) -> dict[str, tuple[float, str, list[torch.Tensor]]]:
    """Entry point -> (the norm it returned, NaN when it raised; the error message; the grads after it)."""
    pgc = registry.build(ParallelLayout(num_ranks=2))
    model = nn.Linear(3, 2)
    optimizer = build_optimizer(model, pgc, optimizer="sgd", lr=0.1)
    calls: dict[str, Callable[[], torch.Tensor]] = {
        "clip_grad_norm_": lambda: clip_grad_norm_(model, MAX_NORM, pgc, norm_type=math.inf),
        "clip_grad_norm_ raising": lambda: clip_grad_norm_(
            model, MAX_NORM, pgc, norm_type=math.inf, error_if_nonfinite=True
        ),
        "grad_norm_and_zeros": lambda: grad_norm_and_zeros(model, pgc, norm_type=math.inf, max_norm=MAX_NORM)[0],
        "optimizer": lambda: optimizer.clip_grad_norm(MAX_NORM, norm_type=math.inf),
    }
    out = {}
    for entry, call in calls.items():
        for param, grad in zip(model.parameters(), GRADS, strict=True):
            if param.grad is None:
                param.grad = grad.clone()
            param.grad.copy_(grad)  # in place: the optimizer's buffers hold these grads
        optimizer.sync_grads()  # both replicas hold the same grads now
        if poison is not None and dist.get_rank() == 1:
            model.bias.grad[0] = poison  # one replica only
        try:
            norm, message = float(call()), ""
        except RuntimeError as error:
            norm, message = math.nan, str(error)
        out[entry] = (norm, message, [p.grad.clone() for p in model.parameters()])
    return out


def _same(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Equal element by element, a NaN equal to a NaN only."""
    return got.shape == want.shape and bool(((got == want) | (got.isnan() & want.isnan())).all())


@pytest.mark.parametrize("poison", [math.nan, math.inf])
def test_a_non_finite_grad_on_one_replica_gives_every_replica_the_same_inf_norm_verdict(poison: float) -> None:
    for rank, results in enumerate(run_world(2, _clip_each_way, poison)):
        for entry, (norm, message, grads) in results.items():
            want = [g.clone() for g in GRADS]
            if rank == 1:
                want[1][0] = poison
            assert all(_same(g, w) for g, w in zip(grads, want, strict=True)), (rank, entry, grads)  # not scaled
            if entry == "clip_grad_norm_ raising":
                assert message.startswith(f"the total grad norm is {poison}, not finite"), (rank, message)
            else:
                assert not message, (rank, entry, message)
                assert (math.isnan(norm) if math.isnan(poison) else norm == math.inf), (rank, entry, norm)


def test_finite_grads_are_clipped_by_the_inf_norm_on_every_replica() -> None:
    peak = max(float(g.abs().max()) for g in GRADS)
    coefficient = MAX_NORM / (peak + CLIP_EPSILON)
    for rank, results in enumerate(run_world(2, _clip_each_way, None)):
        for entry, (norm, message, grads) in results.items():
            assert (norm, message) == (peak, ""), (rank, entry)
            for got, grad in zip(grads, GRADS, strict=True):
                torch.testing.assert_close(got, grad * coefficient, rtol=1e-6, atol=0), (rank, entry)

"""float64 grads accumulate in float64: grads of 3e30 have a finite norm and are clipped.

Before: each group's local share was cast to float32 (``local_share``), so ``sum |g|^2`` of grads of 3e30 (9e60 an
element) overflowed to an infinite norm, and ``clip_grad_norm_`` left the grads unclipped where torch's
``get_total_norm`` gives the right number. Checked on the list path, on a model over two pipeline stages (the
shares summed across ranks), on the flat grad buffer, through an optimizer, and against torch's own norm.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from torch import nn

from pgregistry import ParallelLayout, ProcessGroupCollection, registry
from pgregistry._grad_buffer import GradBuffer
from pgregistry.collection import FIELD_NAMES
from pgregistry.grad_stats import StatsGroups, clip_grad_norm_, grad_norm, norm_of_grads
from pgregistry.testing import run_world

HUGE = 3e30
OFF = ProcessGroupCollection(**dict.fromkeys(FIELD_NAMES))


def _huge(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return HUGE * torch.rand(shape, generator=generator, dtype=torch.float64)


def _oracle(grads: list[torch.Tensor]) -> float:
    """The 2-norm in float64, scaled so no square overflows (each element below 1e31)."""
    scaled = torch.cat([g.reshape(-1) for g in grads]) / HUGE
    return float(scaled.norm()) * HUGE


def test_the_list_path_and_torch_agree_on_huge_float64_grads() -> None:
    grads = [_huge((40,), 1), _huge((7, 3), 2)]
    want = _oracle(grads)
    assert math.isfinite(want)
    assert float(norm_of_grads({None: grads})) == pytest.approx(want, rel=1e-6)
    assert float(torch.nn.utils.get_total_norm(grads)) == pytest.approx(want, rel=1e-6)  # torch: the right number


def test_the_flat_buffer_accumulates_float64_grads_in_float64() -> None:
    params = [nn.Parameter(torch.zeros(40, dtype=torch.float64)), nn.Parameter(torch.zeros(21, dtype=torch.float64))]
    buffer = GradBuffer(params, StatsGroups.from_collection(OFF))
    grads = [_huge((40,), 3), _huge((21,), 4)]
    for view, grad in zip(buffer.views, grads, strict=True):
        view.copy_(grad)
    assert float(buffer.grad_norm()) == pytest.approx(_oracle(grads), rel=1e-6)


def _stage_grads(rank: int) -> list[torch.Tensor]:
    return [_huge((4, 3), 10 + rank), _huge((4,), 20 + rank)]


def _two_stages() -> tuple[float, float, float, float]:
    """Two pipeline stages of float64 grads of up to 3e30: the norm, the norm clip returns, the norm after the clip,
    and the optimizer's clip on a fresh copy."""
    from pgregistry.optim import build_optimizer

    pgc = registry.build(ParallelLayout(num_ranks=2, pp=2))
    stage = nn.Linear(3, 4).double()
    for param, grad in zip(stage.parameters(), _stage_grads(dist.get_rank()), strict=True):
        param.grad = grad.clone()
    norm = float(grad_norm(stage, pgc))
    returned = float(clip_grad_norm_(stage, 1.0, pgc))
    after = float(grad_norm(stage, pgc))
    other = nn.Linear(3, 4).double()
    optimizer = build_optimizer(other, pgc, optimizer="sgd", lr=0.1, mixed_precision=False)  # float64 grads
    for param, grad in zip(other.parameters(), _stage_grads(dist.get_rank()), strict=True):
        param.grad.copy_(grad)
    return norm, returned, after, float(optimizer.clip_grad_norm(1.0))


def test_huge_float64_grads_over_two_stages_have_a_finite_norm_and_are_clipped() -> None:
    want = _oracle([grad for rank in (0, 1) for grad in _stage_grads(rank)])
    for rank, (norm, returned, after, optimizer_norm) in enumerate(run_world(2, _two_stages)):
        assert norm == pytest.approx(want, rel=1e-6), rank
        assert returned == pytest.approx(want, rel=1e-6), rank
        assert after == pytest.approx(1.0, rel=1e-5), rank  # clipped (before: left as it was, the norm infinite)
        assert optimizer_norm == pytest.approx(want, rel=1e-6), rank

"""On a GPU, an optimizer's ``clip_grad_norm`` whose arguments disagree across ranks scales nothing, without a host
read: the norm is NaN on every rank.

The CPU tests (``test_optim_clip_arguments_agree.py``) see every rank raise, since there the verdict is read for free;
on CUDA it is not read unless ``error_if_nonfinite`` (which reads the norm anyway). As
``tests/grad_stats/test_clip_arguments_agree_on_cuda.py`` for the functional clip: two gloo ranks on one GPU. Skipped
without CUDA: run on a GPU machine, alone (its ranks are forked, so no earlier test of the process may have
initialised CUDA; the availability check asks NVML, which does not)::

    .venv/bin/python -m pytest -q -p no:cacheprovider tests/optim/test_optim_clip_arguments_agree_on_cuda.py
"""

from __future__ import annotations

import math
import os

# torch's own availability check initialises CUDA's driver in this process, after which a forked rank cannot
# use CUDA ("Cannot re-initialize CUDA in forked subprocess"); NVML's check leaves it alone.
os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")

import pytest
import torch
import torch.distributed as dist
from torch import nn

from pgregistry import ParallelLayout, registry
from pgregistry.grad_stats import CLIP_EPSILON
from pgregistry.optim import build_optimizer
from pgregistry.testing import run_world

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

LAYOUTS: dict[str, dict[str, int]] = {"replicas": {}, "stages": {"pp": 2}}


def _grads(rank: int, stages: bool) -> list[torch.Tensor]:
    scale = rank + 1 if stages else 1
    weight = torch.arange(6, dtype=torch.float64).reshape(2, 3)
    return [weight * scale, torch.tensor([1.5, -2.0], dtype=torch.float64) * scale]


def _clip_on_rank(
    layout: str, max_norms: dict[int, float], error_if_nonfinite: bool
) -> tuple[str, bool, float, list[torch.Tensor]]:
    """The error (empty when none), whether the grads are unchanged, the norm returned and the grads after."""
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    pgc = registry.build(ParallelLayout(num_ranks=2, **LAYOUTS[layout]))
    model = nn.Linear(3, 2).to(device)
    optimizer = build_optimizer(model, pgc, optimizer="sgd", lr=0.1)
    for param, grad in zip(model.parameters(), _grads(dist.get_rank(), layout == "stages"), strict=True):
        param.main_grad.copy_(grad)
    optimizer.sync_grads()
    before = [p.main_grad.clone() for p in model.parameters()]
    try:
        norm = float(optimizer.clip_grad_norm(max_norms[dist.get_rank()], error_if_nonfinite=error_if_nonfinite))
        error = ""
    except ValueError as exc:
        norm, error = math.nan, str(exc)
    after = [p.main_grad.clone() for p in model.parameters()]
    unchanged = all(bool((a == b).all()) for a, b in zip(after, before, strict=True))
    return error, unchanged, norm, [grad.cpu() for grad in after]


def _run(layout: str, max_norms: dict[int, float], error_if_nonfinite: bool = False) -> list[tuple]:
    return run_world(2, _clip_on_rank, layout, max_norms, error_if_nonfinite, timeout=60.0)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_different_max_norms_on_a_gpu_give_nan_on_every_rank_and_scale_nothing(layout: str) -> None:
    for rank, (error, unchanged, norm, _) in enumerate(_run(layout, {0: 1.0, 1: 2.0})):
        assert error == "" and math.isnan(norm) and unchanged, (rank, error, norm)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_different_max_norms_raise_on_every_rank_with_error_if_nonfinite(layout: str) -> None:
    for rank, (error, unchanged, _, _) in enumerate(_run(layout, {0: 1.0, 1: 2.0}, error_if_nonfinite=True)):
        assert "max_norm" in error and "differs across the ranks holding grads" in error, (rank, error)
        assert unchanged, rank


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_max_norm_refused_on_one_gpu_rank_leaves_its_peer_nan_and_unscaled(layout: str) -> None:
    (peer, peer_unchanged, peer_norm, _), (refusing, refusing_unchanged, _, _) = _run(layout, {0: 1.0, 1: -1.0})
    assert refusing == "max_norm must be a positive, finite number, got -1.0"
    assert peer == "" and math.isnan(peer_norm) and peer_unchanged and refusing_unchanged


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_the_same_max_norm_on_a_gpu_clips_as_the_float64_oracle(layout: str) -> None:
    stages = layout == "stages"
    want = float(torch.cat([g.flatten() for rank in ((0, 1) if stages else (0,)) for g in _grads(rank, stages)]).norm())
    coefficient = 1.0 / (want + CLIP_EPSILON)
    for rank, (error, _, norm, grads) in enumerate(_run(layout, {0: 1.0, 1: 1.0})):
        assert error == "" and norm == pytest.approx(want, rel=1e-6), (rank, error, norm)
        for got, original in zip(grads, _grads(rank, stages), strict=True):
            torch.testing.assert_close(got.double(), original * coefficient, rtol=1e-6, atol=0)

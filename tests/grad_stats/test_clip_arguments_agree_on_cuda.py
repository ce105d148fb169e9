"""On a GPU, ranks whose clip arguments disagree scale nothing, without a host read: the norm is NaN on every rank.

The CPU tests (``test_clip_arguments_agree_across_ranks.py``) see every rank raise, since there the verdict is read
for free; on CUDA it is not read unless ``error_if_nonfinite`` (which reads the norm anyway): the finishing kernel
(pipeline stages: the verdict in the norm's row) or the torch path (replicas: its own all-reduce) makes the norm NaN,
and the clip kernel scales nothing. Two gloo ranks on one GPU (gloo reduces CUDA tensors; NCCL takes one GPU per
rank). Skipped without CUDA: run on a GPU machine, alone (its ranks are forked, so no earlier test of the process may
have initialised CUDA; the availability check asks NVML, which does not)::

    .venv/bin/python -m pytest -q -p no:cacheprovider tests/grad_stats/test_clip_arguments_agree_on_cuda.py
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

from pgregistry import ParallelLayout, clip_grad_norm_, registry
from pgregistry.grad_stats import CLIP_EPSILON
from pgregistry.grad_stats._fused import can_run_fused_stats
from pgregistry.testing import run_world

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

LAYOUTS: dict[str, dict[str, int]] = {"replicas": {}, "stages": {"pp": 2}}


def _grads(rank: int, replicas: bool) -> list[torch.Tensor]:
    scale = 1 if replicas else rank + 1
    return [torch.arange(6, dtype=torch.float32).reshape(2, 3) * scale, torch.tensor([1.5, -2.0]) * scale]


def _clip_on_rank(
    layout: str, max_norms: dict[int, float], flags: dict[int, bool]
) -> tuple[str, bool, float, bool, list[torch.Tensor]]:
    """The error (empty when none), whether the grads are unchanged, the norm returned, whether the one-read kernels
    ran, and the grads after the clip (on the host)."""
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    pgc = registry.build(ParallelLayout(num_ranks=2, **LAYOUTS[layout]))
    model = nn.Linear(3, 2).to(device)
    for param, grad in zip(model.parameters(), _grads(dist.get_rank(), layout == "replicas"), strict=True):
        param.grad = grad.to(device)
    before = [p.grad.clone() for p in model.parameters()]
    try:
        rank = dist.get_rank()
        norm = float(clip_grad_norm_(model, max_norms[rank], pgc, error_if_nonfinite=flags[rank]))
        error = ""
    except ValueError as exc:
        norm, error = math.nan, str(exc)
    unchanged = all(bool((p.grad == b).all()) for p, b in zip(model.parameters(), before, strict=True))
    return error, unchanged, norm, can_run_fused_stats(device), [p.grad.cpu() for p in model.parameters()]


def _run(layout: str, max_norms: dict[int, float], error_if_nonfinite: bool | dict[int, bool] = False) -> list[tuple]:
    flags = error_if_nonfinite if isinstance(error_if_nonfinite, dict) else dict.fromkeys(max_norms, error_if_nonfinite)
    return run_world(2, _clip_on_rank, layout, max_norms, flags, timeout=60.0)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_different_max_norms_on_a_gpu_give_nan_on_every_rank_and_scale_nothing(layout: str) -> None:
    for rank, (error, unchanged, norm, fused, _) in enumerate(_run(layout, {0: 1.0, 1: 2.0})):
        assert fused, "the one-read kernels did not run (triton missing?): this checks nothing of them"
        assert error == "" and math.isnan(norm) and unchanged, (rank, error, norm)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_different_max_norms_raise_on_every_rank_with_error_if_nonfinite(layout: str) -> None:
    for rank, (error, unchanged, _, _, _) in enumerate(_run(layout, {0: 1.0, 1: 2.0}, error_if_nonfinite=True)):
        assert "max_norm" in error and "differs across the ranks holding grads" in error, (rank, error)
        assert unchanged, rank


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_error_if_nonfinite_that_differs_raises_where_true_and_leaves_the_peer_nan_and_unscaled(layout: str) -> None:
    """The rank given ``True`` reads the norm anyway, NaN, and raises naming the flag; its peer reads nothing (no host
    sync): its norm is NaN and nothing is scaled on either (ninth round)."""
    got = _run(layout, {0: 1.0, 1: 1.0}, {0: True, 1: False})
    (raising, raising_unchanged, _, fused, _), (peer, peer_unchanged, peer_norm, _, _) = got
    assert fused, "the one-read kernels did not run (triton missing?): this checks nothing of them"
    assert "error_if_nonfinite (True on some ranks, False on others) differs across the ranks" in raising, raising
    assert peer == "" and math.isnan(peer_norm), (peer, peer_norm)
    assert raising_unchanged and peer_unchanged


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_max_norm_refused_on_one_gpu_rank_leaves_its_peer_nan_and_unscaled(layout: str) -> None:
    (peer, peer_unchanged, peer_norm, _, _), (refusing, refusing_unchanged, _, _, _) = _run(layout, {0: 1.0, 1: -1.0})
    assert refusing == "max_norm must be a positive, finite number, got -1.0"
    assert peer == "" and math.isnan(peer_norm) and peer_unchanged and refusing_unchanged


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_the_same_max_norm_on_a_gpu_clips_as_the_float64_oracle(layout: str) -> None:
    replicas = layout == "replicas"
    counted = [g.double().flatten() for rank in ((0,) if replicas else (0, 1)) for g in _grads(rank, replicas)]
    want = float(torch.cat(counted).norm())
    coefficient = 1.0 / (want + CLIP_EPSILON)
    for rank, (error, _, norm, _, grads) in enumerate(_run(layout, {0: 1.0, 1: 1.0})):
        assert error == "" and norm == pytest.approx(want, rel=1e-6), (rank, error, norm)
        for got, original in zip(grads, _grads(rank, replicas), strict=True):
            torch.testing.assert_close(got.double(), original.double() * coefficient, rtol=1e-6, atol=0)

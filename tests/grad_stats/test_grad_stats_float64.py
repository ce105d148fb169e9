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
from pgregistry.collection import FIELD_NAMES
from pgregistry.grad_stats import StatsGroups, clip_grad_norm_, grad_norm, norm_of_grads
from pgregistry.optim._grad_buffer import GradBuffer
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


# ------------------------------------------------------------------------------- beyond float32's range

BEYOND = 1e38
"""float64 grads of this size: 40 of them have a norm of 6.3e38, past float32's largest (3.4e38)."""


def _beyond(rank: int) -> list[torch.Tensor]:
    """Stage ``rank``'s float64 grads (a 4x4 weight and a bias of 4): 20 of up to 1e38 each."""
    return [_huge((4, 4), 30 + rank) / HUGE * BEYOND, _huge((4,), 40 + rank) / HUGE * BEYOND]


def _beyond_oracle(grads: list[torch.Tensor]) -> float:
    return float((torch.cat([g.reshape(-1) for g in grads]) / BEYOND).norm()) * BEYOND


def _apart_low() -> list[torch.Tensor]:
    """Stage 1's float32 grads beside stage 0's float64 ones beyond float32's range."""
    return [g / BEYOND for g in _beyond(1)]


def _beyond_float32_on_rank() -> dict[str, object]:
    """Over two pipeline stages: the norm, the clip's norm and the norm after it, of float64 grads beyond float32's
    range; the optimizer's clip (float64 grads); a model of float32 and float64 grads; bf16 grads; and the job-wide
    statistics of ``pgregistry.modules``."""
    from pgregistry import modules as mm
    from pgregistry.optim import build_optimizer

    rank = dist.get_rank()
    pgc = registry.build(ParallelLayout(num_ranks=2, pp=2))
    out: dict[str, object] = {}

    def stage(dtypes: tuple[torch.dtype, torch.dtype], grads: list[torch.Tensor]) -> nn.Linear:
        model = nn.Linear(4, 4)
        for param, dtype, grad in zip(model.parameters(), dtypes, grads, strict=True):
            param.data = param.data.to(dtype)
            param.grad = grad.to(dtype)
        return model

    wide = (torch.float64, torch.float64)
    model = stage(wide, _beyond(rank))
    norm = grad_norm(model, pgc)
    clipped = clip_grad_norm_(model, 1.0, pgc)
    out["norm"] = (norm.dtype, float(norm))
    out["clipped"] = (clipped.dtype, float(clipped))
    out["after"] = float(grad_norm(model, pgc))
    other = stage(wide, _beyond(rank))
    optimizer = build_optimizer(other, pgc, optimizer="sgd", lr=0.1, mixed_precision=False)
    for param, grad in zip(other.parameters(), _beyond(rank), strict=True):
        param.grad.copy_(grad)
    optimizer_norm = optimizer.clip_grad_norm(1.0)
    out["optimizer"] = (optimizer_norm.dtype, float(optimizer_norm), float(optimizer.get_grad_norm()))
    mixed = stage((torch.float32, torch.float64), [_beyond(rank)[0] / BEYOND, _beyond(rank)[1]])
    out["mixed"] = (grad_norm(mixed, pgc).dtype, float(grad_norm(mixed, pgc)))
    low = stage((torch.bfloat16, torch.bfloat16), [g / BEYOND for g in _beyond(rank)])
    out["bf16"] = (grad_norm(low, pgc).dtype, float(grad_norm(low, pgc)))
    modules = mm.build_modules({"language": ParallelLayout(num_ranks=2, pp=2)}, language_model="language")
    job = stage(wide, _beyond(rank))
    job_norm = mm.grad_norm({"language": job}, modules)
    job_clipped = mm.clip_grad_norm_({"language": job}, 1.0, modules)
    out["modules"] = (job_norm.dtype, float(job_norm), job_clipped.dtype, float(job_clipped))
    out["modules_after"] = float(mm.grad_norm({"language": job}, modules))
    # Stage 0's grads float64 and beyond float32's range, stage 1's float32: stage 1 reads no float64 grad, so its
    # norm is float32, and a clip made with the finite norm reports the largest float32, never inf.
    apart = stage(wide, [2 * g for g in _beyond(0)]) if rank == 0 else stage((torch.float32,) * 2, _apart_low())
    apart_clipped = clip_grad_norm_(apart, 1.0, pgc)
    out["apart"] = (apart_clipped.dtype, float(apart_clipped), float(grad_norm(apart, pgc)))
    return out


def test_float64_grads_beyond_float32s_range_keep_a_finite_float64_norm() -> None:
    """Before: every path returned the norm as float32, so 6.3e38 came back infinite while the grads had been scaled
    by the finite norm (torch's ``clip_grad_norm_`` returns 6.32e38)."""
    grads = [grad for rank in (0, 1) for grad in _beyond(rank)]
    want = _beyond_oracle(grads)
    assert want > float(torch.finfo(torch.float32).max)
    assert float(torch.nn.utils.clip_grad_norm_([nn.Parameter(g.clone()) for g in grads], 1e50)) != math.inf
    mixed = [grads[0] / BEYOND, grads[1], grads[2] / BEYOND, grads[3]]
    want_mixed = _beyond_oracle([g / BEYOND for g in mixed]) * BEYOND
    low = [(g / BEYOND).to(torch.bfloat16).double() for g in grads]
    for rank, got in enumerate(run_world(2, _beyond_float32_on_rank)):
        where = f"rank {rank}"
        for key in ("norm", "clipped"):
            dtype, value = got[key]  # type: ignore[misc]
            assert dtype == torch.float64 and value == pytest.approx(want, rel=1e-6), (where, key, got[key])
        assert got["after"] == pytest.approx(1.0, rel=1e-5), where  # clipped by the finite norm it reported
        dtype, value, after = got["optimizer"]  # type: ignore[misc]
        assert dtype == torch.float64 and value == pytest.approx(want, rel=1e-6), where
        assert after == pytest.approx(1.0, rel=1e-5), where
        assert got["mixed"] == (torch.float64, pytest.approx(want_mixed, rel=1e-6)), where  # the widest dtype
        low_norm = float(torch.cat([g.reshape(-1) for g in low]).norm())
        assert got["bf16"] == (torch.float32, pytest.approx(low_norm, rel=1e-6)), where  # no narrower than float32
        norm_dtype, norm, clip_dtype, clipped = got["modules"]  # type: ignore[misc]
        assert norm_dtype == clip_dtype == torch.float64, where
        assert norm == pytest.approx(want, rel=1e-6) and clipped == pytest.approx(want, rel=1e-6), where
        assert got["modules_after"] == pytest.approx(1.0, rel=1e-5), where
        dtype, clipped, after = got["apart"]  # type: ignore[misc]
        apart_want = _beyond_oracle([*(2 * g for g in _beyond(0)), *_apart_low()])
        assert apart_want > float(torch.finfo(torch.float32).max)
        if rank == 0:
            assert dtype == torch.float64 and clipped == pytest.approx(apart_want, rel=1e-6), where
        else:
            assert dtype == torch.float32 and clipped == float(torch.finfo(torch.float32).max), where
        assert after == pytest.approx(1.0, rel=1e-5), where  # clipped alike on both stages

"""Norms whose ``sum |g|^p`` leaves the accumulation range are exact, and clips scale by them.

Before: each tensor's ``p``-norm was torch's, accumulated in the grad's precision, and ``sum |g|^p`` was not
scaled, so float32 grads of 1e10 with ``norm_type=4``, grads of 3 and 4 with ``norm_type=1000`` and float64 grads of
1e160 with the 2-norm gave ``inf`` (a clip from them skipped, as for a non-finite grad), and float32 grads of 1e-25
with the 2-norm or of 0.5 with ``norm_type=1000`` gave 0 (a clip to 0.1 of the latter scaled nothing). Checked over
two pipeline stages (the shares summed over both ranks) on every path that reads grads: ``grad_norm`` and
``clip_grad_norm_`` (the plan's list read), the list path (``norm_of_grads``), the optimizer's flat buffer,
``pgregistry.modules``' job-wide statistics, DTensor pieces sharded over the data-parallel mesh, and at TP 2 (a
replicated grad counted on one rank, read on the other for the verdict only); against norms computed exactly in
decimal arithmetic. Non-finite grads keep their verdict on every rank.
"""

from __future__ import annotations

import math
from decimal import Decimal, localcontext

import pytest
import torch
import torch.distributed as dist
from torch import nn

from pgregistry import ParallelLayout, registry
from pgregistry.grad_stats import clip_grad_norm_, grad_norm, norm_of_grads
from pgregistry.params import mark_tensor_parallel
from pgregistry.testing import run_world

CASES: dict[str, tuple[torch.dtype, float, float]] = {
    # name: (dtype, norm_type, max_norm)
    "float32-1e10-p4": (torch.float32, 4.0, 1.0),
    "3-and-4-p1000": (torch.float32, 1000.0, 1.0),
    "float64-1e160-beside-1-p2": (torch.float64, 2.0, 1.0),
    "float64-squares-overflowing-in-the-sum-over-ranks-only": (torch.float64, 2.0, 1.0),
    "float32-1e-25-p2": (torch.float32, 2.0, 5e-7),
    "half-p1000": (torch.float32, 1000.0, 0.1),
    "zeros-p4": (torch.float32, 4.0, 1.0),
    "3-and-4-p1e300": (torch.float32, 1e300, 1.0),
}
NONFINITE = {"nan-beside-1e10-p4": math.nan, "inf-beside-1e10-p4": math.inf}
SHAPES = ((4, 3), (4,))
"""An ``nn.Linear(3, 4)``'s weight and bias: each rank's stage."""


def _uniform(shape: tuple[int, ...], seed: int, low: float, high: float) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return low + (high - low) * torch.rand(shape, generator=generator, dtype=torch.float64)


def _grads(case: str, rank: int) -> list[torch.Tensor]:
    """Stage ``rank``'s grads for ``case`` (float64, exactly representable in the case's dtype)."""
    dtype = CASES[case][0] if case in CASES else torch.float32
    seeds = [100 * rank + index for index in range(len(SHAPES))]
    if case in ("float32-1e10-p4", *NONFINITE):
        grads = [_uniform(shape, seed, 0.5e10, 1.5e10) for shape, seed in zip(SHAPES, seeds, strict=True)]
    elif case.startswith("3-and-4"):
        grads = [torch.full(shape, 3.0, dtype=torch.float64) for shape in SHAPES]
        grads[0][rank, rank] = 4.0 * (rank + 1) / 2  # 2 on rank 0, 4 on rank 1
        grads[1][0] = -3.0
    elif case == "float64-1e160-beside-1-p2":
        scale = 1e160 if rank == 0 else 1.0
        grads = [_uniform(shape, seed, -scale, scale) for shape, seed in zip(SHAPES, seeds, strict=True)]
    elif case == "float64-squares-overflowing-in-the-sum-over-ranks-only":
        # 16 squares of up to 9.6e306 a rank: 1.5e308 at most, finite; the sum of both ranks is not.
        grads = [_uniform(shape, seed, 2.9e153, 3.1e153) for shape, seed in zip(SHAPES, seeds, strict=True)]
    elif case == "float32-1e-25-p2":
        grads = [_uniform(shape, seed, -1.5e-25, 1.5e-25) for shape, seed in zip(SHAPES, seeds, strict=True)]
    elif case == "half-p1000":
        grads = [_uniform(shape, seed, 0.4, 0.6) for shape, seed in zip(SHAPES, seeds, strict=True)]
    else:
        assert case == "zeros-p4", case
        grads = [torch.zeros(shape, dtype=torch.float64) for shape in SHAPES]
    grads = [grad.to(dtype).double() for grad in grads]
    if case in NONFINITE and rank == 1:
        grads[1][2] = NONFINITE[case]
    return grads


def _exact_norm(values: list[float], p: float) -> float:
    """``(sum |x|^p)^(1/p)`` in 60-digit decimal arithmetic (no float range to leave)."""
    if p > 1e6:  # the largest |x| times (a count)^(1/p): 1 to within 1e-294
        return max(map(abs, values))
    with localcontext() as context:
        context.prec = 60
        exponent = Decimal(int(p)) if p == int(p) else Decimal(p)
        total = sum((abs(Decimal(value)) ** exponent for value in values), Decimal(0))
        if total == 0:
            return 0.0
        return float(total ** (Decimal(1) / Decimal(p)))


def _coefficient(max_norm: float, norm: float) -> float:
    return min(1.0, max_norm / (norm + 1e-6))


def _stage(dtype: torch.dtype, grads: list[torch.Tensor]) -> nn.Linear:
    model = nn.Linear(3, 4).to(dtype)
    for param, grad in zip(model.parameters(), grads, strict=True):
        param.grad = grad.to(dtype, copy=True)  # its own: a clip scales it in place
    return model


def _grads_of(model: nn.Module) -> list[list[float]]:
    return [param.grad.double().reshape(-1).tolist() for param in model.parameters()]  # type: ignore[union-attr]


def _on_rank(case: str) -> dict[str, object]:
    """Every path's norm of ``case`` over two pipeline stages, and the grads each clip left."""
    from torch.distributed.tensor import DTensor, Shard

    from pgregistry import modules as mm
    from pgregistry.mesh import to_device_mesh
    from pgregistry.optim import build_optimizer

    rank = dist.get_rank()
    dtype, p, max_norm = CASES.get(case, (torch.float32, 4.0, 1.0))
    grads = _grads(case, rank)
    pgc = registry.build(ParallelLayout(num_ranks=2, pp=2))
    out: dict[str, object] = {}
    model = _stage(dtype, grads)
    out["grad_norm"] = float(grad_norm(model, pgc, norm_type=p))
    out["list"] = float(norm_of_grads({pgc.get("mp"): [g.to(dtype) for g in grads]}, p))
    out["clip"] = float(clip_grad_norm_(model, max_norm, pgc, norm_type=p))
    out["clipped"] = _grads_of(model)
    optimized = _stage(dtype, grads)
    optimizer = build_optimizer(optimized, pgc, optimizer="sgd", lr=0.1, mixed_precision=False)
    for param, grad in zip(optimized.parameters(), grads, strict=True):
        param.grad.copy_(grad)  # type: ignore[union-attr]
    out["optimizer norm"] = float(optimizer.get_grad_norm(p))
    out["optimizer clip"] = float(optimizer.clip_grad_norm(max_norm, p))
    out["optimizer clipped"] = _grads_of(optimized)
    modules = mm.build_modules({"language": ParallelLayout(num_ranks=2, pp=2)}, language_model="language")
    job = _stage(dtype, grads)
    out["modules"] = float(mm.grad_norm({"language": job}, modules, norm_type=p))
    # Each rank's grads as its piece of one DTensor sharded over the data-parallel mesh: summed over it first.
    flat = registry.build(ParallelLayout(num_ranks=2))
    mesh = to_device_mesh(flat, ("dp_cp",), device_type="cpu")
    sharded = nn.Module()
    piece = torch.cat([grad.reshape(-1) for grad in grads]).to(dtype).reshape(2, 8)
    sharded.d = nn.Parameter(DTensor.from_local(torch.zeros(2, 8, dtype=dtype), mesh, [Shard(0)], run_check=False))
    sharded.d.grad = DTensor.from_local(piece, mesh, [Shard(0)], run_check=False)
    out["dtensor"] = float(grad_norm(sharded, flat, norm_type=p))
    if case in CASES:  # TP 2: each rank's weight a slice, rank 0's bias on both (counted once, read twice)
        split = _stage(dtype, [grads[0], _grads(case, 0)[1]])
        mark_tensor_parallel(split.weight, 0)
        out["tp"] = float(grad_norm(split, registry.build(ParallelLayout(num_ranks=2, tp=2)), norm_type=p))
    return out


def _every_case_on_rank() -> dict[str, dict[str, object]]:
    return {case: _on_rank(case) for case in (*CASES, *NONFINITE)}


@pytest.fixture(scope="module")
def results() -> list[dict[str, dict[str, object]]]:
    return run_world(2, _every_case_on_rank, timeout=120)


@pytest.mark.parametrize("case", list(CASES))
def test_the_norm_is_exact_and_the_clip_scales_by_it(results: list[dict[str, dict[str, object]]], case: str) -> None:
    dtype, p, max_norm = CASES[case]
    grads = [_grads(case, rank) for rank in (0, 1)]
    values = [float(x) for stage in grads for grad in stage for x in grad.reshape(-1).tolist()]
    want = _exact_norm(values, p)
    assert math.isfinite(want) and want <= float(torch.finfo(dtype).max), case
    coefficient = _coefficient(max_norm, want)
    once = [*grads[0][0].reshape(-1).tolist(), *grads[1][0].reshape(-1).tolist(), *grads[0][1].tolist()]
    want_tp = _exact_norm(once, p)
    for rank, got in enumerate(results):
        where = (case, f"rank {rank}")
        for path in ("grad_norm", "list", "clip", "optimizer norm", "optimizer clip", "modules", "dtensor"):
            assert got[case][path] == pytest.approx(want, rel=1e-6, abs=0.0), (*where, path)
        assert got[case]["tp"] == pytest.approx(want_tp, rel=1e-6, abs=0.0), (*where, "tp")
        for path in ("clipped", "optimizer clipped"):
            expected = [[x * coefficient for x in grad.reshape(-1).tolist()] for grad in grads[rank]]
            for clipped, scaled in zip(got[case][path], expected, strict=True):  # type: ignore[call-overload]
                assert clipped == pytest.approx(scaled, rel=1e-5, abs=0.0), (*where, path)


@pytest.mark.parametrize("case", list(NONFINITE))
def test_a_nonfinite_grad_keeps_its_verdict_beside_an_overflow(
    results: list[dict[str, dict[str, object]]], case: str
) -> None:
    """Rank 0's grads overflow ``sum |g|^4`` in float32, rank 1 holds a NaN or an inf: the norm is NaN or inf on
    both ranks (no rescue makes it finite) and every clip leaves the grads as they were."""
    for rank, got in enumerate(results):
        for path in ("grad_norm", "list", "clip", "optimizer norm", "optimizer clip", "modules", "dtensor"):
            value = got[case][path]
            assert (math.isnan(value) if math.isnan(NONFINITE[case]) else value == math.inf), (case, rank, path, value)
        for path in ("clipped", "optimizer clipped"):
            before = [grad.reshape(-1).tolist() for grad in _grads(case, rank)]
            assert str(got[case][path]) == str(before), (case, rank, path)

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

The 1- and 2-norm are exact in the one reduction, with no host read of the norm (as torch's ``clip_grad_norm_``, a
training loop's clip must not wait on the device): every ``|g|`` and ``g * g`` accumulates in float64 from the
first element, a float64 grad's squares by range. Their cases run with the host read and the exact norm's second
look replaced by a raise (``_needs_exact_norm``, ``_exact_norm``): float32 and bf16 grads of 1e20 (float32 squares
overflow), of 1e-25 (they underflow), float32 grads of 1e38 summed (beyond float32: the clip scales by the float64
norm), float64 grads of 1e160 and 1e-170, and float64 grads of 1e160 on one stage beside float32 grads on the other
(a decision taken from each rank's dtypes would have sent only the float64 stage into the exact norm's collectives:
a hang). Float64 grads on both sides of 2**256 and of 2**-256 fill two range columns at once: the columns' combination
divided by ``2**600 * 2**600`` (inf in float64), so the middle column beside a large square and the small one beside
a middle square were dropped (the 2**256 case's norm 18% low).
"""

from __future__ import annotations

import math
from contextlib import ExitStack
from decimal import Decimal, localcontext
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch import nn

from pgregistry import ParallelLayout, registry
from pgregistry.grad_stats import _reductions, clip_grad_norm_, grad_norm, norm_of_grads
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
    "float32-1e20-p2": (torch.float32, 2.0, 1.0),
    "float32-1e20-p1": (torch.float32, 1.0, 1.0),
    "float32-1e-25-p1": (torch.float32, 1.0, 5e-7),
    "bf16-1e20-p2": (torch.bfloat16, 2.0, 1.0),
    "bf16-1e-25-p2": (torch.bfloat16, 2.0, 5e-7),
    "float32-1e38-p1": (torch.float32, 1.0, 1e38),
    "float64-1e-170-p2": (torch.float64, 2.0, 1e-171),
    "float64-1e160-stage-beside-a-float32-stage-p2": (torch.float64, 2.0, 1.0),
    # float64 grads on both sides of a range edge: squares in the large (or small) column and in the middle one
    "float64-2^256-p2": (torch.float64, 2.0, 1.0),
    "float64-2^-256-p2": (torch.float64, 2.0, 1e-80),
}
MIXED = "float64-1e160-stage-beside-a-float32-stage-p2"
"""Stage 0's grads float64, stage 1's float32."""
NONFINITE = {"nan-beside-1e10-p4": math.nan, "inf-beside-1e10-p4": math.inf}
SHAPES = ((4, 3), (4,))
"""An ``nn.Linear(3, 4)``'s weight and bias: each rank's stage."""


def _uniform(shape: tuple[int, ...], seed: int, low: float, high: float) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return low + (high - low) * torch.rand(shape, generator=generator, dtype=torch.float64)


def _dtype(case: str, rank: int) -> torch.dtype:
    if case == MIXED:
        return torch.float64 if rank == 0 else torch.float32
    return CASES[case][0] if case in CASES else torch.float32


def _grads(case: str, rank: int) -> list[torch.Tensor]:
    """Stage ``rank``'s grads for ``case`` (float64, exactly representable in the case's dtype)."""
    dtype = _dtype(case, rank)
    seeds = [100 * rank + index for index in range(len(SHAPES))]
    magnitude = {"1e20": 1e20, "1e-25": 1e-25, "1e38": 1e38, "1e-170": 1e-170, "2^256": 2.0**256, "2^-256": 2.0**-256}
    size = next((value for name, value in magnitude.items() if f"-{name}-" in case), None)
    if size is not None:
        grads = [_uniform(shape, seed, 0.5 * size, 1.5 * size) for shape, seed in zip(SHAPES, seeds, strict=True)]
        grads[0][0] *= -1  # a row of negative grads
    elif case == MIXED:
        scale = 1e160 if rank == 0 else 1.0
        grads = [_uniform(shape, seed, -scale, scale) for shape, seed in zip(SHAPES, seeds, strict=True)]
    elif case in ("float32-1e10-p4", *NONFINITE):
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
    """Every path's norm of ``case`` over two pipeline stages, and the grads each clip left (:func:`_every_path`);
    for the 1- and 2-norm with the host read and the exact norm's second look refused."""
    rank = dist.get_rank()
    _, p, max_norm = CASES.get(case, (torch.float32, 4.0, 1.0))
    dtype = _dtype(case, rank)
    grads = _grads(case, rank)
    with ExitStack() as refused:
        if p in (1.0, 2.0):  # no host read, no second look: both raise if reached
            for name in ("_needs_exact_norm", "_exact_norm"):
                refused.enter_context(mock.patch.object(_reductions, name, side_effect=AssertionError(name)))
        return _every_path(case, dtype, p, max_norm, grads)


def _every_path(
    case: str, dtype: torch.dtype, p: float, max_norm: float, grads: list[torch.Tensor]
) -> dict[str, object]:
    from torch.distributed.tensor import DTensor, Shard

    from pgregistry import modules as mm
    from pgregistry.mesh import to_device_mesh
    from pgregistry.optim import build_optimizer

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
    if case in CASES and case != MIXED:  # TP 2: each rank's weight a slice, rank 0's bias on both (counted once)
        split = _stage(dtype, [grads[0], _grads(case, 0)[1]])
        mark_tensor_parallel(split.weight, 0)
        out["tp"] = float(grad_norm(split, registry.build(ParallelLayout(num_ranks=2, tp=2)), norm_type=p))
    return out


def _every_case_on_rank() -> dict[str, dict[str, object]]:
    return {case: _on_rank(case) for case in (*CASES, *NONFINITE)}


@pytest.fixture(scope="module")
def results() -> list[dict[str, dict[str, object]]]:
    return run_world(2, _every_case_on_rank, timeout=60)


def _returned(want: float, dtype: torch.dtype, path: str) -> float:
    """The norm a ``path`` returns for the exact norm ``want``: beyond float32's range, a float32 norm is inf, a
    clip's the largest float32 (it scaled by the finite float64 norm)."""
    largest = float(torch.finfo(torch.float32).max)
    if want <= largest or dtype == torch.float64:
        return want
    return largest if "clip" in path else math.inf


@pytest.mark.parametrize("case", list(CASES))
def test_the_norm_is_exact_and_the_clip_scales_by_it(results: list[dict[str, dict[str, object]]], case: str) -> None:
    _, p, max_norm = CASES[case]
    grads = [_grads(case, rank) for rank in (0, 1)]
    values = [float(x) for stage in grads for grad in stage for x in grad.reshape(-1).tolist()]
    want = _exact_norm(values, p)
    assert math.isfinite(want), case
    coefficient = _coefficient(max_norm, want)
    once = [*grads[0][0].reshape(-1).tolist(), *grads[1][0].reshape(-1).tolist(), *grads[0][1].tolist()]
    want_tp = _exact_norm(once, p)
    for rank, got in enumerate(results):
        where = (case, f"rank {rank}")
        dtype = _dtype(case, rank)
        for path in ("grad_norm", "list", "clip", "optimizer norm", "optimizer clip", "modules", "dtensor"):
            if case == MIXED and path == "modules":
                continue  # stage 1 returns its module norm as float32, inf: a documented limit (docs/reliability.md)
            returned = _returned(want, dtype, path)
            assert got[case][path] == pytest.approx(returned, rel=1e-6, abs=0.0), (*where, path)
        if "tp" in got[case]:
            assert got[case]["tp"] == pytest.approx(_returned(want_tp, dtype, "tp"), rel=1e-6, abs=0.0), (*where, "tp")
        rel = 1e-5 if dtype in (torch.float32, torch.float64) else 2.0**-8  # a clipped bf16 grad is rounded to bf16
        for path in ("clipped", "optimizer clipped"):
            # In the grads' dtype: stage 1's float32 grads of 1 scaled by 4e-161 are 0.
            expected = [(grad * coefficient).to(dtype).double().reshape(-1).tolist() for grad in grads[rank]]
            for clipped, scaled in zip(got[case][path], expected, strict=True):  # type: ignore[call-overload]
                assert clipped == pytest.approx(scaled, rel=rel, abs=0.0), (*where, path)


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

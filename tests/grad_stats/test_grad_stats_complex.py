"""Complex grads: their norm is ``(sum |z|^p)^(1/p)`` and an element is a zero when ``z == 0``, as torch's.

Reported against 7f5a08f: complex grads at TP 2 raised ``linalg.vector_norm: dtype should be complex`` on the rank
that counts them, and where only a TP-replicated grad is complex, only TP rank 0 counts it: rank 0 raised while
rank 1 went on into the norm's all-reduce and waited. Now complex grads are read through their moduli on every
rank, in a 2-rank TP world: the 2-, 3- and inf-norms and the zero count against the float64 oracle of the
unsharded model, and the clip (every grad, the duplicate too, scaled by the oracle's coefficient).
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from pgregistry import ParallelLayout, registry
from pgregistry.grad_stats import CLIP_EPSILON, clip_grad_norm_, count_zeros, grad_norm
from pgregistry.params import mark_tensor_parallel
from pgregistry.testing import run_world

MAX_NORM = 1.0


def _weight(rank: int) -> torch.Tensor:
    """TP rank ``rank``'s shard of the weight: complex, a zero and a purely imaginary element among them."""
    return torch.tensor([[3 + 4j, 0, 1j], [-2, 0.5 - 1j, 2j]], dtype=torch.complex128) * (rank + 1)


BIAS = torch.tensor([1 + 1j, 0, -3j], dtype=torch.complex128)
"""The TP-replicated bias's grad (the same on both ranks; rank 0 counts it)."""


def _on_rank(dtype: torch.dtype, complex_weight: bool) -> dict[str, Any]:
    collection = registry.build(ParallelLayout(num_ranks=2, tp=2))
    model = nn.Module()
    weight = _weight(dist.get_rank())
    model.weight = nn.Parameter(torch.zeros(2, 3, dtype=dtype if complex_weight else dtype.to_real()))
    model.bias = nn.Parameter(torch.zeros(3, dtype=dtype))
    mark_tensor_parallel(model.weight, 0)
    model.weight.grad = (weight if complex_weight else weight.abs()).to(model.weight.dtype)
    model.bias.grad = BIAS.to(dtype)
    norms = {p: grad_norm(model, collection, norm_type=p) for p in (2.0, 3.0, math.inf)}
    out: dict[str, Any] = {f"norm{p}": float(norm) for p, norm in norms.items()}
    out["dtype"] = norms[2.0].dtype
    out["zeros"] = count_zeros(model, collection)
    before = [p.grad.clone() for p in model.parameters()]
    out["clipped"] = float(clip_grad_norm_(model, MAX_NORM, collection))
    after = [p.grad.to(torch.complex128) for p in model.parameters()]
    out["scaled"] = list(zip(after, [b.to(torch.complex128) for b in before], strict=True))
    return out


@pytest.mark.parametrize(
    ("dtype", "complex_weight"),
    [(torch.complex64, True), (torch.complex128, True), (torch.complex64, False)],
    ids=["complex64", "complex128", "only-the-duplicate-complex"],
)
def test_complex_grads_have_torchs_norm_and_zero_count_on_every_rank(dtype: torch.dtype, complex_weight: bool) -> None:
    weights = [_weight(rank) if complex_weight else _weight(rank).abs().to(torch.complex128) for rank in (0, 1)]
    every = torch.cat([*(w.reshape(-1) for w in weights), BIAS])
    moduli = every.abs()  # float64
    coeff = min(1.0, MAX_NORM / (float(moduli.norm()) + CLIP_EPSILON))
    rel = 1e-6 if dtype == torch.complex64 else 1e-12
    for rank, got in enumerate(run_world(2, _on_rank, dtype, complex_weight)):
        where = (dtype, complex_weight, rank)
        assert got["norm2.0"] == pytest.approx(float(moduli.pow(2).sum().sqrt()), rel=rel), where
        assert got["norm3.0"] == pytest.approx(float(moduli.pow(3).sum() ** (1 / 3)), rel=rel), where
        assert got["norminf"] == pytest.approx(float(moduli.max()), rel=rel), where
        assert got["dtype"] == (torch.float64 if dtype == torch.complex128 else torch.float32), where
        assert got["zeros"] == int((every == 0).sum()), where  # 1j is no zero
        assert got["clipped"] == pytest.approx(float(moduli.norm()), rel=rel), where
        for after, before in got["scaled"]:  # every grad this rank holds, the duplicate too, scaled alike
            torch.testing.assert_close(after, before * coeff, rtol=rel * 10, atol=0)


def _optimizer_refusals() -> list[str]:
    """The error of ``build_optimizer`` over a model whose complex parameter is on every rank (TP 2), then on the
    last of two pipeline stages only."""
    from pgregistry.optim import build_optimizer

    errors = []
    for layout, complex_here in (({"tp": 2}, True), ({"pp": 2}, dist.get_rank() == 1)):
        collection = registry.build(ParallelLayout(num_ranks=2, **layout))
        model = nn.Linear(3, 2, dtype=torch.complex64 if complex_here else torch.float32)
        try:
            build_optimizer(model, collection, optimizer="sgd", lr=0.1)
            errors.append("")
        except TypeError as exc:
            errors.append(str(exc))
    return errors


def test_the_optimizer_refuses_a_complex_parameter_on_every_rank() -> None:
    """Before: the stage holding it raised alone and the other waited in the builder's next all-reduce."""
    for rank, errors in enumerate(run_world(2, _optimizer_refusals)):
        for error, complex_here in zip(errors, (True, rank == 1), strict=True):
            assert "build_optimizer steps floating-point parameters only" in error, (rank, error)
            assert ("here: ['weight', 'bias']" in error) == complex_here, (rank, error)

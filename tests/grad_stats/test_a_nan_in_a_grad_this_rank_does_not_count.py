"""A NaN or an inf in a grad this rank holds but does not count makes the norm non-finite on every rank.

Reported against 7f5a08f: at TP 2, a TP-replicated grad holding a NaN on TP rank 1 only (rank 0 counts the grad,
rank 1 holds a duplicate it does not count) gave every rank a finite norm through ``grad_norm``, the optimizer's
``clip_grad_norm`` and ``pgregistry.modules``; the clip and the step went ahead and rank 1's weights became NaN.
The verdict covers every grad a rank holds, counted or not, and is the same on every rank: the duplicate's NaN rides
in the reduction its counted copy's share travels in (no collective more).

Each class of grad a rank does not count, in a 2-rank gloo world: a TP duplicate, an expert TP duplicate, a GTP
duplicate, a ``shared`` copy (a tie over two stages), a DTensor ``Replicate`` over TP; and the optimizer (flat and
sharded) and the job-wide statistics of ``pgregistry.modules``. The finite case of each is checked against its
float64 oracle, so the grads the poison goes into are the ones the statistics do not count, and the zero count of
the poisoned call against the oracle too (the duplicate is read for its NaN, never counted).
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import pgregistry
from pgregistry import ParallelLayout, registry
from pgregistry.grad_stats import clip_grad_norm_, grad_norm, grad_norm_and_zeros
from pgregistry.params import mark_expert, mark_gtp_sharded, mark_shared, mark_tensor_parallel
from pgregistry.testing import run_world

POISONS = (math.nan, math.inf)


def _grad(rank: int, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Fixed grads (a few exact zeros among them), different on each rank and for each tensor."""
    values = torch.arange(math.prod(shape), dtype=torch.float64).reshape(shape) - 1.0
    return values * (0.5 + 0.25 * rank + 0.125 * seed)


# One case per class of grad a rank does not count: the layout, which parameter of the two-parameter model is the
# duplicate (held by both ranks, counted on rank 0 only), and how the other one is marked distinct per rank.
CASES: dict[str, dict[str, int]] = {
    "tp-duplicate": {"tp": 2},
    "expert-tp-duplicate": {"expt_tp": 2},
    "gtp-duplicate": {"gtp_remat": 2},
    "shared-copy": {"pp": 2},
    "dtensor-replicate-over-tp": {"tp": 2},
}


def _model(case: str, collection: Any) -> nn.Module:
    """``distinct`` (counted on both ranks) and ``duplicate`` (a copy on rank 1, counted on rank 0 only), their
    grads :func:`_grad` of this rank (the duplicate's rank 0's on both ranks, as replicas hold)."""
    rank = dist.get_rank()
    model = nn.Module()
    model.distinct = nn.Parameter(torch.zeros(2, 3))
    model.duplicate = nn.Parameter(torch.zeros(4))
    if case == "tp-duplicate":
        mark_tensor_parallel(model.distinct, 0)
    elif case == "expert-tp-duplicate":
        mark_expert(mark_tensor_parallel(model.distinct, 0))
        mark_expert(model.duplicate)  # replicated over expert TP, which the dense TP (off) does not see
    elif case == "gtp-duplicate":
        mark_gtp_sharded(model.distinct)
    elif case == "shared-copy":
        if rank == 1:
            mark_shared(model.duplicate)  # the last stage's copy of a tie: stage 0 counts it
    elif case == "dtensor-replicate-over-tp":
        from torch.distributed.tensor import Replicate, distribute_tensor

        from pgregistry.mesh import to_device_mesh

        mark_tensor_parallel(model.distinct, 0)
        mesh = to_device_mesh(collection, ("tp",), device_type="cpu")
        model.duplicate = nn.Parameter(distribute_tensor(torch.zeros(4), mesh, [Replicate()], src_data_rank=None))
    model.distinct.grad = _grad(rank, (2, 3), 0).float()
    duplicate = _grad(0, (4,), 1).float()
    if case == "dtensor-replicate-over-tp":
        from torch.distributed.tensor import DTensor

        dtensor = model.duplicate
        model.duplicate.grad = DTensor.from_local(duplicate, dtensor.device_mesh, dtensor.placements)
    else:
        model.duplicate.grad = duplicate
    return model


def _local(grad: torch.Tensor) -> torch.Tensor:
    return grad._local_tensor if hasattr(grad, "_local_tensor") else grad


def _poison(model: nn.Module, poison: float) -> None:
    if dist.get_rank() == 1:
        _local(model.duplicate.grad)[1] = poison


def _same(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Equal element by element, a NaN equal only to a NaN."""
    return bool(((got == want) | (got.isnan() & want.isnan())).all())


def _statistics_of_every_case() -> tuple[dict[str, dict[str, Any]], tuple[int, int]]:
    return {case: _statistics_of_a_case(case) for case in CASES}, _collectives()


def _collectives() -> tuple[int, int]:
    """All-reduces a clip issues at TP 2 over a model with a TP duplicate, and over the same model with none."""
    collection = registry.build(ParallelLayout(num_ranks=2, tp=2))
    calls: list[object] = []
    real = dist.all_reduce

    def counting(*args: object, **kwargs: object) -> object:
        calls.append(kwargs.get("group"))
        return real(*args, **kwargs)  # type: ignore[arg-type]

    counts = []
    for duplicate in (True, False):
        model = _model("tp-duplicate", collection)
        if not duplicate:
            mark_tensor_parallel(model.duplicate, 0)
        dist.all_reduce = counting  # type: ignore[assignment]
        try:
            clip_grad_norm_(model, 1e-3, collection)
        finally:
            dist.all_reduce = real
        counts.append(len(calls))
        calls.clear()
    return counts[0], counts[1]


def _statistics_of_a_case(case: str) -> dict[str, Any]:
    collection = registry.build(ParallelLayout(num_ranks=2, **CASES[case]))
    model = _model(case, collection)
    out: dict[str, Any] = {"finite": float(grad_norm(model, collection))}
    for poison in POISONS:
        model = _model(case, collection)
        _poison(model, poison)
        before = [_local(p.grad).clone() for p in model.parameters()]
        norm, zeros = grad_norm_and_zeros(model, collection)
        clipped = float(clip_grad_norm_(model, 1e-3, collection))
        unchanged = all(_same(_local(p.grad), b) for p, b in zip(model.parameters(), before, strict=True))
        try:
            clip_grad_norm_(model, 1e-3, collection, error_if_nonfinite=True)
            raised = ""
        except RuntimeError as exc:
            raised = str(exc)
        out[str(poison)] = {
            "norm": float(grad_norm(model, collection)),
            "inf_norm": float(grad_norm(model, collection, norm_type=math.inf)),
            "with_zeros": float(norm),
            "zeros": int(zeros),
            "clipped": clipped,
            "unchanged": unchanged,
            "raised": raised,
        }
    return out


def _oracle_grads() -> list[torch.Tensor]:
    """Every distinct grad of the unsharded model, once: each rank's ``distinct``, the duplicate once."""
    return [_grad(0, (2, 3), 0), _grad(1, (2, 3), 0), _grad(0, (4,), 1)]


def _non_finite(value: float, poison: float) -> bool:
    return math.isnan(value) if math.isnan(poison) else value == math.inf


def test_a_non_finite_grad_this_rank_does_not_count_makes_the_norm_non_finite_on_every_rank() -> None:
    every = torch.cat([grad.flatten() for grad in _oracle_grads()])
    oracle_zeros = int((every == 0).sum())
    for rank, (by_case, (with_duplicate, without)) in enumerate(run_world(2, _statistics_of_every_case)):
        assert with_duplicate == without, rank  # the duplicate's NaN rides in the norm's all-reduce: none more
        for case, got in by_case.items():
            where = f"{case}, rank {rank}"
            assert got["finite"] == pytest.approx(float(every.norm()), rel=1e-6), where  # the duplicate counted once
            for poison in POISONS:
                seen = got[str(poison)]
                for key in ("norm", "inf_norm", "with_zeros", "clipped"):
                    assert _non_finite(seen[key], poison), (where, poison, key, seen[key])
                assert seen["zeros"] == oracle_zeros, (where, poison)  # the duplicate is never counted
                assert seen["unchanged"], (where, poison)  # nothing scaled, on either rank
                assert seen["raised"].startswith("the total grad norm is"), (where, poison)


# ------------------------------------------------------------------------------------------------- optimizers


def _optimizer_clips() -> dict[tuple[bool, float], dict[str, Any]]:
    return {(sharded, poison): _optimizer_clip(sharded, poison) for sharded in (False, True) for poison in POISONS}


def _optimizer_clip(sharded: bool, poison: float) -> dict[str, Any]:
    from pgregistry.optim import build_optimizer

    collection = registry.build(ParallelLayout(num_ranks=2, tp=2))
    model = nn.Linear(3, 2)
    mark_tensor_parallel(model.weight, 0)
    pgregistry.attach(model, collection)
    optimizer = build_optimizer(model, collection, optimizer="sgd", lr=0.1, sharded=sharded)
    model.weight.grad.copy_(_grad(dist.get_rank(), (2, 3), 0))
    model.bias.grad.copy_(_grad(0, (2,), 1))
    finite = float(optimizer.get_grad_norm())
    if dist.get_rank() == 1:
        model.bias.grad[1] = poison  # the TP duplicate rank 0 counts
    if sharded:
        optimizer.sync_grads()  # a sharded optimizer's clip reads its shard of the synchronised grads
    before = [g.clone() for child in optimizer.chained_optimizers for g in child.grads_to_clip()]
    norm = float(optimizer.clip_grad_norm(1e-3))
    after = [g for child in optimizer.chained_optimizers for g in child.grads_to_clip()]
    try:
        optimizer.clip_grad_norm(1e-3, error_if_nonfinite=True)
        raised = ""
    except RuntimeError as exc:
        raised = str(exc)
    return {
        "finite": finite,
        "norm": float(optimizer.get_grad_norm()),
        "clipped": norm,
        "unchanged": all(_same(a, b) for a, b in zip(after, before, strict=True)),
        "raised": raised,
    }


def test_the_optimizer_sees_a_non_finite_duplicate_on_every_rank() -> None:
    """The flat and the sharded optimizer, a NaN and an inf."""
    oracle = float(torch.cat([_grad(0, (2, 3), 0).flatten(), _grad(1, (2, 3), 0).flatten(), _grad(0, (2,), 1)]).norm())
    for rank, by_case in enumerate(run_world(2, _optimizer_clips)):
        for (sharded, poison), got in by_case.items():
            where = (sharded, poison, rank)
            assert got["finite"] == pytest.approx(oracle, rel=1e-6), where
            assert _non_finite(got["norm"], poison) and _non_finite(got["clipped"], poison), (where, got)
            assert got["unchanged"], where
            assert got["raised"].startswith("the total grad norm is"), where


# ------------------------------------------------------------------------------------------ pgregistry.modules


def _modules_steps() -> dict[float, dict[str, Any]]:
    from pgregistry import modules as mm

    modules = mm.build_modules({"language": ParallelLayout(num_ranks=2, tp=2)}, language_model="language")
    return {poison: _modules_step(modules, poison) for poison in POISONS}


def _modules_step(modules: Any, poison: float) -> dict[str, Any]:
    from pgregistry import modules as mm

    model = nn.Linear(3, 2)
    mark_tensor_parallel(model.weight, 0)
    optimizer = mm.build_optimizer({"language": model}, modules, optimizer="sgd", lr=0.1)
    model.weight.grad.copy_(_grad(dist.get_rank(), (2, 3), 0))
    model.bias.grad.copy_(_grad(0, (2,), 1))
    if dist.get_rank() == 1:
        model.bias.grad[1] = poison
    before = [p.grad.clone() for p in model.parameters()]
    weights = [p.detach().clone() for p in model.parameters()]
    norm = float(mm.grad_norm({"language": model}, modules))
    clipped = float(mm.clip_grad_norm_({"language": model}, 1e-3, modules))
    unchanged = all(_same(p.grad, b) for p, b in zip(model.parameters(), before, strict=True))
    stepped, step_norm, _ = optimizer.step(max_norm=1e-3)
    kept = all(torch.equal(p.detach(), w) for p, w in zip(model.parameters(), weights, strict=True))
    return {"norm": norm, "clipped": clipped, "unchanged": unchanged, "stepped": stepped, "step_norm": step_norm,
            "weights_kept": kept}


def test_job_wide_statistics_and_the_step_see_a_non_finite_duplicate_on_every_rank() -> None:
    for rank, by_poison in enumerate(run_world(2, _modules_steps)):
        for poison, got in by_poison.items():
            where = (poison, rank)
            for key in ("norm", "clipped", "step_norm"):
                assert _non_finite(got[key], poison), (where, key, got[key])
            assert got["unchanged"], where
            assert not got["stepped"] and got["weights_kept"], where  # the step skipped on both ranks

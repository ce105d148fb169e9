"""A module whose own statistic refuses what its ranks hold: every rank of the job raises, none waits.

The fault is found on the module's ranks only, inside the module's statistic (after the call's agreement, which
checks what every rank can check up front); the ranks of the other modules are by then on their way into the one
world all-reduce that combines the modules. The fault travels in that all-reduce, so every rank raises the same
error, naming the module, the fault and the ranks. A 4-rank world: module ``a`` on ranks 0-1 (DP 2), module ``b``
on ranks 2-3 (TP 2). Each case runs in the same world, then good calls whose results must match the float64 oracle:
had a case left a rank inside a collective, they (or the world's short deadline) would fail.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from modules_support import error_of, module_grads, oracle_norm

from pgregistry import modules as mm
from pgregistry.layout import ParallelLayout
from pgregistry.testing import run_world
from pgregistry.testing._toy_models import local_model

JOB = {"a": ParallelLayout(num_ranks=2), "b": ParallelLayout(num_ranks=2, tp=2, rank_offset=2)}
SPARSE = "is torch.sparse_coo"  # how the module's statistic names a sparse grad it refuses (a TypeError)


def _cases() -> dict[str, Any]:
    rank = dist.get_rank()
    modules = mm.build_modules(JOB)
    grads = {name: module_grads(name) for name in JOB}
    models = {name: local_model(JOB[name], rank, grads[name])[0] for name in modules.here()}
    out: dict[str, Any] = {}
    # Module b's ranks hold a sparse grad (as nn.Embedding(sparse=True) makes): b's statistic refuses it there.
    if "b" in models:
        param = next(iter(models["b"].parameters()))
        dense = param.grad
        param.grad = dense.to_sparse()
    out["grad_norm"] = error_of(lambda: mm.grad_norm(models, modules))
    before = [p.grad.clone() for model in models.values() for p in model.parameters()]
    out["clip"] = error_of(lambda: mm.clip_grad_norm_(models, 1e-3, modules))
    after = [p.grad for model in models.values() for p in model.parameters()]
    out["unscaled"] = all(
        torch.equal(kept.to_dense(), now.to_dense()) for kept, now in zip(before, after, strict=True)
    )
    out["count_zeros"] = error_of(lambda: mm.count_zeros(models, modules))
    if "b" in models:
        param.grad = dense
    out["good"] = float(mm.grad_norm(models, modules))
    return out


def _optimizer_cases() -> dict[str, Any]:
    rank = dist.get_rank()
    modules = mm.build_modules(JOB)
    grads = {name: module_grads(name) for name in JOB}
    models = {name: local_model(JOB[name], rank, grads[name])[0] for name in modules.here()}
    out: dict[str, Any] = {}
    # Module b's model is frozen on b's ranks: its build fails there, after the call's agreement.
    frozen = [p for p in models["b"].parameters() if p.requires_grad] if "b" in models else []
    for param in frozen:
        param.requires_grad_(False)
    out["build"] = error_of(
        lambda: mm.build_optimizer(models, modules, optimizer="sgd", lr=0.1, mixed_precision=False)
    )
    for param in frozen:
        param.requires_grad_(True)
    optimizer = mm.build_optimizer(models, modules, optimizer="sgd", lr=0.1, mixed_precision=False)
    weights = [p.detach().clone() for model in models.values() for p in model.parameters()]
    # Module b's optimizer refuses its grads on b's ranks (injected: a module optimizer's statistic raising there).
    if "b" in models:
        chained = optimizer.optimizers["b"]

        def refuses(*_: Any) -> Any:
            raise ValueError("the module optimizer refused its grads")

        chained.get_grad_norm = refuses  # type: ignore[method-assign]
        chained.get_grad_norm_and_zeros = refuses  # type: ignore[method-assign]
    out["step"] = error_of(lambda: optimizer.step(max_norm=1.0, count_zeros=True))
    out["get_grad_norm"] = error_of(lambda: optimizer.get_grad_norm())
    now = [p.detach() for model in models.values() for p in model.parameters()]
    out["unstepped"] = all(torch.equal(kept, p) for kept, p in zip(weights, now, strict=True))
    if "b" in models:
        del chained.get_grad_norm, chained.get_grad_norm_and_zeros
    out["good"] = float(optimizer.get_grad_norm())
    return out


def _raised_naming_b(results: list[dict[str, Any]], case: str, kind: str, *parts: str) -> None:
    for rank, out in enumerate(results):
        message = out[case]
        assert message.startswith(f"{kind}: "), f"rank {rank} ({case}): {message}"
        for part in ("ranks [2, 3]", "module 'b'", *parts):
            assert part in message, f"rank {rank} ({case}): {part!r} not in {message!r}"
        assert message == results[0][case], f"rank {rank} ({case}) raised another text than rank 0"


def test_a_fault_in_one_modules_statistic_raises_on_every_rank_then_good_calls_match_the_oracle() -> None:
    results = run_world(4, _cases, timeout=30)
    for case in ("grad_norm", "clip", "count_zeros"):
        _raised_naming_b(results, case, "TypeError", SPARSE)
    expected = oracle_norm({name: module_grads(name) for name in JOB}, 2.0)
    for rank, out in enumerate(results):
        assert out["unscaled"], f"rank {rank}: grads were clipped by a call that raised"
        assert abs(out["good"] - expected) <= 1e-5 * expected, f"rank {rank}: {out['good']} != {expected}"


def test_a_fault_in_one_modules_optimizer_statistic_raises_on_every_rank_and_nothing_steps() -> None:
    results = run_world(4, _optimizer_cases, timeout=30)
    _raised_naming_b(results, "build", "ValueError", "could not build", "no trainable parameters")
    for case in ("step", "get_grad_norm"):
        _raised_naming_b(results, case, "ValueError", "the module optimizer refused its grads")
    expected = oracle_norm({name: module_grads(name) for name in JOB}, 2.0)
    for rank, out in enumerate(results):
        assert out["unstepped"], f"rank {rank}: a module stepped in a step that raised"
        assert abs(out["good"] - expected) <= 1e-5 * expected, f"rank {rank}: {out['good']} != {expected}"

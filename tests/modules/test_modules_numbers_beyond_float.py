"""A ``norm_type`` or ``max_norm`` beyond float's range (an int such as ``10**400``) given to a job of modules.

Reported in docs/reliability.md (hostile inputs, sixth round, left undone there): ``MultiModuleOptimizer``'s
statistics called ``float(norm_type)`` before any collective, so ``10**400`` on one rank raised a bare
``OverflowError`` there while its peers waited in the modules' reductions; ``pgregistry.modules``' ``grad_norm`` and
``clip_grad_norm_`` raised it on every rank, after agreeing on it. As :mod:`pgregistry.grad_stats._arguments` reads it,
such a number is an infinity of its sign: a ``norm_type`` of ``10**400`` is the max-norm, and a ``max_norm`` of
``10**400`` is refused by name on every rank (not finite). One 4-rank world (module ``a`` on ranks 0-1 at DP 2, ``b`` on
ranks 2-3 at TP 2) with a short deadline, so a rank left waiting fails the test instead of hanging it.
"""

from __future__ import annotations

import math

import pytest
import torch.distributed as dist
from modules_support import error_of, module_grads, oracle_norm

from pgregistry import modules as mm
from pgregistry.layout import ParallelLayout
from pgregistry.testing import run_world
from pgregistry.testing._toy_models import local_model

JOB = {"a": ParallelLayout(num_ranks=2), "b": ParallelLayout(num_ranks=2, tp=2, rank_offset=2)}
HUGE = 10**400
"""An int beyond float's range: ``float(HUGE)`` raises ``OverflowError``."""


def _cases() -> dict[str, str]:
    rank = dist.get_rank()
    modules = mm.build_modules(JOB)
    models = {name: local_model(JOB[name], rank, module_grads(name))[0] for name in modules.here()}
    optimizer = mm.build_optimizer(models, modules, optimizer="sgd", lr=0.0)
    out: dict[str, str] = {}
    out["grad_norm"] = repr(float(mm.grad_norm(models, modules, norm_type=HUGE)))
    out["clip"] = repr(float(mm.clip_grad_norm_(models, 1e9, modules, norm_type=HUGE)))
    out["optimizer_clip"] = repr(float(optimizer.clip_grad_norm(1e9, norm_type=HUGE)))
    out["optimizer_clip_one_rank"] = error_of(
        lambda: optimizer.clip_grad_norm(1e9, norm_type=HUGE if rank == 1 else 2.0)
    )
    out["step_max_norm_one_rank"] = error_of(lambda: optimizer.step(max_norm=HUGE if rank == 2 else 1.0))
    out["clip_max_norm"] = error_of(lambda: mm.clip_grad_norm_(models, HUGE, modules))
    out["good"] = repr(optimizer.step(max_norm=1e9)[1])
    return out


@pytest.fixture(scope="module")
def results() -> list[dict[str, str]]:
    return run_world(4, _cases, timeout=30)


def test_a_norm_type_beyond_float_is_the_max_norm_as_the_oracle(results: list[dict[str, str]]) -> None:
    want = oracle_norm({name: module_grads(name) for name in JOB}, math.inf)
    for rank, out in enumerate(results):
        for case in ("grad_norm", "clip", "optimizer_clip"):
            assert float(out[case]) == pytest.approx(want, rel=1e-6), (rank, case, out[case])


def test_a_norm_type_beyond_float_on_one_rank_raises_on_every_rank(results: list[dict[str, str]]) -> None:
    for rank, out in enumerate(results):
        message = out["optimizer_clip_one_rank"]
        assert message.startswith("ValueError: ranks disagree on MultiModuleOptimizer.clip_grad_norm: 'norm_type' "
                                  "differs"), (rank, message)


def test_a_max_norm_beyond_float_is_refused_by_name_on_every_rank(results: list[dict[str, str]]) -> None:
    for rank, out in enumerate(results):
        for case, ranks in (("step_max_norm_one_rank", "[2]"), ("clip_max_norm", "[0, 1, 2, 3]")):
            message = out[case]
            assert message.startswith("ValueError: "), (rank, case, message)
            assert f"were given bad input (ranks {ranks}: max_norm must be a positive, finite number, got 1000" in (
                message.replace(f"rank {ranks[1:-1]}:", f"ranks {ranks}:")
            ), (rank, case, message)


def test_the_job_steps_after_every_refusal(results: list[dict[str, str]]) -> None:
    want = oracle_norm({name: module_grads(name) for name in JOB}, 2.0)
    for out in results:
        assert float(out["good"]) == pytest.approx(want, rel=1e-6)

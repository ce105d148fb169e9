"""Bad settings on some ranks of a job of modules: the same clear error on every rank, and nothing waits.

One 4-rank world: module ``a`` on ranks 0-1 (DP 2), module ``b`` on ranks 2-3 (TP 2), so a value bad on one rank
or for one module is bad on ranks that take part in collectives the others do not. Each case is one call on every
rank; each asserts that every rank raised the same error, of the right type, naming the value and the ranks given
it (or the module and option). A good step ends the world: had any case left a rank inside a collective, it
would fail (or the world's short deadline would), and its norm is checked against the float64 oracle.
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


def _cases() -> dict[str, str]:
    rank = dist.get_rank()
    out: dict[str, str] = {}
    out["pairs"] = error_of(lambda: mm.build_modules(list(JOB.items())))  # type: ignore[arg-type]
    modules = mm.build_modules(JOB)
    models = {name: local_model(JOB[name], rank, module_grads(name))[0] for name in modules.here()}
    # Options bad for module b only, whose ranks are half the world.
    out["lr_for_b"] = error_of(lambda: mm.build_optimizer(models, modules, per_module={"b": {"lr": "x"}}))
    out["lr_negative"] = error_of(lambda: mm.build_optimizer(models, modules, lr=-1.0))
    # Module b's Adam reads no momentum: ignored before; b's build refusing it is raised on every rank of the job.
    out["momentum_for_b"] = error_of(
        lambda: mm.build_optimizer(models, modules, per_module={"b": {"optimizer": "adam", "momentum": 0.9}})
    )
    out["lr_differs"] = error_of(
        lambda: mm.build_optimizer(models, modules, per_module={"b": {"lr": 0.1 if rank == 3 else 0.2}})
    )
    optimizer = mm.build_optimizer(models, modules, optimizer="sgd", lr=0.0)
    out["step_string"] = error_of(lambda: optimizer.step(max_norm="1.0" if rank == 1 else 1.0))  # type: ignore[arg-type]
    out["step_none"] = error_of(lambda: optimizer.step(max_norm=None if rank == 0 else 1.0))
    out["step_nan"] = error_of(lambda: optimizer.step(max_norm=math.nan if rank == 2 else 1.0))
    out["clip_norm_type"] = error_of(lambda: optimizer.clip_grad_norm(1.0, norm_type="2" if rank == 3 else 2.0))
    for label, bad in (("string", "1.0"), ("nan", math.nan), ("negative", -1.0), ("inf", math.inf)):
        out[f"clip_{label}"] = error_of(lambda bad=bad: mm.clip_grad_norm_(models, bad, modules))
    out["good"] = repr(optimizer.step(max_norm=1e9)[1])
    return out


@pytest.fixture(scope="module")
def results() -> list[dict[str, str]]:
    return run_world(4, _cases, timeout=40)


def _same_on_every_rank(results: list[dict[str, str]], case: str, kind: str, *parts: str) -> None:
    first = results[0][case]
    for rank, out in enumerate(results):
        message = out[case]
        assert message.startswith(f"{kind}: "), f"rank {rank} ({case}): {message}"
        for part in parts:
            assert part in message, f"rank {rank} ({case}): {part!r} not in {message!r}"
        assert message == first, f"rank {rank} ({case}) differs from rank 0: {message!r}"


def test_a_string_or_nan_max_norm_on_one_rank_raises_on_every_rank_naming_it(results: list[dict[str, str]]) -> None:
    _same_on_every_rank(
        results, "step_string", "TypeError", "MultiModuleOptimizer.step: ranks [1] were given bad input (rank 1: "
        "max_norm must be a positive, finite number", "got '1.0' (str)", "ranks [1] asked for '1.0'"
    )
    _same_on_every_rank(
        results, "step_nan", "ValueError", "MultiModuleOptimizer.step: ranks [2] were given bad input (rank 2: "
        "max_norm must be a positive, finite number, got nan)", "ranks [2] asked for nan"
    )
    _same_on_every_rank(
        results, "clip_norm_type", "TypeError", "MultiModuleOptimizer.clip_grad_norm: ranks [3] were given bad "
        "input (rank 3: norm_type must be a positive number or inf, got '2' (str))"
    )


def test_a_max_norm_of_none_on_one_rank_is_named_with_the_rank_on_every_rank(results: list[dict[str, str]]) -> None:
    """Reported (issue 41): rank 0's message had an empty detail, the others' said ``<missing>``, naming neither
    ``None`` nor the rank."""
    for rank, out in enumerate(results):
        assert out["step_none"] == (
            "ValueError: ranks disagree on MultiModuleOptimizer.step: 'max_norm' differs (ranks [0] asked for None; "
            f"ranks [1, 2, 3] asked for 1.0); this rank is rank {rank}. Every rank "
            "must ask for the same job-wide statistic, with the same settings."
        ), f"rank {rank}: {out['step_none']}"


def test_an_option_bad_for_one_module_raises_on_every_rank_of_the_job(results: list[dict[str, str]]) -> None:
    _same_on_every_rank(
        results, "lr_for_b", "TypeError", "pgregistry.modules.build_optimizer: ranks [0, 1, 2, 3] were given bad "
        "input", "module 'b': lr must be a number, got 'x' (str)"
    )
    _same_on_every_rank(results, "lr_negative", "ValueError", "lr must be a non-negative, finite number, got -1.0")
    _same_on_every_rank(results, "momentum_for_b", "ValueError", "module 'b': momentum given, which 'adam' does not")
    for rank, out in enumerate(results):
        assert out["lr_differs"].startswith(
            "ValueError: ranks disagree on pgregistry.modules.build_optimizer: \"per_module['b']\" differs (ranks "
            "[0, 1, 2] asked for {lr=0.2}; ranks [3] asked for {lr=0.1})"
        ), f"rank {rank}: {out['lr_differs']}"


def test_a_max_norm_that_is_no_positive_finite_number_is_refused_on_every_rank(
    results: list[dict[str, str]],
) -> None:
    every = "pgregistry.modules.clip_grad_norm_: ranks [0, 1, 2, 3] were given bad input (ranks [0, 1, 2, 3]: "
    _same_on_every_rank(results, "clip_string", "TypeError", every, "max_norm must be a positive, finite number",
                        "got '1.0' (str)")
    for label, shown in (("nan", "nan"), ("negative", "-1.0"), ("inf", "inf")):
        _same_on_every_rank(results, f"clip_{label}", "ValueError",
                            f"{every}max_norm must be a positive, finite number, got {shown})")


def test_build_modules_given_a_list_of_pairs_says_to_pass_a_mapping(results: list[dict[str, str]]) -> None:
    _same_on_every_rank(
        results, "pairs", "TypeError", "build_modules takes a mapping from module name to its ParallelLayout",
        "got a list; for (name, layout) pairs pass dict(pairs)"
    )


def test_the_job_steps_after_every_refusal(results: list[dict[str, str]]) -> None:
    want = oracle_norm({name: module_grads(name) for name in JOB}, 2.0)
    for out in results:
        assert float(out["good"]) == pytest.approx(want, rel=1e-6)

"""Bad input to a job of several modules: a clear error on every rank, naming the culprit, and nothing hangs.

One 8-rank world (the disjoint job: encoder on ranks 0-3, language model on ranks 4-7) runs every case, one after
the other, then a good call: had any case left a rank inside a collective, that call (or the world's deadline)
would fail. A rank raising alone while the others wait is what each case guards against, so each asserts that
every rank raised, and with the culprit's rank and module named.
"""

from __future__ import annotations

import pytest
import torch.distributed as dist
from modules_support import JOBS, error_of, job_grads, oracle_norm

import pgregistry
from pgregistry import modules as mm
from pgregistry.layout import ParallelLayout
from pgregistry.testing import run_world
from pgregistry.testing._toy_models import local_model

JOB = JOBS["disjoint"]
ENCODER, LANGUAGE = JOB["encoder"], JOB["language"]


def _cases() -> dict[str, str]:
    rank = dist.get_rank()
    modules = mm.build_modules(JOB, language_model="language", disjoint=True)
    grads = job_grads("disjoint")
    models = {name: local_model(JOB[name], rank, grads[name])[0] for name in modules.here()}
    stray = local_model(ParallelLayout(num_ranks=4, tp=2, pp=2, rank_offset=4), 4, grads["language"])[0]
    out: dict[str, str] = {}
    # Rank 3 declares the language model one rank lower (ranks 3-6).
    shifted = ParallelLayout(num_ranks=4, tp=2, pp=2, rank_offset=3)
    out["span"] = error_of(lambda: mm.build_modules({
        "encoder": ENCODER, "language": shifted if rank == 3 else LANGUAGE,
    }))
    # Declared disjoint, but the encoder's five ranks reach into the language model's span.
    out["overlap"] = error_of(lambda: mm.build_modules(
        {"encoder": ParallelLayout(num_ranks=5), "language": LANGUAGE}, disjoint=True
    ))
    # Rank 0 passes a model for the language model, which does not run on it.
    out["elsewhere"] = error_of(lambda: mm.grad_norm({**models, "language": stray} if rank == 0 else models, modules))
    # Rank 6 passes no model for the language model it runs.
    out["missing"] = error_of(lambda: mm.count_zeros({} if rank == 6 else models, modules))
    # Rank 1 names a module the job does not have.
    out["unknown"] = error_of(lambda: mm.clip_grad_norm_({**models, "decoder": stray} if rank == 1 else models, 1.0,
                                                       modules))
    # Rank 2 holds a collection of the encoder alone (assembled by hand): it lists other modules than its peers.
    partial = mm.MultiModuleCollection({"encoder": modules["encoder"]})
    out["listed"] = error_of(lambda: mm.grad_norm(models, partial if rank == 2 else modules))
    # Rank 5's language model carries the encoder's collection (attached): the module's statistics refuse it.
    if rank == 5:
        pgregistry.attach(models["language"], modules["encoder"])
    out["attached"] = error_of(lambda: mm.grad_norm(models, modules))
    if rank == 5:
        pgregistry.attach(models["language"], modules["language"])
    # Rank 7 asks for a norm type that is none.
    out["norm_type"] = error_of(lambda: mm.grad_norm(models, modules, norm_type=-1 if rank == 7 else 2))
    out["norm_zero"] = error_of(lambda: mm.grad_norm(models, modules, norm_type=0))
    # A rank outside the language model gives its collection to a single-model consumer: it raises there, and the
    # language model's ranks, which make no such call, are not waiting for it.
    if rank < 4:
        out["outside"] = error_of(lambda: pgregistry.grad_norm(stray, modules["language"]))
    out["good"] = repr(float(mm.grad_norm(models, modules)))
    return out


@pytest.fixture(scope="module")
def results() -> list[dict[str, str]]:
    return run_world(8, _cases, timeout=60)


def _on_every_rank(results: list[dict[str, str]], case: str, *parts: str) -> None:
    for rank, out in enumerate(results):
        message = out[case]
        assert message.startswith("ValueError: "), f"rank {rank}: {message}"
        for part in parts:
            assert part in message, f"rank {rank} ({case}): {part!r} not in {message!r}"


def test_ranks_disagreeing_on_a_modules_span_raise_on_every_rank(results: list[dict[str, str]]) -> None:
    _on_every_rank(results, "span", "ranks disagree on the modules to build", "\"module 'language'\" differs",
                   "ranks [3] asked for ParallelLayout(", "rank_offset=3")


def test_modules_declared_disjoint_whose_spans_overlap_raise_on_every_rank(results: list[dict[str, str]]) -> None:
    _on_every_rank(results, "overlap", "modules 'encoder' (ranks 0-4) and 'language' (ranks 4-7) are declared "
                   "disjoint but share ranks 4-4")


def test_a_model_for_a_module_this_rank_does_not_run_raises_on_every_rank(results: list[dict[str, str]]) -> None:
    _on_every_rank(results, "elsewhere", "pgregistry.modules.grad_norm: ranks [0] were given bad input",
                   "rank 0: a model for module 'language', which runs on ranks 4-7, not on this rank")


def test_no_model_for_a_module_this_rank_runs_raises_on_every_rank(results: list[dict[str, str]]) -> None:
    _on_every_rank(results, "missing", "ranks [6] were given bad input",
                   "rank 6: no model for module 'language' (ranks 4-7), which this rank runs")


def test_a_model_for_no_module_of_the_job_raises_on_every_rank(results: list[dict[str, str]]) -> None:
    _on_every_rank(results, "unknown", "ranks [1] were given bad input", "models for ['decoder']")


def test_a_rank_listing_other_modules_raises_on_every_rank(results: list[dict[str, str]]) -> None:
    _on_every_rank(results, "listed", "ranks disagree on pgregistry.modules.grad_norm", "'modules' differs",
                   "ranks [2] asked for encoder=ParallelLayout(")


def test_a_model_the_modules_statistics_refuse_raises_on_every_rank(results: list[dict[str, str]]) -> None:
    _on_every_rank(results, "attached", "ranks [5] were given bad input", "rank 5: module 'language': ",
                   "the model carries layout 'encoder'")


def test_a_bad_norm_type_on_one_rank_raises_on_every_rank(results: list[dict[str, str]]) -> None:
    _on_every_rank(results, "norm_type", "pgregistry.modules.grad_norm: ranks [7] were given bad input (rank 7: "
                   "norm_type must be positive (or inf), got -1); the ranks also disagree: 'norm_type' differs",
                   "ranks [7] asked for -1")
    _on_every_rank(results, "norm_zero", "ranks [0, 1, 2, 3, 4, 5, 6, 7] were given bad input",
                   "(ranks [0, 1, 2, 3, 4, 5, 6, 7]: norm_type must be positive (or inf), got 0)")


def test_a_rank_outside_a_module_cannot_compute_with_its_collection(results: list[dict[str, str]]) -> None:
    for rank, out in enumerate(results[:4]):
        assert out["outside"].startswith(
            "ValueError: grad_norm was given layout 'language' ParallelLayout("
        ), out["outside"]
        assert f"which spans ranks 4-7; this rank ({rank}) is not one of them" in out["outside"]


def test_the_world_is_usable_after_every_refusal(results: list[dict[str, str]]) -> None:
    want = oracle_norm(job_grads("disjoint"), 2.0)
    for out in results:
        assert float(out["good"]) == pytest.approx(want, rel=1e-6)

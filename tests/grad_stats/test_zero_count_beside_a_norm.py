"""A zero count on some ranks beside a norm on others of the same reduction ends in an error naming both statistics
on every rank: no abort, no wait, no count or norm of neither.

Reported in docs/reliability.md (hostile inputs, ninth round, left as found): ``count_zeros(model, pg)`` on one of two
pipeline stages beside ``grad_norm(model, pg)`` on the other aborted gloo (``Received data size doesn't match
expected size ... 88 vs 8``, SIGABRT on rank 0): a zero count alone made rows of its own width (``[0, zeros]``) and
carried no arguments. Now every statistic's row has one width and the zero count carries its own arguments
(``ZEROS_ALONE``: ``norm_type`` 0.0 and the statistic it reduces), through each entry point of a zero count alone
(``count_zeros``, ``zeros_of_grads``, an optimizer's ``count_zeros``, ``pgregistry.modules.count_zeros``); so does a
norm without its zero count beside one with it (``grad_norm`` beside ``grad_norm_and_zeros``: the latter's count
lacked the other rank's zeros). Two gloo ranks as pipeline stages (one reduction over both); a short deadline, so a
wait shows as a failure. After each error, agreeing calls give the float64 oracle: no collective was left behind.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
from fixtures.errors import value_error_of
from fixtures.finish_cases import bits
from torch import nn

from pgregistry import (
    ParallelLayout,
    clip_grad_norm_,
    count_zeros,
    grad_norm,
    grad_norm_and_zeros,
    registry,
)
from pgregistry.grad_stats import norm_of_grads, zeros_of_grads
from pgregistry.grad_stats._arguments import arguments_of_call
from pgregistry.grad_stats._reductions import Shares, Wanted, reduce_shares
from pgregistry.optim import build_optimizer
from pgregistry.testing import run_world

ZEROS_ALONE = "counts zeros alone (count_zeros, zeros_of_grads, an optimizer's count_zeros, pgregistry.modules."
"""What a norm's rank is told its peer does."""

A_NORM = "computes a norm (grad_norm, clip_grad_norm_, grad_norm_and_zeros, norm_of_grads, an optimizer's"
"""What a zero count's rank is told its peer does."""


def _grads(rank: int) -> list[torch.Tensor]:
    """Each stage's own grads, three zeros each."""
    weight = torch.arange(6, dtype=torch.float32).reshape(2, 3) * (rank + 1)  # one zero
    bias = torch.tensor([0.0, -2.0]) if rank == 0 else torch.tensor([1.5, 0.0])
    weight[1, rank] = 0.0
    return [weight, bias]


def _oracle() -> tuple[float, int]:
    """The float64 2-norm and the zero count of both stages' grads together, unsharded."""
    every = torch.cat(
        [grad.to(torch.float64).reshape(-1) for rank in (0, 1) for grad in _grads(rank)]
    )
    return float(torch.linalg.vector_norm(every)), int((every == 0).sum())


def _model_with_grads(pgc: object) -> nn.Module:
    model = nn.Linear(3, 2)
    for param, grad in zip(model.parameters(), _grads(dist.get_rank()), strict=True):
        param.grad = grad.clone()
    return model


FUNCTIONAL: dict[str, Callable[[nn.Module, object], object]] = {
    "count_zeros": lambda model, pgc: count_zeros(model, pgc),  # type: ignore[arg-type]
    "grad_norm": lambda model, pgc: grad_norm(model, pgc),  # type: ignore[arg-type]
    "clip_grad_norm_": lambda model, pgc: clip_grad_norm_(model, 1.0, pgc),  # type: ignore[arg-type]
    "grad_norm_and_zeros": lambda model, pgc: grad_norm_and_zeros(model, pgc),  # type: ignore[arg-type]
    "zeros_of_grads": lambda model, pgc: zeros_of_grads(
        {pgc.mp: [p.grad for p in model.parameters()]}
    ),  # type: ignore[attr-defined]
    "norm_of_grads": lambda model, pgc: norm_of_grads(
        {pgc.mp: [p.grad for p in model.parameters()]}
    ),  # type: ignore[attr-defined]
}
"""The functional and list entry points, each on this stage's grads over both stages."""


def _functional_on_rank(pairs: list[tuple[str, str]]) -> list[tuple[str, bool, float, int]]:
    """For each pair (rank 0's call, rank 1's): this rank's error, whether its grads are unchanged, and the norm and
    zero count of agreeing calls after it."""
    pgc = registry.build(ParallelLayout(num_ranks=2, pp=2))
    results = []
    for pair in pairs:
        model = _model_with_grads(pgc)
        before = [p.grad.clone() for p in model.parameters()]
        error = value_error_of(lambda: FUNCTIONAL[pair[dist.get_rank()]](model, pgc))  # noqa: B023
        unchanged = all(
            bool((p.grad == b).all()) for p, b in zip(model.parameters(), before, strict=True)
        )
        results.append((error, unchanged, float(grad_norm(model, pgc)), count_zeros(model, pgc)))
    return results


PAIRS = [
    ("count_zeros", "grad_norm"),
    ("grad_norm", "count_zeros"),
    ("count_zeros", "clip_grad_norm_"),
    ("count_zeros", "grad_norm_and_zeros"),
    ("zeros_of_grads", "norm_of_grads"),
    ("norm_of_grads", "zeros_of_grads"),
    ("zeros_of_grads", "clip_grad_norm_"),
]
"""A zero count alone on one stage beside a norm on the other, through each functional and list entry point."""


@pytest.fixture(scope="module")
def functional() -> list[list[tuple[str, bool, float, int]]]:
    by_rank = run_world(
        2, _functional_on_rank, PAIRS, timeout=40.0
    )  # a rank left waiting fails in 40 s
    return [list(results) for results in zip(*by_rank, strict=True)]


@pytest.mark.parametrize("pair", PAIRS, ids="-beside-".join)
def test_a_zero_count_beside_a_norm_raises_naming_both_on_every_rank(
    functional: list[list[tuple[str, bool, float, int]]], pair: tuple[str, str]
) -> None:
    norm, zeros = _oracle()
    for rank, (error, unchanged, norm_after, zeros_after) in enumerate(
        functional[PAIRS.index(pair)]
    ):
        call = pair[rank]
        counts = call in ("count_zeros", "zeros_of_grads")
        peer = A_NORM if counts else ZEROS_ALONE
        assert error.startswith(f"{call}: another rank reducing with this one {peer}"), (
            pair,
            rank,
            error,
        )
        assert "the norm is NaN and the zero count -1 on every rank" in error, error
        assert unchanged, (pair, rank)  # a clip beside a zero count scales nothing
        assert norm_after == pytest.approx(norm, rel=1e-6) and zeros_after == zeros, (pair, rank)


def test_agreeing_zero_counts_and_norms_give_the_oracle() -> None:
    """The wider row changes no number: each entry point on both stages gives the float64 oracle."""
    norm, zeros = _oracle()
    for results in run_world(2, _agreeing_on_rank, timeout=40.0):
        assert (
            results["count_zeros"] == results["zeros_of_grads"] == results["optimizer"] == zeros
        ), results
        assert results["grad_norm"] == pytest.approx(norm, rel=1e-6), results
        assert results["and_zeros"] == zeros, results


def _agreeing_on_rank() -> dict[str, float]:
    pgc = registry.build(ParallelLayout(num_ranks=2, pp=2))
    model = _model_with_grads(pgc)
    optimizer = _optimizer_with_grads(pgc)
    return {
        "count_zeros": count_zeros(model, pgc),
        "zeros_of_grads": int(zeros_of_grads({pgc.mp: [p.grad for p in model.parameters()]})),
        "optimizer": int(optimizer.count_zeros()),
        "grad_norm": float(grad_norm(model, pgc)),
        "and_zeros": int(grad_norm_and_zeros(model, pgc)[1]),
    }


def _optimizer_with_grads(pgc: object) -> object:
    model = nn.Linear(3, 2)
    optimizer = build_optimizer(model, pgc, optimizer="sgd", lr=0.1)  # type: ignore[arg-type]
    for param, grad in zip(model.parameters(), _grads(dist.get_rank()), strict=True):
        param.main_grad.copy_(grad)
    optimizer.sync_grads()
    return optimizer


OPTIMIZER_CALLS: dict[str, Callable[[object], object]] = {
    "count_zeros": lambda opt: opt.count_zeros(),  # type: ignore[attr-defined]
    "get_grad_norm": lambda opt: opt.get_grad_norm(),  # type: ignore[attr-defined]
    "clip_grad_norm": lambda opt: opt.clip_grad_norm(1.0),  # type: ignore[attr-defined]
    "get_grad_norm_and_zeros": lambda opt: opt.get_grad_norm_and_zeros(),  # type: ignore[attr-defined]
}


def _optimizer_on_rank(pairs: list[tuple[str, str]]) -> list[tuple[str, int]]:
    """For each pair: this rank's error through the optimizer, and its zero count of an agreeing call after it."""
    pgc = registry.build(ParallelLayout(num_ranks=2, pp=2))
    optimizer = _optimizer_with_grads(pgc)
    results = []
    for pair in pairs:
        error = value_error_of(lambda: OPTIMIZER_CALLS[pair[dist.get_rank()]](optimizer))  # noqa: B023
        results.append((error, int(optimizer.count_zeros())))  # type: ignore[attr-defined]
    return results


OPTIMIZER_PAIRS = [
    ("count_zeros", "get_grad_norm"),
    ("clip_grad_norm", "count_zeros"),
    ("count_zeros", "get_grad_norm_and_zeros"),
]


def test_an_optimizers_zero_count_beside_its_norm_raises_naming_both_on_every_rank() -> None:
    _, zeros = _oracle()
    by_rank = run_world(2, _optimizer_on_rank, OPTIMIZER_PAIRS, timeout=40.0)
    for pair, results in zip(OPTIMIZER_PAIRS, zip(*by_rank, strict=True), strict=True):
        for rank, (error, zeros_after) in enumerate(results):
            counts = pair[rank] == "count_zeros"
            owner = (
                ".count_zeros"
                if counts
                else "'s grad norm"
                if pair[rank].startswith("get")
                else "clip_grad_norm"
            )
            peer = A_NORM if counts else ZEROS_ALONE
            assert f"{owner}: another rank reducing with this one {peer}" in error, (
                pair,
                rank,
                error,
            )
            assert zeros_after == zeros, (pair, rank)


def _modules_on_rank(calls: dict[int, str]) -> tuple[str, int]:
    """``pgregistry.modules``' zero count or norm over a job of one module on both ranks (two stages)."""
    from pgregistry.modules import build_modules
    from pgregistry.modules import count_zeros as modules_count_zeros
    from pgregistry.modules import grad_norm as modules_grad_norm

    modules = build_modules({"lm": ParallelLayout(num_ranks=2, pp=2)})
    models = {"lm": _model_with_grads(modules["lm"])}
    call = modules_count_zeros if calls[dist.get_rank()] == "count_zeros" else modules_grad_norm
    error = value_error_of(lambda: call(models, modules))
    return error, modules_count_zeros(models, modules)


def test_the_modules_zero_count_beside_their_norm_raises_naming_both_calls_on_every_rank() -> None:
    """The job of modules agrees on its call before any module reduces (the call's name now among what it agrees on,
    where it named the norm's options only); each module's own zero count carries its arguments as above."""
    _, zeros = _oracle()
    got = run_world(2, _modules_on_rank, {0: "count_zeros", 1: "grad_norm"}, timeout=40.0)
    for rank, (error, zeros_after) in enumerate(got):
        assert error.startswith(
            f"ranks disagree on pgregistry.modules.{['count_zeros', 'grad_norm'][rank]}: 'call'"
        ), (
            rank,
            error,
        )
        assert (
            "(ranks [0] asked for pgregistry.modules.count_zeros; ranks [1] asked for pgregistry.modules.grad_norm)"
        ) in error, error
        assert zeros_after == zeros, rank


def test_a_norm_without_its_zero_count_beside_one_with_it_raises_naming_both() -> None:
    """``grad_norm`` beside ``grad_norm_and_zeros``: the latter's count lacked the other stage's zeros, silently."""
    pairs = [("grad_norm", "grad_norm_and_zeros"), ("grad_norm_and_zeros", "clip_grad_norm_")]
    by_rank = run_world(2, _functional_on_rank, pairs, timeout=40.0)
    norm, zeros = _oracle()
    for pair, results in zip(pairs, zip(*by_rank, strict=True), strict=True):
        for rank, (error, unchanged, norm_after, zeros_after) in enumerate(results):
            with_zeros = pair[rank] == "grad_norm_and_zeros"
            peer = (
                "without a zero count (grad_norm,"
                if with_zeros
                else "and the zero count together (grad_norm_and"
            )
            assert error.startswith(
                f"{pair[rank]}: another rank reducing with this one computes a norm {peer}"
            ), (
                pair,
                rank,
                error,
            )
            assert (
                unchanged and norm_after == pytest.approx(norm, rel=1e-6) and zeros_after == zeros
            )


def _reduced_on_rank(statistics: dict[int, str]) -> tuple[int | None, int | None]:
    """The norm's bits (NaN: -1) and the zero count of this rank's statistic, reduced over both ranks and not checked:
    what a GPU returns, where nothing reads the agreement on the host."""
    both = dist.new_group([0, 1])
    statistic = statistics[dist.get_rank()]
    zeros = float(dist.get_rank() + 2)
    if statistic == "zeros":
        shares = Shares(Wanted.zeros_only(), torch.device("cpu"), [both])
        shares.add(both, torch.tensor([0.0, zeros], dtype=torch.float64))
        reduced = reduce_shares(shares)
    else:
        with_zeros = statistic == "norm and zeros"
        shares = Shares(Wanted(2.0, zeros=with_zeros), torch.device("cpu"), [both])
        shares.add(both, torch.tensor([9.0, zeros if with_zeros else 0.0], dtype=torch.float64))
        reduced = reduce_shares(
            shares, given=arguments_of_call(2.0, None, clip=False, zeros=with_zeros)
        )
    return bits(reduced.norm64), None if reduced.zeros is None else int(reduced.zeros)


@pytest.mark.parametrize(
    ("statistics", "want"),
    [
        ({0: "zeros", 1: "zeros"}, [(None, 5), (None, 5)]),
        ({0: "zeros", 1: "norm"}, [(None, -1), (-1, None)]),
        ({0: "norm and zeros", 1: "zeros"}, [(-1, -1), (None, -1)]),
        ({0: "norm", 1: "norm and zeros"}, [(-1, None), (-1, -1)]),
    ],
    ids=[
        "zeros-agree",
        "zeros-beside-a-norm",
        "norm-and-zeros-beside-zeros",
        "norm-beside-norm-and-zeros",
    ],
)
def test_the_reduction_makes_the_count_minus_one_and_the_norm_nan_where_the_statistics_differ(
    statistics: dict[int, str], want: list[tuple[int | None, int | None]]
) -> None:
    """What a GPU rank gets where no rank raises: the count -1, the norm NaN, on every rank; the count where every
    rank counts zeros alone (2 + 3)."""
    assert run_world(2, _reduced_on_rank, statistics, timeout=30.0) == want

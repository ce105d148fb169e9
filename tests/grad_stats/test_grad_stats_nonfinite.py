"""A NaN or infinite global grad norm never scales a grad, and sparse grads are refused by name.

Before: ``clip_grad_norm_`` multiplied every grad, the finite ones on every other rank too, by NaN (NaN norm) or
by 0 (infinite norm). Two pipeline stages in a real gloo world: the global norm covers both ranks' grads, so a
non-finite grad on one rank makes the norm non-finite on both. The finite case is checked against a float64
oracle over the grads of both stages.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from torch import nn

import pgregistry
from pgregistry import (
    ParallelLayout,
    ProcessGroupCollection,
    clip_grad_norm_,
    count_zeros,
    grad_norm,
    grad_norm_and_zeros,
    registry,
)
from pgregistry.grad_stats import CLIP_EPSILON
from pgregistry.testing import run_world


def _grads(rank: int) -> list[torch.Tensor]:
    """Stage ``rank``'s grads: a 2x3 weight and a bias of 2, from fixed numbers."""
    weight = torch.arange(6, dtype=torch.float32).reshape(2, 3) * (rank + 1) / 4
    bias = torch.tensor([1.5, -2.0]) * (rank + 1)
    return [weight, bias]


def _stage(poison: float | None) -> tuple[nn.Module, ProcessGroupCollection]:
    pgc = registry.build(ParallelLayout(num_ranks=2, pp=2))
    stage = nn.Linear(3, 2)
    for param, grad in zip(stage.parameters(), _grads(dist.get_rank()), strict=True):
        param.grad = grad.clone()
    if poison is not None and dist.get_rank() == 1:
        stage.bias.grad[0] = poison
    return stage, pgc


def _same(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Equal element by element, a NaN equal to a NaN and to nothing else (a grad scaled by NaN is not unchanged,
    which a difference passed through ``nan_to_num`` would say it is)."""
    return got.shape == want.shape and bool(((got == want) | (got.isnan() & want.isnan())).all())


def _clip_on_rank(poison: float | None, error_if_nonfinite: bool) -> tuple[float, list[torch.Tensor], str]:
    """The norm (NaN when the clip raised), the grads after the clip, and the error message (empty when none)."""
    stage, pgc = _stage(poison)
    try:
        # The default call unless asked: the non-finite cases then fail on the code before the option existed.
        options = {"error_if_nonfinite": True} if error_if_nonfinite else {}
        norm = float(clip_grad_norm_(stage, 1.0, pgc, **options))
        message = ""
    except RuntimeError as exc:
        norm, message = math.nan, str(exc)
    return norm, [p.grad for p in stage.parameters()], message


def test_a_finite_norm_clips_like_the_float64_oracle() -> None:
    every = torch.cat([g.double().flatten() for rank in (0, 1) for g in _grads(rank)])
    norm = float(every.norm())
    assert norm > 1.0  # so the grads are scaled
    for rank, (got_norm, grads, _) in enumerate(run_world(2, _clip_on_rank, None, False)):
        assert got_norm == pytest.approx(norm, rel=1e-6)
        for got, original in zip(grads, _grads(rank), strict=True):
            torch.testing.assert_close(got.double(), original.double() * (1.0 / (norm + CLIP_EPSILON)))


def _poisoned(rank: int, poison: float) -> list[torch.Tensor]:
    """Stage ``rank``'s grads as :func:`_stage` sets them: rank 1's first bias element is ``poison``."""
    grads = _grads(rank)
    if rank == 1:
        grads[1][0] = poison
    return grads


@pytest.mark.parametrize("poison", [math.nan, math.inf, -math.inf])
def test_a_non_finite_norm_leaves_every_grad_unscaled_on_every_rank(poison: float) -> None:
    for rank, (got_norm, grads, _) in enumerate(run_world(2, _clip_on_rank, poison, False)):
        assert (math.isnan(got_norm) if math.isnan(poison) else got_norm == math.inf), got_norm
        for got, original in zip(grads, _poisoned(rank, poison), strict=True):
            assert _same(got, original), (got, original)


def test_error_if_nonfinite_raises_on_every_rank_and_scales_nothing() -> None:
    for rank, (got_norm, grads, message) in enumerate(run_world(2, _clip_on_rank, math.nan, True)):
        assert message.startswith("the total grad norm is nan, not finite, so the grads cannot be clipped")
        assert math.isnan(got_norm)
        for got, original in zip(grads, _poisoned(rank, math.nan), strict=True):
            assert _same(got, original), (got, original)


def _optimizer_clip_on_rank() -> tuple[float, bool, str, bool]:
    """The norm and whether the grads are unchanged after the default clip, then the error message of the clip with
    ``error_if_nonfinite`` and whether the grads are still unchanged after it (measured after each call)."""
    from pgregistry.optim import build_optimizer

    stage, pgc = _stage(None)
    pgregistry.attach(stage, pgc)
    optimizer = build_optimizer(stage, pgc, optimizer="sgd", lr=0.1)
    for param, grad in zip(stage.parameters(), _grads(dist.get_rank()), strict=True):
        param.grad.copy_(grad)
    if dist.get_rank() == 1:
        stage.bias.grad[0] = math.inf
    before = [p.grad.clone() for p in stage.parameters()]

    def unchanged() -> bool:
        return all(_same(p.grad, b) for p, b in zip(stage.parameters(), before, strict=True))

    norm = float(optimizer.clip_grad_norm(1.0))
    unchanged_by_the_clip = unchanged()
    try:
        optimizer.clip_grad_norm(1.0, error_if_nonfinite=True)
        message = ""
    except RuntimeError as exc:
        message = str(exc)
    return norm, unchanged_by_the_clip, message, unchanged()


def test_the_optimizer_clip_leaves_grads_unscaled_or_raises() -> None:
    for norm, unchanged_by_the_clip, message, unchanged_by_the_error in run_world(2, _optimizer_clip_on_rank):
        assert norm == math.inf and unchanged_by_the_clip
        assert message.startswith("the total grad norm is inf, not finite")
        assert unchanged_by_the_error  # the call that raised scaled nothing either


def test_sparse_grads_are_refused_naming_the_parameter() -> None:
    off = ProcessGroupCollection(tp=None, pp=None, mp=None, tp_ep_pp=None, gtp_remat=None, expt_gtp_remat=None,
                                 ep=None, expt_tp=None)
    model = nn.Module()
    model.embedding = nn.Embedding(10, 4, sparse=True)
    model.embedding(torch.tensor([1, 2])).sum().backward()
    for call in (lambda: grad_norm(model, off), lambda: count_zeros(model, off),
                 lambda: clip_grad_norm_(model, 1.0, off)):
        with pytest.raises(TypeError, match=r"the grad of 'embedding\.weight' is torch\.sparse_coo .*need dense"):
            call()
    # A grad that turns sparse after a kept plan was made for a dense one is refused alike.
    model.embedding.weight.grad = torch.ones(10, 4)
    assert float(grad_norm(model, off)) == pytest.approx(40**0.5)
    model.embedding.weight.grad = None
    model.embedding(torch.tensor([3])).sum().backward()
    with pytest.raises(TypeError, match=r"the grad of 'embedding\.weight' is torch\.sparse_coo .*need dense"):
        grad_norm(model, off)


# ------------------------------------------------------------------------------------- one verdict for the job


def _replica(poison: float | None) -> tuple[nn.Module, ProcessGroupCollection]:
    """Rank r of two data-parallel replicas holding the same grads, but rank 1's first bias element ``poison`` (not
    synchronised yet, or a NaN that arose after the sync). Nothing is model-parallel: each replica's norm is its own."""
    pgc = registry.build(ParallelLayout(num_ranks=2))
    model = nn.Linear(3, 2)
    for param, grad in zip(model.parameters(), _grads(0), strict=True):
        param.grad = grad.clone()
    if poison is not None and dist.get_rank() == 1:
        model.bias.grad[0] = poison
    return model, pgc


def _replica_clip(poison: float, error_if_nonfinite: bool, entry: str) -> tuple[float, bool, str]:
    """The norm (NaN when the clip raised), whether every grad is unchanged, and the error message."""
    model, pgc = _replica(poison)
    before = [p.grad.clone() for p in model.parameters()]
    options = {"error_if_nonfinite": True} if error_if_nonfinite else {}
    try:
        if entry == "clip_grad_norm_":
            norm = float(clip_grad_norm_(model, 1.0, pgc, **options))
        else:
            norm = float(grad_norm_and_zeros(model, pgc, max_norm=1.0, **options)[0])
        message = ""
    except RuntimeError as exc:
        norm, message = math.nan, str(exc)
    unchanged = all(_same(p.grad, b) for p, b in zip(model.parameters(), before, strict=True))
    return norm, unchanged, message


@pytest.mark.parametrize("entry", ["clip_grad_norm_", "grad_norm_and_zeros"])
@pytest.mark.parametrize("poison", [math.nan, math.inf])
def test_a_non_finite_grad_on_one_replica_skips_the_clip_on_every_replica(entry: str, poison: float) -> None:
    """Before: the norm was reduced over the model-parallel groups only, so rank 0 got a finite norm and clipped
    while rank 1 got NaN (or inf) and skipped."""
    for rank, (norm, unchanged, message) in enumerate(run_world(2, _replica_clip, poison, False, entry)):
        assert (math.isnan(norm) if math.isnan(poison) else norm == math.inf), (rank, norm)
        assert unchanged and not message, rank


def test_a_non_finite_grad_on_one_replica_raises_on_every_replica() -> None:
    """Before: rank 1 raised and rank 0 went on into the next collective, and hung there."""
    for rank, (_, unchanged, message) in enumerate(run_world(2, _replica_clip, math.nan, True, "clip_grad_norm_")):
        assert message.startswith("the total grad norm is nan, not finite"), (rank, message)
        assert unchanged, rank


def _replica_optimizer_clip(error_if_nonfinite: bool) -> tuple[float, bool, str]:
    from pgregistry.optim import build_optimizer

    model, pgc = _replica(None)
    optimizer = build_optimizer(model, pgc, optimizer="sgd", lr=0.1)
    for param, grad in zip(model.parameters(), _grads(0), strict=True):
        param.grad.copy_(grad)
    optimizer.sync_grads()  # both replicas hold the same grads now
    if dist.get_rank() == 1:
        model.bias.grad[0] = math.nan  # arises after the sync, on one replica
    before = [p.grad.clone() for p in model.parameters()]
    try:
        norm, message = float(optimizer.clip_grad_norm(1.0, error_if_nonfinite=error_if_nonfinite)), ""
    except RuntimeError as exc:
        norm, message = math.nan, str(exc)
    return norm, all(_same(p.grad, b) for p, b in zip(model.parameters(), before, strict=True)), message


@pytest.mark.parametrize("error_if_nonfinite", [False, True])
def test_the_optimizer_clip_decides_on_every_replica_alike(error_if_nonfinite: bool) -> None:
    for rank, (norm, unchanged, message) in enumerate(run_world(2, _replica_optimizer_clip, error_if_nonfinite)):
        assert math.isnan(norm) and unchanged, (rank, norm)
        assert bool(message) == error_if_nonfinite, (rank, message)


def _collectives_of_a_clip(layout: ParallelLayout) -> tuple[int, int]:
    """All-reduces issued by grad_norm and by clip_grad_norm_ on the same model (counted on this rank)."""
    pgc = registry.build(layout)
    model = nn.Linear(3, 2)
    for param, grad in zip(model.parameters(), _grads(dist.get_rank()), strict=True):
        param.grad = grad.clone()
    calls: list[object] = []
    real = dist.all_reduce

    def counting(*args: object, **kwargs: object) -> object:
        calls.append(kwargs.get("group"))
        return real(*args, **kwargs)  # type: ignore[arg-type]

    dist.all_reduce = counting  # type: ignore[assignment]
    grad_norm(model, pgc)
    norm_calls = len(calls)
    clip_grad_norm_(model, 1e9, pgc)
    return norm_calls, len(calls) - norm_calls


@pytest.mark.parametrize(("sizes", "extra"), [({}, 1), ({"pp": 2}, 0)])
def test_the_verdict_costs_one_scalar_all_reduce_or_none(sizes: dict[str, int], extra: int) -> None:
    """Over two data-parallel replicas the verdict is one more all-reduce (2 elements) than the norm; over two
    pipeline stages the norm's own all-reduce over mp spans every rank and carries it."""
    for norm_calls, clip_calls in run_world(2, _collectives_of_a_clip, ParallelLayout(num_ranks=2, **sizes)):
        assert clip_calls == norm_calls + extra, (sizes, norm_calls, clip_calls)


def _inf_norm_on_rank() -> float:
    stage, pgc = _stage(math.nan)
    return float(grad_norm(stage, pgc, norm_type=math.inf))


def test_a_nan_reaches_every_rank_of_an_inf_norm() -> None:
    """A MAX all-reduce may drop a NaN (gloo keeps whichever operand comes first): the inf-norm's maxima are gathered
    by a SUM in a column per rank instead, a NaN with them, so both stages see it."""
    assert all(math.isnan(norm) for norm in run_world(2, _inf_norm_on_rank))

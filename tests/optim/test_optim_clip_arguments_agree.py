"""An optimizer's ``clip_grad_norm`` given a ``max_norm`` or ``norm_type`` refused on one rank only, or values that
differ across ranks, decides on every rank alike, with no collective more than the clip's.

Reported in docs/reliability.md (hostile inputs, sixth round, left undone there): ``optimizer.clip_grad_norm(-1.0 if
rank == 1 else 1.0)`` raised on rank 1 before any collective while rank 0 waited in the norm's all-reduce until the
group's timeout; ranks given different valid ``max_norm`` values clipped by different coefficients, their replicas
drifting apart. As for the functional ``clip_grad_norm_`` (tests/grad_stats/test_clip_arguments_agree_across_ranks.py),
the arguments now ride in the clip's verdict: every rank raises (on the CPU, where the verdict is read without a
device sync), naming the argument, and no grad is scaled anywhere. Two gloo ranks as data-parallel replicas (plain
and sharded optimizers) and as pipeline stages; a short deadline, so a wait shows as a failure, not as a hang.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from torch import nn

from pgregistry import ParallelLayout, registry
from pgregistry.grad_stats import CLIP_EPSILON
from pgregistry.optim import build_optimizer
from pgregistry.testing import run_world

CASES: dict[str, tuple[dict[str, int], bool]] = {
    "replicas": ({}, False),
    "sharded replicas": ({}, True),
    "stages": ({"pp": 2}, False),
}
"""Two ranks as data-parallel replicas (the verdict's own all-reduce), sharded (the norm reduced over both), or as
pipeline stages (the verdict rides in the norm's row): layout options and ``sharded``."""


def _grads(rank: int, stages: bool) -> list[torch.Tensor]:
    """The synchronised grads of a rank's ``nn.Linear(3, 2)``: alike on replicas, each stage its own; norm above 2."""
    scale = rank + 1 if stages else 1
    weight = torch.arange(6, dtype=torch.float64).reshape(2, 3)
    return [weight * scale, torch.tensor([1.5, -2.0], dtype=torch.float64) * scale]


def _clip_on_rank(case: str, arguments: dict[int, dict[str, object]]) -> tuple[str, bool, float, Result]:
    """``clip_grad_norm`` with this rank's ``arguments``: the error (``type: message``, empty when none), whether
    every grad is unchanged, the norm returned (NaN when it raised), and the norm and grads after (a sharded
    optimizer's grads are its shard's alone: ``None``)."""
    options, sharded = CASES[case]
    pgc = registry.build(ParallelLayout(num_ranks=2, **options))
    model = nn.Linear(3, 2)
    optimizer = build_optimizer(model, pgc, optimizer="sgd", lr=0.1, sharded=sharded)
    for param, grad in zip(model.parameters(), _grads(dist.get_rank(), "pp" in options), strict=True):
        param.main_grad.copy_(grad)  # the buffer's view (sync_grads averages the replicas' alike grads)
    optimizer.sync_grads()
    before = [p.main_grad.clone() for p in model.parameters()]
    given = dict(arguments[dist.get_rank()])
    try:
        norm = float(optimizer.clip_grad_norm(given.pop("max_norm"), **given))  # type: ignore[arg-type]
        error = ""
    except (TypeError, ValueError) as exc:
        norm, error = math.nan, f"{type(exc).__name__}: {exc}"
    after = [p.main_grad.clone() for p in model.parameters()]
    unchanged = all(bool((a == b).all()) for a, b in zip(after, before, strict=True))
    return error, unchanged, norm, (float(optimizer.get_grad_norm()), None if sharded else after)


Result = tuple[float, list[torch.Tensor] | None]
"""The norm after the clip, and the grads after (``None`` for a sharded optimizer)."""


def _run(case: str, arguments: dict[int, dict[str, object]]) -> list[tuple[str, bool, float, Result]]:
    return run_world(2, _clip_on_rank, case, arguments, timeout=20.0)  # a rank left waiting fails in 20 s


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("norm_type", [2.0, math.inf])
def test_a_max_norm_refused_on_one_rank_raises_on_every_rank_and_scales_nothing(case: str, norm_type: float) -> None:
    arguments = {0: {"max_norm": 1.0, "norm_type": norm_type}, 1: {"max_norm": -1.0, "norm_type": norm_type}}
    (peer, peer_unchanged, _, _), (refusing, refusing_unchanged, _, _) = _run(case, arguments)
    assert refusing == "ValueError: max_norm must be a positive, finite number, got -1.0"
    assert peer.startswith("ValueError: clip_grad_norm: another rank holding grads refused its max_norm"), peer
    assert "this rank was given max_norm=1.0" in peer, peer
    assert peer_unchanged and refusing_unchanged


@pytest.mark.parametrize("case", ["replicas", "stages"])
def test_a_norm_type_refused_on_one_rank_raises_on_every_rank(case: str) -> None:
    arguments = {0: {"max_norm": 1.0}, 1: {"max_norm": 1.0, "norm_type": "2"}}
    (peer, peer_unchanged, _, _), (refusing, refusing_unchanged, _, _) = _run(case, arguments)
    assert refusing.startswith("TypeError: norm_type must be a positive number or inf, got '2' (str)"), refusing
    assert "another rank holding grads refused its max_norm, norm_type or error_if_nonfinite" in peer, peer
    assert peer_unchanged and refusing_unchanged


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("norm_type", [2.0, math.inf])
def test_different_max_norms_raise_on_every_rank_and_scale_nothing(case: str, norm_type: float) -> None:
    arguments = {0: {"max_norm": 1.0, "norm_type": norm_type}, 1: {"max_norm": 2.0, "norm_type": norm_type}}
    for rank, (error, unchanged, _, _) in enumerate(_run(case, arguments)):
        assert error.startswith("ValueError: clip_grad_norm: max_norm"), (rank, error)
        assert "differs across the ranks holding grads" in error, (rank, error)
        assert f"this rank was given max_norm={[1.0, 2.0][rank]!r}" in error, error
        assert unchanged, rank


@pytest.mark.parametrize("case", list(CASES))
def test_the_same_max_norm_as_a_float_and_a_tensor_clips_as_the_oracle(case: str) -> None:
    """Equal values agree whatever their type; the clip is the unsharded float64 one."""
    stages = "pp" in CASES[case][0]
    counted = [g.flatten() for rank in ((0, 1) if stages else (0,)) for g in _grads(rank, stages)]
    want_norm = float(torch.cat(counted).norm())
    coefficient = min(1.0, 2.0 / (want_norm + CLIP_EPSILON))
    arguments = {0: {"max_norm": 2.0}, 1: {"max_norm": torch.tensor([2.0])}}
    for rank, (error, _, norm, (norm_after, after)) in enumerate(_run(case, arguments)):
        assert error == "" and norm == pytest.approx(want_norm, rel=1e-6), (rank, error, norm)
        assert norm_after == pytest.approx(want_norm * coefficient, rel=1e-6), (rank, norm_after)
        for got, grad in zip(after or [], _grads(rank, stages) if after else [], strict=True):
            torch.testing.assert_close(got.double(), grad * coefficient, rtol=1e-6, atol=0)

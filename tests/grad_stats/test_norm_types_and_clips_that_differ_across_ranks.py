"""Norm types that differ across the ranks of a reduction, a refused one on a norm without a clip, and a clip on some
ranks beside a plain norm on others end in an error naming the argument on every rank: no wait, no abort, no norm
of neither.

Reported in docs/reliability.md (hostile inputs, sixth and seventh rounds, left as found): ``norm_type`` 2 on one
pipeline stage and inf on the other made rows of different widths and reduction operations (gloo aborted a rank with
``Received data size doesn't match expected size``, or a peer waited); 1 and 3 made one shape and a norm of neither;
``grad_norm``'s peers of a rank that refused its ``norm_type`` got NaN; ``grad_norm_and_zeros(max_norm=1.0 if rank
== 0 else None)`` made different collectives. Now every row has one width and one operation (SUM; the inf-norm's
maxima gather in a column per rank) whatever the norm type, and the arguments ride at each row's end, a call without
a clip carrying ``max_norm`` 0.0. Two gloo ranks as pipeline stages (one reduction over both); a short deadline, so a
wait shows as a failure. After each error, a call with agreeing arguments gives the float64 oracle: no collective was
left behind.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from torch import nn

from pgregistry import ParallelLayout, clip_grad_norm_, grad_norm, grad_norm_and_zeros, registry
from pgregistry.grad_stats import norm_of_grads
from pgregistry.testing import run_world


def _grads(rank: int) -> list[torch.Tensor]:
    """Each stage's own grads: the norm well above 1 whatever ``p``."""
    scale = rank + 1.0
    return [torch.arange(6, dtype=torch.float32).reshape(2, 3) * scale, torch.tensor([1.5, -2.0]) * scale]


def _oracle(p: float) -> float:
    """The float64 norm of both stages' grads together, unsharded."""
    every = torch.cat([grad.to(torch.float64).reshape(-1) for rank in (0, 1) for grad in _grads(rank)])
    return float(torch.linalg.vector_norm(every, p))


def _call(call: str, model: nn.Module, pgc: object, arguments: dict[str, object]) -> str:
    """``call`` with ``arguments``: the error as ``type: message``, empty when none."""
    given = dict(arguments)
    try:
        if call == "clip_grad_norm_":
            clip_grad_norm_(model, given.pop("max_norm"), pgc, **given)  # type: ignore[arg-type]
        elif call == "grad_norm_and_zeros":
            grad_norm_and_zeros(model, pgc, **given)  # type: ignore[arg-type]
        else:
            grad_norm(model, pgc, **given)  # type: ignore[arg-type]
    except (TypeError, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return ""


Case = tuple[str, dict[int, dict[str, object]]]
"""A call and each rank's arguments."""


def _on_rank(cases: list[Case]) -> list[tuple[str, bool, float]]:
    """For each case: the error of its call with this rank's arguments, whether every grad is unchanged, and the norm
    of an agreeing 2-norm call after it."""
    pgc = registry.build(ParallelLayout(num_ranks=2, pp=2))
    model = nn.Linear(3, 2)
    results = []
    for call, arguments in cases:
        for param, grad in zip(model.parameters(), _grads(dist.get_rank()), strict=True):
            param.grad = grad.clone()
        before = [p.grad.clone() for p in model.parameters()]
        error = _call(call, model, pgc, arguments[dist.get_rank()])
        unchanged = all(bool((p.grad == b).all()) for p, b in zip(model.parameters(), before, strict=True))
        results.append((error, unchanged, float(grad_norm(model, pgc))))
    return results


def _run(cases: list[Case]) -> list[list[tuple[str, bool, float]]]:
    """Each case's results on each rank, by case (one world for them all)."""
    by_rank = run_world(2, _on_rank, cases, timeout=30.0)  # a rank left waiting fails in 30 s
    return [list(results) for results in zip(*by_rank, strict=True)]


NORM_TYPE_PAIRS = [(2.0, math.inf), (math.inf, 1.0), (1.0, 3.0), (3.0, 2.0), (0.5, math.inf)]
"""Rows of different widths and operations (2 or 1 beside inf), and of one shape (1 and 3: a norm of neither)."""


@pytest.mark.parametrize("call", ["grad_norm", "grad_norm_and_zeros"])
def test_norm_types_that_differ_raise_on_every_rank(call: str) -> None:
    cases = [(call, {0: {"norm_type": first}, 1: {"norm_type": second}}) for first, second in NORM_TYPE_PAIRS]
    for (first, second), got in zip(NORM_TYPE_PAIRS, _run(cases), strict=True):
        for rank, (error, _, after) in enumerate(got):
            assert error.startswith(f"ValueError: {call}: norm_type differs across the ranks reducing this norm"), (
                first,
                second,
                rank,
                error,
            )
            assert f"this rank was given norm_type={[first, second][rank]!r}" in error, error
            assert "the norm is NaN on every rank" in error, error
            assert after == pytest.approx(_oracle(2.0), rel=1e-6), (rank, after)


def test_a_clip_with_norm_types_that_differ_raises_on_every_rank_and_scales_nothing() -> None:
    pairs = NORM_TYPE_PAIRS[:3]
    cases: list[Case] = [
        ("clip_grad_norm_", {rank: {"max_norm": 1.0, "norm_type": p} for rank, p in enumerate(pair)}) for pair in pairs
    ]
    for pair, got in zip(pairs, _run(cases), strict=True):
        for rank, (error, unchanged, after) in enumerate(got):
            assert error.startswith("ValueError: clip_grad_norm_: norm_type differs across the ranks holding grads"), (
                pair,
                rank,
                error,
            )
            assert unchanged, (pair, rank)
            assert after == pytest.approx(_oracle(2.0), rel=1e-6), (rank, after)


def test_a_norm_type_refused_on_one_rank_of_a_plain_norm_is_named_on_its_peer() -> None:
    norm_types: list[object] = [-2.0, "inf"]
    cases: list[Case] = [("grad_norm", {0: {"norm_type": math.inf}, 1: {"norm_type": p}}) for p in norm_types]
    for norm_type, got in zip(norm_types, _run(cases), strict=True):
        (peer, _, peer_after), (refusing, _, refusing_after) = got
        assert refusing.startswith("TypeError: norm_type" if isinstance(norm_type, str) else "ValueError: norm_type")
        assert peer.startswith("ValueError: grad_norm: another rank reducing this norm refused its"), peer
        assert "this rank was given norm_type=inf" in peer, peer
        assert peer_after == refusing_after == pytest.approx(_oracle(2.0), rel=1e-6)


@pytest.mark.parametrize("norm_type", [2.0, math.inf, 1.0])
def test_a_clip_on_one_rank_beside_a_plain_norm_raises_on_every_rank_and_scales_nothing(norm_type: float) -> None:
    arguments = {0: {"norm_type": norm_type, "max_norm": 1.0}, 1: {"norm_type": norm_type, "max_norm": None}}
    ((clipping, clipping_unchanged, after_0), (plain, plain_unchanged, after_1)), *_ = _run(
        [("grad_norm_and_zeros", arguments)]
    )
    assert clipping.startswith("ValueError: grad_norm_and_zeros: max_norm differs across the ranks holding grads"), (
        clipping
    )
    assert "this rank was given max_norm=1.0" in clipping, clipping
    assert plain.startswith(
        "ValueError: grad_norm_and_zeros: max_norm (this rank does not clip; another does) differs across the ranks "
        "reducing this norm"
    ), plain
    assert clipping_unchanged and plain_unchanged
    assert after_0 == after_1 == pytest.approx(_oracle(2.0), rel=1e-6)


@pytest.mark.parametrize("norm_type", [2.0, math.inf, 1.0, 3.0])
def test_agreeing_norm_types_give_the_oracle(norm_type: float) -> None:
    """The rows' one shape changes no number: each norm type on both stages is the float64 oracle's."""
    arguments: dict[int, dict[str, object]] = {rank: {"norm_type": norm_type} for rank in (0, 1)}
    for error, _, _ in _run([("grad_norm", arguments)])[0]:
        assert error == ""
    norms = run_world(2, _norm_of_type, norm_type, timeout=30.0)
    assert norms[0] == norms[1] == pytest.approx(_oracle(norm_type), rel=1e-6)


def _norm_of_type(norm_type: float) -> float:
    pgc = registry.build(ParallelLayout(num_ranks=2, pp=2))
    model = nn.Linear(3, 2)
    for param, grad in zip(model.parameters(), _grads(dist.get_rank()), strict=True):
        param.grad = grad.clone()
    return float(grad_norm(model, pgc, norm_type=norm_type))


def _list_norm_on_rank(norm_types: dict[int, list[object]]) -> list[str]:
    """``norm_of_grads`` of this stage's grads over both stages with each of this rank's norm types: the error,
    empty when none (then the norm is checked against the float64 oracle)."""
    pgc = registry.build(ParallelLayout(num_ranks=2, pp=2))
    errors = []
    for norm_type in norm_types[dist.get_rank()]:
        try:
            norm = norm_of_grads({pgc.mp: _grads(dist.get_rank())}, norm_type)  # type: ignore[arg-type]
        except (TypeError, ValueError) as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
            continue
        assert float(norm) == pytest.approx(_oracle(norm_type), rel=1e-6)  # type: ignore[arg-type]
        errors.append("")
    return errors


def test_the_list_path_tells_norm_types_that_differ_and_a_refusal_on_every_rank() -> None:
    """``norm_of_grads`` refused a ``norm_type`` before its reduction (its peers waited) and took differing ones."""
    norm_types: dict[int, list[object]] = {0: [2.0, 2.0, 2.0], 1: [math.inf, -1.0, 2.0]}
    first, second = run_world(2, _list_norm_on_rank, norm_types, timeout=30.0)
    for errors in (first, second):
        assert errors[0].startswith("ValueError: norm_of_grads: norm_type differs across the ranks reducing this norm")
    assert second[1] == "ValueError: norm_type must be positive (or inf), got -1.0", second[1]
    assert first[1].startswith("ValueError: norm_of_grads: another rank reducing this norm refused its"), first[1]
    assert first[2] == second[2] == ""  # agreeing afterwards: the oracle

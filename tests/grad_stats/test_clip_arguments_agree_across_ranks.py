"""A clip's ``max_norm`` or ``norm_type`` refused on one rank only, or ``max_norm`` values that differ, are decided on
every rank alike, with no collective more than the clip's.

Reported in docs/reliability.md (hostile inputs, fifth round): ``clip_grad_norm_(model, -1.0 if rank == 1 else 1.0,
pg)`` raised on rank 1 before any collective while rank 0 waited in the norm's all-reduce until the group's timeout;
ranks given different valid ``max_norm`` values clipped by different coefficients, their replicas drifting apart.
Now the arguments ride in the clip's verdict: every rank raises (here, on the CPU, where the verdict is read without a
device sync), naming the argument, and no grad is scaled anywhere. Two gloo ranks as data-parallel replicas (the
verdict's own all-reduce, MAX) and as pipeline stages (the verdict rides in the norm's row: SUM for the 2-norm, MAX
for the inf-norm); a short deadline, so a wait shows as a failure, not as a hang.
"""

from __future__ import annotations

import math
import struct

import pytest
import torch
import torch.distributed as dist
from fixtures.finish_cases import bits
from torch import nn

from pgregistry import ParallelLayout, clip_grad_norm_, grad_norm, grad_norm_and_zeros, registry
from pgregistry.grad_stats import CLIP_EPSILON
from pgregistry.grad_stats._arguments import arguments_of_call
from pgregistry.grad_stats._reductions import Shares, Wanted, reduce_shares
from pgregistry.testing import run_world

LAYOUTS: dict[str, dict[str, int]] = {"replicas": {}, "stages": {"pp": 2}}
"""Two ranks as data-parallel replicas (the verdict's own all-reduce) or as pipeline stages (it rides in the row)."""



def _grads(rank: int, replicas: bool) -> list[torch.Tensor]:
    """The grads a rank holds: the same on both replicas, each stage its own; norm well above 2."""
    scale = 1 if replicas else rank + 1
    return [torch.arange(6, dtype=torch.float32).reshape(2, 3) * scale, torch.tensor([1.5, -2.0]) * scale]


def _model(layout: str) -> tuple[nn.Module, object]:
    pgc = registry.build(ParallelLayout(num_ranks=2, **LAYOUTS[layout]))
    model = nn.Linear(3, 2)
    for param, grad in zip(model.parameters(), _grads(dist.get_rank(), layout == "replicas"), strict=True):
        param.grad = grad.clone()
    return model, pgc


def _call_on_rank(layout: str, call: str, arguments: dict[int, dict[str, object]]) -> tuple[str, bool, float]:
    """``call`` with this rank's ``arguments``: the error (``type: message``, empty when none), whether every grad
    is unchanged, and the norm returned (NaN when it raised)."""
    model, pgc = _model(layout)
    before = [p.grad.clone() for p in model.parameters()]
    given = dict(arguments[dist.get_rank()])
    try:
        if call == "clip_grad_norm_":
            norm = float(clip_grad_norm_(model, given.pop("max_norm"), pgc, **given))  # type: ignore[arg-type]
        elif call == "grad_norm_and_zeros":
            norm = float(grad_norm_and_zeros(model, pgc, **given)[0])  # type: ignore[arg-type]
        else:
            norm = float(grad_norm(model, pgc, **given))  # type: ignore[arg-type]
        error = ""
    except (TypeError, ValueError) as exc:
        norm, error = math.nan, f"{type(exc).__name__}: {exc}"
    unchanged = all(bool((p.grad == b).all()) for p, b in zip(model.parameters(), before, strict=True))
    return error, unchanged, norm


def _run(layout: str, call: str, arguments: dict[int, dict[str, object]]) -> list[tuple[str, bool, float]]:
    return run_world(2, _call_on_rank, layout, call, arguments, timeout=30.0)  # a rank left waiting fails in 30 s


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("norm_type", [2.0, math.inf, 1.0])
def test_a_max_norm_refused_on_one_rank_raises_on_every_rank_and_scales_nothing(layout: str, norm_type: float) -> None:
    arguments = {0: {"max_norm": 1.0, "norm_type": norm_type}, 1: {"max_norm": -1.0, "norm_type": norm_type}}
    (peer, peer_unchanged, _), (refusing, refusing_unchanged, _) = _run(layout, "clip_grad_norm_", arguments)
    assert refusing == "ValueError: max_norm must be a positive, finite number, got -1.0"
    assert peer.startswith("ValueError: clip_grad_norm_: another rank holding grads refused its max_norm"), peer
    assert "this rank was given max_norm=1.0" in peer, peer
    assert peer_unchanged and refusing_unchanged


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_norm_type_refused_on_one_rank_raises_on_every_rank(layout: str) -> None:
    arguments = {0: {"max_norm": 1.0}, 1: {"max_norm": 1.0, "norm_type": "2"}}
    (peer, peer_unchanged, _), (refusing, refusing_unchanged, _) = _run(layout, "clip_grad_norm_", arguments)
    assert refusing.startswith("TypeError: norm_type must be a positive number or inf, got '2' (str)"), refusing
    assert "another rank holding grads refused its max_norm, norm_type or error_if_nonfinite" in peer, peer
    assert peer_unchanged and refusing_unchanged


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_norm_type_refused_on_one_rank_of_a_norm_leaves_no_peer_waiting(layout: str) -> None:
    """No clip, no verdict: the refusal rides in the norm's own row, and its peers raise naming it (eighth round;
    they got a NaN norm before)."""
    arguments = {0: {"norm_type": 2.0}, 1: {"norm_type": -2.0}}
    for call in ("grad_norm", "grad_norm_and_zeros"):
        (peer, _, peer_norm), (refusing, _, _) = _run(layout, call, arguments)
        assert refusing == "ValueError: norm_type must be positive (or inf), got -2.0", (call, refusing)
        if layout == "stages":  # the norm is reduced over both ranks (replicas reduce over none)
            assert peer.startswith(f"ValueError: {call}: another rank reducing this norm refused its"), (call, peer)
            assert "this rank was given norm_type=2.0" in peer, peer
        else:
            assert peer == "" and not math.isnan(peer_norm), (call, peer, peer_norm)


NEXT_AFTER_ONE = struct.unpack("<d", struct.pack("<q", struct.unpack("<q", struct.pack("<d", 1.0))[0] + 1))[0]
"""The float64 just above 1.0: a difference of one bit."""


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("norm_type", [2.0, math.inf])
@pytest.mark.parametrize("other", [2.0, NEXT_AFTER_ONE])
def test_different_max_norms_raise_on_every_rank_and_scale_nothing(layout: str, norm_type: float, other: float) -> None:
    arguments = {0: {"max_norm": 1.0, "norm_type": norm_type}, 1: {"max_norm": other, "norm_type": norm_type}}
    for rank, (error, unchanged, _) in enumerate(_run(layout, "clip_grad_norm_", arguments)):
        assert error.startswith("ValueError: clip_grad_norm_: max_norm"), (rank, error)
        assert "differs across the ranks holding grads" in error, (rank, error)
        if layout == "replicas":  # the verdict's own all-reduce (MAX) carries the range
            assert f"(from 1.0 to {other!r})" in error, error
        assert f"this rank was given max_norm={[1.0, other][rank]!r}" in error, error
        assert unchanged, rank


@pytest.mark.parametrize(
    ("layout", "first", "second"), [("replicas", 2.0, math.inf), ("replicas", 1.0, 3.0), ("stages", 1.0, 3.0)]
)
def test_different_norm_types_raise_on_every_rank_and_scale_nothing(layout: str, first: float, second: float) -> None:
    """Ranks clipping with different norm types computed different norms (2 and inf over replicas) or a mixture of
    both (1 and 3 over stages, whose rows had the same width), each clipping by its own. Norm types whose rows
    differ in width or operation over stages (2 and inf) make mismatched collectives before any verdict: left (see
    docs/reliability.md)."""
    arguments = {0: {"max_norm": 1.0, "norm_type": first}, 1: {"max_norm": 1.0, "norm_type": second}}
    for rank, (error, unchanged, _) in enumerate(_run(layout, "clip_grad_norm_", arguments)):
        assert error.startswith("ValueError: clip_grad_norm_: norm_type"), (rank, error)
        assert "differs across the ranks holding grads" in error, (rank, error)
        assert unchanged, rank


def _oracle_clip(layout: str, max_norm: float) -> tuple[float, list[list[torch.Tensor]]]:
    """The 2-norm of the job's grads (float64, unsharded: the replicas' once) and each rank's grads clipped."""
    replicas = layout == "replicas"
    counted = [g.double().flatten() for rank in ((0,) if replicas else (0, 1)) for g in _grads(rank, replicas)]
    norm = float(torch.cat(counted).norm())
    coefficient = min(1.0, max_norm / (norm + CLIP_EPSILON))
    return norm, [[g.double() * coefficient for g in _grads(rank, replicas)] for rank in (0, 1)]


def _clip_alike_on_rank(layout: str, max_norm: object) -> tuple[float, list[torch.Tensor]]:
    model, pgc = _model(layout)
    norm = float(clip_grad_norm_(model, max_norm, pgc))  # type: ignore[arg-type]
    return norm, [p.grad for p in model.parameters()]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_the_same_max_norm_given_as_a_float_and_as_a_tensor_clips_as_the_oracle(layout: str) -> None:
    """Equal values agree whatever their type (a one-element tensor on one rank, a float on the other)."""
    want_norm, want = _oracle_clip(layout, 2.0)
    results = run_world(2, _clip_on_rank_with_a_tensor_on_rank_1, layout, timeout=30.0)
    for rank, (norm, grads) in enumerate(results):
        assert norm == pytest.approx(want_norm, rel=1e-6)
        for got, expected in zip(grads, want[rank], strict=True):
            torch.testing.assert_close(got.double(), expected, rtol=1e-6, atol=0)


def _clip_on_rank_with_a_tensor_on_rank_1(layout: str) -> tuple[float, list[torch.Tensor]]:
    return _clip_alike_on_rank(layout, torch.tensor([2.0]) if dist.get_rank() == 1 else 2.0)


def _reduced_on_rank(carrier: bool, norm_type: float, max_norms: dict[int, float | None]) -> tuple[int, bool | None]:
    """The norm's bits (NaN: -1) reduced with this rank's arguments in the verdict, and whether they disagree.

    The reduction itself, as a GPU runs it (nothing read on the host): each rank's share of squares, over a group of
    both ranks that carries the verdict (``carrier``), or over none, the verdict in its own all-reduce."""
    both = dist.new_group([0, 1])
    verdict = dist.new_group([0, 1])
    group = both if carrier else None
    wanted = Wanted(norm_type, zeros=False)
    shares = Shares(wanted, torch.device("cpu"), [group])
    value = 3.0 * (dist.get_rank() + 1)
    shares.add(group, torch.tensor([value if math.isinf(norm_type) else value**norm_type, 0.0], dtype=torch.float64))
    given = None
    if max_norms:
        max_norm = max_norms[dist.get_rank()]
        given = arguments_of_call(norm_type, -1.0 if max_norm is None else max_norm, clip=True)
    reduced = reduce_shares(shares, verdict=(verdict,), given=given)
    agreement = None if reduced.agreement is None else bool(reduced.agreement.disagrees())
    return bits(reduced.norm64), agreement  # type: ignore[return-value]


CARRIERS = {"in the norm's row": True, "in its own all-reduce": False}


@pytest.mark.parametrize("carrier", list(CARRIERS))
@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf])
def test_the_reduction_makes_the_norm_nan_on_every_rank_where_the_arguments_differ(
    carrier: str, norm_type: float
) -> None:
    """What stops the scaling where no rank reads the verdict (a GPU): the norm itself, NaN on every rank, so the
    clip's coefficient is 1 (``clip_coefficient``); where the arguments agree, the norm's bits are those of the call
    without them."""
    on = CARRIERS[carrier]
    plain = run_world(2, _reduced_on_rank, on, norm_type, {}, timeout=30.0)
    assert all(norm_bits != -1 and disagrees is None for norm_bits, disagrees in plain)
    assert (plain[0] == plain[1]) == on  # over no group, each rank's own norm
    for max_norms, disagree in [
        ({0: 1.0, 1: 1.0}, False),
        ({0: 1.0, 1: 2.0}, True),
        ({0: 1.0, 1: NEXT_AFTER_ONE}, True),
        ({0: 1.0, 1: None}, True),
    ]:
        got = run_world(2, _reduced_on_rank, on, norm_type, max_norms, timeout=30.0)
        for rank, (norm_bits, disagrees) in enumerate(got):
            assert disagrees is disagree, (max_norms, rank)
            assert norm_bits == (-1 if disagree else plain[rank][0]), (max_norms, rank, norm_bits)


def _instances_on_rank(case: str) -> tuple[str, bool]:
    """Four ranks as two optimizer instances (``intra_dist_opt`` each a pair of pipeline stages, ``inter_dist_opt``
    across them): the verdict rides in each pair's row (summed), then crosses the instances (MAX)."""
    pgc = registry.build(ParallelLayout(num_ranks=4, pp=2))
    pgc = pgc.evolve(intra_dist_opt=pgc.mp, inter_dist_opt=pgc.dp)
    model = nn.Linear(3, 2)
    for param, grad in zip(model.parameters(), _grads(dist.get_rank() % 2, False), strict=True):
        param.grad = grad.clone()
    before = [p.grad.clone() for p in model.parameters()]
    first_instance = 0 in dist.get_process_group_ranks(pgc.mp)
    max_norm = {
        "one-rank": 2.0 if dist.get_rank() == 3 else 1.0,
        "one-instance": 1.0 if first_instance else 2.0,
        "refused": -1.0 if dist.get_rank() == 3 else 1.0,
    }[case]
    try:
        clip_grad_norm_(model, max_norm, pgc)
        error = ""
    except ValueError as exc:
        error = str(exc)
    return error, all(bool((p.grad == b).all()) for p, b in zip(model.parameters(), before, strict=True))


@pytest.mark.parametrize("case", ["one-rank", "one-instance", "refused"])
def test_arguments_that_differ_across_optimizer_instances_raise_on_every_rank(case: str) -> None:
    for rank, (error, unchanged) in enumerate(run_world(4, _instances_on_rank, case, timeout=30.0)):
        if case == "refused" and rank == 3:
            assert error == "max_norm must be a positive, finite number, got -1.0", error
        elif case == "refused":
            assert "another rank holding grads refused its max_norm" in error, (rank, error)
        else:  # the range where the verdict crossed instances with MAX; unknown where a pair's sum told
            spread = " (from 1.0 to 2.0)" if case == "one-instance" else ""
            assert error.startswith(f"clip_grad_norm_: max_norm{spread} differs across the ranks"), (rank, error)
        assert unchanged, rank

"""An optimizer's (or a grad buffer's) ``get_grad_norm`` / ``get_grad_norm_and_zeros`` given a ``norm_type`` refused on
one rank only: that rank raises its refusal after the norm's reduction, which it joins with a NaN share, and its
peers raise naming it (a NaN norm before the eighth round) instead of waiting in the all-reduce until the group's
timeout (docs/reliability.md, hostile inputs, seventh round: the clip carried its arguments, the statistics alone
still refused before the reduction).
Two gloo ranks as data-parallel replicas of a sharded optimizer (its norm reduced over both) and as pipeline stages;
a short deadline, so a wait shows as a failure."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from torch import nn

from pgregistry import ParallelLayout, registry
from pgregistry.optim import build_optimizer
from pgregistry.testing import run_world

CASES: dict[str, tuple[dict[str, int], bool]] = {"sharded replicas": ({}, True), "stages": ({"pp": 2}, False)}


def _norm_on_rank(case: str, call: str, norm_types: dict[int, object]) -> tuple[str, float, float]:
    """The error (``type: message``, empty when none), the norm returned (NaN when it raised), and the norm of a
    second call with 2.0 on every rank (the buffer left as it was)."""
    options, sharded = CASES[case]
    pgc = registry.build(ParallelLayout(num_ranks=2, **options))
    model = nn.Linear(3, 2)
    optimizer = build_optimizer(model, pgc, optimizer="sgd", lr=0.1, sharded=sharded)
    scale = dist.get_rank() + 1
    for param in model.parameters():
        param.main_grad.copy_(torch.full_like(param.main_grad, 0.5 * scale))
    optimizer.sync_grads()
    (child,) = optimizer.stats_optimizers()  # one dtype: one flat optimizer, one buffer
    norm_of = optimizer.get_grad_norm if call == "optimizer" else child.buffer.grad_norm
    try:
        norm, error = float(norm_of(norm_types[dist.get_rank()])), ""  # type: ignore[arg-type]
    except (TypeError, ValueError) as exc:
        norm, error = math.nan, f"{type(exc).__name__}: {exc}"
    return error, norm, float(norm_of(2.0))


@pytest.mark.parametrize(
    ("case", "call"), [("sharded replicas", "optimizer"), ("stages", "optimizer"), ("stages", "buffer")]
)  # a replica's buffer reduces its norm over no other rank: nothing to wait for
def test_a_norm_type_refused_on_one_rank_leaves_its_peer_an_error_not_a_wait(case: str, call: str) -> None:
    (peer, peer_norm, peer_after), (refusing, _, refusing_after) = run_world(
        2, _norm_on_rank, case, call, {0: 2.0, 1: -1.0}, timeout=20.0
    )
    assert refusing.startswith("ValueError") and "norm_type" in refusing, refusing
    # its peer raises naming the refusal (the arguments ride in the norm's row: eighth round), once a NaN norm
    assert peer.startswith("ValueError: ") and "another rank reducing this norm refused its" in peer, peer
    assert math.isnan(peer_norm)
    assert peer_after == refusing_after and math.isfinite(peer_after)  # the next call is whole again

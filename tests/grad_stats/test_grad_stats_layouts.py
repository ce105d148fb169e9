"""Grad statistics on sharded toy models over a matrix of 8-rank layouts, against the unsharded float64 oracle.

Every layout shards the same unsharded model (:mod:`pgregistry.testing._toy_models`: its definition and its float64
gradients) the way real layers do; the oracles come from ``tests/fixtures/unsharded_oracle.py``. Each
rank computes norms (p = 2, inf, 3), the zero count, clipping and the replication audit through the public API;
the parent compares every rank with the oracle computed from the unsharded gradients. One world per layout runs
every check.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from fixtures.unsharded_oracle import oracle_clipped, oracle_norm, oracle_numel, oracle_zeros

from pgregistry import registry
from pgregistry.audit import audit_grad_replication
from pgregistry.grad_stats import clip_grad_norm_, count_zeros, grad_norm
from pgregistry.layout import ParallelLayout
from pgregistry.testing import run_world
from pgregistry.testing._toy_models import ZEROED, full_grads, local_model, set_grads

WORLD = 8
LAYOUTS: dict[str, dict[str, Any]] = {
    "DP8": {},
    "TP2-EP4-ETP1": {"tp": 2, "ep": 4, "expt_tp": 1},
    "TP2-CP2-PP2": {"tp": 2, "cp": 2, "pp": 2},
    "TP4-EP2-ETP2": {"tp": 4, "ep": 2, "expt_tp": 2},
    "TP2-GTP2-EP2": {"tp": 2, "gtp_remat": 2, "ep": 2},
    "TP2-GTP2-EP2-EGTP2": {"tp": 2, "gtp_remat": 2, "ep": 2, "expt_gtp_remat": 2},
    "PP2-EP4-ETP1": {"pp": 2, "ep": 4, "expt_tp": 1},
    "TP2-PP2-EP2-ETP2": {"tp": 2, "pp": 2, "ep": 2, "expt_tp": 2},
    "TP2-CP2-EP4-ETP1": {"tp": 2, "cp": 2, "ep": 4, "expt_tp": 1},
    "GTP2-PP2-EP2-EGTP2": {"gtp_remat": 2, "pp": 2, "ep": 2, "expt_gtp_remat": 2},
    "EP8-ETP1": {"ep": 8, "expt_tp": 1},
    "TP2-EP2-ETP1-order-tp-dp-ep-cp-pp": {"tp": 2, "ep": 2, "expt_tp": 1, "order": "tp-dp-ep-cp-pp"},
}

REL = 1e-6


def _on_rank(layout: ParallelLayout, max_norm: float) -> dict[str, Any]:
    rank = torch.distributed.get_rank()
    collection = registry.build(layout)
    grads = full_grads("random")
    model, shards = local_model(layout, rank, grads)
    out: dict[str, Any] = {
        "norm2": grad_norm(model, collection).item(),
        "norm_inf": grad_norm(model, collection, norm_type=math.inf).item(),
        "norm3": grad_norm(model, collection, norm_type=3).item(),
        "zeros": count_zeros(model, collection),
    }
    report = audit_grad_replication(model, collection)
    out["audit"] = (report.ok, report.classified_norm, report.true_norm, str(report))

    # Clipping: every local shard must equal the same shard of the oracle's clipped unsharded gradients.
    out["norm_before_clip"] = clip_grad_norm_(model, max_norm, collection).item()
    expected = oracle_clipped(grads, max_norm)
    params = dict(model.named_parameters())
    worst = 0.0
    for shard in shards:
        want = shard.take(expected[shard.full_name])
        got = params[shard.local_name].grad.to(torch.float64)
        worst = max(worst, float((got - want).abs().max()) / max(float(want.abs().max()), 1e-30))
    out["clip_worst_rel"] = worst

    # Invariance oracle: every element 1 -> sqrt(numel); every element 0 -> numel zeros.
    set_grads(model, shards, full_grads("ones"))
    out["ones_norm"] = grad_norm(model, collection).item()
    set_grads(model, shards, full_grads("zeros"))
    out["zeros_all"] = count_zeros(model, collection)
    return out


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_unsharded_oracle(name: str) -> None:
    layout = ParallelLayout(num_ranks=WORLD, **LAYOUTS[name])
    grads = full_grads("random")
    norm2 = oracle_norm(grads, 2.0)
    max_norm = norm2 / 3
    results = run_world(WORLD, _on_rank, layout, max_norm)
    for rank, got in enumerate(results):
        where = f"{name} rank {rank}"
        assert got["norm2"] == pytest.approx(norm2, rel=REL), where
        assert got["norm_inf"] == pytest.approx(oracle_norm(grads, math.inf), rel=REL), where
        assert got["norm3"] == pytest.approx(oracle_norm(grads, 3.0), rel=REL), where
        assert got["zeros"] == oracle_zeros(grads), where
        ok, classified, true, text = got["audit"]
        assert ok, f"{where}: {text}"
        assert classified == pytest.approx(norm2, rel=REL), where
        assert true == pytest.approx(norm2, rel=REL), where
        assert got["norm_before_clip"] == pytest.approx(norm2, rel=REL), where
        assert got["clip_worst_rel"] < REL, where
        assert got["ones_norm"] == pytest.approx(math.sqrt(oracle_numel()), rel=REL), where
        assert got["zeros_all"] == oracle_numel(), where


def test_the_oracle_is_not_trivial() -> None:
    """The random gradients have zeros, a wholly zero tensor and a norm far from the invariance oracle's; every
    rank draws the same ones (one seed), in float64 that float32 shards hold exactly."""
    grads = full_grads("random")
    assert not grads[ZEROED].any() and all(g.any() for name, g in grads.items() if name != ZEROED)
    assert all(torch.equal(g, again) for g, again in zip(grads.values(), full_grads("random").values(), strict=True))
    assert all(g.dtype == torch.float64 and torch.equal(g.float().double(), g) for g in grads.values())
    assert 0 < oracle_zeros(grads) < oracle_numel()
    assert oracle_norm(grads, math.inf) < oracle_norm(grads, 3.0) < oracle_norm(grads, 2.0)
    unclipped = oracle_clipped(grads, oracle_norm(grads, 2.0) * 2)
    assert all(torch.equal(unclipped[name], grad) for name, grad in grads.items())

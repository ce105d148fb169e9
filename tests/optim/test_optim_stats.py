"""Grad statistics of built optimizers over 4-rank layouts, against the unsharded float64 oracle.

Each world builds the unsharded and the sharded chained optimizer of the toy model
(:mod:`pgregistry.testing._toy_models`) and checks norms (p = 2, inf), the zero count, clipping, and how many
all-reduces the chained optimizer issues: one per distinct statistics group, one in all when the dense and expert
children share it. Collectives are counted by wrapping ``torch.distributed.all_reduce`` in the rank process; the
wrapper still calls the real one.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from fixtures.unsharded_oracle import oracle_norm, oracle_numel, oracle_zeros

from pgregistry import registry
from pgregistry.layout import ParallelLayout
from pgregistry.optim import build_optimizer
from pgregistry.testing import run_world
from pgregistry.testing._toy_models import (
    EXPERT,
    full_grads,
    local_model,
    set_main_grads,
    shards_of,
)

WORLD = 4
LAYOUTS: dict[str, dict[str, Any]] = {
    "DP4": {},
    "TP2-EP2-ETP1": {"tp": 2, "ep": 2, "expt_tp": 1},  # mp and the expert stats group hold the same ranks: shared
    "TP2-EP4-ETP1": {"tp": 2, "ep": 4, "expt_tp": 1},
    "TP2-EP2-ETP2": {"tp": 2, "ep": 2, "expt_tp": 2},
    "PP2-EP2": {"pp": 2, "ep": 2},  # the first stage holds no expert: an empty expert child joins the reduction
    "GTP2-EP2-EGTP2": {"gtp_remat": 2, "ep": 2, "expt_gtp_remat": 2},
}


def _counting_all_reduce() -> list[Any]:
    calls: list[Any] = []
    real = dist.all_reduce

    def counting(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        calls.append(kwargs.get("group"))
        return real(tensor, *args, **kwargs)

    dist.all_reduce = counting  # this rank process only; it exits when the test's world ends
    return calls


def _collectives(calls: list[Any], fn: Callable[[], torch.Tensor]) -> tuple[float, int]:
    before = len(calls)
    value = fn()
    return float(value), len(calls) - before


def _on_rank(layout: ParallelLayout) -> dict[str, Any]:
    rank = dist.get_rank()
    collection = registry.build(layout)
    calls = _counting_all_reduce()
    out: dict[str, Any] = {}
    for sharded in (False, True):
        model, shards = local_model(layout, rank, full_grads("zeros"))
        opt = build_optimizer(model, collection, sharded=sharded, lr=0.0)
        grads = full_grads("random")
        set_main_grads(model, shards, grads, layout)
        opt.sync_grads()  # every replica holds the same raw grads: the synchronised grads are ``grads``
        res: dict[str, Any] = {"shared": len(opt.stats_reduce_groups()) == 1}
        res["norm2"], res["norm2_calls"] = _collectives(calls, opt.get_grad_norm)
        res["zeros"], res["zeros_calls"] = _collectives(calls, opt.count_zeros)
        res["norm_inf"] = float(opt.get_grad_norm(math.inf))
        both = opt.get_grad_norm_and_zeros()
        res["both"] = (float(both[0]), int(both[1]))
        both_inf = opt.get_grad_norm_and_zeros(math.inf)
        res["both_inf"] = (float(both_inf[0]), int(both_inf[1]))
        res["children_combined"] = math.sqrt(sum(float(c.get_grad_norm()) ** 2 for c in opt.chained_optimizers))
        res["distinct_groups"] = sum(
            1 for g in opt.stats_reduce_groups() if g is not None and g.size() > 1
        )
        res["children"] = [(c.expert, len(c.params)) for c in opt.chained_optimizers]
        max_norm = oracle_norm(grads, 2.0) / 3
        res["clip_returned"] = float(opt.clip_grad_norm(max_norm))
        res["after_clip"] = float(opt.get_grad_norm())
        if not sharded:
            coeff = max_norm / (oracle_norm(grads, 2.0) + 1e-6)
            params = dict(model.named_parameters())
            res["clip_worst"] = max(
                float((params[s.local_name].main_grad.double() - s.take(grads[s.full_name]) * coeff).abs().max())
                for s in shards
            )
        set_main_grads(model, shards, full_grads("zeros"), layout)
        opt.sync_grads()
        res["all_zeros"] = float(opt.count_zeros())
        out["sharded" if sharded else "unsharded"] = res
    return out


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_chained_statistics_match_the_unsharded_oracle(name: str) -> None:
    layout = ParallelLayout(num_ranks=WORLD, **LAYOUTS[name])
    grads = full_grads("random")
    want_norm, want_inf, want_zeros = oracle_norm(grads, 2.0), oracle_norm(grads, math.inf), oracle_zeros(grads)
    numel = oracle_numel()
    mp = set(layout.groups_of(0)["mp"])
    shared_groups = mp == set(layout.groups_of(0)["tp_ep_pp_with_egtp_remat"])
    for rank, result in enumerate(run_world(WORLD, _on_rank, layout)):
        for kind, res in result.items():
            where = f"{name} rank {rank} {kind}"
            assert res["norm2"] == pytest.approx(want_norm, rel=1e-6), where
            assert res["norm_inf"] == pytest.approx(want_inf, rel=1e-6), where
            assert res["zeros"] == want_zeros, where
            assert res["both"] == (pytest.approx(want_norm, rel=1e-6), want_zeros), where
            assert res["both_inf"] == (pytest.approx(want_inf, rel=1e-6), want_zeros), where
            assert res["all_zeros"] == numel, where
            # Shared or separate statistics groups, the chained norm is the norm of the children's norms.
            assert res["children_combined"] == pytest.approx(res["norm2"], rel=1e-6), where
            assert res["clip_returned"] == pytest.approx(want_norm, rel=1e-6), where
            assert res["after_clip"] == pytest.approx(want_norm / 3, rel=1e-5), where
            assert res.get("clip_worst", 0.0) < 1e-6, where
            # One all-reduce per distinct group of more than one rank; one in all when the children share it.
            expected_shared = kind == "sharded" or shared_groups
            assert res["shared"] == expected_shared, where
            assert res["norm2_calls"] == res["distinct_groups"], where
            assert res["zeros_calls"] == res["distinct_groups"], where
            if expected_shared:
                assert res["norm2_calls"] <= 1, where
            else:
                assert res["norm2_calls"] == 2, where
            # A stage without experts still has an (empty) expert child, so it joins the expert reduction.
            local_experts = sum(shard.spec.kind == EXPERT for shard in shards_of(layout, rank))
            assert [n for expert, n in res["children"] if expert] == [local_experts], where
            if layout.pp > 1 and layout.coords(rank)["pp"] == 0:
                assert local_experts == 0, where


"""A few training steps of the demo MoE on TP 2 x EP 4 x ETP 1 (8 ranks: dp_cp 4, expt_dp 2), against the
unsharded float64 model trained with the same rule in each rank, for the unsharded and the sharded optimizer.

float64 model parameters (``mixed_precision=False``) make the comparison tight, so a wrong grad scale (experts
averaged over ``expt_dp`` instead of divided by the ``dp_cp`` size), a wrong clipping norm or a wrong shard shows.
A bf16 run with float32 main copies is compared at bf16 tolerance. The sharded optimizer's state dict, keyed by
global names, resumes a run exactly.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import torch
import torch.distributed as dist

from examples.moe_demo.model import (
    ReferenceMoE,
    ShardedMoE,
    ToyMoEConfig,
    full_weights,
    make_batch,
    shard_of,
)
from pgregistry import registry
from pgregistry.experts import get_ep_rank_and_size, globalize_expert_keys
from pgregistry.layout import ParallelLayout
from pgregistry.optim import build_optimizer
from pgregistry.testing import run_world

LAYOUT = ParallelLayout(num_ranks=8, tp=2, ep=4, expt_tp=1)
CONFIG = ToyMoEConfig(num_layers=1, seed=7)
STEPS, LR, MAX_NORM = 3, 0.02, 0.5


def _global_names(model: ShardedMoE, collection: Any) -> dict[str, torch.nn.Parameter]:
    """Global (unsharded) name -> parameter: checkpoint names with global expert indices."""
    ep_rank, ep_size = get_ep_rank_and_size(collection)
    return globalize_expert_keys(model.checkpoint_names(), CONFIG.num_experts, ep_rank, ep_size)


def _reference(rule: str) -> tuple[dict[str, torch.Tensor], list[float]]:
    """The unsharded float64 model after STEPS of ``rule`` on the global batch, clipped by its own norm; and the
    norm before clipping at each step."""
    model = ReferenceMoE(CONFIG, full_weights(CONFIG))
    opt = (torch.optim.SGD if rule == "sgd" else torch.optim.Adam)(model.parameters(), lr=LR)
    norms = []
    for step in range(STEPS):
        x, target, ids = make_batch(CONFIG, step, LAYOUT.dp)
        opt.zero_grad()
        model.loss(x, target, ids).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        opt.step()
    return {name: p.detach().clone() for name, p in model.named_weights().items()}, norms


def _train(model: ShardedMoE, opt: Any, steps: range) -> list[float]:
    dp_rank, per_rank = LAYOUT.coords(dist.get_rank())["dp"], CONFIG.tokens_per_dp_rank
    mine = slice(dp_rank * per_rank, (dp_rank + 1) * per_rank)
    norms = []
    for step in steps:
        x, target, ids = make_batch(CONFIG, step, LAYOUT.dp)
        opt.zero_grad()
        model.loss(x[mine], target[mine], ids[mine], per_rank).backward()
        opt.sync_grads()
        norms.append(float(opt.clip_grad_norm(MAX_NORM)))
        opt.step()
    return norms


def _worst_rel_diff(model: ShardedMoE, reference: dict[str, torch.Tensor], collection: Any) -> float:
    worst = 0.0
    for full, param in _global_names(model, collection).items():
        want = shard_of(full, reference[full], collection, CONFIG.num_experts)
        assert want is not None
        worst = max(worst, float((param.detach().double() - want).abs().max() / want.abs().max()))
    return worst


def _on_rank() -> dict[str, Any]:
    collection = registry.build(LAYOUT)
    weights = full_weights(CONFIG)
    out: dict[str, Any] = {}
    # SGD is sensitive to the grads' scale (Adam is not); the resume uses Adam, whose state must survive.
    for name, dtype, sharded, rule in (
        ("float64", torch.float64, False, "sgd"),
        ("float64_sharded", torch.float64, True, "sgd"),
        ("bf16_sharded", torch.bfloat16, True, "sgd"),
    ):
        reference, _ = _reference(rule)
        model = ShardedMoE(CONFIG, weights, collection, dtype=dtype)
        opt = build_optimizer(
            model, collection, optimizer=rule, lr=LR, sharded=sharded, mixed_precision=dtype != torch.float64
        )
        out[name] = {"norms": _train(model, opt, range(STEPS)), "worst": _worst_rel_diff(model, reference, collection)}

    # Resume: 2 steps, save, a fresh model and optimizer load the state, step 3 must equal an uninterrupted run.
    def fresh() -> tuple[ShardedMoE, Any]:
        model = ShardedMoE(CONFIG, weights, collection, dtype=torch.float32)
        names = {id(p): n for n, p in _global_names(model, collection).items()}
        opt = build_optimizer(
            model, collection, lr=LR, sharded=True, mixed_precision=False, param_name_fn=lambda p: names[id(p)]
        )
        return model, opt

    straight, straight_opt = fresh()
    _train(straight, straight_opt, range(STEPS))
    first, first_opt = fresh()
    _train(first, first_opt, range(STEPS - 1))
    saved = copy.deepcopy(first_opt.state_dict())
    resumed, resumed_opt = fresh()
    resumed_opt.load_state_dict(saved)
    _train(resumed, resumed_opt, range(STEPS - 1, STEPS))
    out["resume_equal"] = all(
        torch.equal(a, b) for a, b in zip(straight.parameters(), resumed.parameters(), strict=True)
    )
    out["state_keys"] = sorted(k for child in saved["children"] for k in child["shards"])
    return out


def test_sharded_and_unsharded_training_match_the_float64_model() -> None:
    oracle = _reference("sgd")[1]
    assert all(n > MAX_NORM for n in oracle)  # clipping acts every step
    results = run_world(LAYOUT.num_ranks, _on_rank, timeout=60.0)
    for rank, result in enumerate(results):
        for name in ("float64", "float64_sharded"):
            # Norms reduce in float32 (grad_stats), so float64 runs agree to float32 precision.
            assert result[name]["norms"] == [pytest_approx(n, 1e-6) for n in oracle], f"rank {rank} {name}"
            assert result[name]["worst"] < 1e-7, f"rank {rank} {name}: {result[name]['worst']:.2e}"
        assert result["bf16_sharded"]["norms"] == [pytest_approx(n, 2e-2) for n in oracle], f"rank {rank}"
        assert result["bf16_sharded"]["worst"] < 2e-2, f"rank {rank}: {result['bf16_sharded']['worst']:.2e}"
        assert result["resume_equal"], f"rank {rank}"
    # Every rank keys its shard by global names; together they cover every parameter of the model.
    keys = {k for result in results for k in result["state_keys"]}
    assert keys == set(full_weights(CONFIG))


def pytest_approx(value: float, rel: float) -> Any:
    import pytest

    return pytest.approx(value, rel=rel, abs=rel * math.ulp(1.0))

"""The demo's sharded MoE against its float64 twin: same loss, same grads, on several TP x EP layouts."""

from __future__ import annotations

import pytest
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
from pgregistry.layout import ParallelLayout
from pgregistry.testing import run_world

CONFIG = ToyMoEConfig(num_layers=1)
WORLD = 4


def _sharded_grads(tp: int, ep: int) -> tuple[float, dict[str, torch.Tensor], int]:
    layout = ParallelLayout(num_ranks=WORLD, tp=tp, ep=ep, expt_tp=1)
    pg = registry.build(layout)
    model = ShardedMoE(CONFIG, full_weights(CONFIG), pg, dtype=torch.float64)
    x, target, ids = make_batch(CONFIG, 0, layout.dp)
    n = CONFIG.tokens_per_dp_rank
    mine = slice(layout.coords(dist.get_rank())["dp"] * n, (layout.coords(dist.get_rank())["dp"] + 1) * n)
    loss = model.loss(x[mine], target[mine], ids[mine], n)
    loss.backward()
    # Megatron-Core's rule: dense grads averaged over dp_cp, expert grads summed over expt_dp / |dp_cp|.
    grads = {}
    for name, param in model.checkpoint_names().items():
        grad = param.grad.clone() if param.grad is not None else torch.zeros_like(param)
        group = pg.get("expt_dp") if getattr(param, "allreduce", True) is False else pg.get("dp_cp")
        if group is not None:
            dist.all_reduce(grad, group=group)
        grads[name] = grad / layout.dp
    mean = loss.detach().clone()
    if pg.get("dp_cp") is not None:
        dist.all_reduce(mean, group=pg.get("dp_cp"))
    return float(mean) / layout.dp, grads, model.first_expert


@pytest.mark.parametrize(("tp", "ep"), [(2, 2), (4, 1), (1, 4)])
def test_sharded_grads_equal_the_float64_model(tp: int, ep: int) -> None:
    weights = full_weights(CONFIG)
    reference = ReferenceMoE(CONFIG, weights)
    x, target, ids = make_batch(CONFIG, 0, WORLD // tp)
    loss = reference.loss(x, target, ids)
    loss.backward()
    layout = ParallelLayout(num_ranks=WORLD, tp=tp, ep=ep, expt_tp=1)
    for rank, (sharded_loss, grads, first_expert) in enumerate(run_world(WORLD, _sharded_grads, tp, ep)):
        assert sharded_loss == pytest.approx(loss.item(), rel=1e-12)
        tp_rank = layout.coords(rank)["tp"]
        for name, grad in grads.items():
            if ".local_experts." in name:
                head, rest = name.split(".local_experts.")
                local, part = rest.split(".")
                full = reference.param(f"{head}.local_experts.{first_expert + int(local)}.{part}").grad
            else:
                full = reference.param(name).grad
                full = full.chunk(tp, 0)[tp_rank] if name.endswith("mlp.fc1") else full
                full = full.chunk(tp, 1)[tp_rank] if name.endswith("mlp.fc2") else full
            torch.testing.assert_close(grad, full, rtol=1e-10, atol=1e-12, msg=f"rank {rank} {name}")


def test_shard_of_places_experts_on_their_ep_rank() -> None:
    def shards() -> list[bool]:
        pg = registry.build(ParallelLayout(num_ranks=WORLD, ep=4))
        weights = full_weights(CONFIG)
        names = [f"layers.0.moe.experts.local_experts.{e}.fc1" for e in range(CONFIG.num_experts)]
        return [shard_of(n, weights[n], pg, CONFIG.num_experts) is not None for n in names]

    held = run_world(WORLD, shards)
    for rank, mine in enumerate(held):
        assert mine == [e // 2 == rank for e in range(CONFIG.num_experts)]

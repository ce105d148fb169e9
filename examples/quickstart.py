"""The README's example, runnable: ``torchrun --nproc-per-node 8 examples/quickstart.py`` (gloo,
CPU)."""

from __future__ import annotations

import torch
import torch.distributed as dist

import pgregistry
from pgregistry import registry
from pgregistry.optim import build_optimizer
from pgregistry.params import mark_expert, mark_expert_module


def train_step() -> tuple[float, float]:
    layout = pgregistry.ParallelLayout(num_ranks=8, tp=2, ep=4, expt_tp=1)  # dp 4, expert dp 2
    pg = registry.build(layout, name="policy")  # one communicator per distinct rank set
    pgregistry.attach(model := torch.nn.Module(), pg)  # the model knows its own grid
    model.dense = torch.nn.Linear(16, 16)  # replicated over TP: counted on TP rank 0 only
    model.experts = mark_expert_module(torch.nn.Module())
    model.experts.w = mark_expert(torch.nn.Parameter(torch.randn(16, 16)))  # one expert per EP rank

    pgregistry.model_parallel_manual_seed(1234, pg)  # per-axis RNG streams, Megatron-Core's seeds
    # dense + expert children, all groups wired
    optimizer = build_optimizer(model, pg, optimizer="adam", lr=1e-3)
    loss = (model.dense(torch.randn(4, 16)) @ model.experts.w).square().mean()
    loss.backward()
    optimizer.sync_grads()  # dense grads over dp_cp, expert grads over expt_dp
    norm = optimizer.clip_grad_norm(1.0)  # the global norm of the unsharded model, before clipping
    optimizer.step()
    return loss.item(), norm.item()


if __name__ == "__main__":
    dist.init_process_group("gloo")
    loss, norm = train_step()
    if dist.get_rank() == 0:
        print(f"loss {loss:.4f}, grad norm {norm:.4f}")
    registry.destroy()
    dist.destroy_process_group()

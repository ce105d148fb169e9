"""FSDP2 with EP experts on the collection's own communicators, with exact grad statistics.

Runnable on CPU: ``torchrun --nproc-per-node 4 examples/fsdp2_experts.py`` (gloo). Four ranks, EP 2:
each EP rank holds half the experts and FSDP2 shards them over expert data parallelism (2 ranks);
the dense layer is sharded over the dense data-parallel group (4 ranks). The roles are marked before
``fully_shard`` and survive it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard

import pgregistry
from pgregistry import registry
from pgregistry.grad_stats import clip_grad_norm_, count_zeros
from pgregistry.mesh import to_device_mesh
from pgregistry.params import mark_expert, mark_expert_module, mark_expert_replicated

EXPERTS, HIDDEN, RANK = 4, 8, 2


class Experts(nn.Module):
    """This EP rank's experts, each with its own LoRA factors (distinct per EP rank)."""

    def __init__(self, local_experts: int) -> None:
        super().__init__()
        mark_expert_module(self)  # every parameter here must say how it stands to EP
        self.lora_a = mark_expert(nn.Parameter(torch.randn(local_experts, RANK, HIDDEN)))
        self.lora_b = mark_expert(nn.Parameter(torch.randn(local_experts, HIDDEN, RANK)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # summed over the experts
        return torch.einsum("eor,eri,bi->ebo", self.lora_b, self.lora_a, x).sum(dim=0)


class Model(nn.Module):
    def __init__(self, local_experts: int) -> None:
        super().__init__()
        self.dense = nn.Linear(HIDDEN, HIDDEN)
        self.experts = Experts(local_experts)
        # Replicated across EP, so sharded with the dense parameters over the dense data-parallel
        # group (all of whose ranks average its grad), not with the experts over expert data
        # parallelism.
        self.scale = mark_expert_replicated(nn.Parameter(torch.ones(HIDDEN)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(torch.relu(self.dense(x))) * self.scale


def build() -> tuple[pgregistry.ParallelLayout, pgregistry.ProcessGroupCollection, Model]:
    """The layout, its collection, and the model sharded with FSDP2 over meshes made of the
    collection's groups."""
    layout = pgregistry.ParallelLayout(num_ranks=dist.get_world_size(), ep=2)  # dp 4, expert dp 2
    pg = registry.build(layout)
    # each EP rank its own experts, the same dense layer
    torch.manual_seed(layout.coords(dist.get_rank())["ep"])
    model = Model(EXPERTS // layout.ep)
    torch.manual_seed(0)
    model.dense.reset_parameters()
    fully_shard(model.experts, mesh=to_device_mesh(pg, ("expt_dp",)))
    fully_shard(model, mesh=to_device_mesh(pg, ("dp_cp",)))
    return layout, pg, model


def backward(model: Model) -> None:
    batch = torch.randn(4, HIDDEN, generator=torch.Generator().manual_seed(dist.get_rank()))
    model(batch).square().mean().backward()


def train_step(max_norm: float = 1.0) -> tuple[float, int]:
    """One step's statistics: the global grad norm before clipping and the global zero count."""
    _, pg, model = build()
    backward(model)
    zeros = count_zeros(model, pg)
    # every grad counted once: dense once, each expert once
    norm = clip_grad_norm_(model, max_norm, pg)
    return float(norm), zeros


if __name__ == "__main__":
    dist.init_process_group("gloo")
    norm, zeros = train_step()
    if dist.get_rank() == 0:
        print(f"grad norm {norm:.6f}, zero grad elements {zeros}")
    registry.destroy()
    dist.destroy_process_group()

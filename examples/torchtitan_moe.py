"""torchtitan's Qwen3 MoE, parallelized by torchtitan, trained on pgregistry's communicators with an
exact grad norm.

Runnable on CPU: ``torchrun --nproc-per-node 4 examples/torchtitan_moe.py`` (gloo; needs torchtitan
0.3, which ``make setup`` installs). Four ranks: FSDP2 over ``dp_shard`` 2, TP 2, EP 2 (torchtitan's
EP borrows its ranks from ``dp_shard x tp``; expert TP 1). ``to_parallel_dims`` hands torchtitan a
``ParallelDims`` whose meshes are the collection's communicators, one per distinct rank set (plus a
second one for expert FSDP, whose ranks are the dense FSDP ranks when EP = TP, as here: FSDP2 needs
the two apart), where torchtitan's own ``build_mesh`` would create several per rank set;
torchtitan's ``parallelize_qwen3`` then applies its TP, EP and FSDP2 on them. Each step prints
pgregistry's grad norm (the norm of the whole model, each expert counted once) next to torchtitan's
own.

torchtitan 0.3's default ``spmd_backend`` ("spmd_types") needs an FSDP2 newer than torch 2.13's, so
this runs torchtitan's "partial_dtensor" backend. FlexAttention, which torchtitan's language-model
configs pick, needs ``torch.compile``; SDPA stands in for it here.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

import pgregistry
from pgregistry import registry
from pgregistry.grad_stats import clip_grad_norm_, count_zeros
from pgregistry.interop.torchtitan import (
    communicator_ranks,
    mark_torchtitan_experts,
    to_parallel_dims,
)

VOCAB, DIM, HEAD_DIM, SEQ = 64, 32, 8, 8
SPMD_BACKEND = "partial_dtensor"


def qwen3_moe_config(*, ep: int, experts: int = 8, layers: int = 2) -> Any:
    """A Qwen3 MoE at CPU size, built by torchtitan's own builder for its Qwen3 MoE flavors, with
    its sharding (sequence parallel on, as torchtitan's default) set as torchtitan's
    ``update_from_config`` sets it."""
    from torchtitan.models import qwen3
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.qwen3.model import Qwen3Model
    from torchtitan.models.qwen3.sharding import set_qwen3_sharding_config

    config = Qwen3Model.Config(
        vocab_size=VOCAB,
        dim=DIM,
        norm=qwen3._qwen3_norm(DIM),
        tok_embeddings=Embedding.Config(
            num_embeddings=VOCAB, embedding_dim=DIM, param_init=qwen3._EMBEDDING_INIT
        ),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=qwen3._LINEAR_INIT),
        layers=qwen3._build_qwen3_moe_layers(
            n_layers=layers,
            dim=DIM,
            n_heads=4,
            n_kv_heads=2,
            head_dim=HEAD_DIM,
            moe_hidden_dim=16,
            num_experts=experts,
            top_k=2,
            attn_backend="flex",
            moe_comm_backend="standard",
            rope=CosSinRoPE.Config(dim=HEAD_DIM, max_seq_len=64, theta=10000.0),
        ),
    )
    for layer in config.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    set_qwen3_sharding_config(config, enable_sp=True, enable_ep=ep > 1)
    return config


def build() -> tuple[
    pgregistry.ParallelLayout, pgregistry.ProcessGroupCollection, Any, torch.nn.Module
]:
    """The layout, its collection, torchtitan's ParallelDims on the collection's communicators, and
    the model parallelized by torchtitan on them."""
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import utils as titan_utils
    from torchtitan.models.qwen3 import parallelize_qwen3

    # dp_shard = world / 2
    layout = pgregistry.ParallelLayout(num_ranks=dist.get_world_size(), tp=2, ep=2, expt_tp=1)
    pg = registry.build(layout)  # one communicator per distinct rank set
    parallel_dims = to_parallel_dims(pg, spmd_backend=SPMD_BACKEND, device_type="cpu")
    titan_utils.set_spmd_backend(SPMD_BACKEND)
    torch.manual_seed(0)  # the same weights on every rank; torchtitan shards them
    model = qwen3_moe_config(ep=layout.ep).build()
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    parallelism = ParallelismConfig(
        data_parallel_shard_degree=parallel_dims.dp_shard,
        tensor_parallel_degree=layout.tp,
        expert_parallel_degree=layout.ep,
        spmd_backend=SPMD_BACKEND,
    )
    model = parallelize_qwen3(
        model,
        parallel_dims=parallel_dims,
        training=TrainingConfig(mixed_precision_param="float32"),
        parallelism=parallelism,
        compile_config=CompileConfig(),
        ac_config=None,
        dump_folder="",
    )
    for module in model.modules():
        if isinstance(module, FSDPModule):
            # gloo has no PREMUL_SUM; the sum is the same
            module.set_force_sum_reduction_for_comms(True)
    mark_torchtitan_experts(model)  # each expert counted once, an unclassified one refused
    return layout, pg, parallel_dims, model


def batch(step: int, parallel_dims: Any) -> torch.Tensor:
    """This data-parallel rank's tokens for ``step`` (TP ranks share them, as torchtitan's
    dataloader does)."""
    mesh = parallel_dims.get_optional_mesh("batch")
    dp_rank = 0 if mesh is None else mesh.get_local_rank()
    generator = torch.Generator().manual_seed(1000 * step + dp_rank)
    return torch.randint(0, VOCAB, (2, SEQ), generator=generator)


def backward(model: torch.nn.Module, tokens: torch.Tensor, parallel_dims: Any) -> float:
    """Forward and backward in torchtitan's SPMD context; a loss summed over tokens (the global
    grads add up)."""
    from torchtitan.distributed import utils as titan_utils

    with titan_utils.get_spmd_context(parallel_dims=parallel_dims)():
        output = model(tokens)
        output = output.full_tensor() if hasattr(output, "full_tensor") else output
        loss = output.float().square().mean()
        loss.backward()
    return float(loss.detach())


def train(steps: int = 3, max_norm: float = 1.0) -> list[dict[str, float]]:
    """``steps`` AdamW steps; per step the loss, pgregistry's norm and zero count, torchtitan's
    norm."""
    from torchtitan.distributed.utils import clip_grad_norm_ as titan_clip_grad_norm_

    _, pg, parallel_dims, model = build()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    history = []
    for step in range(steps):
        optimizer.zero_grad()
        loss = backward(model, batch(step, parallel_dims), parallel_dims)
        # scales by 1
        titan = float(
            titan_clip_grad_norm_(list(model.parameters()), float("inf"), ep_enabled=True)
        )
        zeros = count_zeros(model, pg)
        norm = float(clip_grad_norm_(model, max_norm, pg))  # the global norm, before clipping
        optimizer.step()
        history.append({"loss": loss, "norm": norm, "titan_norm": titan, "zeros": zeros})
    return history


def main() -> None:
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    history = train()
    held = communicator_ranks()
    if dist.get_rank() == 0:
        for step, row in enumerate(history):
            print(
                f"step {step}: loss {row['loss']:.5f}  pgregistry norm {row['norm']:.7f}  "
                f"torchtitan norm {row['titan_norm']:.7f}  zero grads {row['zeros']}"
            )
        print(f"rank 0 holds {len(held)} communicators for {len(set(held))} rank sets")
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()

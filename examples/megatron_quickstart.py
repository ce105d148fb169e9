"""The README's Megatron-Core example: ``torchrun --nproc-per-node 4
examples/megatron_quickstart.py`` (GPUs, NCCL).

A Megatron-Core MoE GPTModel on pgregistry's groups, with no ``initialize_model_parallel`` and no
hand-written mapping, then pgregistry's grad norm. Megatron-Core's local attention draws scratch
memory from a CUDA buffer that only ``initialize_model_parallel`` (or its private
``_set_global_memory_buffer``) sets up, so the training step needs GPUs; :func:`build_model` alone
also runs on CPU (the tests build it in a gloo world).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.transformer_config import TransformerConfig

import pgregistry
from pgregistry import registry
from pgregistry.collection import ProcessGroupCollection
from pgregistry.interop.megatron import (
    check_config,
    mark_megatron_experts,
    megatron_config_kwargs,
    seed_megatron_rng,
    to_megatron,
)


def build_model(world_size: int) -> tuple[GPTModel, ProcessGroupCollection]:
    # one expert group per rank
    layout = pgregistry.ParallelLayout(num_ranks=world_size, ep=world_size, expt_tp=1)
    pg = registry.build(layout)
    config = TransformerConfig(
        num_layers=2,
        hidden_size=64,
        ffn_hidden_size=128,
        num_attention_heads=4,
        num_moe_experts=8,
        moe_router_topk=2,
        add_bias_linear=False,
        use_cpu_initialization=not torch.cuda.is_available(),
        moe_token_dispatcher_type="alltoall" if torch.cuda.is_available() else "allgather",
        **megatron_config_kwargs(layout),  # Megatron-Core's names for the layout's sizes
    )
    # a size that disagrees with the groups is an error, not a silent reshard
    check_config(config, pg)
    spec = get_gpt_layer_local_spec(num_experts=8, moe_grouped_gemm=False)
    # the same communicators, under Megatron-Core's type
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=256,
        max_sequence_length=32,
        pg_collection=to_megatron(pg),
    )
    mark_megatron_experts(model)  # an expert parameter that loses allreduce=False is then an error
    return model, pg


def train_step() -> float:
    model, pg = build_model(dist.get_world_size())
    seed_megatron_rng(1234, pg)  # Megatron-Core's RNG tracker, seeded from the collection's ranks
    parallel_state._set_global_memory_buffer()  # the attention's scratch buffer (no process group)
    tokens = torch.randint(0, 256, (2, 32), device="cuda")
    positions = torch.arange(32, device="cuda").expand(2, -1)
    loss = model.cuda()(tokens, positions, None, labels=tokens).float().mean()
    loss.backward()
    norm = pgregistry.grad_norm(model, pg)  # the norm of the whole model, experts counted once
    return float(norm)


if __name__ == "__main__":
    dist.init_process_group("nccl")
    torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
    norm = train_step()
    if dist.get_rank() == 0:
        print(f"grad norm {norm:.6f}")
    registry.destroy()
    dist.destroy_process_group()

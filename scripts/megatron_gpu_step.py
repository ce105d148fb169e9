"""One Megatron-Core MoE training step on GPUs, on pgregistry's groups: Megatron's optimizer norm vs pgregistry's.

Run under torchrun, one rank per GPU (needs CUDA, Megatron-Core and its triton; no Transformer Engine or Apex)::

    torchrun --standalone --nproc-per-node 1 scripts/megatron_gpu_step.py [--ep N] [--expt-tp N] [--tp N]

Every rank: builds a ``ParallelLayout`` (expert parallelism over every GPU by default), ``pgregistry.build(...)``
and hands it to Megatron-Core with ``to_megatron`` (no ``initialize_model_parallel``:
Megatron-Core's only global set up here is its scratch memory buffer, which its local attention needs). Then:

1. ``seed_megatron_rng`` seeds Megatron-Core's CUDA RNG tracker from the collection; each stream's first draw must
   equal a fresh CUDA generator seeded with what ``pgregistry.rng.tracker_seeds`` computes;
2. a Megatron-Core ``GPTModel`` with routed experts (local layer spec, alltoall dispatcher, float32), wrapped in its
   ``DistributedDataParallel``, its optimizer from ``get_megatron_optimizer`` (Adam, clipping at 1.0, zero counting);
   ``check_config`` and ``mark_megatron_experts`` on it;
3. one forward/backward on random tokens, ``finalize_model_grads``, then ``pgregistry.grad_norm`` and
   ``count_zeros`` over the synchronised main grads, then ``optimizer.step()``, which returns Megatron-Core's norm
   and zero count of the same grads.

Rank 0 prints each rank's figures and PASS/FAIL (relative difference of the norms at most 1e-5, zero counts equal,
RNG streams as computed); every rank exits 1 when a check failed.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

NORM_TOLERANCE = 1e-5


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size (default 1)")
    parser.add_argument("--ep", type=int, default=0, help="expert-parallel size (default: the world size)")
    parser.add_argument("--expt-tp", type=int, default=1, help="expert tensor-parallel size (default 1)")
    parser.add_argument("--experts", type=int, default=8, help="routed experts (default 8)")
    parser.add_argument("--seed", type=int, default=1234, help="base seed (default 1234)")
    return parser.parse_args(argv)


def _check_rng_streams(seeds: dict[str, int]) -> list[str]:
    """Streams of Megatron-Core's tracker whose first draw differs from a fresh generator with the computed seed."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    tracker = get_cuda_rng_tracker()
    wrong = []
    for name, seed in seeds.items():
        with tracker.fork(name):
            drawn = torch.rand(8, device="cuda")
        expected = torch.rand(8, device="cuda", generator=torch.Generator(device="cuda").manual_seed(seed))
        if not torch.equal(drawn, expected):
            wrong.append(name)
    return wrong


def _step(args: argparse.Namespace) -> dict[str, Any]:
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.transformer_config import TransformerConfig

    from pgregistry import count_zeros, grad_norm, registry
    from pgregistry.interop.megatron import (
        check_config,
        mark_megatron_experts,
        megatron_config_kwargs,
        seed_megatron_rng,
        to_megatron,
    )
    from pgregistry.layout import ParallelLayout

    world = dist.get_world_size()
    layout = ParallelLayout(num_ranks=world, tp=args.tp, ep=args.ep or world, expt_tp=args.expt_tp)
    pg = registry.build(layout)
    mc = to_megatron(pg)
    seeds = seed_megatron_rng(args.seed, pg)
    rng_wrong = _check_rng_streams(seeds)
    parallel_state._set_global_memory_buffer()  # scratch memory for the local attention; no process group

    config = TransformerConfig(
        num_layers=2, hidden_size=256, ffn_hidden_size=512, num_attention_heads=8, num_moe_experts=args.experts,
        moe_router_topk=2, moe_token_dispatcher_type="alltoall", moe_router_load_balancing_type="none",
        add_bias_linear=False, params_dtype=torch.float32, masked_softmax_fusion=False,
        bias_activation_fusion=False, bias_dropout_fusion=False, gradient_accumulation_fusion=False,
        apply_rope_fusion=False, sequence_parallel=args.tp > 1, **megatron_config_kwargs(layout),
    )
    check_config(config, pg)
    spec = get_gpt_layer_local_spec(num_experts=args.experts, moe_grouped_gemm=False)
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=1024, max_sequence_length=128,
                     pg_collection=mc).cuda()
    marked = mark_megatron_experts(model)
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                               use_distributed_optimizer=False)
    ddp_model = DistributedDataParallel(config, ddp_config, model, pg_collection=mc)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-4, clip_grad=1.0, log_num_zeros_in_grad=True, bf16=False),
        [ddp_model], use_gloo_process_groups=False, pg_collection=mc,
    )

    generator = torch.Generator(device="cuda").manual_seed(args.seed + dist.get_rank())
    tokens = torch.randint(0, 1024, (4, 128), device="cuda", generator=generator)
    positions = torch.arange(128, device="cuda").unsqueeze(0).expand(4, -1)
    loss = ddp_model(tokens, positions, None, labels=tokens).float().mean()
    loss.backward()
    finalize_model_grads([ddp_model], pg_collection=mc)

    for param in model.parameters():
        param.grad = param.main_grad  # the synchronised grads Megatron-Core's optimizer reads
    ours_norm = float(grad_norm(model, pg))
    ours_zeros = int(count_zeros(model, pg))
    success, megatron_norm, megatron_zeros = optimizer.step()
    registry.destroy()
    return {
        "layout": f"tp{layout.tp} ep{layout.ep} expt_tp{layout.expt_tp} dp{layout.dp} expt_dp{layout.expt_dp}",
        "loss": float(loss), "marked": marked, "rng_wrong": rng_wrong, "step_ok": bool(success),
        "megatron_norm": float(megatron_norm), "pgregistry_norm": ours_norm,
        "megatron_zeros": int(megatron_zeros), "pgregistry_zeros": ours_zeros,
    }


def _verdict(result: dict[str, Any]) -> list[str]:
    failures = []
    if result["rng_wrong"]:
        failures.append(f"RNG streams {result['rng_wrong']} differ from the computed seeds")
    if not result["step_ok"]:
        failures.append("optimizer step skipped (inf/nan)")
    relative = abs(result["megatron_norm"] - result["pgregistry_norm"]) / max(result["megatron_norm"], 1e-30)
    if relative > NORM_TOLERANCE:
        failures.append(f"norms differ by {relative:.2e} (relative)")
    if result["megatron_zeros"] != result["pgregistry_zeros"]:
        failures.append("zero counts differ")
    return failures


def main(argv: list[str]) -> int:
    args = _parse(argv)
    if not torch.cuda.is_available():
        print("megatron_gpu_step needs CUDA (Megatron-Core's DDP and alltoall dispatcher do)", file=sys.stderr)
        return 2
    warnings.filterwarnings("ignore", message="Apex is not installed")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    try:
        result = _step(args)
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, result)
    finally:
        dist.destroy_process_group()
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, world {len(everyone)}")
        for rank, res in enumerate(everyone):
            failures = _verdict(res)
            print(
                f"rank {rank} {res['layout']}: loss {res['loss']:.6f}; grad norm megatron {res['megatron_norm']:.9g} "
                f"pgregistry {res['pgregistry_norm']:.9g}; zeros megatron {res['megatron_zeros']} pgregistry "
                f"{res['pgregistry_zeros']}; expert modules marked {res['marked']}; "
                f"{'FAIL: ' + '; '.join(failures) if failures else 'PASS'}"
            )
    return 1 if any(_verdict(res) for res in everyone) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

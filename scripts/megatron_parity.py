"""Megatron-Core GPT with routed experts trained on Megatron-Core's own groups and on pgregistry's, step for step.

Run under torchrun, one rank per GPU (needs CUDA and Megatron-Core with its triton; no Transformer Engine or Apex)::

    torchrun --standalone --nproc-per-node 8 scripts/megatron_parity.py --layout tp=2,ep=4,expt_tp=1
    torchrun --standalone --nproc-per-node 8 scripts/megatron_parity.py --layout tp=2,pp=2,ep=2
    torchrun --standalone --nproc-per-node 1 scripts/megatron_parity.py --layout tp=1 --steps 3   # one GPU

Every rank trains the same model twice in one process, from the same seed on the same data (tokens drawn per step,
microbatch and data-parallel rank from a seeded CPU generator):

* ``pgregistry``: ``registry.build(layout)`` handed to Megatron-Core with ``to_megatron``, and no
  ``initialize_model_parallel`` (Megatron-Core's ``parallel_state`` is checked uninitialised before and after);
  seeded with ``seed_megatron_rng``; the model, DDP, optimizer, pipeline schedule (its ``P2PCommunicator`` on the
  collection's ``pp`` group) and ``finalize_model_grads`` all given the collection; each step also takes
  ``pgregistry.grad_norm`` and ``count_zeros`` of the synchronised grads before the optimizer's step;
* ``megatron``: ``initialize_model_parallel`` with the same sizes and order, ``model_parallel_cuda_manual_seed`` of
  the seed plus ``100 * pp_rank`` (as Megatron-LM's training loop seeds), everything read from ``parallel_state``.

Both run with ``torch.use_deterministic_algorithms`` (warnings only, where an op has no deterministic kernel) and
``CUBLAS_WORKSPACE_CONFIG=:4096:8``. Rank 0 prints a table per step (loss, Megatron-Core's grad norm and zero count
of each run, pgregistry's) and PASS/FAIL lines; every rank exits 1 when a check failed:

* the pgregistry run needed no ``initialize_model_parallel``, and its RNG streams are the seeds pgregistry computes;
* the losses (every last-stage rank's, every step), Megatron-Core's grad norms and zero counts of the two runs are
  bit-identical; or, where they are not, the reason is the known one and they agree to ``--tolerance`` (relative,
  default 1e-6): Megatron-Core's ``ChainedOptimizer`` takes the dense and expert norms in one reduction when the two
  optimizers' grad-statistics groups are one ``ProcessGroup`` object, and as ``sqrt(a**2 + b**2)`` of two
  reductions otherwise. pgregistry keeps one communicator per rank set, so where ``mp`` and ``tp_ep_pp`` hold the
  same ranks its collection takes the first path and ``initialize_model_parallel`` (a communicator per kind) the
  second: the same norm, rounded differently (seen at 5e-8 on a CPU run). The line says which path each run took,
  by how much the values differ, and where first;
* ``pgregistry.grad_norm`` equals Megatron-Core's optimizer norm to 1e-5 relative (another summation order) and
  ``count_zeros`` its zero count exactly, at every step.

``--modes pgregistry --steps 1`` is the one-step check ``scripts/megatron_gpu_step.py`` used to be (its record:
docs/measurements/megatron_gpu_step_h200x2.txt).
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import sys
import warnings
import zlib
from pathlib import Path
from typing import Any

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before CUDA starts: deterministic cuBLAS
REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from pgregistry.cli._layout_views import parse_layout_spec  # noqa: E402

NORM_TOLERANCE = 1e-5
MODES = ("pgregistry", "megatron")
VOCAB, SEQUENCE, MICRO_BATCH = 1024, 64, 2


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layout", default="tp=1", help="sizes as KEY=VALUE,... (tp cp pp ep expt_tp order)")
    parser.add_argument("--steps", type=int, default=20, help="training steps per run (default 20)")
    parser.add_argument("--microbatches", type=int, default=4, help="microbatches per step (default 4)")
    parser.add_argument("--experts", type=int, default=8, help="routed experts (default 8)")
    parser.add_argument("--seed", type=int, default=1234, help="the job's seed (default 1234)")
    parser.add_argument("--dispatcher", choices=("alltoall", "allgather"), default="alltoall",
                        help="Megatron-Core's MoE token dispatcher (default alltoall)")
    parser.add_argument("--modes", default=",".join(MODES), help="runs, in order (default pgregistry,megatron)")
    parser.add_argument("--tolerance", type=float, default=1e-6,
                        help="relative difference allowed between the runs' losses and norms when the known reason "
                        "holds (default 1e-6); otherwise they must be bit-identical")
    args = parser.parse_args(argv)
    args.modes = [mode.strip() for mode in args.modes.split(",") if mode.strip()]
    unknown = sorted(set(args.modes) - set(MODES))
    if unknown or not args.modes:
        parser.error(f"--modes takes {', '.join(MODES)}; got {args.modes}")
    return args


def _check_rng_streams(seeds: dict[str, int]) -> list[str]:
    """Streams of Megatron-Core's tracker whose first draw differs from a fresh generator with the computed seed;
    the tracker's states are put back, so the model draws what it would have without this check."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    tracker = get_cuda_rng_tracker()
    states = tracker.get_states()
    wrong = []
    for name, seed in seeds.items():
        with tracker.fork(name):
            drawn = torch.rand(8, device="cuda")
        expected = torch.rand(8, device="cuda", generator=torch.Generator(device="cuda").manual_seed(seed))
        if not torch.equal(drawn, expected):
            wrong.append(name)
    tracker.set_states(states)
    return wrong


def _microbatches(seed: int, step: int, dp_rank: int, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The step's microbatches for one data-parallel rank: the same in both runs (a seeded CPU generator)."""
    out = []
    for index in range(count):
        generator = torch.Generator().manual_seed(zlib.crc32(f"{seed}/{step}/{index}/{dp_rank}".encode()))
        tokens = torch.randint(0, VOCAB, (MICRO_BATCH, SEQUENCE), generator=generator)
        positions = torch.arange(SEQUENCE).unsqueeze(0).expand(MICRO_BATCH, -1)
        out.append((tokens.cuda(), positions.cuda()))
    return out


def _forward_step(data_iterator: Any, model: Any) -> tuple[torch.Tensor, Any]:
    tokens, positions = next(data_iterator)
    output = model(tokens, positions, None, labels=tokens)  # per-token losses on the last stage

    def loss_func(output_tensor: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        loss = output_tensor.float().mean()
        return loss, {"lm loss": loss.detach().clone()}

    return output, loss_func


class SequenceParallelLayerNorm(torch.nn.LayerNorm):
    """torch's LayerNorm for the layer spec's norms: Megatron-Core's own torch norm refuses sequence parallelism
    (which its MoE layer requires in training with TP > 1) unless Apex or Transformer Engine provides the norm.
    Its weight and bias are marked ``sequence_parallel``, as Apex's marks them, so ``finalize_model_grads``
    all-reduces their grads over TP."""

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5, **_unused: Any) -> None:
        super().__init__(hidden_size, eps=eps)
        for param in self.parameters():
            param.sequence_parallel = config.sequence_parallel  # type: ignore[attr-defined]


def _block_spec(args: argparse.Namespace, config: Any, stages: int) -> Any:
    """Megatron-Core's local GPT layer spec with :class:`SequenceParallelLayerNorm`, this stage's layers of it."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    layer = get_gpt_layer_local_spec(num_experts=args.experts, moe_grouped_gemm=False)
    layer.submodules.input_layernorm = SequenceParallelLayerNorm
    layer.submodules.pre_mlp_layernorm = SequenceParallelLayerNorm
    return TransformerBlockSubmodules(
        layer_specs=[layer] * (config.num_layers // stages), layer_norm=SequenceParallelLayerNorm
    )


def _train(mode: str, args: argparse.Namespace, layout: Any) -> dict[str, Any]:
    """One run: this rank's per-step losses (last stage only), Megatron-Core's norms and zero counts, and (for the
    pgregistry run) pgregistry's."""
    from megatron.core import parallel_state
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.models.gpt import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig

    from pgregistry import count_zeros, grad_norm, registry
    from pgregistry.interop.megatron import (
        mark_megatron_experts,
        megatron_config_kwargs,
        seed_megatron_rng,
        to_megatron,
    )

    rank = dist.get_rank()
    coords = layout.coords(rank)
    first, last = coords["pp"] == 0, coords["pp"] == layout.pp - 1
    out: dict[str, Any] = {"mode": mode, "losses": [], "norms": [], "zeros": [], "ours_norms": [], "ours_zeros": [],
                           "step_ok": [], "rng_wrong": [], "globals_before": None, "globals_after": None}
    torch.manual_seed(args.seed + 100 * coords["pp"])  # Megatron-LM's _set_random_seed, before the CUDA streams
    groups: dict[str, Any] = {}
    pg = None
    if mode == "pgregistry":
        out["globals_before"] = parallel_state.model_parallel_is_initialized()
        pg = registry.build(layout, name="megatron-parity")
        groups["pg_collection"] = to_megatron(pg)
        out["rng_wrong"] = _check_rng_streams(seed_megatron_rng(args.seed, pg))
    else:
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
            context_parallel_size=layout.cp, expert_model_parallel_size=layout.ep,
            expert_tensor_parallel_size=layout.expt_tp, order=layout.order, create_gloo_process_groups=False,
        )
        model_parallel_cuda_manual_seed(args.seed + 100 * parallel_state.get_pipeline_model_parallel_rank())
    if mode == "pgregistry":  # initialize_model_parallel sets it up for the other run
        parallel_state._set_global_memory_buffer()  # the local attention's scratch memory (no process group)

    config = TransformerConfig(
        num_layers=4, hidden_size=256, ffn_hidden_size=512, num_attention_heads=8, num_moe_experts=args.experts,
        moe_router_topk=2, moe_token_dispatcher_type=args.dispatcher, moe_router_load_balancing_type="none",
        add_bias_linear=False, params_dtype=torch.float32, pipeline_dtype=torch.float32,
        masked_softmax_fusion=False, bias_activation_fusion=False, bias_dropout_fusion=False,
        gradient_accumulation_fusion=False, apply_rope_fusion=False, sequence_parallel=layout.tp > 1,
        **megatron_config_kwargs(layout),
    )
    model = GPTModel(config=config, transformer_layer_spec=_block_spec(args, config, layout.pp), vocab_size=VOCAB,
                     max_sequence_length=SEQUENCE,
                     pre_process=first, post_process=last, **groups).cuda()
    if pg is not None:
        mark_megatron_experts(model)
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                               use_distributed_optimizer=False)
    ddp_model = DistributedDataParallel(config, ddp_config, model, **groups)
    config.finalize_model_grads_func = finalize_model_grads
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-4, clip_grad=1.0, log_num_zeros_in_grad=True, bf16=False),
        [ddp_model], use_gloo_process_groups=False, **groups,
    )
    chained = getattr(optimizer, "chained_optimizers", [])
    out["one_stats_group"] = len(chained) > 1 and bool(optimizer.grads_states_parallel_group_is_shared())
    schedule: dict[str, Any] = {}
    if pg is not None:
        forward_backward = get_forward_backward_func(pp_size=layout.pp, vp_size=None)
        schedule = {"p2p_communicator": P2PCommunicator(pp_group=groups["pg_collection"].pp, config=config),
                    "pg_collection": groups["pg_collection"]}
    else:
        forward_backward = get_forward_backward_func()

    for step in range(args.steps):
        ddp_model.zero_grad_buffer()
        optimizer.zero_grad()
        batches = _microbatches(args.seed, step, coords["dp"], args.microbatches)
        reduced = forward_backward(
            forward_step_func=_forward_step, data_iterator=iter(batches), model=[ddp_model],
            num_microbatches=args.microbatches, seq_length=SEQUENCE, micro_batch_size=MICRO_BATCH,
            forward_only=False, **schedule,
        )
        for param in model.parameters():
            param.grad = param.main_grad  # the synchronised grads Megatron-Core's optimizer reads (it does the same)
        if pg is not None:
            out["ours_norms"].append(float(grad_norm(model, pg)))
            out["ours_zeros"].append(int(count_zeros(model, pg)))
        success, norm, zeros = optimizer.step()
        out["losses"].append([float(entry["lm loss"]) for entry in reduced] if last else None)
        out["norms"].append(float(norm))
        out["zeros"].append(int(zeros))
        out["step_ok"].append(bool(success))

    del optimizer, ddp_model, model
    gc.collect()
    torch.cuda.synchronize()
    if pg is not None:
        out["globals_after"] = parallel_state.model_parallel_is_initialized()
        registry.destroy()
    else:
        parallel_state.destroy_model_parallel()
    parallel_state.destroy_global_memory_buffer()
    torch.cuda.empty_cache()
    return out


def _differs(a: float, b: float, tolerance: float) -> float | None:
    """The relative difference of ``a`` and ``b`` when it exceeds ``tolerance`` (any difference at 0), else None."""
    if a == b or (math.isnan(a) and math.isnan(b)):
        return None
    relative = abs(a - b) / max(abs(a), abs(b), 1e-30)
    return relative if relative > tolerance else None


def _compare(name: str, pairs: list[tuple[str, float, float]], tolerance: float) -> tuple[bool, str]:
    """Whether every (where, a, b) pair agrees to ``tolerance``; the detail says whether they are bit-identical, and
    names the first difference and the largest."""
    differ = [(where, rel) for where, a, b in pairs if (rel := _differs(a, b, 0.0)) is not None]
    if not differ:
        return True, f"{len(pairs)} {name} bit-identical"
    worst = max(differ, key=lambda item: item[1])
    detail = (f"{len(differ)} of {len(pairs)} {name} not bit-identical; first at {differ[0][0]}, largest "
              f"{worst[1]:.3e} relative at {worst[0]}")
    return worst[1] <= tolerance, detail


def _report(args: argparse.Namespace, layout: Any, everyone: list[dict[str, dict[str, Any]]]) -> bool:
    """Rank 0's table and PASS/FAIL lines; whether every check passed."""
    runs = args.modes
    print(f"megatron_parity: torch {torch.__version__}, {torch.cuda.get_device_name()}, world {len(everyone)}, "
          f"layout {layout!r}, {args.steps} steps x {args.microbatches} microbatches, seed {args.seed}; "
          f"deterministic algorithms {torch.are_deterministic_algorithms_enabled()}")
    header = ["step"]
    for mode in runs:
        header += [f"loss {mode}", f"norm {mode}", f"zeros {mode}"]
    if "pgregistry" in runs:
        header += ["pgregistry.grad_norm", "pgregistry.count_zeros"]
    print("  ".join(f"{h:>22s}" for h in header))
    last_ranks = [r for r, runs_of in enumerate(everyone) if runs_of[runs[0]]["losses"][0] is not None]
    if args.steps == 0:
        print("no steps: nothing to compare")
        return True
    for step in range(args.steps):
        row = [str(step + 1)]
        for mode in runs:
            losses = [value for r in last_ranks for value in everyone[r][mode]["losses"][step]]
            run0 = everyone[0][mode]
            row += [f"{sum(losses) / len(losses):.9g}", f"{run0['norms'][step]:.12g}", str(run0["zeros"][step])]
        if "pgregistry" in runs:
            ours = everyone[0]["pgregistry"]
            row += [f"{ours['ours_norms'][step]:.12g}", str(ours["ours_zeros"][step])]
        print("  ".join(f"{cell:>22s}" for cell in row))

    checks: list[tuple[str, bool, str]] = []
    for mode in runs:
        failed = [(r, s) for r, runs_of in enumerate(everyone)
                  for s, ok in enumerate(runs_of[mode]["step_ok"]) if not ok]
        checks.append((f"{mode}: every optimizer step succeeded", not failed,
                       f"failed (rank, step): {failed[:4]}" if failed else f"{args.steps} steps"))
    if "pgregistry" in runs:
        ours_all = [runs_of["pgregistry"] for runs_of in everyone]
        initialised = [r for r, run in enumerate(ours_all) if run["globals_before"] or run["globals_after"]]
        checks.append(("pgregistry: no initialize_model_parallel (parallel_state uninitialised before and after)",
                       not initialised, f"initialised on ranks {initialised}" if initialised else "every rank"))
        wrong = {r: run["rng_wrong"] for r, run in enumerate(ours_all) if run["rng_wrong"]}
        checks.append(("pgregistry: Megatron-Core's RNG streams are the seeds pgregistry computes", not wrong,
                       f"wrong streams {wrong}" if wrong else "every stream, every rank"))
        norms = [(f"rank {r} step {s + 1}", run["ours_norms"][s], run["norms"][s])
                 for r, run in enumerate(ours_all) for s in range(args.steps)]
        checks.append(("pgregistry.grad_norm equals Megatron-Core's optimizer norm (1e-5 relative)",
                       *_compare("norms", norms, NORM_TOLERANCE)))
        zeros = [(f"rank {r} step {s + 1}", float(run["ours_zeros"][s]), float(run["zeros"][s]))
                 for r, run in enumerate(ours_all) for s in range(args.steps)]
        checks.append(("pgregistry.count_zeros equals Megatron-Core's zero count", *_compare("counts", zeros, 0.0)))
    if set(MODES) <= set(runs):
        a, b = "megatron", "pgregistry"
        losses = [(f"rank {r} step {s + 1} microbatch {m + 1}", x, y)
                  for r in last_ranks for s in range(args.steps)
                  for m, (x, y) in enumerate(
                      zip(everyone[r][a]["losses"][s], everyone[r][b]["losses"][s], strict=True))]
        norms = [(f"rank {r} step {s + 1}", runs_of[a]["norms"][s], runs_of[b]["norms"][s])
                 for r, runs_of in enumerate(everyone) for s in range(args.steps)]
        zeros = [(f"rank {r} step {s + 1}", float(runs_of[a]["zeros"][s]), float(runs_of[b]["zeros"][s]))
                 for r, runs_of in enumerate(everyone) for s in range(args.steps)]
        shared = {mode: everyone[0][mode]["one_stats_group"] for mode in (a, b)}
        reason = shared[a] != shared[b]
        allowed = args.tolerance if reason else 0.0
        print("Megatron-Core's ChainedOptimizer reduces the dense and expert norms together (one grad-stats "
              f"ProcessGroup): {a} {shared[a]}, {b} {shared[b]}; so the runs may round differently: {reason}")
        checks.append(("losses: Megatron-Core's groups and pgregistry's give the same "
                       f"({'bit-identical' if not reason else f'to {allowed:g}, the reason above'})",
                       *_compare("losses", losses, allowed)))
        checks.append(("grad norms (Megatron-Core's optimizer): the same on both "
                       f"({'bit-identical' if not reason else f'to {allowed:g}, the reason above'})",
                       *_compare("norms", norms, allowed)))
        checks.append(("zero counts (Megatron-Core's optimizer): the same on both", *_compare("counts", zeros, 0.0)))
    ops = sorted({op for runs_of in everyone for op in runs_of["nondeterministic"]})
    print("ops without a deterministic kernel (torch's warnings): " + ("; ".join(ops) if ops else "none"))
    for name, ok, detail in checks:
        print(f"[{'PASS' if ok else 'FAIL'}] {name} ({detail})")
    failed = sum(not ok for _, ok, _ in checks)
    print(f"{len(checks) - failed} passed, {failed} failed")
    return not failed


def main(argv: list[str]) -> int:
    args = _parse(argv)
    if not torch.cuda.is_available():
        print("megatron_parity needs CUDA (Megatron-Core's DDP and alltoall dispatcher do)", file=sys.stderr)
        return 2
    warnings.filterwarnings("ignore", message="Apex is not installed")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    torch.use_deterministic_algorithms(True, warn_only=True)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    try:
        try:
            _, layout = parse_layout_spec(args.layout, dist.get_world_size(), "layout")
        except ValueError as exc:  # every rank raises alike
            if dist.get_rank() == 0:
                print(f"megatron_parity: error: {exc}", file=sys.stderr)
            return 2
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            mine: dict[str, Any] = {mode: _train(mode, args, layout) for mode in args.modes}
        mine["nondeterministic"] = sorted({str(w.message).split(". ")[0] for w in caught
                                          if "deterministic" in str(w.message)})
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        passed = _report(args, layout, everyone) if dist.get_rank() == 0 else True
        verdict = [passed]
        dist.broadcast_object_list(verdict, src=0)
    finally:
        dist.destroy_process_group()
    return 0 if verdict[0] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

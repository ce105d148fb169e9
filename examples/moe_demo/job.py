"""``python -m examples.moe_demo``: a small MoE trained on its own grids in a local gloo world,
checked against float64.

Every rank of a forked gloo world (``pgregistry.testing.run_world``):

1. builds two layouts in one job, TP 2 x EP 4 x ETP 1 for the model and TP 4 x EP 2 for a second
   model, and counts the communicators each creates (rank sets the second layout shares with the
   first are reused);
2. seeds the RNG trackers from the model's collection;
3. trains the sharded bf16 model with the chained mixed-precision optimizer, clipping by the global
   grad norm, next to the float64 unsharded model trained with the same rule; each step it records
   the loss, the grad norm against the float64 oracle and against what a dense-TP-only filter
   reports (Megatron-LM PR 6470's bug), the zero count of zeroed grads against the model's numel,
   and the largest parameter difference from the float64 run;
4. saves the experts under global names at EP 4 and loads them at EP 2 (the second layout), checking
   that every expert arrives exactly once, bit-identical;
5. calls the legacy path (no collection) to show the fallback warning, then the same call under an
   ``error`` filter.

Rank 0 prints progress to stderr; the parent prints the tables and returns exit code 1 if any check
failed.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import tempfile
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs

from pgregistry.cli._options import check_output_file

__all__ = ["DemoConfig", "build_parser", "main", "run_demo"]

# A bf16 model against float64: parameters may differ by a few bf16 ulps of the update, not more.
_PARAM_TOLERANCE = 2e-2
_NORM_TOLERANCE = 5e-2
_EXACT_TOLERANCE = 1e-6  # the reductions accumulate in float32
# The expert grads a dense-TP-only filter drops are a visible share of the norm, far above float32
# rounding.
_DENSE_TP_FILTER_MIN_DROP = 1e-3


@attrs.frozen(slots=True, kw_only=True)
class DemoConfig:
    """What the demo runs: world size, the model's layout, steps and the optimizer's rule."""

    world_size: int = 8
    tp: int = 2
    ep: int = 4
    second_tp: int = 4
    second_ep: int = 2
    steps: int = 4
    lr: float = 0.05
    max_norm: float = 2.0
    seed: int = 1234


def _rank_main(config: DemoConfig) -> dict[str, Any]:
    import torch.distributed as dist

    from examples.moe_demo.model import ToyMoEConfig, full_weights
    from pgregistry import registry
    from pgregistry.layout import ParallelLayout

    rank = dist.get_rank()
    say = _progress(rank == 0)
    model_config = ToyMoEConfig(seed=config.seed)
    weights = full_weights(model_config)

    say("building layouts")
    layout = ParallelLayout(num_ranks=config.world_size, tp=config.tp, ep=config.ep, expt_tp=1)
    second = ParallelLayout(
        num_ranks=config.world_size, tp=config.second_tp, ep=config.second_ep, expt_tp=1
    )
    created_before = registry.communicators_created()
    pg = registry.build(layout, name="demo-model")
    created_first = registry.communicators_created() - created_before
    pg_second = registry.build(second, name="demo-second-model")
    created_second = registry.communicators_created() - created_before - created_first
    first_groups = {id(g) for _, g in pg.items() if g is not None and not isinstance(g, list)}
    shared = sorted(
        k
        for k, g in pg_second.items()
        if g is not None and not isinstance(g, list) and id(g) in first_groups
    )

    say("seeding")
    from pgregistry.rng import model_parallel_manual_seed

    seeds = model_parallel_manual_seed(config.seed, pg)

    say("float64 step")
    exact = _exact_norm(model_config, weights, layout, pg)
    say("training")
    steps = _train(config, model_config, weights, layout, pg, say)

    say(f"checkpoint EP {config.ep} -> EP {config.second_ep}")
    checkpoint = _checkpoint_roundtrip(steps.pop("_model"), model_config, pg, pg_second)

    say("fallback warnings")
    fallback = _fallback_demo(layout)
    dist.barrier()
    return {
        "rank": rank,
        "groups_created": {"model": created_first, "second_model": created_second},
        "shared_with_second": shared,
        "collection": repr(pg),
        "seeds": seeds,
        "steps": steps["rows"],
        "zero_count": steps["zero_count"],
        "float64_step": exact,
        "checkpoint": checkpoint,
        "fallback": fallback,
        "num_experts": model_config.num_experts,
    }


def _progress(enabled: bool) -> Any:
    started = time.monotonic()

    def say(message: str) -> None:
        if enabled:
            print(
                f"[demo {time.monotonic() - started:5.1f}s] {message}", file=sys.stderr, flush=True
            )

    return say


def _local_loss(model: Any, model_config: Any, layout: Any, batch: tuple[Any, Any, Any]) -> Any:
    """The sharded model's loss on this data-parallel rank's share of the global ``batch``."""
    import torch.distributed as dist

    n = model_config.tokens_per_dp_rank
    dp_rank = layout.coords(dist.get_rank())["dp"]
    x, target, ids = (t[dp_rank * n : (dp_rank + 1) * n] for t in batch)
    return model.loss(x, target, ids, n)


def _oracle_norm(reference: Any) -> float:
    """The float64 unsharded model's grad norm."""
    return math.sqrt(
        sum(float((p.grad**2).sum()) for p in reference.parameters() if p.grad is not None)
    )


def _exact_norm(model_config: Any, weights: Any, layout: Any, pg: Any) -> dict[str, float]:
    """Step 0 in float64 on both sides: the sharded norm must equal the oracle's to round-off, which
    isolates the grad-statistics rules from bf16 rounding."""
    import torch

    from examples.moe_demo.model import ReferenceMoE, ShardedMoE, make_batch
    from pgregistry.optim import build_optimizer

    model = ShardedMoE(model_config, weights, pg, dtype=torch.float64)
    optimizer = build_optimizer(model, pg, optimizer="sgd", lr=0.0, mixed_precision=False)
    batch = make_batch(model_config, 0, layout.dp)
    _local_loss(model, model_config, layout, batch).backward()
    optimizer.sync_grads()
    reference = ReferenceMoE(model_config, weights)
    reference.loss(*batch).backward()
    return {"grad_norm": float(optimizer.get_grad_norm()), "oracle_norm": _oracle_norm(reference)}


def _train(
    config: DemoConfig, model_config: Any, weights: Any, layout: Any, pg: Any, say: Any
) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    import pgregistry
    from examples.moe_demo.model import ReferenceMoE, ShardedMoE, make_batch, shard_of
    from pgregistry.experts import get_ep_rank_and_size, globalize_expert_keys
    from pgregistry.optim import build_optimizer

    model = ShardedMoE(model_config, weights, pg, dtype=torch.bfloat16)
    pgregistry.attach(model, pg)
    optimizer = build_optimizer(model, pg, optimizer="sgd", lr=config.lr, mixed_precision=True)
    reference = ReferenceMoE(model_config, weights)
    reference_opt = torch.optim.SGD(reference.parameters(), lr=config.lr)
    global_names = globalize_expert_keys(
        model.checkpoint_names(), model_config.num_experts, *get_ep_rank_and_size(pg)
    )
    rows = []
    for step in range(config.steps):
        batch = make_batch(model_config, step, layout.dp)
        # The float64 oracle: the unsharded model on the global batch.
        reference_opt.zero_grad()
        reference_loss = reference.loss(*batch)
        reference_loss.backward()
        oracle_norm = _oracle_norm(reference)
        coeff = min(1.0, config.max_norm / (oracle_norm + 1e-6))
        for p in reference.parameters():
            if p.grad is not None:
                p.grad.mul_(coeff)
        reference_opt.step()

        # The sharded bf16 model on this data-parallel rank's tokens.
        optimizer.zero_grad()
        loss = _local_loss(model, model_config, layout, batch)
        loss.backward()
        optimizer.sync_grads()
        norm = float(optimizer.get_grad_norm())
        dense_tp_filter = _dense_tp_filter_norm(model, pg)
        optimizer.clip_grad_norm(config.max_norm)
        optimizer.step()

        mean_loss = loss.detach().double().clone()
        dp_cp = pg.get("dp_cp")
        if dp_cp is not None:
            dist.all_reduce(mean_loss, group=dp_cp)
        mean_loss /= max(1, layout.dp * layout.cp)
        worst = 0.0
        for full_name, param in global_names.items():
            expected = shard_of(
                full_name, reference.param(full_name).detach(), pg, model_config.num_experts
            )
            assert expected is not None
            scale = float(expected.abs().max()) or 1.0
            worst = max(worst, float((param.detach().double() - expected).abs().max()) / scale)
        worst_t = torch.tensor([worst], dtype=torch.float64)
        dist.all_reduce(worst_t, op=dist.ReduceOp.MAX)
        rows.append(
            {
                "step": step,
                "loss": float(mean_loss),
                "oracle_loss": reference_loss.item(),
                "grad_norm": norm,
                "oracle_norm": oracle_norm,
                "dense_tp_filter_norm": dense_tp_filter,
                "max_param_rel_diff": float(worst_t),
            }
        )
        say(
            f"step {step + 1}/{config.steps}: norm {norm:.6f} (oracle {oracle_norm:.6f}, "
            f"dense-TP filter {dense_tp_filter:.6f})"
        )

    optimizer.zero_grad()
    zero_count = int(optimizer.count_zeros())
    numel = sum(w.numel() for w in weights.values())
    return {
        "rows": rows,
        "_model": model,
        "zero_count": {"pgregistry": zero_count, "oracle": numel},
    }


def _dense_tp_filter_norm(model: Any, pg: Any) -> float:
    """The norm Megatron-LM reported before PR 6470: expert grads deduplicated with the *dense* TP
    group."""
    from pgregistry import ProcessGroupCollection
    from pgregistry.grad_stats import (
        norm_of_grads,
        param_is_not_shared,
        param_is_not_tensor_parallel_duplicate,
    )
    from pgregistry.params import is_expert_param

    # The bug: the dense TP group stands in for the expert TP group.
    dense_tp_for_experts = ProcessGroupCollection(tp=pg.get("tp"), expt_tp=pg.get("tp"))
    dense: list[Any] = []
    expert: list[Any] = []
    for param in model.parameters():
        grad = getattr(param, "main_grad", None)
        grad = grad if grad is not None else param.grad
        if grad is None or not param_is_not_shared(param):
            continue
        if not param_is_not_tensor_parallel_duplicate(param, dense_tp_for_experts):
            continue
        (expert if is_expert_param(param) else dense).append(grad)
    return float(norm_of_grads({pg.get("mp"): dense, pg.get("tp_ep_pp_with_egtp_remat"): expert}))


def _checkpoint_roundtrip(model: Any, model_config: Any, pg: Any, pg_second: Any) -> dict[str, Any]:
    """Save experts under global names at the model's EP size, load them at the second layout's EP
    size."""
    import torch
    import torch.distributed as dist

    from pgregistry.collection import group_rank
    from pgregistry.experts import get_ep_rank_and_size, globalize_expert_keys, localize_expert_keys

    ep_rank, ep_size = get_ep_rank_and_size(pg)
    local = {
        k: v.detach().clone() for k, v in model.checkpoint_names().items() if ".local_experts." in k
    }
    saved = globalize_expert_keys(local, model_config.num_experts, ep_rank, ep_size)
    directory = _shared_tempdir()
    if group_rank(pg.get("expt_dp")) == 0:  # one writer per expert replica set
        torch.save(saved, Path(directory) / f"experts-ep{ep_rank}.pt")
    dist.barrier()
    everything: dict[str, torch.Tensor] = {}
    duplicates = 0
    for path in sorted(Path(directory).glob("experts-ep*.pt")):
        for key, value in torch.load(path).items():
            duplicates += key in everything
            everything[key] = value
    new_rank, new_size = get_ep_rank_and_size(pg_second)
    mine = localize_expert_keys(
        everything, model_config.num_experts, new_rank, new_size, foreign="skip"
    )
    per_layer = 2 * model_config.num_experts // new_size
    loaded_ok = len(mine) == per_layer * model_config.num_layers
    # Every expert this rank saved must come back bit-identical under its global name.
    identical = all(torch.equal(everything[k], v) for k, v in saved.items())
    experts_found = sorted({int(k.split(".local_experts.")[1].split(".")[0]) for k in everything})
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(directory, ignore_errors=True)
    return {
        "experts_found": experts_found,
        "duplicates": duplicates,
        "loaded_here": len(mine),
        "loaded_ok": loaded_ok,
        "bit_identical": identical,
    }


def _shared_tempdir() -> str:
    """One temporary directory for every rank of the local world (rank 0 names it, the others
    receive it)."""
    import torch.distributed as dist

    name = [tempfile.mkdtemp(prefix="pgregistry-demo-") if dist.get_rank() == 0 else ""]
    dist.broadcast_object_list(name, src=0)
    return str(name[0])


def _fallback_demo(layout: Any) -> dict[str, Any]:
    """The legacy call (no collection) warns once; under an ``error`` filter it raises."""
    import torch

    from pgregistry.fallback import ProcessGroupFallbackWarning
    from pgregistry.global_grid import initialize_global_grid
    from pgregistry.grad_stats import grad_norm

    initialize_global_grid(layout)
    param = torch.nn.Parameter(torch.ones(3))
    param.grad = torch.ones(3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        grad_norm([param], None)
        grad_norm([param], None)
    messages = [
        str(w.message) for w in caught if issubclass(w.category, ProcessGroupFallbackWarning)
    ]
    raised = ""
    with warnings.catch_warnings():
        warnings.simplefilter("error", ProcessGroupFallbackWarning)
        try:
            grad_norm([param], None)
        except ProcessGroupFallbackWarning as exc:
            raised = str(exc)
    return {"warnings": messages, "error_filter_raised": raised}


# ---------------------------------------------------------------------------------------- reporting


def _checks(config: DemoConfig, results: list[dict[str, Any]]) -> list[tuple[str, bool, str]]:
    first = results[0]
    checks: list[tuple[str, bool, str]] = []
    exact = first["float64_step"]
    rel = abs(exact["grad_norm"] - exact["oracle_norm"]) / exact["oracle_norm"]
    checks.append(
        (
            "float64 step: grad norm equals the oracle to float32 round-off",
            rel < _EXACT_TOLERANCE,
            f"{rel:.1e}",
        )
    )
    for row in first["steps"]:
        rel = abs(row["grad_norm"] - row["oracle_norm"]) / row["oracle_norm"]
        label = (
            f"step {row['step']}: bf16 grad norm within {_NORM_TOLERANCE:g} of the float64 oracle"
        )
        detail = f"relative error {rel:.2e}"
        checks.append(
            (f"{label} (the exact check is the float64 step)", rel < _NORM_TOLERANCE, detail)
        )
        checks.append(
            (
                f"step {row['step']}: parameters match the float64 run",
                row["max_param_rel_diff"] < _PARAM_TOLERANCE,
                f"max relative difference {row['max_param_rel_diff']:.2e}",
            )
        )
    # Same grads, two filters: the dense-TP one drops the expert grads of dense-TP ranks other
    # than 0.
    drops = [1 - row["dense_tp_filter_norm"] / row["grad_norm"] for row in first["steps"]]
    if config.tp > 1:
        checks.append(
            (
                "a dense-TP-only filter (Megatron-LM PR 6470's bug) undercounts the same grads",
                min(drops) > _DENSE_TP_FILTER_MIN_DROP,
                f"by {min(drops):.2%} to {max(drops):.2%}",
            )
        )
    else:  # with dense TP 1 every rank is dense-TP rank 0: the dense-TP filter drops nothing
        checks.append(
            (
                "with dense TP 1 the dense-TP-only filter agrees (no undercount possible)",
                max(abs(d) for d in drops) < _DENSE_TP_FILTER_MIN_DROP,
                f"largest difference {max(drops):.2%}",
            )
        )
    zero = first["zero_count"]
    checks.append(
        (
            "zero count of zeroed grads equals the model's numel",
            zero["pgregistry"] == zero["oracle"],
            f"{zero['pgregistry']} vs {zero['oracle']}",
        )
    )
    found = set()
    duplicates = 0
    for result in results:
        found.update(result["checkpoint"]["experts_found"])
        duplicates += result["checkpoint"]["duplicates"]
    expected = set(range(results[0]["num_experts"]))
    checks.append(
        (
            "checkpoint: every expert saved once and found at the new EP size",
            found == expected and duplicates == 0,
            f"experts {sorted(found)}, duplicates {duplicates}",
        )
    )
    checks.append(
        (
            "checkpoint: each rank loaded its experts, bit-identical",
            all(r["checkpoint"]["loaded_ok"] and r["checkpoint"]["bit_identical"] for r in results),
            "",
        )
    )
    fallback = first["fallback"]
    warned = fallback["warnings"]
    checks.append(
        (
            "legacy call warns once per (owner, argument)",
            len(warned) >= 1 and len(warned) == len(set(warned)),
            f"{len(warned)} warnings",
        )
    )
    checks.append(
        (
            "legacy call raises under -W error::pgregistry.ProcessGroupFallbackWarning",
            bool(fallback["error_filter_raised"]),
            "",
        )
    )
    return checks


def _print_report(
    config: DemoConfig, results: list[dict[str, Any]], checks: list[tuple[str, bool, str]]
) -> None:
    first = results[0]
    print(
        f"moe_demo: {config.world_size} ranks (gloo), model on TP {config.tp} x EP "
        f"{config.ep} x ETP 1, second model on TP {config.second_tp} x EP {config.second_ep}"
    )
    print(f"  rank 0 collection: {first['collection']}")
    created = [r["groups_created"] for r in results]
    print(
        f"  communicators created per rank: model {max(c['model'] for c in created)}, "
        f"second model {max(c['second_model'] for c in created)} more (shared with "
        f"the first: {', '.join(first['shared_with_second']) or 'none'})"
    )
    print(f"  rank 0 RNG seeds: {first['seeds']}")
    print()
    exact = first["float64_step"]
    print(
        f"  float64 step 0: grad norm {exact['grad_norm']:.12f}, oracle {exact['oracle_norm']:.12f}"
    )
    print(
        "  bf16 training (model in bf16, float32 main params) next to the float64 unsharded model:"
    )
    header = (
        f"  {'step':>4}  {'loss':>10}  {'oracle loss':>11}  {'grad norm':>10} "
        f" {'oracle':>10}  {'dense-TP':>10}  {'max |dp|/|p|':>12}"
    )
    print(header)
    for row in first["steps"]:
        print(
            f"  {row['step']:>4}  {row['loss']:>10.6f}  {row['oracle_loss']:>11.6f}  "
            f"{row['grad_norm']:>10.6f}  {row['oracle_norm']:>10.6f}  "
            f"{row['dense_tp_filter_norm']:>10.6f}  {row['max_param_rel_diff']:>12.2e}"
        )
    print()
    for message in first["fallback"]["warnings"][:2]:
        print(f"  warning: {message}")
    if first["fallback"]["error_filter_raised"]:
        raised = first["fallback"]["error_filter_raised"]
        print(f"  under the error filter: raised ProcessGroupFallbackWarning: {raised}")
    print()
    for name, ok, detail in checks:
        print(f"  [{'PASS' if ok else 'FAIL'}] {name}" + (f" ({detail})" if detail else ""))
    failed = sum(not ok for _, ok, _ in checks)
    print(f"\n{len(checks) - failed} passed, {failed} failed")


def run_demo(config: DemoConfig, json_path: str | None = None) -> int:
    """Run the demo world; print the report; return 0 when every check passed."""
    from pgregistry.testing import run_world

    started = time.monotonic()
    results = run_world(config.world_size, _rank_main, config, timeout=300.0)
    checks = _checks(config, results)
    _print_report(config, results, checks)
    print(f"(took {time.monotonic() - started:.1f} s)")
    if json_path:
        payload = {
            "config": attrs.asdict(config),
            "ranks": results,
            "checks": [{"name": n, "passed": ok, "detail": d} for n, ok, d in checks],
        }
        Path(json_path).write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n")
    return 0 if all(ok for _, ok, _ in checks) else 1


_SIZE_OPTIONS = {
    "world_size": "number of local gloo ranks",
    "tp": "tensor-parallel size of the model's first grid",
    "ep": "expert-parallel size of the model's first grid",
    "second_tp": "tensor-parallel size of the grid the checkpoint is reloaded on",
    "second_ep": "expert-parallel size of the grid the checkpoint is reloaded on",
    "steps": "training steps",
}


def build_parser() -> argparse.ArgumentParser:
    """The demo's command line: the sizes of its two grids, the number of steps, an optional JSON
    report."""
    parser = argparse.ArgumentParser(
        prog="python -m examples.moe_demo",
        description=(
            "Train a toy MoE on its own grids in a local gloo world and check it against float64."
        ),
    )
    defaults = {field.name: field.default for field in attrs.fields(DemoConfig)}
    for name, text in _SIZE_OPTIONS.items():
        parser.add_argument(
            f"--{name.replace('_', '-')}",
            type=int,
            default=defaults[name],
            dest=name,
            help=f"{text} (default {defaults[name]})",
        )
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON to FILE")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv``, run the demo; exit code 0 when every check passed, 1 when one failed, 2 for
    bad sizes."""
    from examples.moe_demo.model import ToyMoEConfig
    from pgregistry.layout import ParallelLayout

    args = build_parser().parse_args(argv)
    config = DemoConfig(
        world_size=args.world_size,
        tp=args.tp,
        ep=args.ep,
        second_tp=args.second_tp,
        second_ep=args.second_ep,
        steps=args.steps,
    )
    num_experts = ToyMoEConfig().num_experts
    try:
        if config.steps < 1:
            raise ValueError(f"--steps must be at least 1, got {config.steps}")
        for tp, ep in ((config.tp, config.ep), (config.second_tp, config.second_ep)):
            ParallelLayout(num_ranks=config.world_size, tp=tp, ep=ep, expt_tp=1)
            if num_experts % ep:
                raise ValueError(
                    f"the demo model's {num_experts} experts do not split over EP {ep}"
                )
        if args.json is not None:
            check_output_file(args.json)
    except ValueError as exc:
        print(f"moe_demo: error: {exc}", file=sys.stderr)
        return 2
    return run_demo(config, args.json)

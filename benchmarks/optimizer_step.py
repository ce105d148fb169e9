"""Benchmark: one mixed-precision Adam(W) step of pgregistry's optimizers against torch's fused AdamW.

One process, no torch.distributed (every parallelism axis off). A model of bf16 parameters split into ``--tensors``
tensors (sizes spread like a model's), float32 main params and grads. For each tensor count it measures, in this
one run:

- ``copy reference``: ``dst.copy_(src)`` of a float32 tensor of the main params' size, the measured read + write
  bandwidth the other rows are compared with;
- ``baseline``: ``torch.optim.AdamW(fused=True)`` over separate float32 masters, then ``torch._foreach_copy_`` of
  the masters into the bf16 parameters;
- ``per-tensor step``: :class:`~pgregistry.optim.MixedPrecisionOptimizer` with a factory that is not an
  elementwise rule (``functools.partial(torch.optim.AdamW)``), which steps one tensor per parameter (the step as
  it was before the flat step, less its copy back one parameter at a time);
- ``mixed precision, torch's step + copy``: :class:`~pgregistry.optim.MixedPrecisionOptimizer` with an
  :class:`~pgregistry.optim.ElementwiseRule` that names torch's implementation (``fused=True`` on CUDA), so the
  flat buffer is stepped by torch's fused AdamW and copied back once per dtype: the flat step before the
  one-kernel step;
- ``mixed precision, one kernel``: the same optimizer with ``inner_factory("adamw")``: on CUDA the step and the
  copy back in one kernel (:mod:`pgregistry.optim._fused_step`; the header says whether it runs here), elsewhere
  the row above;
- ``sharded, ...``: :class:`~pgregistry.optim.ShardedOptimizer`, the same two rules; with one rank its shard is
  the whole model (the per-shard work of a sharded step: no collective runs).

``--configs 1024x16x4,2048x8x8`` adds rows timing the one kernel alone (AdamW over the flat buffer, copied into a
bf16 buffer) with other programs: block elements x iterations x warps.

Columns: milliseconds (median of ``--repeat`` after ``--warmup``; CUDA events on a GPU), the bytes an AdamW step
must move (read param, grad and two moments, write param and two moments: 28 bytes per element, plus the bf16
copy: 2), the TB/s that makes, % of the measured copy bandwidth, and the speed-up over the baseline. Before timing,
one step of each path from the same state is compared with the baseline (printed; exit 1 if they disagree).

Usage: ``python benchmarks/optimizer_step.py --device cuda`` (512 M parameters over 2,000 and 20,000 tensors) or
``--device cpu`` (a smaller size).
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from benchmarks.common import (  # noqa: E402
    GiB,
    Target,
    describe_device,
    fill_,
    finish,
    measure,
    selected_device,
    tensor_sizes,
)
from pgregistry.collection import FIELD_NAMES, ProcessGroupCollection  # noqa: E402
from pgregistry.optim import (  # noqa: E402
    ElementwiseRule,
    MixedPrecisionOptimizer,
    ShardedOptimizer,
    inner_factory,
    setup_process_groups_for_optimizer,
)
from pgregistry.optim._base import FlatOptimizer, InnerFactory  # noqa: E402
from pgregistry.optim._copies import Copy  # noqa: E402
from pgregistry.optim._fused_step import FusedStep, can_run_fused_step  # noqa: E402

ALL_OFF = ProcessGroupCollection(**dict.fromkeys(FIELD_NAMES))
HYPER = {"lr": 1e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
STEP_BYTES = 30
"""Bytes per parameter an AdamW step with a bf16 copy must move: 4 x 4 read, 3 x 4 written, 2 for the copy."""

BASELINE = "baseline: fused AdamW + _foreach_copy_"
COPY = "copy reference (float32 copy_)"
PER_TENSOR = "per-tensor step (other factory)"
TORCH_STEP = "torch's step + copy"
ONE_KERNEL = "one kernel"
OPTIMIZERS = ("mixed precision", "sharded")
PATHS = (PER_TENSOR, *(f"{kind}, {rule}" for kind in OPTIMIZERS for rule in (TORCH_STEP, ONE_KERNEL)))


def _model(sizes: list[int], device: torch.device, seed: int) -> list[nn.Parameter]:
    params = [nn.Parameter(torch.empty(s, dtype=torch.bfloat16, device=device)) for s in sizes]
    with torch.no_grad():
        fill_(params, seed=seed, zeros=0.0)
    return params


class _Baseline:
    """torch's fused AdamW over float32 masters, copied back into the bf16 parameters."""

    def __init__(self, params: list[nn.Parameter], grads: list[torch.Tensor]) -> None:
        self.params = params
        self.masters = [nn.Parameter(p.detach().float()) for p in params]
        for master, grad in zip(self.masters, grads, strict=True):
            master.grad = grad
        self.optimizer = torch.optim.AdamW(self.masters, fused=True, **HYPER)

    @torch.no_grad()
    def step(self) -> None:
        self.optimizer.step()
        torch._foreach_copy_(self.params, self.masters)


def _rule(path: str, device: torch.device) -> InnerFactory:
    """The inner rule of ``path``: torch's AdamW per tensor, the flat step with torch's implementation named (fused
    on CUDA, as the flat step ran before the one-kernel step), or ``inner_factory``'s (the one kernel on CUDA)."""
    if path == PER_TENSOR:
        return functools.partial(torch.optim.AdamW, **HYPER)
    if path.endswith(TORCH_STEP):
        return ElementwiseRule(torch.optim.AdamW, {**HYPER, "fused": device.type == "cuda"})
    return inner_factory("adamw", **HYPER)  # type: ignore[arg-type]


def _pgregistry(path: str, params: list[nn.Parameter], grads: list[torch.Tensor]) -> FlatOptimizer:
    kind = ShardedOptimizer if path.startswith("sharded") else MixedPrecisionOptimizer
    groups = setup_process_groups_for_optimizer(ALL_OFF, use_distributed_optimizer=kind is ShardedOptimizer)
    opt: FlatOptimizer = kind(params, groups, inner=_rule(path, params[0].device))
    with torch.no_grad():
        torch._foreach_copy_([p.main_grad for p in params], grads)  # type: ignore[attr-defined]
    return opt


def _worst_diff(got: list[nn.Parameter], want: list[nn.Parameter]) -> float:
    """Largest difference in units of the bf16 rounding step at the value (0: identical)."""
    worst = 0.0
    for a, b in zip(got, want, strict=True):
        diff = (a.detach().float() - b.detach().float()).abs()
        ulp = b.detach().float().abs().clamp(min=1e-30) * 2.0**-7
        worst = max(worst, float((diff / ulp).max()))
    return worst


def _copy_reference(args: argparse.Namespace, device: torch.device) -> tuple[float, float | None]:
    src = torch.empty(args.numel, device=device).normal_()
    dst = torch.empty_like(src)
    return measure(lambda: dst.copy_(src), device, args.warmup, args.repeat)


def _kernel_configs(args: argparse.Namespace, device: torch.device) -> dict[str, tuple[float, float | None]]:
    """The one kernel alone under each of ``--configs``: AdamW over a flat float32 buffer of the main params' size,
    copied into a bf16 buffer (a bf16 model's one copy)."""
    if not args.configs:
        return {}
    flat = nn.Parameter(torch.empty(args.numel, device=device).normal_())
    flat.grad = torch.empty_like(flat).normal_()
    out = torch.empty(args.numel, dtype=torch.bfloat16, device=device)
    adamw = torch.optim.AdamW([flat], fused=True, **HYPER)
    results = {}
    for config in args.configs.split(","):
        block, iters, warps = (int(part) for part in config.split("x"))
        stepper = FusedStep(flat, [Copy(0, out)], block=block, iters=iters, warps=warps)
        name = f"one kernel alone, {block} x {iters}, {warps} warps"
        results[name] = measure(functools.partial(stepper.step, adamw), device, args.warmup, args.repeat)
    return results


def run_count(count: int, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    sizes = tensor_sizes(count, args.numel)
    grads = [torch.empty(s, device=device) for s in sizes]
    fill_(grads, seed=1)
    results: dict[str, tuple[float, float | None]] = {}
    diffs: dict[str, float] = {}
    results[COPY] = _copy_reference(args, device)
    baseline = _Baseline(_model(sizes, device, seed=2), grads)
    baseline.step()  # one step from the shared initial state: what every path is compared with
    for path in PATHS:
        params = _model(sizes, device, seed=2)
        opt = _pgregistry(path, params, grads)
        opt.step()
        diffs[path] = _worst_diff(params, baseline.params)
        results[path] = measure(opt.step, device, args.warmup, args.repeat)
        del opt, params
        if device.type == "cuda":
            torch.cuda.empty_cache()
    results[BASELINE] = measure(baseline.step, device, args.warmup, args.repeat)
    del baseline
    results.update(_kernel_configs(args, device))
    return {"count": count, "numel": args.numel, "results": results, "diffs": diffs}


def print_table(run: dict[str, Any], device: torch.device) -> None:
    results, numel = run["results"], run["numel"]
    moved = numel * STEP_BYTES
    copy_tbs = 2 * numel * 4 / results[COPY][0] / 1e9
    print(f"\n{run['count']:,} bf16 tensors, {numel / 1e6:,.0f} M parameters "
          f"({numel * 4 / GiB:.3f} GiB of float32 main params) on {device}")
    header = f"  {'path':<44} {'ms':>9} {'GB moved':>9} {'TB/s':>7} {'% copy BW':>9} {'vs base':>8}"
    if device.type == "cuda":
        header += f" {'peak MiB':>9}"
    print(header)
    base_ms = results[BASELINE][0]
    for name in (COPY, BASELINE, *PATHS, *(r for r in results if r not in (COPY, BASELINE, *PATHS))):
        ms, peak = results[name]
        nbytes = 2 * numel * 4 if name == COPY else moved
        tbs = nbytes / ms / 1e9
        vs = "" if name == COPY else f"{base_ms / ms:7.2f}x"
        line = f"  {name:<44} {ms:9.3f} {nbytes / 1e9:9.3f} {tbs:7.3f} {100 * tbs / copy_tbs:8.1f}% {vs:>8}"
        if device.type == "cuda":
            line += f" {peak or 0.0:9.1f}"
        print(line)
    diffs = ", ".join(f"{path}: {diff:.2f}" for path, diff in run["diffs"].items())
    print(f"  one step from the same state, worst difference from the baseline in bf16 steps: {diffs}")


def targets(runs: list[dict[str, Any]]) -> list[Target]:
    """The issue's targets (H200, 512 M parameters): informative here, measured on whatever device ran."""
    first = runs[0]
    lines: list[Target] = []
    for path in (f"{kind}, {ONE_KERNEL}" for kind in OPTIMIZERS):
        for run in runs:
            results = run["results"]
            copy_tbs = 2 * run["numel"] * 4 / results[COPY][0] / 1e9
            share = run["numel"] * STEP_BYTES / results[path][0] / 1e9 / copy_tbs
            lines.append((f"{path} at {run['count']:,} tensors at >= 85% of the copy bandwidth for its bytes",
                          share >= 0.85, f"{100 * share:.1f}%"))
            ratio = results[path][0] / results[BASELINE][0]
            lines.append((f"{path} at {run['count']:,} tensors not slower than the baseline", ratio <= 1.0,
                          f"{ratio:.2f}x the baseline's time"))
        for run in runs[1:]:
            ratio = run["results"][path][0] / first["results"][path][0]
            lines.append((f"{path} at {run['count']:,} tensors within 1.2x of {first['count']:,}", ratio <= 1.2,
                          f"{ratio:.2f}x"))
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--numel", type=int, help="parameters (default: 512 M on CUDA, 2 M on CPU)")
    parser.add_argument("--tensors", default=None, help="comma-separated tensor counts (default: 2000,20000 on "
                        "CUDA, 200,2000 on CPU)")
    parser.add_argument("--repeat", type=int, help="timed steps per figure (default: 20 on CUDA, 5 on CPU)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--configs", default="", help="comma-separated BLOCKxITERSxWARPS of the one kernel to time "
                        "alone as well (CUDA with triton only), e.g. 1024x16x4,2048x8x8")
    args = parser.parse_args(argv)
    device = selected_device(args.device)
    cuda = device.type == "cuda"
    args.numel = args.numel or ((512 << 20) if cuda else (2 << 20))
    args.repeat = args.repeat or (20 if cuda else 5)
    counts = [int(c) for c in (args.tensors or ("2000,20000" if cuda else "200,2000")).split(",")]
    if not counts or min(counts) < 1 or args.numel < max(counts) or args.repeat < 1 or args.warmup < 0:
        parser.error("tensor counts and --repeat must be positive, --numel at least the largest count")
    kernel = "on" if can_run_fused_step(device) else "off (torch's step + copy)"
    if args.configs and kernel != "on":
        parser.error("--configs times the one kernel, which does not run on this device")
    print(f"optimizer step: torch {torch.__version__}, device {describe_device(device)}, AdamW {HYPER}, "
          f"median of {args.repeat} after {args.warmup} warm-up steps; one-kernel step: {kernel}")
    runs = []
    problems = []
    for count in counts:
        run = run_count(count, args, device)
        print_table(run, device)
        runs.append(run)
        # The flat step is elementwise like the baseline: a step may differ by rounding (1 bf16 step) at most.
        problems += [f"{count} tensors: {path} differs from the baseline by {diff:.2f} bf16 steps"
                     for path, diff in run["diffs"].items() if diff > 1.0]
    title = "Targets (defined for an H200, 512 M bf16 parameters over 2,000 and 20,000 tensors):"
    return finish(title, targets(runs), problems)


if __name__ == "__main__":
    sys.exit(main())

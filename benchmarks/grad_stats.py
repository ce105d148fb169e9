"""Benchmark: grad norm and zero count over a flat grad buffer, over a list of grads, and torch's own baseline.

One process, no torch.distributed (every parallelism axis off, so nothing is reduced across ranks); the same
gradient values, 30% zeros, in every path. For each tensor count it measures, in this one run:

- ``read reference``: one ``torch.linalg.vector_norm`` over one contiguous tensor of the same bytes, the measured
  read bandwidth the other rows are compared with;
- ``baseline``: ``torch.nn.utils.get_total_norm(grads, foreach=True)`` plus a per-tensor ``count_nonzero`` loop
  over separately allocated grads;
- ``list path``: :func:`pgregistry.grad_stats.norm_of_grads` and :func:`~pgregistry.grad_stats.zeros_of_grads`
  over the same list of grads;
- ``buffer``: :meth:`pgregistry.optim._grad_buffer.GradBuffer.grad_norm` and ``count_zeros`` over the grads laid out in
  one :class:`~pgregistry.optim._grad_buffer.GradBuffer`, and ``norm_and_zeros`` (both statistics in one read where the
  Triton kernel runs: CUDA with triton).

``--configs 1024x8,1024x16`` adds a table per tensor count timing the kernels alone over the list of grads (a
launch table made once, as a kept plan holds it) with other programs: elements a program loads per iteration x
iterations (the defaults: :data:`pgregistry.grad_stats._fused.ITERS`). ``table read``: the one-read kernel and the
sum of its pairs; ``scale``: the clip's scale kernel by 0.5 (reads and writes every grad; timed last, after the
values are taken; the run fails unless the grads' norm afterwards is halved once per call).

Columns: milliseconds (median of ``--repeat`` after ``--warmup``; CUDA events on a GPU), bytes read (each
statistic reads every grad once, so a norm + zero-count row reads the grads twice), effective TB/s, speed-up over
the baseline row of the same statistic, % of the measured read bandwidth, and on CUDA the peak memory allocated
beyond the inputs. The targets (defined for an H200 with 2 GiB of grads) are checked and printed at the end.

Usage: ``python benchmarks/grad_stats.py --device cuda`` (2 GiB over 2,000 and 20,000 tensors) or
``--device cpu`` (a smaller size); ``--dtype bfloat16`` for bf16 grads (float32 by default, the dtype of the
main grads of a mixed-precision optimizer), ``--dtype mixed`` for float32 and bf16 tensors alternating (list
rows only). Exits 1 if the paths disagree.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from benchmarks.common import (  # noqa: E402
    GiB,
    MiB,
    Target,
    describe_device,
    fill_,
    finish,
    measure,
    norm64,
    selected_device,
    tensor_sizes,
)
from pgregistry.collection import FIELD_NAMES, ProcessGroupCollection  # noqa: E402
from pgregistry.grad_stats import StatsGroups, norm_of_grads, zeros_of_grads  # noqa: E402
from pgregistry.grad_stats import _fused as fused  # noqa: E402
from pgregistry.grad_stats._fused import can_run_fused_stats  # noqa: E402
from pgregistry.optim._grad_buffer import GradBuffer  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
READ = "read reference (1 vector_norm)"
ONE_READ = "buffer norm + zeros, one read"


def run_count(count: int, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    dtypes = [torch.float32, torch.bfloat16] if args.dtype == "mixed" else [DTYPES[args.dtype]]
    numel = args.bytes * len(dtypes) // sum(torch.finfo(d).bits // 8 for d in dtypes)
    sizes = tensor_sizes(count, numel)
    grads = [torch.empty(s, dtype=dtypes[i % len(dtypes)], device=device) for i, s in enumerate(sizes)]
    fill_(grads, seed=1)
    nbytes = sum(g.numel() * g.element_size() for g in grads)

    def baseline_norm() -> torch.Tensor:
        return torch.nn.utils.get_total_norm(grads, 2.0, foreach=True)

    def baseline_zeros() -> torch.Tensor:
        return numel - torch.stack([torch.count_nonzero(g) for g in grads]).sum()

    def list_norm() -> torch.Tensor:
        return norm_of_grads({None: grads})

    def list_zeros() -> torch.Tensor:
        return zeros_of_grads({None: grads})

    paths: dict[str, Callable[[], Any]] = {
        "baseline norm (get_total_norm)": baseline_norm,
        "baseline zeros (count_nonzero loop)": baseline_zeros,
        "baseline norm + zeros": lambda: (baseline_norm(), baseline_zeros()),
        "list path norm": list_norm,
        "list path zeros": list_zeros,
        "list path norm + zeros": lambda: (list_norm(), list_zeros()),
    }
    values = {
        "baseline": (float(baseline_norm()), int(baseline_zeros())),
        "list path": (float(list_norm()), int(list_zeros())),
    }
    if len(dtypes) == 1:  # one buffer holds one dtype
        off = StatsGroups.from_collection(ProcessGroupCollection(**dict.fromkeys(FIELD_NAMES)))
        buffer = GradBuffer([torch.empty(s, device="meta") for s in sizes], off, dtype=dtypes[0], device=device)
        torch._foreach_copy_(list(buffer.views), grads)
        reference = buffer.data
        paths |= {
            "buffer norm": buffer.grad_norm,
            "buffer zeros": buffer.count_zeros,
            "buffer norm + zeros": lambda: (buffer.grad_norm(), buffer.count_zeros()),
            ONE_READ: buffer.norm_and_zeros,
        }
        both = buffer.norm_and_zeros()
        values["buffer"] = (float(buffer.grad_norm()), int(buffer.count_zeros()))
        values["buffer one read"] = (float(both[0]), int(both[1]))
    else:
        reference = torch.empty(nbytes // 4, device=device).normal_()
    paths = {READ: lambda: torch.linalg.vector_norm(reference)} | paths
    results = {name: measure(fn, device, args.warmup, args.repeat) for name, fn in paths.items()}
    kernels, problems = _kernel_configs(grads, args, device) if len(dtypes) == 1 else ({}, [])
    return {"count": count, "bytes": nbytes, "results": results, "values": values, "kernels": kernels,
            "problems": problems}


def _kernel_configs(
    grads: list[torch.Tensor], args: argparse.Namespace, device: torch.device
) -> tuple[dict[str, tuple[float, float]], list[str]]:
    """Each of ``--configs``: (table read ms, scale ms), the launch table made once. Scales the grads, each call by
    0.5 (exact), and checks after each config that they were scaled by 0.5 as many times as the scale kernel ran
    (the problems returned): a launch that skipped its work would time nothing."""
    kernels: dict[str, tuple[float, float]] = {}
    problems: list[str] = []
    half = torch.tensor(0.5, dtype=torch.float64, device=device)
    for config in filter(None, args.configs.split(",")):
        block, iters = (int(part) for part in config.split("x"))
        launch = fused.launch_of(grads, block=block, iters=iters)
        read = measure(lambda launch=launch: fused.read_over(grads, launch), device, args.warmup, args.repeat)[0]
        before = norm64(grads)
        scale = measure(lambda launch=launch: fused.scale_over_(grads, launch, half), device, args.warmup,
                        args.repeat)[0]
        calls = args.warmup + args.repeat
        after, want = norm64(grads), before * 0.5**calls
        if not math.isclose(after, want, rel_tol=1e-9):
            problems.append(f"{len(grads):,} tensors, scale kernel {block} x {iters}: the grads' norm is {after!r} "
                            f"after {calls} scalings by 0.5, not {want!r}")
        kernels[f"{block} x {iters}"] = (read, scale)
    return kernels, problems


def print_kernels(run: dict[str, Any]) -> None:
    if not run["kernels"]:
        return
    nbytes, read_ms = run["bytes"], run["results"][READ][0]
    print(f"  kernels alone over the {run['count']:,} tensors, by elements per iteration x iterations "
          f"(% of the read reference's bandwidth)")
    print(f"  {'program':<14} {'table read ms':>13} {'TB/s':>7} {'%':>6} {'scale ms':>9} {'TB/s':>7} {'%':>6}")
    for name, (read, scale) in run["kernels"].items():
        print(f"  {name:<14} {read:13.3f} {nbytes / read / 1e9:7.3f} {100 * read_ms / read:5.1f}% {scale:9.3f} "
              f"{2 * nbytes / scale / 1e9:7.3f} {200 * read_ms / scale:5.1f}%")


def print_table(run: dict[str, Any], device: torch.device, dtype: str) -> None:
    results, nbytes = run["results"], run["bytes"]
    ref_ms = results[READ][0]
    ref_tbs = nbytes / ref_ms / 1e9
    print(f"\n{run['count']:,} {dtype} tensors, {nbytes / GiB:.3f} GiB on {device}")
    header = f"  {'path':<38} {'ms':>9} {'GB read':>8} {'TB/s':>7} {'vs base':>8} {'% read BW':>9}"
    if device.type == "cuda":
        header += f" {'peak MiB':>9}"
    print(header)
    for name, (ms, peak) in results.items():
        stat = "norm + zeros" if "+" in name else "zeros" if "zeros" in name else "norm"
        read = nbytes * (2 if stat == "norm + zeros" and name != ONE_READ else 1)
        tbs = read / ms / 1e9
        base = {"norm": "baseline norm (get_total_norm)", "zeros": "baseline zeros (count_nonzero loop)",
                "norm + zeros": "baseline norm + zeros"}[stat]
        vs = "" if name.startswith("read") else f"{results[base][0] / ms:7.2f}x"
        line = f"  {name:<38} {ms:9.3f} {read / 1e9:8.3f} {tbs:7.3f} {vs:>8} {100 * tbs / ref_tbs:8.1f}%"
        if device.type == "cuda":
            line += f" {peak:9.1f}"
        print(line)
    agreed = ", ".join(f"{path}: norm {n:.6g}, zeros {z:,}" for path, (n, z) in run["values"].items())
    print(f"  values: {agreed}")


def check_values(run: dict[str, Any], dtype: str) -> list[str]:
    norms = [n for n, _ in run["values"].values()]
    zeros = {z for _, z in run["values"].values()}
    problems = []
    # get_total_norm keeps bf16 grads' per-tensor norms in bf16: compare bf16 runs at bf16 precision.
    tolerance = 1e-2 if dtype in ("bfloat16", "mixed") else 1e-4
    if max(norms) - min(norms) > tolerance * max(norms):
        problems.append(f"{run['count']} tensors: norms disagree: {run['values']}")
    if len(zeros) != 1:
        problems.append(f"{run['count']} tensors: zero counts disagree: {run['values']}")
    return problems


def targets(runs: list[dict[str, Any]]) -> list[Target]:
    """The issue's targets (H200, 2 GiB): informative here, measured on whatever device ran."""
    first = runs[0]
    lines: list[Target] = []
    if ONE_READ in first["results"]:
        r = first["results"]
        ms = r["buffer norm + zeros"][0]
        share = 2 * first["bytes"] / ms / 1e9 / (first["bytes"] / r[READ][0] / 1e9)
        speedup = r["baseline norm + zeros"][0] / ms
        lines += [
            (f"buffer norm + zeros at {first['count']:,} tensors reads at >= 70% of the read bandwidth",
             share >= 0.7, f"{100 * share:.1f}%"),
            (f"buffer norm + zeros at {first['count']:,} tensors >= 5x faster than the baseline", speedup >= 5,
             f"{speedup:.1f}x"),
        ]
        for run in runs[1:]:
            ratio = run["results"]["buffer norm + zeros"][0] / ms
            lines.append((f"buffer at {run['count']:,} tensors within 1.5x of {first['count']:,}", ratio <= 1.5,
                          f"{ratio:.2f}x"))
        for run in runs:
            one_ms = run["results"][ONE_READ][0]
            lines.append((f"buffer norm + zeros in one read at {run['count']:,} tensors <= 0.6 ms (2 GiB float32)",
                          one_ms <= 0.6, f"{one_ms:.3f} ms, {run['bytes'] / GiB:.3f} GiB"))
    for index, run in enumerate(runs):
        results, goal = run["results"], 5.0 if index == 0 else 20.0
        speedup = results["baseline norm + zeros"][0] / results["list path norm + zeros"][0]
        lines.append((f"list path norm + zeros at {run['count']:,} tensors >= {goal:.0f}x the baseline",
                      speedup >= goal, f"{speedup:.1f}x"))
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=[*sorted(DTYPES), "mixed"], default="float32",
                        help="grad dtype; mixed: float32 and bf16 tensors alternate (no buffer rows)")
    parser.add_argument("--bytes", type=int, help="grad bytes (default: 2 GiB on CUDA, 32 MiB on CPU)")
    parser.add_argument("--tensors", default="2000,20000", help="comma-separated tensor counts")
    parser.add_argument("--repeat", type=int, help="timed runs per figure (default: 20 on CUDA, 5 on CPU)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--configs", default="", help="comma-separated BLOCKxITERS of the kernels to time alone "
                        "over the list of grads (CUDA with triton only), e.g. 1024x8,1024x16,1024x32")
    args = parser.parse_args(argv)
    device = selected_device(args.device)
    args.bytes = args.bytes or (2 * GiB if device.type == "cuda" else 32 * MiB)
    args.repeat = args.repeat or (20 if device.type == "cuda" else 5)
    counts = [int(c) for c in args.tensors.split(",")]
    if not counts or min(counts) < 1 or args.bytes < 1 or args.repeat < 1 or args.warmup < 0:
        parser.error("tensor counts, --bytes and --repeat must be positive, --warmup not negative")
    kernel = "on" if can_run_fused_stats(device) else "off"
    if args.configs and (kernel != "on" or args.dtype == "mixed"):
        parser.error("--configs times the kernels over one dtype's grads, and they do not run on this device")
    print(f"grad statistics: torch {torch.__version__}, device {describe_device(device)}, one-read kernel {kernel}, "
          f"{args.dtype} grads, median of {args.repeat} after {args.warmup} warm-up runs")
    runs = []
    problems: list[str] = []
    for count in counts:
        run = run_count(count, args, device)
        print_table(run, device, args.dtype)
        print_kernels(run)
        problems += check_values(run, args.dtype) + run["problems"]
        runs.append(run)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    title = "Targets (defined for an H200 with 2 GiB of grads over 2,000 and 20,000 tensors):"
    return finish(title, targets(runs), problems)


if __name__ == "__main__":
    sys.exit(main())

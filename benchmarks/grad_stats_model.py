"""Benchmark: the public grad statistics over a model, as a training loop calls them, against torch in the same run.

One process, a collection with every axis off (a world of one rank: nothing is reduced across ranks, so the rows
measure the local read and the host work per call). The model holds ``--params`` parameters (pairs of a weight and
a bias per module, sizes spread over two orders of magnitude) filling ``--bytes``, every grad set, about 30% exact
zeros. Each row is timed in this run, median of ``--repeat`` after ``--warmup`` (CUDA events on a GPU; on the host
torch's call and pgregistry's alternate, run by run, so that a shared machine's load falls on both alike):

- ``norm + zeros``: torch's ``get_total_norm(grads, foreach=True)`` plus a ``count_nonzero`` loop over the grads
  (the list built once, outside the timing: the most favourable baseline) against pgregistry's
  ``grad_norm(model, pg)`` + ``count_zeros(model, pg)`` (two calls, as before) and ``grad_norm_and_zeros(model, pg)``
  (one read);
- ``clip``: torch's ``clip_grad_norm_(params, max_norm, foreach=True)`` (parameter list built once) against
  ``clip_grad_norm_(model, max_norm, pg)``, with a ``max_norm`` above the norm (nothing to scale) and below it;
- ``norm`` and ``zeros`` alone (the host-cost goals on CPU): ``get_total_norm`` against ``grad_norm``, the
  ``count_nonzero`` loop against ``count_zeros``;
- ``floor``: what any call that reads the grads as they are now must do per parameter, and nothing else: each
  ``param.grad``, then each grad's address, element count and contiguity (a kept launch table is only valid for
  those), grad by grad at C speed into one flat list (nothing the garbage collector tracks). No statistic is
  computed; the row bounds what the host work of a call can be brought down to (on a GPU, calls are host-bound
  where this floor exceeds the read of the grads).

It also prints the memory the kept classification takes (Python objects, by ``tracemalloc``, and device memory),
per parameter. Exits 1 if a pgregistry value disagrees with torch's (relative 1e-4 for float32, 1e-2 for bf16, the
zero count exactly).

Usage: ``python benchmarks/grad_stats_model.py --device cuda`` (2 GiB over 2,000 and 20,000 parameters) or
``--device cpu`` (20,000 parameters of 64 elements by default: the host cost); ``--dtype bfloat16``.
"""

from __future__ import annotations

import argparse
import operator
import statistics
import sys
import time
import tracemalloc
from collections.abc import Callable
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
    metadata_reads,
    selected_device,
    tensor_sizes,
)
from pgregistry.collection import FIELD_NAMES, ProcessGroupCollection  # noqa: E402
from pgregistry.grad_stats import _fused as fused  # noqa: E402
from pgregistry.grad_stats import _plan as plans  # noqa: E402
from pgregistry.grad_stats import clip_grad_norm_, count_zeros, grad_norm, grad_norm_and_zeros  # noqa: E402
from pgregistry.grad_stats._fused import fused_stats_available  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
OFF = ProcessGroupCollection(**dict.fromkeys(FIELD_NAMES))
"""Every axis off: one rank, nothing reduced across ranks."""


def make_model(count: int, numel: int, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """``count`` parameters in ``count // 2`` modules holding about ``numel`` elements: a weight matrix of rows of
    16 elements (its size rounded up to whole rows) and a bias vector each."""
    sizes = tensor_sizes(count, numel)
    model = nn.Module()
    layers = nn.ModuleList()
    for first in range(0, count, 2):
        layer = nn.Module()
        for name, size in zip(("weight", "bias"), sizes[first : first + 2], strict=False):
            shape = (-(-size // 16), 16) if name == "weight" else (size,)
            setattr(layer, name, nn.Parameter(torch.empty(shape, dtype=dtype, device=device)))
        layers.append(layer)
    model.layers = layers
    params = list(model.parameters())
    for param in params:
        param.grad = torch.empty_like(param)
    fill_([param.grad for param in params], seed=1)
    return model


def kept_size(model: nn.Module, device: torch.device) -> tuple[float, float]:
    """Bytes per parameter of the kept classification, made anew (another collection: ``hcp`` left unset) and
    measured while it is made and kept: Python objects (tracemalloc) and device memory (the launch tables)."""
    params = sum(1 for _ in model.parameters())
    collection = ProcessGroupCollection(**dict.fromkeys(name for name in FIELD_NAMES if name != "hcp"))
    fused._TABLES = fused._Tables(8)  # the launch tables are kept by addresses: make them afresh too
    plans._KEPT.pop(model, None)  # and the kept plan, which holds its launch tables
    torch.cuda.empty_cache() if device.type == "cuda" else None
    before_device = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    tracemalloc.start()
    grad_norm_and_zeros(model, collection)
    clip_grad_norm_(model, 1e30, collection)  # the clip's tables too
    first = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    kept_device = (torch.cuda.memory_allocated(device) - before_device) if device.type == "cuda" else 0
    grad_norm_and_zeros(model, OFF)  # back to the benchmark's plan
    return first / params, kept_device / params


def run(count: int, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    dtype = DTYPES[args.dtype]
    model = make_model(count, args.bytes // torch.finfo(dtype).bits * 8, dtype, device)
    params = list(model.parameters())
    numel = sum(param.numel() for param in params)
    grads = [param.grad for param in params]
    total = float(torch.nn.utils.get_total_norm(grads, foreach=True))

    def torch_norm() -> torch.Tensor:
        return torch.nn.utils.get_total_norm(grads, 2.0, foreach=True)

    def torch_zeros() -> torch.Tensor:
        return numel - torch.stack([torch.count_nonzero(grad) for grad in grads]).sum()

    paths: dict[str, Callable[[], Any]] = {
        "torch norm + zeros": lambda: (torch_norm(), torch_zeros()),
        "pgregistry grad_norm + count_zeros": lambda: (grad_norm(model, OFF), count_zeros(model, OFF)),
        "pgregistry grad_norm_and_zeros": lambda: grad_norm_and_zeros(model, OFF),
        "torch clip, nothing to scale": lambda: torch.nn.utils.clip_grad_norm_(params, 4 * total, foreach=True),
        "pgregistry clip, nothing to scale": lambda: clip_grad_norm_(model, 4 * total, OFF),
        "torch clip, scaling": lambda: torch.nn.utils.clip_grad_norm_(params, total / 4, foreach=True),
        "pgregistry clip, scaling": lambda: clip_grad_norm_(model, total / 4, OFF),
        "torch norm (get_total_norm)": torch_norm,
        "pgregistry grad_norm": lambda: grad_norm(model, OFF),
        "torch zeros (count_nonzero loop)": torch_zeros,
        "pgregistry count_zeros": lambda: count_zeros(model, OFF),
    }
    def floor() -> list[int]:
        return metadata_reads(list(map(operator.attrgetter("grad"), params)))

    values = {
        "torch": (float(torch_norm()), int(torch_zeros())),
        "pgregistry": (float(grad_norm(model, OFF)), count_zeros(model, OFF)),
        "pgregistry one read": tuple(map(float, grad_norm_and_zeros(model, OFF))),
    }
    clip_grad_norm_(model, 1e30, OFF)  # compiles the scale kernel first: its compilation is no kept memory
    per_param = kept_size(model, device)
    results: dict[str, float] = {}
    for _, theirs, ours in PAIRS:
        if ours not in results:
            results[theirs], results[ours] = measure_pair(paths[theirs], paths[ours], device, args.warmup, args.repeat)
    results["floor"] = measure_pair(floor, floor, torch.device("cpu"), args.warmup, args.repeat)[0]  # host time
    return {"count": count, "bytes": numel * torch.finfo(dtype).bits // 8, "results": results, "values": values,
            "kept": per_param}


def measure_pair(
    theirs: Callable[[], Any], ours: Callable[[], Any], device: torch.device, warmup: int, repeat: int
) -> tuple[float, float]:
    """Median milliseconds of each; on the host the two alternate run by run, so that the load of a shared machine
    falls on both alike."""
    if device.type == "cuda":
        return measure(theirs, device, warmup, repeat)[0], measure(ours, device, warmup, repeat)[0]
    times: tuple[list[float], list[float]] = ([], [])
    for index in range(warmup + repeat):
        for fn, kept in ((theirs, times[0]), (ours, times[1])):
            start = time.perf_counter()
            fn()
            if index >= warmup:
                kept.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times[0]), statistics.median(times[1])


PAIRS = (
    ("norm + zeros", "torch norm + zeros", "pgregistry grad_norm + count_zeros"),
    ("norm + zeros, one read", "torch norm + zeros", "pgregistry grad_norm_and_zeros"),
    ("clip, nothing to scale", "torch clip, nothing to scale", "pgregistry clip, nothing to scale"),
    ("clip, scaling", "torch clip, scaling", "pgregistry clip, scaling"),
    ("norm", "torch norm (get_total_norm)", "pgregistry grad_norm"),
    ("zeros", "torch zeros (count_nonzero loop)", "pgregistry count_zeros"),
)


def print_table(run: dict[str, Any], device: torch.device, dtype: str) -> None:
    print(f"\n{run['count']:,} {dtype} parameters, {run['bytes'] / GiB:.3f} GiB on {device}")
    print(f"  {'statistic':<26} {'torch ms':>10} {'pgregistry ms':>14} {'speed-up':>9}")
    for label, theirs, ours in PAIRS:
        base, mine = run["results"][theirs], run["results"][ours]
        print(f"  {label:<26} {base:10.3f} {mine:14.3f} {base / mine:8.2f}x")
    floor = run["results"]["floor"]
    print(f"  {'floor (metadata reads)':<26} {'':>10} {floor:14.3f}   each grad's .grad, address, size and "
          "contiguity, nothing else (host ms)")
    host, on_device = run["kept"]
    print(f"  kept classification: {host:.0f} bytes of Python objects and {on_device:.1f} bytes of device memory "
          "per parameter")
    agreed = ", ".join(f"{path}: norm {n:.7g}, zeros {int(z):,}" for path, (n, z) in run["values"].items())
    print(f"  values: {agreed}")


def check_values(run: dict[str, Any], dtype: str) -> list[str]:
    norms = [n for n, _ in run["values"].values()]
    zeros = {int(z) for _, z in run["values"].values()}
    tolerance = 1e-2 if dtype == "bfloat16" else 1e-4  # torch keeps bf16 grads' per-tensor norms in bf16
    problems = []
    if max(norms) - min(norms) > tolerance * max(norms):
        problems.append(f"{run['count']} parameters: norms disagree: {run['values']}")
    if len(zeros) != 1:
        problems.append(f"{run['count']} parameters: zero counts disagree: {run['values']}")
    return problems


def targets(runs: list[dict[str, Any]], device: torch.device) -> list[Target]:
    lines: list[Target] = []
    for run in runs:
        r, where = run["results"], f"{run['count']:,} parameters"

        def ratio(theirs: str, ours: str, r: dict[str, float] = r) -> float:
            return r[theirs] / r[ours]

        if device.type == "cuda":
            for label, theirs, ours in PAIRS[:2]:
                speed = ratio(theirs, ours)
                lines.append((f"{label} at {where} >= 20x torch", speed >= 20, f"{speed:.1f}x"))
            for label, theirs, ours in PAIRS[2:4]:
                speed = ratio(theirs, ours)
                detail = f"{speed:.1f}x (10x is {r[theirs] / 10:.2f} ms; the metadata floor {r['floor']:.2f} ms)"
                lines.append((f"{label} at {where} >= 10x torch", speed >= 10, detail))
        else:
            for label, theirs, ours, most in (("norm", *PAIRS[4][1:], 1.2), ("zeros", *PAIRS[5][1:], 1.1),
                                              ("clip", *PAIRS[3][1:], 1.2)):
                cost = 1 / ratio(theirs, ours)
                lines.append((f"{label} at {where} costs <= {most}x torch's", cost <= most, f"{cost:.2f}x"))
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--bytes", type=int, help="grad bytes (default: 2 GiB on CUDA, 64 elements a parameter on "
                        "CPU)")
    parser.add_argument("--params", help="comma-separated parameter counts (default: 2000,20000 on CUDA, 20000 on CPU)")
    parser.add_argument("--repeat", type=int, help="timed runs per figure (default: 20 on CUDA, 15 on CPU)")
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args(argv)
    device = selected_device(args.device)
    counts = [int(c) for c in (args.params or ("2000,20000" if device.type == "cuda" else "20000")).split(",")]
    args.repeat = args.repeat or (20 if device.type == "cuda" else 15)
    if not counts or min(counts) < 2 or args.repeat < 1 or args.warmup < 0:
        parser.error("parameter counts must be at least 2, --repeat positive, --warmup not negative")
    kernel = "on" if fused_stats_available(device) else "off"
    print(f"grad statistics over a model: torch {torch.__version__}, device {describe_device(device)}, one-read "
          f"kernel {kernel}, {args.dtype} grads, median of {args.repeat} after {args.warmup} warm-up runs")
    runs, problems = [], []
    for count in counts:
        itemsize = torch.finfo(DTYPES[args.dtype]).bits // 8
        size = args.bytes or (2 * GiB if device.type == "cuda" else 64 * count * itemsize)
        run_args = argparse.Namespace(**{**vars(args), "bytes": size})
        result = run(count, run_args, device)
        print_table(result, device, args.dtype)
        problems += check_values(result, args.dtype)
        runs.append(result)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    goals = "H200, 2 GiB" if device.type == "cuda" else "2-core CPU, host cost"
    return finish(f"Targets ({goals}):", targets(runs, device), problems)


if __name__ == "__main__":
    sys.exit(main())

"""Benchmark: the compiled steady check of a kept plan's grads, every piece listed against only the kept ones.

``planned_pieces`` (``pgregistry/grad_stats/_steady_checks.cpp``) checks that each parameter's grad is the planned
tensor at its planned address. Before issue 38's change it always returned the list of every piece (each grad's Python
object wrapped and appended); where a steady call's reads are the one-read kernel's alone it is now given a mask and
lists only each kind's first and base piece, ``None`` at the other positions. This times the two calls alone, over the
same parameters, alternated round by round: ``every piece`` (``kept=None``) and ``kept only`` (a mask keeping
:data:`KEPT` pieces, as a model of two kinds whose first pieces are their bases keeps). Each answer is checked before
the timing (every piece the grad itself; the kept ones, ``None`` elsewhere). Host only: the grads are CPU tensors, the
pass reads no element.

Usage: ``python benchmarks/planned_pieces.py [--params 2000 20000] [--rounds 15] [--calls 200]``. A figure is the
median over ``--rounds`` rounds of one round's ns a parameter (``--calls`` calls back to back); the least is printed
beside it. Needs the compiled checks (a C++ compiler and ninja).
"""

from __future__ import annotations

import argparse
import operator
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from benchmarks.common import tensor_sizes  # noqa: E402
from pgregistry.grad_stats._compiled import steady_checks  # noqa: E402

KEPT = (0, 1)
"""The positions the mask keeps: the first piece (the reduction's device, the first kind's first and base) and the
second kind's first piece, its base too (a float32 and a bf16 kind, each contiguous from a 16-byte aligned start)."""


def _params(count: int) -> list[torch.nn.Parameter]:
    """``count`` parameters of model-like sizes (256 elements on average), each with a grad."""
    params = []
    for size in tensor_sizes(count, 256 * count):
        param = torch.nn.Parameter(torch.empty(size))
        param.grad = torch.zeros(size)
        params.append(param)
    return params


def _ns_per_param(
    checks: Any, params: list[Any], planned: torch.Tensor, kept: torch.Tensor | None, calls: int
) -> float:
    """ns a parameter of ``calls`` checks back to back: every piece listed (``kept`` None, the call made before the
    mask was) or only the kept ones."""
    start = time.perf_counter_ns()
    if kept is None:
        for _ in range(calls):
            checks.planned_pieces(params, planned)
    else:
        for _ in range(calls):
            checks.planned_pieces(params, planned, kept)
    return (time.perf_counter_ns() - start) / calls / len(params)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--params", type=int, nargs="+", default=[2000, 20000])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args()
    checks = steady_checks()
    if checks is None:
        print("FAIL: the compiled checks are not built here (PGREGISTRY_COMPILED_CHECKS, or no compiler or ninja)")
        return 1
    print(f"planned_pieces alone, host only; {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at start")
    rows = [
        "| params | every piece (ns a param) | kept only (ns a param) | kept only / every piece |",
        "|---|---|---|---|",
    ]
    for count in args.params:
        params = _params(count)
        grads = [param.grad for param in params]
        planned = checks.planned_rows(grads)
        kept = torch.zeros(count, dtype=torch.bool)
        kept[list(KEPT)] = True
        every = checks.planned_pieces(params, planned)
        some = checks.planned_pieces(params, planned, kept)
        want = [grad if position in KEPT else None for position, grad in enumerate(grads)]
        if not (every is not None and all(map(operator.is_, every, grads))):
            print(f"FAIL: every piece at {count} parameters is not the grads")
            return 1
        if not (some is not None and len(some) == count and all(map(operator.is_, some, want))):
            print(f"FAIL: the kept pieces at {count} parameters are not the kept grads, None elsewhere")
            return 1
        times: dict[str, list[float]] = {"every": [], "kept": []}
        for _ in range(args.rounds):  # alternated: both under the same load
            times["every"].append(_ns_per_param(checks, params, planned, None, args.calls))
            times["kept"].append(_ns_per_param(checks, params, planned, kept, args.calls))
        every_ns, kept_ns = (statistics.median(times[way]) for way in ("every", "kept"))
        rows.append(
            f"| {count:,} | {every_ns:.1f} (least {min(times['every']):.1f}) | {kept_ns:.1f} "
            f"(least {min(times['kept']):.1f}) | {kept_ns / every_ns:.2f}x |"
        )
    print(f"load average {os.getloadavg()[0]:.1f} at end; medians of {args.rounds} rounds of {args.calls} calls")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())

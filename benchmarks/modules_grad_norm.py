"""Benchmark: the job-wide grad norm over two modules on disjoint spans, against each module's norm by hand, in one run.

A local 8-rank gloo world (CPU): an encoder on ranks 0-3 at DP 4 and a language model on ranks 4-7 at TP 2 x PP 2
(half its tensors TP-sharded), each rank holding ``--tensors`` grads of ``--mib`` MiB in all, about 30% exact
zeros. Rows, each timed in this run on every rank:

- ``grad_norm per module (baseline)``: :func:`pgregistry.grad_norm` of each module this rank runs on its
  collection: what a user computes by hand, each module's norm on its own ranks, with no job-wide value;
- ``per module + one world MAX (MIMO-style, unchecked)``: the baseline plus what Megatron-Core's ``MimoOptimizer``
  adds for a job-wide value: each module's norm squared in a vector indexed by module, one MAX all-reduce over the
  world (no agreement, non-finite norms not kept apart);
- ``modules.grad_norm``: :func:`pgregistry.modules.grad_norm`, the job-wide norm: the same per-module norms, plus
  the agreement on the modules and the inputs (one world all-reduce, and each module's model checked by the
  statistics' door before any module collective) and the world all-reduce that combines the modules;
- ``ChainedOptimizer.get_grad_norm per module (baseline)`` and ``MultiModuleOptimizer.get_grad_norm``: the same
  pair through the optimizers' flat grad buffers (the modules were agreed on when the optimizer was made, so
  the job-wide norm adds one world all-reduce).

Columns: median milliseconds over ``--repeat`` calls after ``--warmup`` (rank 0's, and the slowest rank's),
and the ratio to the row's baseline. Exits 1 if a job-wide norm differs from the module norms combined by hand in
float64 (relative 1e-6). The 8 ranks share this machine's cores: absolute times depend on the machine, the
ratios less so.

Usage: ``python benchmarks/modules_grad_norm.py [--tensors 200] [--mib 4] [--repeat 30]``.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from pgregistry import grad_norm  # noqa: E402
from pgregistry import modules as mm  # noqa: E402
from pgregistry.layout import ParallelLayout  # noqa: E402
from pgregistry.params import mark_tensor_parallel  # noqa: E402
from pgregistry.testing import run_world  # noqa: E402

LAYOUTS = {
    "encoder": ParallelLayout(num_ranks=4),
    "language": ParallelLayout(num_ranks=4, tp=2, pp=2, rank_offset=4),
}


def _model(name: str, tensors: int, numel: int) -> torch.nn.Module:
    """``tensors`` parameters of ``numel`` elements in all (sizes spread 1x-100x), grads ~30% zeros; in the
    language model every other one is TP-sharded (distinct on each TP rank), the rest replicated."""
    shapes = torch.Generator().manual_seed(len(name))  # the same parameters on every rank of the module
    weights = torch.exp(torch.rand(tensors, generator=shapes, dtype=torch.float64) * 4.6)
    sizes = (weights / weights.sum() * numel).floor().clamp(min=1).to(torch.int64).tolist()
    model = torch.nn.Module()
    generator = torch.Generator().manual_seed(len(name) * 1000 + dist.get_rank())  # distinct TP shards
    replica = torch.Generator().manual_seed(len(name))  # the same on every replica of a replicated parameter
    for index, size in enumerate(sizes):
        param = torch.nn.Parameter(torch.zeros(size))
        sharded = name == "language" and index % 2 == 0
        source = generator if sharded else replica
        grad = torch.randn(size, generator=source)
        grad[torch.rand(size, generator=source) < 0.3] = 0.0
        param.grad = grad
        if sharded:
            mark_tensor_parallel(param, 0)
        model.register_parameter(f"p{index}", param)
    return model


def _time(fn: Callable[[], Any], warmup: int, repeat: int) -> tuple[float, Any]:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        dist.barrier()  # every rank starts the call together: the time is the call's, not a peer's lag
        start = time.perf_counter()
        value = fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times), value


def _on_rank(tensors: int, numel: int, warmup: int, repeat: int) -> dict[str, Any]:
    modules = mm.build_modules(LAYOUTS, language_model="language", disjoint=True)
    models = {name: _model(name, tensors, numel) for name in modules.here()}
    out: dict[str, Any] = {}
    out["per_module"], module_norms = _time(
        lambda: {name: float(grad_norm(model, modules[name])) for name, model in models.items()}, warmup, repeat
    )
    names = list(modules)

    def by_hand() -> float:
        squares = torch.zeros(len(names), dtype=torch.float64)
        for name, model in models.items():
            squares[names.index(name)] = float(grad_norm(model, modules[name])) ** 2
        dist.all_reduce(squares, op=dist.ReduceOp.MAX)
        return float(squares.sum().sqrt())

    out["by_hand"], _ = _time(by_hand, warmup, repeat)
    out["job_wide"], job_norm = _time(lambda: float(mm.grad_norm(models, modules)), warmup, repeat)
    # The optimizer copies each grad into its buffer when it is built: the same grads as above.
    optimizer = mm.build_optimizer(models, modules, optimizer="sgd", lr=0.0, mixed_precision=False)
    out["optimizer_per_module"], optimizer_norms = _time(
        lambda: {name: float(opt.get_grad_norm()) for name, opt in optimizer.optimizers.items()}, warmup, repeat
    )
    out["optimizer_job_wide"], optimizer_norm = _time(lambda: float(optimizer.get_grad_norm()), warmup, repeat)
    out["norms"] = (module_norms, job_norm, optimizer_norms, optimizer_norm)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tensors", type=int, default=200, help="grads per rank per module (default 200)")
    parser.add_argument("--mib", type=float, default=4.0, help="MiB of float32 grads per rank per module")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=30)
    args = parser.parse_args(argv)
    numel = int(args.mib * (1 << 20) / 4)
    results = run_world(8, _on_rank, args.tensors, numel, args.warmup, args.repeat, timeout=60)

    # The job-wide norms must be the module norms combined by hand (each module's norm is the same on its ranks).
    failed = []
    for per, job in ((0, 1), (2, 3)):
        modules: dict[str, float] = {}
        for got in results:
            modules.update(got["norms"][per])
        want = math.sqrt(sum(norm**2 for norm in modules.values()))
        for rank, got in enumerate(results):
            if not math.isclose(got["norms"][job], want, rel_tol=1e-6):
                failed.append(f"rank {rank}: job-wide norm {got['norms'][job]} but the modules' combine to {want}")

    rows = [
        ("grad_norm per module (baseline)", "per_module", "per_module"),
        ("per module + one world MAX (MIMO-style, unchecked)", "by_hand", "per_module"),
        ("modules.grad_norm", "job_wide", "per_module"),
        ("ChainedOptimizer.get_grad_norm per module (baseline)", "optimizer_per_module", "optimizer_per_module"),
        ("MultiModuleOptimizer.get_grad_norm", "optimizer_job_wide", "optimizer_per_module"),
    ]
    print(f"job-wide grad norm, 8-rank gloo world on this machine's CPUs (one thread per rank): encoder DP 4 on "
          f"ranks 0-3, language TP 2 x PP 2 on ranks 4-7; {args.tensors} grads, {args.mib:g} MiB per rank and "
          f"module; median of {args.repeat}")
    print(f"| {'row':<52} | rank 0 ms | slowest rank ms | vs baseline |")
    print(f"| {'-' * 52} | --------: | --------------: | ----------: |")
    for label, key, baseline in rows:
        first = results[0][key]
        slowest = max(got[key] for got in results)
        ratio = slowest / max(got[baseline] for got in results)
        print(f"| {label:<52} | {first:9.3f} | {slowest:15.3f} | {ratio:10.2f}x |")
    for problem in failed:
        print(f"FAILED: {problem}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

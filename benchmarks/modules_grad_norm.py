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

With ``--colocated``: one rank running two colocated modules of ``--linears`` ``nn.Linear(4, 4)`` each (grads
about 30% zeros), where a call is bound by host work per parameter. Rows: ``pgregistry.grad_norm`` of each module
(baseline), then ``modules.grad_norm``, ``modules.count_zeros`` and ``modules.clip_grad_norm_``; every call of the
clip scales (``max_norm`` halved before each call). Exits 1 if the norm or the zero count differs from the float64
oracle computed from the grads by hand, or if the clip's grads were not scaled by every call (their float64 norm
after the run, and the last call's norm, checked against the ``max_norm`` given). ``--against REV`` exports
``pgregistry/`` at git revision ``REV`` (``git archive``) and runs the colocated rows ``--rounds`` times in fresh
processes, alternately on that tree and on this checkout (the machine's load drifts; alternating spreads it over
both), and prints each row's median over the rounds for both and their ratio.

Usage: ``python benchmarks/modules_grad_norm.py [--tensors 200] [--mib 4] [--repeat 30]``;
``python benchmarks/modules_grad_norm.py --colocated [--linears 5000] [--against REV [--rounds 4]]``.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
TREE = os.environ.get("MODULES_GRAD_NORM_TREE")
"""Where ``--against`` exported the package this process times, else this checkout's."""
if TREE:
    sys.path.insert(0, TREE)
elif str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from pgregistry import clip_grad_norm_, grad_norm  # noqa: E402
from pgregistry import modules as mm  # noqa: E402
from pgregistry.grad_stats import CLIP_EPSILON  # noqa: E402
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


COLOCATED_ROWS = {
    "per_module": "grad_norm per module (baseline)",
    "grad_norm": "modules.grad_norm",
    "count_zeros": "modules.count_zeros",
    "clip_per_module": "clip_grad_norm_ per module (baseline, scales)",
    "clip": "modules.clip_grad_norm_ (every call scales)",
}


def _linears(count: int, seed: int) -> torch.nn.Module:
    """``count`` ``nn.Linear(4, 4)`` with grads, about 30% of their elements zero."""
    model = torch.nn.Sequential(*(torch.nn.Linear(4, 4) for _ in range(count)))
    generator = torch.Generator().manual_seed(seed)
    for param in model.parameters():
        grad = torch.randn(param.shape, generator=generator)
        grad[torch.rand(param.shape, generator=generator) < 0.3] = 0.0
        param.grad = grad
    return model


def _grads64(models: dict[str, torch.nn.Module]) -> torch.Tensor:
    return torch.cat([p.grad.double().flatten() for model in models.values() for p in model.parameters()])


def _colocated_on_rank(linears: int, warmup: int, repeat: int) -> dict[str, Any]:
    modules = mm.build_modules({"encoder": ParallelLayout(num_ranks=1), "language": ParallelLayout(num_ranks=1)})
    models = {name: _linears(linears, seed) for seed, name in enumerate(modules)}
    grads = _grads64(models)
    oracle_norm, oracle_zeros = float(grads.norm()), int((grads == 0).sum())
    out: dict[str, Any] = {"problems": [], "package": str(Path(mm.__file__).resolve().parents[2])}
    out["per_module"], _ = _time(lambda: [grad_norm(model, modules[name]) for name, model in models.items()],
                                 warmup, repeat)
    out["grad_norm"], norm = _time(lambda: float(mm.grad_norm(models, modules)), warmup, repeat)
    out["count_zeros"], zeros = _time(lambda: mm.count_zeros(models, modules), warmup, repeat)
    if not math.isclose(norm, oracle_norm, rel_tol=1e-6):
        out["problems"].append(f"modules.grad_norm {norm}, the float64 oracle {oracle_norm}")
    if zeros != oracle_zeros:
        out["problems"].append(f"modules.count_zeros {zeros}, the oracle {oracle_zeros}")
    # Each module clipped on its own to its share of the job-wide max_norm: the same scaling, module by module.
    shares = {name: float(_grads64({name: model}).norm()) / oracle_norm for name, model in models.items()}
    out["clip_per_module"] = _time_halving_clip(
        "clip_grad_norm_ per module",
        lambda limit: math.hypot(*(float(clip_grad_norm_(model, limit * shares[name], modules[name]))
                                   for name, model in models.items())),
        models, warmup, repeat, out["problems"])
    out["clip"] = _time_halving_clip("modules.clip_grad_norm_",
                                     lambda limit: float(mm.clip_grad_norm_(models, limit, modules)),
                                     models, warmup, repeat, out["problems"])
    return out


def _time_halving_clip(label: str, clip: Callable[[float], float], models: dict[str, torch.nn.Module], warmup: int,
                       repeat: int, problems: list[str]) -> float:
    """The median time of ``clip(max_norm)`` (which returns the job-wide norm before it), ``max_norm`` halved before
    each call so that every call scales the grads by about 1/2; a problem noted unless every call did. The grads are
    left as they were before."""
    originals = [p.grad.clone() for model in models.values() for p in model.parameters()]
    limit = [float(_grads64(models).norm())]

    def call() -> float:
        limit[0] /= 2
        return clip(limit[0])

    ms, last = _time(call, warmup, repeat)
    after = float(_grads64(models).norm())
    want = last * limit[0] / (last + CLIP_EPSILON)  # left by the last coefficient (a call that scaled nothing: 2x)
    if not (math.isclose(after, want, rel_tol=1e-3) and math.isclose(last, 2 * limit[0], rel_tol=1e-3)):
        problems.append(f"{label} did not scale on every call: the last returned {last} for a max_norm of "
                        f"{limit[0]} (half the one before), the grads' norm after it is {after}, not {want}")
    for param, original in zip((p for model in models.values() for p in model.parameters()), originals, strict=True):
        param.grad.copy_(original)
    return ms


def _colocated(args: argparse.Namespace) -> dict[str, Any]:
    (out,) = run_world(1, _colocated_on_rank, args.linears, args.warmup, args.repeat, timeout=600)
    return out


def _against(args: argparse.Namespace) -> int:
    """The colocated rows on the package at ``args.against`` and on this checkout, alternately (module docstring)."""
    archive = subprocess.run(["git", "-C", str(REPO), "archive", "--format=tar", args.against, "pgregistry"],
                             check=True, capture_output=True).stdout
    runs: dict[str, list[dict[str, Any]]] = {args.against: [], "this checkout": []}
    with tempfile.TemporaryDirectory() as old_tree:
        with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            tar.extractall(old_tree, filter="data")
        command = [sys.executable, __file__, "--colocated", "--json", "--linears", str(args.linears),
                   "--warmup", str(args.warmup), "--repeat", str(args.repeat)]
        for _ in range(args.rounds):
            for label, tree in ((args.against, old_tree), ("this checkout", "")):
                done = subprocess.run(command, check=False, capture_output=True, text=True,
                                      env={**os.environ, "MODULES_GRAD_NORM_TREE": tree})
                if done.returncode not in (0, 1):
                    print(done.stderr, file=sys.stderr)
                    return 2
                run = json.loads(done.stdout.splitlines()[-1])
                if Path(run["package"]) != Path(tree or REPO).resolve():
                    print(f"FAILED: {label}'s run imported pgregistry from {run['package']}", file=sys.stderr)
                    return 2
                runs[label].append(run)
    old, new = runs.values()
    print(f"two colocated modules of {args.linears} nn.Linear(4, 4) each ({args.linears * 2} parameters each), one "
          f"rank (gloo, CPU); median of {args.repeat} calls a round, {args.rounds} rounds alternating; the median "
          "of the rounds' medians")
    print(f"| {'row':<46} | {args.against[:12]:>12} ms | this checkout ms | ratio |")
    print(f"| {'-' * 46} | {'-' * 14}: | ---------------: | ----: |")
    for key, label in COLOCATED_ROWS.items():
        before = statistics.median(run[key] for run in old)
        after = statistics.median(run[key] for run in new)
        print(f"| {label:<46} | {before:15.1f} | {after:16.1f} | {after / before:5.2f} |")
    problems = [f"{label}: {problem}" for label, got in runs.items() for run in got for problem in run["problems"]]
    for problem in problems:
        print(f"FAILED: {problem}", file=sys.stderr)
    return 1 if problems else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tensors", type=int, default=200, help="grads per rank per module (default 200)")
    parser.add_argument("--mib", type=float, default=4.0, help="MiB of float32 grads per rank per module")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=30)
    parser.add_argument("--colocated", action="store_true", help="one rank, two colocated modules (docstring)")
    parser.add_argument("--linears", type=int, default=5000, help="nn.Linear(4, 4) per module with --colocated")
    parser.add_argument("--against", metavar="REV", help="with --colocated: also time pgregistry/ at REV")
    parser.add_argument("--rounds", type=int, default=4, help="with --against: alternations (default 4)")
    parser.add_argument("--json", action="store_true", help=argparse.SUPPRESS)  # --against's child processes
    args = parser.parse_args(argv)
    if args.colocated and args.against:
        return _against(args)
    if args.colocated:
        out = _colocated(args)
        if args.json:
            print(json.dumps(out))
        else:
            print(f"two colocated modules of {args.linears} nn.Linear(4, 4) each, one rank; median of {args.repeat}")
            for key, label in COLOCATED_ROWS.items():
                print(f"| {label:<46} | {out[key]:9.1f} ms |")
            for problem in out["problems"]:
                print(f"FAILED: {problem}", file=sys.stderr)
        return 1 if out["problems"] else 0
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

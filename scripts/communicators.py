"""Communicators and start-up per rank: pgregistry (``new_group`` once per distinct rank set, and ``split_group``)
against Megatron-Core's ``initialize_model_parallel``, on the same layouts.

    python scripts/communicators.py --nproc 8 --layouts tp=2,ep=4,expt_tp=1 tp=2,pp=2,ep=2
    python scripts/communicators.py --nproc 4 --layouts tp=2,ep=2,expt_tp=1 --backend gloo   # CPU
    python scripts/communicators.py --nproc 1 --layouts tp=1 --group-timeout 300             # one GPU

For each layout and method the driver launches a fresh torchrun world (a process has one default group), whose
ranks each measure, from just before ``init_process_group`` to one all-reduce completed on every group the rank
belongs to (issued in one global order: by size, then ranks): the wall time; how many communicators the rank joined
(process groups created during the set-up that hold it), and how many ``new_group`` and ``split_group`` calls it
made (counted by wrapping them); the device memory in use after that warm-up (``cuda.mem_get_info``, the whole
GPU, which is the rank's own; on CPU the process's peak RSS). Methods:

* ``megatron``: ``parallel_state.initialize_model_parallel`` (every group of every kind, on every rank);
* ``new_group``: ``pgregistry.registry.build`` in a world not bound to a device (``new_group`` once per
  distinct rank set, walked by every rank);
* ``split_group``: the same build in a world bound to the rank's GPU (``init_process_group(device_id=...)``), so
  pgregistry splits the world's communicator (NCCL only; skipped on gloo).

Checks (PASS/FAIL): every group's all-reduce of ones gives its size; pgregistry's builds hold the layout's ranks;
the ``split_group`` run made no ``new_group`` call and as many splits as its plan has families, the ``new_group``
run no split. ``--group-timeout S`` builds with an explicit timeout, so that even the world's own rank set is
created by the path under test (on one GPU, the only way to exercise it). Exit 1 when a check failed.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

METHODS = ("megatron", "new_group", "split_group")
WORKER_TIMEOUT_S = 900
MiB = 1 << 20


# ------------------------------------------------------------------------------------------------------ worker


def _worker(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    from pgregistry import registry
    from pgregistry.cli._layout_views import parse_layout_spec

    if args.method == "megatron":
        from megatron.core import (
            parallel_state,  # imported before the clock starts, as pgregistry is
        )

    calls = {"new_group": 0, "split_group": 0}
    for name in calls:
        original = getattr(dist, name)

        def counted(*a: Any, _name: str = name, _original: Any = original, **k: Any) -> Any:
            calls[_name] += 1
            return _original(*a, **k)

        setattr(dist, name, counted)
    cuda = args.backend == "nccl"
    init: dict[str, Any] = {"backend": args.backend, "timeout": timedelta(seconds=args.timeout)}
    memory_before = 0
    if cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        torch.cuda.init()
        free, total = torch.cuda.mem_get_info(device)
        memory_before = total - free
        if args.method == "split_group":
            init["device_id"] = device
    else:
        device = torch.device("cpu")
    start = time.perf_counter()
    dist.init_process_group(**init)
    world, rank = dist.get_world_size(), dist.get_rank()
    _, layout = parse_layout_spec(args.layout, world, "layout")
    existing = set(c10d._world.pg_group_ranks)
    collection = None
    if args.method == "megatron":
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
            context_parallel_size=layout.cp, expert_model_parallel_size=layout.ep,
            expert_tensor_parallel_size=layout.expt_tp, order=layout.order, create_gloo_process_groups=False,
        )
    else:
        timeout = None if args.group_timeout is None else timedelta(seconds=args.group_timeout)
        collection = registry.build(layout, timeout=timeout)
    joined = [group for group, ranks in c10d._world.pg_group_ranks.items() if group not in existing and rank in ranks]
    ordered = sorted(joined, key=lambda g: (g.size(), sorted(c10d._world.pg_group_ranks[g])))
    wrong_sums = []
    for group in [dist.group.WORLD, *ordered]:
        ones = torch.ones(1, device=device)
        dist.all_reduce(ones, group=group)
        if int(ones.item()) != group.size():
            wrong_sums.append(sorted(c10d._world.pg_group_ranks[group]))
    if cuda:
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    if cuda:
        free, total = torch.cuda.mem_get_info(device)
        memory = total - free
    else:
        memory = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    result = {
        "rank": rank, "seconds": seconds, "communicators": len(joined), "calls": calls, "wrong_sums": wrong_sums,
        "memory": memory, "memory_before": memory_before, "wrong_groups": _wrong_groups(collection, layout, rank),
        "expected_splits": _expected_splits(layout, args.group_timeout) if args.method == "split_group" else 0,
        "device": torch.cuda.get_device_name(device) if cuda else "CPU", "torch": torch.__version__,
    }
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, result)
    if rank == 0:
        Path(args.json).write_text(json.dumps(everyone))
    dist.barrier()
    dist.destroy_process_group()
    return 0


def _wrong_groups(collection: Any, layout: Any, rank: int) -> list[str]:
    """The collection's fields whose groups do not hold the ranks the layout gives this rank."""
    import torch.distributed as dist

    if collection is None:
        return []
    wrong = []
    for kind, want in layout.groups_of(rank).items():
        if want is None:
            continue
        group = collection.get(kind)
        ranks = (rank,) if group is None else tuple(dist.get_process_group_ranks(group))
        if ranks != tuple(want):
            wrong.append(f"{kind}: {list(ranks)} != {list(want)}")
    return wrong


def _expected_splits(layout: Any, group_timeout: float | None) -> int:
    """The families pgregistry's plan deals a build's rank sets (every rank's) into."""
    from pgregistry._runtime.group_cache import split_plan

    world = tuple(range(layout.num_ranks))
    sets = {(rank,) for rank in world} | {world}
    for rank in world:
        sets.update(ranks for ranks in layout.groups_of(rank).values() if ranks is not None and len(ranks) > 1)
    if group_timeout is None:
        sets.discard(world)  # the world's own group, with default options
    return len(split_plan(sets))


# ------------------------------------------------------------------------------------------------------ driver


def _launch(args: argparse.Namespace, layout: str, method: str) -> list[dict[str, Any]] | str:
    """One torchrun world; its ranks' results, or why there are none."""
    with tempfile.TemporaryDirectory() as temporary:
        output = Path(temporary) / "result.json"
        command = [
            args.python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.nproc),
            __file__, "--worker", "--method", method, "--layout", layout, "--backend", args.backend,
            "--timeout", str(args.timeout), "--json", str(output),
        ]
        if args.group_timeout is not None:
            command += ["--group-timeout", str(args.group_timeout)]
        environment = {**os.environ, "NCCL_NVLS_ENABLE": os.environ.get("NCCL_NVLS_ENABLE", "0")}
        done = subprocess.run(command, capture_output=True, text=True, timeout=WORKER_TIMEOUT_S, env=environment)
        if done.returncode != 0 or not output.exists():
            tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-12:])
            return f"exit {done.returncode}:\n{tail}"
        results: list[dict[str, Any]] = json.loads(output.read_text())
        return results


def _span(values: list[float], fmt: str = "{:.0f}") -> str:
    low, high = min(values), max(values)
    return fmt.format(low) if low == high else f"{fmt.format(low)}-{fmt.format(high)}"


def _driver(args: argparse.Namespace) -> int:
    methods = [m for m in args.methods if not (m == "split_group" and args.backend != "nccl")]
    if len(methods) < len(args.methods):
        print("split_group skipped: it needs NCCL bound to a device (the gloo path is new_group)")
    rows = [("layout", "method", "ranks", "comms/rank", "new_group/rank", "split_group/rank", "start-up s (max)",
             "memory MiB/rank (max)", "memory before MiB")]
    checks: list[tuple[str, bool, str]] = []
    header = ""
    for layout in args.layouts:
        for method in methods:
            results = _launch(args, layout, method)
            where = f"{layout} {method}"
            if isinstance(results, str):
                checks.append((f"{where}: the world ran", False, results))
                continue
            header = f"{results[0]['device']}, torch {results[0]['torch']}, backend {args.backend}"
            calls = [r["calls"] for r in results]
            rows.append((
                layout, method, str(len(results)), _span([r["communicators"] for r in results]),
                _span([c["new_group"] for c in calls]), _span([c["split_group"] for c in calls]),
                f"{max(r['seconds'] for r in results):.3f}", f"{max(r['memory'] for r in results) / MiB:.0f}",
                f"{max(r['memory_before'] for r in results) / MiB:.0f}",
            ))
            sums = {r["rank"]: r["wrong_sums"] for r in results if r["wrong_sums"]}
            checks.append((f"{where}: every group's all-reduce of ones gives its size", not sums, f"{sums}"))
            if method != "megatron":
                wrong = {r["rank"]: r["wrong_groups"][:2] for r in results if r["wrong_groups"]}
                checks.append((f"{where}: every field holds the layout's ranks", not wrong, f"{wrong}"))
            if method == "split_group":
                bad = [(r["rank"], r["calls"], r["expected_splits"]) for r in results
                       if r["calls"]["new_group"] or r["calls"]["split_group"] != r["expected_splits"]]
                checks.append((f"{where}: no new_group, one split per family of the plan "
                               f"({results[0]['expected_splits']})", not bad, f"(rank, calls, plan) {bad[:3]}"))
            if method == "new_group":
                bad = [r["rank"] for r in results if r["calls"]["split_group"]]
                checks.append((f"{where}: an unbound world never splits", not bad, f"ranks {bad}"))
    print(f"communicators and start-up: {args.nproc} ranks per world; {header}")
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.rjust(width) for cell, width in zip(row, widths, strict=True)))
    for name, ok, detail in checks:
        print(f"[{'PASS' if ok else 'FAIL'}] {name}" + ("" if ok else f" ({detail})"))
    failed = sum(not ok for _, ok, _ in checks)
    print(f"{len(checks) - failed} passed, {failed} failed")
    return 1 if failed else 0


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=8, help="ranks per world (default 8)")
    parser.add_argument("--layouts", nargs="+", default=["tp=2,ep=4,expt_tp=1", "tp=2,pp=2,ep=2"],
                        help="layouts as KEY=VALUE,... (default: the two of the 8-GPU runs)")
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS), help="what to measure")
    parser.add_argument("--backend", choices=("nccl", "gloo"), default=None, help="default: nccl where CUDA is")
    parser.add_argument("--timeout", type=float, default=300.0, help="init and collective timeout, seconds")
    parser.add_argument("--group-timeout", type=float, default=None,
                        help="build pgregistry's groups with this timeout (every rank set is then created, the "
                        "world's too)")
    parser.add_argument("--python", default=sys.executable, help=argparse.SUPPRESS)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--method", choices=METHODS, help=argparse.SUPPRESS)
    parser.add_argument("--layout", help=argparse.SUPPRESS)
    parser.add_argument("--json", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.backend is None:
        import torch

        args.backend = "nccl" if torch.cuda.is_available() else "gloo"
    if args.backend == "nccl":
        from pgregistry.cli._torchrun_checks import nccl_without_cuda

        problem = nccl_without_cuda()
        if problem is not None:  # each world's ranks would fail on their first CUDA call, naming neither
            parser.error(problem)
    return _worker(args) if args.worker else _driver(args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Benchmark: process-group creation per rank, the registry against creating every group of every kind.

Runs on PyTorch's single-process ``fake`` backend, where one process stands for any rank of an 8,192-rank world
(``new_group`` computes nothing there, so this measures the calls a rank issues and the host work around them;
on a real backend each call is also a store round trip). A process has one default group, so each measurement
runs in a fresh interpreter, for a sample of ranks (the first and one in the middle) of each world size:

- registry: ``pgregistry.registry.build(layout)`` in a world not bound to a device: ``new_group`` once per
  distinct rank set of the layout, on every rank (torch names a group alike on all its members only so), after one
  agreement all-reduce;
- baseline: what Megatron-Core's ``initialize_model_parallel`` does, ``new_group`` for every group of every kind
  on every rank (world-synchronised), measured in the same run.

``new_group`` calls are counted by wrapping ``torch.distributed.new_group``, for both, so no count is inferred.

Usage: ``python benchmarks/group_creation.py [--worlds 1024 8192]``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent

LAYOUTS: dict[str, dict[str, int]] = {
    "TP8 PP8 CP2 EP8 ETP1": {"tp": 8, "pp": 8, "cp": 2, "ep": 8, "expt_tp": 1},
    "TP4 GTP2 PP8 CP2 EP8 ETP1 EGTP2": {
        "tp": 4, "gtp_remat": 2, "pp": 8, "cp": 2, "ep": 8, "expt_tp": 1, "expt_gtp_remat": 2,
    },
}


def _worker(world: int, rank: int, layout_name: str, method: str) -> dict[str, Any]:
    """One measurement in this (fresh) process; returns the calls issued and the seconds taken."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from pgregistry import registry
    from pgregistry.layout import GROUP_KINDS, ParallelLayout

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    calls = 0
    new_group = dist.new_group

    def counting_new_group(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        return new_group(*args, **kwargs)

    dist.new_group = counting_new_group  # type: ignore[assignment]
    layout = ParallelLayout(num_ranks=world, **LAYOUTS[layout_name])
    start = time.perf_counter()
    if method == "registry":
        registry.build(layout)
    else:
        for kind in GROUP_KINDS:
            for ranks in layout.groups(kind):
                dist.new_group(list(ranks))
    seconds = time.perf_counter() - start
    return {"calls": calls, "seconds": seconds}


def _measure(world: int, rank: int, layout_name: str, method: str) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, __file__, "--worker", str(world), str(rank), layout_name, method],
        capture_output=True, text=True, check=False, cwd=REPO,
    )
    if done.returncode != 0:
        raise SystemExit(f"worker {world} {rank} {layout_name} {method} failed:\n{done.stderr}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[1024, 8192])
    parser.add_argument("--worker", nargs=4, metavar=("WORLD", "RANK", "LAYOUT", "METHOD"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        world, rank, layout_name, method = args.worker
        print(json.dumps(_worker(int(world), int(rank), layout_name, method)))
        return
    from pgregistry.layout import ParallelLayout

    for layout_name, sizes in LAYOUTS.items():  # a world the layouts do not divide: refused before any run
        for world in args.worlds:
            try:
                ParallelLayout(num_ranks=world, **sizes)
            except ValueError as exc:
                parser.error(f"--worlds {world} does not fit {layout_name}: {exc} (try 1024 or 8192)")
    header = (
        f"{'layout':<32} {'ranks':>6} {'rank':>5} {'registry calls':>14} {'registry s':>10} "
        f"{'baseline calls':>14} {'baseline s':>10} {'calls ratio':>11} {'time ratio':>10}"
    )
    print(header)
    print("-" * len(header))
    for layout_name in LAYOUTS:
        for world in args.worlds:
            for rank in (0, world // 2 + 3):
                ours = _measure(world, rank, layout_name, "registry")
                base = _measure(world, rank, layout_name, "baseline")
                print(
                    f"{layout_name:<32} {world:>6} {rank:>5} {ours['calls']:>14} {ours['seconds']:>10.4f} "
                    f"{base['calls']:>14} {base['seconds']:>10.3f} {base['calls'] / ours['calls']:>10.2f}x "
                    f"{base['seconds'] / ours['seconds']:>9.2f}x",
                    flush=True,
                )


if __name__ == "__main__":
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    main()

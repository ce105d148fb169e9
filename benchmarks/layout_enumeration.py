"""Benchmark: enumerating every group of every kind of a layout at 8k / 32k / 131k ranks.

Times, in this one run, for a TP8 PP8 CP2 EP8 ETP1 layout and one with GTP-remat (TP4 GTP2 ... EGTP2):

- ``ParallelLayout(...)``: construction and validation (which compares the dense and expert pipeline groups);
- ``groups_tensor(kind)`` for every kind: the vectorised fast path, one ``[groups, size]`` tensor per kind;
- ``groups(kind)`` for every kind: the same as tuples of ranks (the issue's target: under 1 s at 131,072 ranks);
- ``groups_of(rank)``: one rank's groups of every kind, without enumerating;
- the baseline: a plain-loop port of Megatron-Core's ``generate_masked_orthogonal_rank_groups`` (the test
  oracle of ``tests/core/test_layout.py``, loaded from there so there is one copy), every kind, same sizes.

Usage: ``python benchmarks/layout_enumeration.py [--repeat 3] [--baseline-max 131072]``. Each figure is the
median of ``--repeat`` runs (the baseline runs once).
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402,F401  - imported up front so no timing includes it

from pgregistry.layout import GROUP_KINDS, ParallelLayout  # noqa: E402

WORLDS = (8192, 32768, 131072)
LAYOUTS: dict[str, dict[str, int]] = {
    "TP8 PP8 CP2 EP8 ETP1": {"tp": 8, "pp": 8, "cp": 2, "ep": 8, "expt_tp": 1},
    "TP4 GTP2 PP8 CP2 EP8 ETP1 EGTP2": {
        "tp": 4, "gtp_remat": 2, "pp": 8, "cp": 2, "ep": 8, "expt_tp": 1, "expt_gtp_remat": 2,
    },
}


def _median_seconds(fn: Callable[[], Any], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _oracle() -> ModuleType:
    path = REPO / "tests" / "core" / "test_layout.py"
    spec = importlib.util.spec_from_file_location("layout_oracle", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _row(name: str, sizes: dict[str, int], world: int, repeat: int, oracle: ModuleType | None) -> str:
    layout = ParallelLayout(num_ranks=world, **sizes)
    enumerated = {kind: layout.groups(kind) for kind in GROUP_KINDS}  # counted and checked, outside the timings
    count = sum(len(groups) for groups in enumerated.values())
    construct = _median_seconds(lambda: ParallelLayout(num_ranks=world, **sizes), repeat)
    tensors = _median_seconds(lambda: [layout.groups_tensor(k) for k in GROUP_KINDS], repeat)
    tuples = _median_seconds(lambda: [layout.groups(k) for k in GROUP_KINDS], repeat)
    one_rank = _median_seconds(lambda: layout.groups_of(world // 2 + 3), repeat)
    baseline_cell, ratio_cell = "-", "-"
    if oracle is not None:
        oracle_sizes = {k: v for k, v in sizes.items() if k not in ("gtp_remat", "expt_gtp_remat")}
        oracle_sizes["gtp"] = sizes.get("gtp_remat", 1)
        oracle_sizes["egtp"] = sizes.get("expt_gtp_remat", 1)
        start = time.perf_counter()
        expected = oracle.oracle_groups(world, **oracle_sizes)
        baseline = time.perf_counter() - start
        if any([list(g) for g in enumerated[k]] != expected[k] for k in GROUP_KINDS):
            raise SystemExit(f"layout and baseline disagree at {name}, {world} ranks")
        baseline_cell, ratio_cell = f"{baseline:.2f}", f"{baseline / tuples:.0f}x"
    return (
        f"{name:<32} {world:>7} {count:>8} {construct:>11.3f} {tensors:>9.3f} {tuples:>8.3f} "
        f"{one_rank:>11.5f} {baseline_cell:>10} {ratio_cell:>15}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--baseline-max", type=int, default=131072, help="largest world the baseline runs at")
    args = parser.parse_args()
    oracle = _oracle()
    header = (
        f"{'layout':<32} {'ranks':>7} {'groups':>8} {'construct s':>11} {'tensors s':>9} {'tuples s':>8} "
        f"{'groups_of s':>11} {'baseline s':>10} {'baseline/tuples':>15}"
    )
    print(header)
    print("-" * len(header))
    for name, sizes in LAYOUTS.items():
        for world in WORLDS:
            print(_row(name, sizes, world, args.repeat, oracle if world <= args.baseline_max else None), flush=True)


if __name__ == "__main__":
    main()

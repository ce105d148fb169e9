"""Benchmark: enumerating every group of every kind of a layout at 8k / 32k / 131k ranks.

Times, in this one run, for a TP8 PP8 CP2 EP8 ETP1 layout and one with GTP-remat (TP4 GTP2 ... EGTP2):

- ``ParallelLayout(...)``: construction and validation (which compares the dense and expert pipeline groups);
- ``groups_tensor(kind)`` for every kind: the vectorised fast path, one ``[groups, size]`` tensor per kind;
- ``groups(kind)`` for every kind: the same as tuples of ranks (the issue's target: under 1 s at 131,072 ranks);
- ``groups_of(rank)``: one rank's groups of every kind, without enumerating;
- the baseline: Megatron-Core's own ``RankGenerator`` (its plain-loop ``generate_masked_orthogonal_rank_groups``),
  the dense and the expert generator built as ``initialize_model_parallel`` builds them, every kind from the token
  ``initialize_model_parallel`` asks it for (``embd`` / ``pos_embd`` from its pipeline groups, as its defaults
  take them), same sizes; every group checked equal to the layout's (needs Megatron-Core: ``make setup``).

Usage: ``python benchmarks/layout_enumeration.py [--repeat 3] [--baseline-max 131072]``. Each figure is the
median of ``--repeat`` runs (the baseline runs once).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
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


# Each kind: (generator, the token initialize_model_parallel asks that generator for).
_MEGATRON_TOKENS: dict[str, tuple[str, str]] = {
    "tp": ("dense", "tp"), "gtp_remat": ("dense", "gtp_remat"), "cp": ("dense", "cp"), "dp": ("dense", "dp"),
    "pp": ("dense", "pp"), "dp_cp": ("dense", "dp-cp"), "tp_cp": ("dense", "tp-cp"), "mp": ("dense", "tp-gtp_remat-pp"),
    "tp_dp_cp": ("dense", "tp-gtp_remat-dp-cp"), "dp_cp_gtp_remat": ("dense", "gtp_remat-dp-cp"),
    "ep": ("expert", "ep"), "expt_tp": ("expert", "tp"), "expt_gtp_remat": ("expert", "gtp_remat"),
    "expt_dp": ("expert", "dp"), "tp_ep": ("expert", "tp-ep"), "tp_ep_pp": ("expert", "tp-ep-pp"),
    "tp_ep_pp_with_egtp_remat": ("expert", "tp-ep-gtp_remat-pp"), "expt_dp_gtp_remat": ("expert", "gtp_remat-dp"),
}


def _megatron_groups(world: int, sizes: dict[str, int]) -> dict[str, list[list[int]]]:
    """Every kind's groups from Megatron-Core's ``RankGenerator``, as ``initialize_model_parallel`` forms them."""
    from megatron.core import parallel_state as ps

    tp, pp, cp, gtp = sizes["tp"], sizes["pp"], sizes["cp"], sizes.get("gtp_remat", 1)
    expt_tp, ep, egtp = sizes["expt_tp"], sizes["ep"], sizes.get("expt_gtp_remat", 1)
    order = "tp-cp-ep-dp-pp"
    generators = {
        "dense": ps.RankGenerator(
            tp=tp, ep=1, dp=world // (tp * gtp * pp * cp), pp=pp, cp=cp,
            order=ps._inject_gtp_remat_axis(order, after="tp"), rank_offset=0, gtp_remat=gtp,
        ),
        "expert": ps.RankGenerator(
            tp=expt_tp, ep=ep, dp=world // (expt_tp * ep * pp * egtp), pp=pp, cp=1,
            order=ps._inject_gtp_remat_axis(order, after="ep"), rank_offset=0, gtp_remat=egtp,
        ),
    }
    groups = {kind: generators[which].get_ranks(token) for kind, (which, token) in _MEGATRON_TOKENS.items()}
    groups["embd"] = [ps.default_embedding_ranks(ranks) for ranks in groups["pp"]]
    groups["pos_embd"] = [ps.default_position_embedding_ranks(ranks) for ranks in groups["pp"]]
    return groups


def _row(name: str, sizes: dict[str, int], world: int, repeat: int, with_baseline: bool) -> str:
    layout = ParallelLayout(num_ranks=world, **sizes)
    enumerated = {kind: layout.groups(kind) for kind in GROUP_KINDS}  # counted and checked, outside the timings
    count = sum(len(groups) for groups in enumerated.values())
    construct = _median_seconds(lambda: ParallelLayout(num_ranks=world, **sizes), repeat)
    tensors = _median_seconds(lambda: [layout.groups_tensor(k) for k in GROUP_KINDS], repeat)
    tuples = _median_seconds(lambda: [layout.groups(k) for k in GROUP_KINDS], repeat)
    one_rank = _median_seconds(lambda: layout.groups_of(world // 2 + 3), repeat)
    baseline_cell, ratio_cell = "-", "-"
    if with_baseline:
        start = time.perf_counter()
        expected = _megatron_groups(world, sizes)
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
    if args.baseline_max > 0:
        import megatron.core.parallel_state  # noqa: F401  - the baseline's import, outside its timing
    header = (
        f"{'layout':<32} {'ranks':>7} {'groups':>8} {'construct s':>11} {'tensors s':>9} {'tuples s':>8} "
        f"{'groups_of s':>11} {'baseline s':>10} {'baseline/tuples':>15}"
    )
    print(header)
    print("-" * len(header))
    for name, sizes in LAYOUTS.items():
        for world in WORLDS:
            print(_row(name, sizes, world, args.repeat, world <= args.baseline_max), flush=True)


if __name__ == "__main__":
    main()

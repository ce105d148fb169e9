"""``pgregistry seed-plan``: every rank's RNG tracker seeds for a layout, and a check for seed collisions.

A layout over part of the world (``--rank-offset``) is planned for its own ranks, listed by their global rank: the
seeds follow each rank's coordinates in the layout, as the collection built from it gives them.

Torch is imported only inside the handler (through :mod:`pgregistry.rng`), as the CLI table requires.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING

from pgregistry.cli._limits import memory_shortfall, not_enough_memory
from pgregistry.cli._options import Subparsers, add_layout_arguments, layout_from_args

if TYPE_CHECKING:
    from pgregistry.layout import ParallelLayout

__all__ = ["add_command"]


def add_command(subparsers: Subparsers) -> None:
    """Register the ``seed-plan`` sub-command."""
    parser = subparsers.add_parser(
        "seed-plan",
        help="print every rank's RNG tracker seeds for a layout, or check them for collisions",
        description=(
            "Compute the seeds every rank's RNG trackers get (Megatron-Core's formulas, pipeline and optional "
            "data-parallel offsets included) from the layout alone, without process groups. With --check, "
            "report seeds shared by streams that must differ, and seeds outside [0, 2**64) that "
            "model_parallel_manual_seed refuses, and exit 1 when there are any."
        ),
    )
    add_layout_arguments(parser)
    parser.add_argument("--seed", type=int, required=True, help="the job's seed")
    parser.add_argument(
        "--data-parallel-random-init",
        action="store_true",
        help="add 10 * dp_rank to the base seed (data-parallel replicas initialised differently)",
    )
    parser.add_argument(
        "--check", action="store_true", help="report collisions and out-of-range seeds; exit 1 when any is found"
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.set_defaults(handler=_run)


def _run(args: argparse.Namespace) -> int:
    from pgregistry.rng import check_seed_plan, seed_plan

    try:
        layout = layout_from_args(args)
        _check_memory(layout, args.check)
        if args.check:
            collisions = check_seed_plan(layout, args.seed, data_parallel_random_init=args.data_parallel_random_init)
        else:
            plan = seed_plan(layout, args.seed, data_parallel_random_init=args.data_parallel_random_init)
    except ValueError as exc:
        print(f"pgregistry seed-plan: error: {exc}", file=sys.stderr)
        return 2
    if args.check:
        if args.json:
            print(json.dumps({"collisions": [c.to_dict() for c in collisions]}, indent=2))
        elif collisions:
            for collision in collisions:
                print(collision.describe())
        else:
            first, stop = layout.rank_range()
            span = f" (ranks {first}-{stop - 1})" if first else ""
            print(f"no seed collisions in {layout.num_ranks} ranks{span}")
        return 1 if collisions else 0
    if args.json:
        print(json.dumps({str(rank): seeds for rank, seeds in plan.items()}, indent=2))
        return 0
    _print_table(layout, plan)
    return 0


# Measured with ru_maxrss at 2**19 ranks on three layouts: checking peaked at 403 to 425 bytes per rank, the plan
# (table or JSON) at 1,800 to 2,275 bytes per rank. About 1.35 times the largest, to stay on the safe side.
_CHECK_BYTES_PER_RANK = 576
_PLAN_BYTES_PER_RANK = 3072


def _check_memory(layout: ParallelLayout, check: bool) -> None:
    """``ValueError`` when the plan (or its check) of every rank would need more memory than is available,
    estimated from the world size before any seed is computed: at 2**31 - 1 ranks it ran for hours, silent."""
    needed = (_CHECK_BYTES_PER_RANK if check else _PLAN_BYTES_PER_RANK) * layout.num_ranks
    available = memory_shortfall(needed)
    if available is not None:
        doing = f"{'checking ' if check else ''}the seed plan of {layout.num_ranks} ranks"
        advice = "it holds every rank's seeds: run it where more memory is free"
        raise not_enough_memory(doing, needed, available, advice)


def _print_table(layout: ParallelLayout, plan: dict[int, dict[str, int]]) -> None:
    axes = ("tp", "cp", "dp", "pp", "ep", "expt_tp", "gtp_remat", "expt_gtp_remat")
    trackers: list[str] = []
    for seeds in plan.values():
        trackers.extend(t for t in seeds if t not in trackers)
    header = ["rank", *axes, *trackers]
    rows = []
    for rank, seeds in plan.items():
        coords = layout.coords(rank)
        rows.append([str(rank), *(str(coords[a]) for a in axes), *(str(seeds.get(t, "-")) for t in trackers)])
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        print("  ".join(cell.rjust(width) for cell, width in zip(row, widths, strict=True)))

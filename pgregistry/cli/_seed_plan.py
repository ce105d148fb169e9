"""``pgregistry seed-plan``: each rank's RNG tracker seeds for a layout, and a check for collisions.

A layout over part of the world (``--rank-offset``) is planned for its own ranks, listed by their
global rank: the seeds follow each rank's coordinates in the layout, as the collection built from it
gives them.

Before enumerating anything the command estimates the memory the plan or its check holds (from the
layout's sizes, :func:`pgregistry.rng.check_seed_plan_size`) and refuses what would not fit; once
the first ranks are done it estimates the time from their measured rate, refuses a run longer than
``--time-limit``, and reports progress on stderr for a run longer than ``--progress`` seconds: at
about 10 microseconds a rank, 38 million ranks take six minutes, which used to pass in silence.

Torch is imported only inside the handler (through :mod:`pgregistry.rng`), as the CLI table
requires.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from typing import TYPE_CHECKING

from pgregistry.cli._limits import memory_shortfall, not_enough_memory
from pgregistry.cli._options import Subparsers, add_layout_arguments, layout_from_args, non_negative

if TYPE_CHECKING:
    from pgregistry.layout import ParallelLayout

__all__ = ["add_command", "estimate_plan_bytes"]


def add_command(subparsers: Subparsers) -> None:
    """Register the ``seed-plan`` sub-command."""
    parser = subparsers.add_parser(
        "seed-plan",
        help="print every rank's RNG tracker seeds for a layout, or check them for collisions",
        description=(
            "Compute the seeds every rank's RNG trackers get (Megatron-Core's "
            "formulas, pipeline and optional data-parallel offsets included) from "
            "the layout alone, without process groups. With --check, report seeds "
            "shared by streams that must differ, and seeds outside [0, 2**64) that "
            "model_parallel_manual_seed refuses, and exit 1 when there are any. "
            "Without --check, a plan with such a seed is not printed: its seeds "
            "are named on stderr, exit 2."
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
        "--check",
        action="store_true",
        help="report collisions and out-of-range seeds; exit 1 when any is found",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument(
        "--time-limit",
        type=non_negative,
        default=30.0,
        metavar="MINUTES",
        help=(
            "refuse (exit 2) a run estimated, from the rate of its first "
            "ranks, to take longer (default: %(default)s; 0 for no limit)"
        ),
    )
    parser.add_argument(
        "--progress",
        type=non_negative,
        default=10.0,
        metavar="SECONDS",
        help=(
            "print progress on stderr every SECONDS of a run estimated "
            "to take longer than that (default: %(default)s; 0 for none)"
        ),
    )
    parser.set_defaults(handler=_run_seed_plan)


def _run_seed_plan(args: argparse.Namespace) -> int:
    from pgregistry.rng import SeedCollision, check_seed_plan, seed_plan

    random_init = args.data_parallel_random_init
    try:
        layout = layout_from_args(args)
        doing = f"{'checking ' if args.check else ''}the seed plan of {layout.num_ranks} ranks"
        _check_memory(layout, args.seed, args.check, random_init, doing)
        advice = "raise --time-limit (0 for no limit)"
        if args.check and not random_init:
            advice += (
                ", or check the layout with fewer data-parallel replicas: "
                "without --data-parallel-random-init the seeds do not depend "
                "on the data-parallel size, so it has the same collisions"
            )
        progress = _Progress(doing, layout.num_ranks, args.time_limit, args.progress, advice)
        if args.check:
            collisions = check_seed_plan(
                layout, args.seed, data_parallel_random_init=random_init, progress=progress
            )
        else:
            plan = seed_plan(
                layout, args.seed, data_parallel_random_init=random_init, progress=progress
            )
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
    out_of_range = SeedCollision.out_of_range_in(plan)
    if out_of_range:  # seeds every such rank fails on at start-up: never printed as a plan
        for collision in out_of_range:
            print(f"pgregistry seed-plan: error: {collision.describe()}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({str(rank): seeds for rank, seeds in plan.items()}, indent=2))
        return 0
    _print_table(layout, plan)
    return 0


# Measured with tracemalloc at 2**18 ranks on layouts with and without expert and GTP-remat axes:
# checking held 256 to 450 bytes per stream (check_seed_plan_size's count) and 34 per listed (rank,
# collision) entry, nothing else per rank; the plan (table or JSON) peaked at 1,174 to 1,670 bytes
# per rank (1,800 to 2,275 by ru_maxrss). Rounded up, for what the allocator adds.
# tests/core/test_layout_cli_limits.py holds them within a small factor of tracemalloc.
_STREAM_BYTES = 512
_LISTED_BYTES = 48
_PLAN_BYTES_PER_RANK = 3072


def estimate_plan_bytes(
    layout: ParallelLayout, seed: int, check: bool, data_parallel_random_init: bool
) -> int:
    """Memory of ``layout``'s plan (``check``: its check), estimated from the layout's sizes."""
    from pgregistry.rng import check_seed_plan_size

    if not check:
        return _PLAN_BYTES_PER_RANK * layout.num_ranks
    streams, listed = check_seed_plan_size(
        layout, seed, data_parallel_random_init=data_parallel_random_init
    )
    return _STREAM_BYTES * streams + _LISTED_BYTES * listed


def _check_memory(
    layout: ParallelLayout, seed: int, check: bool, data_parallel_random_init: bool, doing: str
) -> None:
    """``ValueError`` when the plan (or its check) would need more memory than is available.

    Estimated before any seed is computed: at 2**31 - 1 ranks it ran for hours, silent."""
    needed = estimate_plan_bytes(layout, seed, check, data_parallel_random_init)
    available = memory_shortfall(needed)
    if available is not None:
        if not check:
            advice = (
                "it holds every rank's seeds: run it where "
                "more memory is free, or check it (--check)"
            )
        elif data_parallel_random_init:
            advice = (
                "with --data-parallel-random-init every data-parallel rank has streams "
                "of its own, which the check holds: run it where more memory is free"
            )
        else:
            advice = (
                "it lists every rank of its within-rank and out-of-range collisions: "
                "run it where more memory is free"
            )
        raise not_enough_memory(doing, needed, available, advice)


class _Progress:
    """The plan's ``progress`` callback: refuses a run past ``--time-limit``, reports a long one.

    From the rate of the first ranks, the time the whole run takes; ``ValueError`` (with ``advice``)
    when that is past ``--time-limit``, and lines on stderr every ``--progress`` seconds of a run
    estimated longer than that. Nothing is timed before the first callback, so short runs print
    nothing."""

    def __init__(
        self, doing: str, total: int, limit_minutes: float, every_s: float, advice: str
    ) -> None:
        self.doing, self.total, self.advice = doing, total, advice
        self.limit_minutes, self.every_s = limit_minutes, every_s
        self.start = self.printed = time.monotonic()
        self.first = True

    def __call__(self, done: int) -> None:
        now = time.monotonic()
        elapsed = now - self.start
        whole = elapsed * self.total / done
        if self.first:
            self.first = False
            rate = f"{elapsed / done * 1e6:.1f} microseconds a rank over the first {done}"
            if self.limit_minutes and whole > self.limit_minutes * 60:
                raise ValueError(
                    f"{self.doing} would take about {_format_duration(whole)} here ({rate}), "
                    f"more than --time-limit {self.limit_minutes:g} (minutes); {self.advice}"
                )
            if self.every_s and whole > self.every_s:
                estimate = f"about {_format_duration(whole)} here ({rate})"
                print(f"pgregistry seed-plan: {self.doing}: {estimate}", file=sys.stderr)
            return
        if self.every_s and whole > self.every_s and now - self.printed >= self.every_s:
            self.printed = now
            print(
                f"pgregistry seed-plan: {done} of {self.total} ranks "
                f"({100 * done // self.total}%), about {_format_duration(whole - elapsed)} left",
                file=sys.stderr,
            )


def _format_duration(seconds: float) -> str:
    if seconds < 90:
        return f"{math.ceil(seconds)} s"
    return f"{seconds / 60:.1f} min" if seconds < 5400 else f"{seconds / 3600:.1f} h"


def _print_table(layout: ParallelLayout, plan: dict[int, dict[str, int]]) -> None:
    axes = ("tp", "cp", "dp", "pp", "ep", "expt_tp", "gtp_remat", "expt_gtp_remat")
    trackers: list[str] = []
    for seeds in plan.values():
        trackers.extend(t for t in seeds if t not in trackers)
    header = ["rank", *axes, *trackers]
    rows = []
    for rank, seeds in plan.items():
        coords = layout.coords(rank)
        rows.append(
            [
                str(rank),
                *(str(coords[a]) for a in axes),
                *(str(seeds.get(t, "-")) for t in trackers),
            ]
        )
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        print("  ".join(cell.rjust(width) for cell, width in zip(row, widths, strict=True)))

"""Options shared by commands: the sizes declaring a parallel layout, and the node-placement check.

Torch-free at import (the layout arithmetic is imported inside :func:`layout_from_args`).
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias

from pgregistry._runtime.empty_options import empty_option

if TYPE_CHECKING:
    from pgregistry.layout import ParallelLayout

__all__ = [
    "Subparsers",
    "add_layout_arguments",
    "add_placement_arguments",
    "check_not_empty",
    "check_output_file",
    "check_span",
    "intra_node_kinds",
    "layout_from_args",
    "non_negative",
    "positive_seconds",
]

Subparsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"
"""What ``add_command`` receives: the top-level parser's sub-command table."""


def add_layout_arguments(parser: argparse.ArgumentParser, *, num_ranks: bool = True) -> None:
    """The options that declare a :class:`~pgregistry.layout.ParallelLayout`.

    ``--num-ranks``, ``--rank-offset`` and ``--world-size`` are left out when the world comes from
    elsewhere, e.g. torchrun."""
    if num_ranks:
        parser.add_argument(
            "--num-ranks", type=int, required=True, help="number of ranks the layout spans"
        )
        parser.add_argument(
            "--rank-offset",
            type=int,
            default=0,
            help=(
                "the layout's first (global) rank, for a layout over "
                "part of the world (Megatron-Core's HyperCommGrid "
                "rank_offset; default 0: from the world's first rank)"
            ),
        )
        parser.add_argument(
            "--world-size",
            type=int,
            default=None,
            metavar="N",
            help=(
                "ranks in the whole job, when the layout spans part of it: the "
                "span must end within it (default: --rank-offset + --num-ranks)"
            ),
        )
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    parser.add_argument("--cp", type=int, default=1, help="context-parallel size")
    parser.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")
    parser.add_argument("--ep", type=int, default=1, help="expert-parallel size")
    parser.add_argument("--expt-tp", type=int, default=None, help="expert TP size (default: --tp)")
    parser.add_argument("--gtp-remat", type=int, default=1, help="GTP-remat size")
    parser.add_argument("--expt-gtp-remat", type=int, default=1, help="expert GTP-remat size")
    parser.add_argument(
        "--order", default=None, help="axis order, fastest first (default tp-cp-ep-dp-pp)"
    )


_SIZE_OPTIONS = ("tp", "cp", "pp", "ep", "expt_tp", "gtp_remat", "expt_gtp_remat")


def check_not_empty(args: argparse.Namespace, options: Mapping[str, tuple[str, str]]) -> None:
    """``ValueError`` naming the first of ``options`` given an empty value.

    ``options``: dest -> (option, what to set it to). ``--svg "$OUT"`` with the variable unset would
    otherwise pass as the option left out (:mod:`pgregistry._runtime.empty_options`)."""
    problem = empty_option(args, options)
    if problem is not None:
        raise ValueError(problem)


def layout_from_args(args: argparse.Namespace, world_size: int | None = None) -> ParallelLayout:
    """The layout :func:`add_layout_arguments` declared; ``ValueError`` when it is invalid.

    Over the whole ``world_size`` when given, else ``--num-ranks`` from ``--rank-offset``, checked
    by :func:`check_span`; the ``ValueError`` carries the layout's message."""
    from pgregistry.layout import ParallelLayout

    for dest in _SIZE_OPTIONS:  # named as the option, not as the layout's argument
        value = getattr(args, dest)
        if value is not None and value < 1:
            raise ValueError(f"--{dest.replace('_', '-')} must be a positive integer, got {value}")
    check_not_empty(
        args,
        {"order": ("--order", "an axis order such as tp-cp-ep-dp-pp, or leave the option out")},
    )
    if world_size is None:
        check_span(args.num_ranks, args.rank_offset, args.world_size)
    span = (
        {"num_ranks": world_size}
        if world_size is not None
        else {
            "num_ranks": args.num_ranks,
            "rank_offset": args.rank_offset,
        }
    )
    sizes: dict[str, Any] = {
        **span,
        "tp": args.tp,
        "cp": args.cp,
        "pp": args.pp,
        "ep": args.ep,
        "gtp_remat": args.gtp_remat,
        "expt_gtp_remat": args.expt_gtp_remat,
    }
    if args.expt_tp is not None:
        sizes["expt_tp"] = args.expt_tp
    if args.order is not None:
        sizes["order"] = args.order
    return ParallelLayout(**sizes)


def check_span(num_ranks: int, rank_offset: int, world_size: int | None, spec: str = "") -> None:
    """``ValueError`` naming the option at fault for a span that cannot be.

    ``--num-ranks`` not positive, ``--rank-offset`` negative, ``--world-size`` not positive or
    ending before the span does (``spec``: the ``--compare`` spec the span comes from, named in the
    message)."""
    where = f"layout spec {spec!r}: " if spec else ""
    num, offset = ("num_ranks", "rank_offset") if spec else ("--num-ranks", "--rank-offset")
    if num_ranks < 1:
        raise ValueError(f"{where}{num} must be a positive integer, got {num_ranks}")
    if rank_offset < 0:
        raise ValueError(
            f"{where}{offset} must be a non-negative integer "
            f"(the layout's first rank), got {rank_offset}"
        )
    if world_size is None:
        return
    if world_size < 1:
        raise ValueError(f"--world-size must be a positive integer, got {world_size}")
    stop = rank_offset + num_ranks
    if stop > world_size:
        raise ValueError(
            f"{where}the layout spans ranks {rank_offset}-{stop - 1} ({offset} "
            f"{rank_offset} + {num} {num_ranks}), past the end of --world-size {world_size}"
        )


def add_placement_arguments(
    parser: argparse.ArgumentParser,
    *,
    gpus_per_node_help: str | None = None,
    check: bool = True,
) -> None:
    """The options of the node-placement check.

    ``--gpus-per-node``, ``--intra-node`` and (with ``check``) ``--check``."""
    from pgregistry.placement import DEFAULT_INTRA_NODE_KINDS

    group = parser.add_argument_group("placement on nodes")
    group.add_argument(
        "--gpus-per-node",
        type=int,
        default=None,
        metavar="N",
        help=gpus_per_node_help
        or "ranks per node (rank r runs on node r // N): report how many nodes each kind's "
        "groups span and warn when a kind of --intra-node crosses nodes",
    )
    group.add_argument(
        "--intra-node",
        default=",".join(DEFAULT_INTRA_NODE_KINDS),
        metavar="KINDS",
        help=(
            "comma-separated kinds whose groups should stay "
            "on one node (default: %(default)s; '' for none)"
        ),
    )
    if check:
        group.add_argument(
            "--check",
            action="store_true",
            help="exit 1 when a kind of --intra-node crosses nodes (needs --gpus-per-node)",
        )


def intra_node_kinds(args: argparse.Namespace) -> tuple[str, ...]:
    """The kinds of ``--intra-node`` (:func:`pgregistry.placement.place` refuses unknown names)."""
    return tuple(kind.strip() for kind in args.intra_node.split(",") if kind.strip())


def positive_seconds(text: str) -> float:
    """An argparse ``type``: a positive, finite number of seconds.

    A collective timeout of 0 would fail at once.
    """
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text}")
    return value


def non_negative(text: str) -> float:
    """An argparse ``type``: a finite number, 0 or more.

    A NaN compares false with every limit, so it would be no limit, silently."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not (value >= 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a finite number, 0 or more, got {text}")
    return value


def check_output_file(path: str | Path) -> None:
    """``ValueError`` (naming ``--json``) unless ``path`` can be written as a new or existing file.

    Checked before a run, not after minutes of it."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"--json {path} is a directory; give a file name")
    parent = path.parent
    if not parent.is_dir():
        raise ValueError(f"--json {path}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise ValueError(f"--json {path} is not writable")

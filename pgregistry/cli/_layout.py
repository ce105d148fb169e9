"""``pgregistry layout``: the groups a layout creates, without creating any.

Prints every group kind (which grid and axes it spans, how many groups, their size, the first few)
and, with ``--rank``, that rank's coordinates and groups; ``--json`` gives the same for tools. A
layout over part of the world (``--rank-offset``, ``--world-size``) is shown with its global ranks
throughout. Invalid sizes exit 2 with the layout's own message, and so does a layout whose listing
would not fit in the memory available (estimated from the layout's arithmetic before anything is
enumerated, instead of dying in the allocator). Torch is imported only inside the handler (the
layout arithmetic needs it), as the CLI table requires.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING, Any

from pgregistry.cli import _layout_views as layout_views
from pgregistry.cli._columns import align_columns
from pgregistry.cli._limits import memory_shortfall, not_enough_memory
from pgregistry.cli._options import (
    Subparsers,
    add_layout_arguments,
    add_placement_arguments,
    check_not_empty,
    layout_from_args,
)

if TYPE_CHECKING:
    from pgregistry.layout import ParallelLayout

__all__ = ["add_command"]


def add_command(subparsers: Subparsers) -> None:
    """Register the ``layout`` sub-command."""
    parser = subparsers.add_parser(
        "layout",
        help="print the process groups a parallel layout creates",
        description=(
            "Enumerate every group kind of a layout (Megatron-Core's rank arithmetic) "
            "without creating process groups: number of groups, group size and the "
            "first groups; with --rank, one rank's coordinates and groups."
        ),
    )
    add_layout_arguments(parser)
    parser.add_argument(
        "--rank",
        type=int,
        default=None,
        help="also show this (global) rank's coordinates and groups",
    )
    parser.add_argument(
        "--show", type=int, default=3, help="how many groups of each kind to list (default 3)"
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    add_placement_arguments(parser)
    views = parser.add_argument_group("pictures and comparison")
    views.add_argument(
        "--svg",
        metavar="FILE",
        help=(
            "draw the layout on its nodes as SVG: placement table, rank map "
            "with coordinates, one panel per kind (needs --gpus-per-node)"
        ),
    )
    views.add_argument(
        "--html", metavar="FILE", help="the same picture as an HTML page (needs --gpus-per-node)"
    )
    views.add_argument(
        "--highlight",
        metavar="KINDS",
        help=(
            "comma-separated kinds to draw as panels, one per view "
            "(default: every kind whose groups have more than one rank)"
        ),
    )
    views.add_argument(
        "--compare",
        nargs=2,
        metavar=("A", "B"),
        help=(
            "compare two layouts instead of the one of --tp ... --order, e.g. "
            "policy:tp=2,ep=4,expt_tp=1 reference:tp=4 (NAME: optional; keys tp cp pp "
            "ep expt_tp gtp_remat expt_gtp_remat order, and num_ranks rank_offset for "
            "a span of its own: default --num-ranks from --rank-offset): what differs, "
            "which communicators they share; --svg/--html draw them side by side"
        ),
    )
    parser.set_defaults(handler=_run_layout)


_PATH_AND_LIST_OPTIONS = {
    "svg": ("--svg", "a file name, or leave the option out"),
    "html": ("--html", "a file name, or leave the option out"),
    "highlight": (
        "--highlight",
        "comma-separated kinds, or leave the option out to draw every kind",
    ),
    "compare": (
        "--compare",
        "two layout specs such as tp=2,ep=4 and tp=4 (a spec of defaults: tp=1)",
    ),
}
"""The options of ``layout`` whose empty value would pass as the option left out (``--svg ''`` drew
nothing, ``--compare '' ''`` compared two default layouts)."""


def _run_layout(args: argparse.Namespace) -> int:
    try:
        if args.show < 0:
            raise ValueError(f"--show must be non-negative, got {args.show}")
        check_not_empty(args, _PATH_AND_LIST_OPTIONS)
        layout_views.check_view_arguments(args)
        if args.compare:
            return layout_views.run_compare(args)
        layout = layout_from_args(args)
        _check_memory(layout, args.show, args.rank)
        report = _layout_report(layout, args.show, args.rank, args.world_size)
        placement = layout_views.placement_of(layout, args)
        if placement is not None:
            report["placement"] = layout_views.placement_report(layout, placement)
            if args.rank is not None:
                report["rank"]["node"] = args.rank // placement.gpus_per_node
        layout_views.write_pictures(args, layout, placement)
    except (ValueError, OSError) as exc:
        print(f"pgregistry layout: error: {exc}", file=sys.stderr)
        return 2
    text = _format_report(report, layout)
    if placement is not None:
        text += "\n\n" + layout_views.placement_table(report["placement"])
    print(json.dumps(report) if args.json else text)
    return layout_views.warn_and_check(args, [placement] if placement else [])


# Measured with ru_maxrss at 2**24 and 2**25 ranks on four layouts: enumerating every kind peaked at
# 8.1 to 24.3 bytes per rank (up to three int64 copies of the world), and each listed rank cost 40
# to 51 bytes (a Python int in a list, then its JSON text). About 1.3 times the largest of each, to
# stay on the safe side.
_ENUMERATION_BYTES_PER_RANK = 32
_LISTED_BYTES_PER_RANK = 64


def _check_memory(layout: ParallelLayout, show: int, rank: int | None) -> None:
    """``ValueError`` when the report would need more memory than is available.

    Estimated from the layout's shapes alone; its advice names the option that would help, if any
    does."""
    from pgregistry.layout import GROUP_KINDS

    shapes = [layout.group_shape(kind) for kind in GROUP_KINDS]
    shown = sum(min(show, count) * size for count, size in shapes)
    of_rank = sum(size for _, size in shapes) if rank is not None else 0
    enumeration = _ENUMERATION_BYTES_PER_RANK * layout.num_ranks

    def bytes_needed(listed: int) -> int:
        return enumeration + _LISTED_BYTES_PER_RANK * listed

    available = memory_shortfall(bytes_needed(shown + of_rank))
    if available is None:
        return
    if enumeration > available:
        advice = (
            f"enumerating the groups alone needs about {enumeration / 2**30:.1f} "
            "GiB, whatever --show and --rank say: run it where more memory is free"
        )
    elif shown and bytes_needed(of_rank) <= available:
        advice = "lower --show (--show 0 prints only the group counts and sizes)"
    elif of_rank and bytes_needed(shown) <= available:
        advice = "leave out --rank (it lists that rank's groups in full)"
    else:
        advice = "use --show 0 and leave out --rank"
    doing = f"listing {layout.num_ranks} ranks ({shown + of_rank} of them printed)"
    raise not_enough_memory(doing, bytes_needed(shown + of_rank), available, advice)


def _layout_report(
    layout: ParallelLayout, show: int, rank: int | None, world_size: int | None
) -> dict[str, Any]:
    from pgregistry.layout import DENSE_GROUP_KINDS, EXPERT_GROUP_KINDS, GROUP_KINDS

    kinds: dict[str, Any] = {}
    for kind in GROUP_KINDS:
        groups = layout.groups_tensor(kind)  # one tensor per kind, even at 100k+ ranks
        if kind in DENSE_GROUP_KINDS:
            spans = f"dense {'-'.join(DENSE_GROUP_KINDS[kind])}"
        elif kind in EXPERT_GROUP_KINDS:
            spans = f"expert {'-'.join(EXPERT_GROUP_KINDS[kind])}"
        else:
            spans = "pp first+last" if kind == "embd" else "pp first"
        kinds[kind] = {
            "spans": spans,
            "groups": int(groups.shape[0]),
            "size": int(groups.shape[1]),
            "first": groups[:show].tolist(),
        }
    first = layout.rank_offset
    report: dict[str, Any] = {
        "layout": {
            "num_ranks": layout.num_ranks,
            "rank_offset": first,
            "world_size": world_size,
            "order": layout.order,
            **layout.axis_sizes(),
            "fingerprint": layout.fingerprint(),
        },
        "kinds": kinds,
    }
    if rank is not None:
        groups_of = layout.groups_of(rank)
        report["rank"] = {
            "rank": rank,
            "coords": layout.coords(rank),
            "groups": {kind: None if g is None else list(g) for kind, g in groups_of.items()},
        }
    return report


_SHOWN_RANKS = 8


def _format_group(group: list[int]) -> str:
    """A group for the table: in full up to 8 ranks, else its first ranks, last one and size."""
    if len(group) <= _SHOWN_RANKS:
        return "[" + ", ".join(map(str, group)) + "]"
    head = ", ".join(map(str, group[: _SHOWN_RANKS - 2]))
    return f"[{head}, ..., {group[-1]}]({len(group)})"


def _format_report(report: dict[str, Any], layout: ParallelLayout) -> str:
    sizes = report["layout"]
    first, stop, world = (
        sizes["rank_offset"],
        sizes["rank_offset"] + sizes["num_ranks"],
        sizes["world_size"],
    )
    span = (
        ""
        if (first, stop) == (0, world or stop)
        else f" (ranks {first}-{stop - 1}" + (f" of the {world}-rank world)" if world else ")")
    )
    lines = [
        f"layout: {sizes['num_ranks']} ranks{span}, order {sizes['order']}; "
        + ", ".join(f"{axis} {size}" for axis, size in layout.axis_sizes().items())
        + f"; fingerprint {sizes['fingerprint']}",
        "",
    ]
    rows = [("kind", "spans", "groups", "size", "first groups")]
    for kind, info in report["kinds"].items():
        first = " ".join(_format_group(g) for g in info["first"])
        if info["groups"] > len(info["first"]):
            first += " ..."
        rows.append((kind, info["spans"], str(info["groups"]), str(info["size"]), first))
    lines += align_columns(rows, numeric=(2, 3))
    mine = report.get("rank")
    if mine is not None:
        coords = ", ".join(f"{axis} {value}" for axis, value in mine["coords"].items())
        node = f" (node {mine['node']})" if "node" in mine else ""
        lines += ["", f"rank {mine['rank']}{node}: {coords}", ""]
        group_rows = [("kind", "group")]
        group_rows += [
            (kind, "-" if group is None else _format_group(group))
            for kind, group in mine["groups"].items()
        ]
        lines += align_columns(group_rows, numeric=())
    return "\n".join(lines)

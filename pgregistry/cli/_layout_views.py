"""The node-placement, picture and comparison options of ``pgregistry layout``.

``--gpus-per-node N`` adds a placement table (how many nodes each kind's groups span, how many
communicators a rank joins) and warns on stderr when a kind of ``--intra-node`` crosses nodes;
``--check`` turns that warning into exit
1. ``--svg`` / ``--html`` write the picture of :mod:`pgregistry.cli._layout_svg`. ``--compare A B``
   compares two layouts
given as ``NAME:key=value,...`` specs, each over ``--num-ranks`` ranks from ``--rank-offset`` unless
its spec gives its own ``num_ranks`` / ``rank_offset``, in one world (``--world-size``, default:
where the later span ends). Usage errors raise ``ValueError`` naming the option or spec at fault
(the command exits 2).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pgregistry._source.storage import atomic_write
from pgregistry.cli._columns import align_columns
from pgregistry.cli._limits import memory_shortfall, not_enough_memory
from pgregistry.cli._options import check_span, intra_node_kinds

if TYPE_CHECKING:
    from pgregistry.layout import ParallelLayout
    from pgregistry.placement import Placement

__all__ = [
    "check_view_arguments",
    "parse_layout_spec",
    "placement_of",
    "placement_report",
    "placement_table",
    "run_compare",
    "warn_and_check",
    "write_pictures",
]

# Spec key -> ParallelLayout argument (dashes accepted as on the command line).
_SPEC_KEYS = {
    "tp": "tp",
    "cp": "cp",
    "pp": "pp",
    "ep": "ep",
    "expt_tp": "expt_tp",
    "gtp_remat": "gtp_remat",
    "expt_gtp_remat": "expt_gtp_remat",
    "order": "order",
    "num_ranks": "num_ranks",
    "rank_offset": "rank_offset",
}
_LAYOUT_FLAGS = {
    "tp": 1,
    "cp": 1,
    "pp": 1,
    "ep": 1,
    "expt_tp": None,
    "gtp_remat": 1,
    "expt_gtp_remat": 1,
    "order": None,
}


def check_view_arguments(args: argparse.Namespace) -> None:
    """``ValueError`` for option combinations that cannot mean what the user wants."""
    drawing = [
        flag
        for flag, value in (("--svg", args.svg), ("--html", args.html), ("--check", args.check))
        if value
    ]
    if drawing and args.gpus_per_node is None:
        raise ValueError(f"{drawing[0]} needs --gpus-per-node")
    if args.highlight and not (args.svg or args.html):
        raise ValueError("--highlight chooses the panels of --svg/--html; give one of them")
    if args.compare:
        if args.rank is not None:
            raise ValueError("--rank shows one layout; it does not combine with --compare")
        given = [
            f"--{flag.replace('_', '-')}"
            for flag, default in _LAYOUT_FLAGS.items()
            if getattr(args, flag) != default
        ]
        if given:
            raise ValueError(f"--compare takes both layouts as specs; drop {', '.join(given)}")
        if args.highlight:
            raise ValueError(
                "--highlight does not combine with --compare (every kind is drawn side by side)"
            )


def placement_of(
    layout: ParallelLayout,
    args: argparse.Namespace,
    world_size: int | None = None,
) -> Placement | None:
    """The placement ``--gpus-per-node`` and ``--intra-node`` ask for.

    ``None`` without ``--gpus-per-node``; in a world of ``world_size`` ranks (default
    ``--world-size``, else where the layout ends), which must be whole nodes."""
    from pgregistry.placement import place

    if args.gpus_per_node is None:
        return None
    world = world_size or args.world_size
    _check_whole_nodes(layout, args, world)
    return place(layout, args.gpus_per_node, intra_node_kinds(args), world_size=world)


def _check_whole_nodes(layout: ParallelLayout, args: argparse.Namespace, world: int | None) -> None:
    """``ValueError`` naming the options when the world is not whole nodes of ``--gpus-per-node``.

    A launcher starts the same number of ranks on every node; a span may start and end mid-node."""
    g = args.gpus_per_node
    if g < 1:
        raise ValueError(f"--gpus-per-node must be a positive integer, got {g}")
    first, stop = layout.rank_range()
    if (world or stop) % g == 0:
        return
    if args.world_size is not None:
        whose = f"--world-size {args.world_size}"
    elif world is not None:  # --compare: where the later span ends
        whose = (
            "the world, taken to end where the later layout does "
            f"({world} ranks; give --world-size when larger),"
        )
    elif first == 0:
        whose = f"--num-ranks {layout.num_ranks}"
    else:
        whose = (
            f"the world, taken to end where the layout does (--rank-offset {first} + --num-ranks "
            f"{layout.num_ranks} = {stop} ranks; give --world-size when larger),"
        )
    raise ValueError(
        f"{whose} is not a multiple of --gpus-per-node {g}: "
        "launchers start the same number of ranks on every node"
    )


def placement_report(layout: ParallelLayout, placement: Placement) -> dict[str, Any]:
    """The placement as plain data (the ``placement`` entry of ``--json``).

    Communicators per rank are counted over the layout's ranks."""
    from pgregistry._runtime.communicators import communicators_per_rank, kinds_by_communicator

    per_rank = communicators_per_rank(kinds_by_communicator(layout), range(*layout.rank_range()))
    return {
        "gpus_per_node": placement.gpus_per_node,
        "world_size": placement.world_size,
        "num_nodes": placement.num_nodes,
        "first_node": placement.first_node,
        "shared_nodes": list(placement.shared_nodes),
        "nodes": placement.describe_nodes(),
        "intra_node_kinds": [
            entry.kind for entry in placement.kinds if entry.should_stay_intra_node
        ],
        "communicators_per_rank": {"min": min(per_rank), "max": max(per_rank)},
        "kinds": {
            entry.kind: {
                "groups": entry.num_groups,
                "size": entry.group_size,
                "min_nodes": entry.min_nodes,
                "max_nodes": entry.max_nodes,
                "crossing_groups": entry.crossing_groups,
                "first_crossing": None
                if entry.first_crossing is None
                else list(entry.first_crossing),
                "within_node": entry.within_node,
                "violated": entry.violated,
                "verdict": entry.verdict,
            }
            for entry in placement.kinds
        },
        "warnings": placement.warnings(),
    }


def _range_text(low: int, high: int) -> str:
    """``low``, or ``low-high`` when they differ."""
    return str(low) if low == high else f"{low}-{high}"


def placement_table(report: dict[str, Any]) -> str:
    """The placement report as text."""
    g = report["gpus_per_node"]
    span = report["nodes"].startswith("ranks ")  # a layout over part of the world
    per_rank = report["communicators_per_rank"]
    joins = _range_text(per_rank["min"], per_rank["max"])
    lines = [
        f"placement: {report['nodes']} (rank r on node r // {g}); each rank "
        f"{'of the layout ' * span}joins {joins} communicators; should stay "
        f"on one node: {', '.join(report['intra_node_kinds']) or 'none'}",
        "",
    ]
    rows = [("kind", "groups", "size", "nodes/group", "placement")]
    for kind, info in report["kinds"].items():
        nodes_per_group = _range_text(info["min_nodes"], info["max_nodes"])
        rows.append(
            (kind, str(info["groups"]), str(info["size"]), nodes_per_group, info["verdict"])
        )
    return "\n".join(lines + align_columns(rows, numeric=(1, 2, 3)))


def write_pictures(
    args: argparse.Namespace, layout: ParallelLayout, placement: Placement | None
) -> None:
    """Write ``--svg`` / ``--html`` of one layout."""
    from pgregistry.cli._layout_svg import render_svg

    if not (args.svg or args.html):
        return
    assert placement is not None, "check_view_arguments requires --gpus-per-node for pictures"
    kinds = (
        [kind.strip() for kind in args.highlight.split(",") if kind.strip()]
        if args.highlight
        else None
    )
    first, stop = layout.rank_range()
    title = f"pgregistry layout: {layout.num_ranks} ranks ({first}-{stop - 1})"
    _write_svg_and_html(args, render_svg(placement, kinds), title)


def _write_svg_and_html(args: argparse.Namespace, svg: str, title: str) -> None:
    from pgregistry.cli._layout_svg import svg_to_html

    # Through a temporary file and a rename: never a half-written picture.
    if args.svg:
        atomic_write(Path(args.svg), svg.encode("utf-8"), durable=False, make_parents=False)
    if args.html:
        html = svg_to_html(svg, title).encode("utf-8")
        atomic_write(Path(args.html), html, durable=False, make_parents=False)


def warn_and_check(
    args: argparse.Namespace, placements: list[Placement], names: tuple[str, ...] = ()
) -> int:
    """Print every placement warning on stderr; 1 under ``--check`` when there was one, else 0."""
    warned = False
    for i, placement in enumerate(placements):
        prefix = f"{names[i]}: " if names else ""
        for message in placement.warnings():
            print(f"pgregistry layout: warning: {prefix}{message}", file=sys.stderr)
            warned = True
    return 1 if args.check and warned else 0


def parse_layout_spec(
    spec: str,
    num_ranks: int,
    default_name: str,
    rank_offset: int = 0,
    world_size: int | None = None,
) -> tuple[str, ParallelLayout]:
    """``NAME:key=value,...`` (``NAME:`` optional) -> (name, layout); ``ValueError`` when bad.

    The layout is over ``num_ranks`` ranks from ``rank_offset`` unless the spec gives its own
    ``num_ranks`` / ``rank_offset``; the ``ValueError`` names the bad part, and the spec whose span
    ends past ``world_size``."""
    from pgregistry.layout import ParallelLayout

    name, _, body = spec.rpartition(":") if ":" in spec else (default_name, "", spec)
    sizes: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in body.split(","))):
        key, equals, value = item.partition("=")
        key = key.strip().replace("-", "_")
        if not equals or key not in _SPEC_KEYS:
            raise ValueError(
                f"layout spec {spec!r}: {item!r} is not KEY=VALUE "
                f"with KEY one of {', '.join(_SPEC_KEYS)}"
            )
        if key in sizes:
            raise ValueError(f"layout spec {spec!r} gives {key} twice")
        if key == "order":
            sizes[key] = value.strip()
            continue
        try:
            sizes[key] = int(value)
        except ValueError:
            raise ValueError(
                f"layout spec {spec!r}: {key} must be an integer, got {value.strip()!r}"
            ) from None
    sizes.setdefault("num_ranks", num_ranks)
    sizes.setdefault("rank_offset", rank_offset)
    check_span(sizes["num_ranks"], sizes["rank_offset"], world_size, spec)
    try:
        return name.strip() or default_name, ParallelLayout(**sizes)
    except ValueError as exc:
        raise ValueError(f"layout spec {spec!r}: {exc}") from None


# Measured at 16384 ranks with tracemalloc on four pairs of layouts: comparing held 143 to 884 bytes
# a rank of each layout (every group as a tuple of Python ints, and its kinds); with ru_maxrss
# between 65536 and 262144 ranks, at most 613. About 2.3 times the largest, to be safe.
_COMPARE_BYTES_PER_RANK = 2048


def _check_compare_memory(a: ParallelLayout, b: ParallelLayout) -> None:
    """``ValueError`` when comparing ``a`` and ``b`` would need more memory than is available.

    Estimated from their sizes before anything is enumerated: without it a comparison of 2**30
    ranks held 21 GiB in its first minute, still enumerating."""
    needed = _COMPARE_BYTES_PER_RANK * (a.num_ranks + b.num_ranks)
    available = memory_shortfall(needed)
    if available is not None:
        raise not_enough_memory(
            f"comparing layouts of {a.num_ranks} and {b.num_ranks} ranks",
            needed,
            available,
            "every group of both is enumerated: compare smaller layouts (a share of the world "
            "with the same sizes shows the same groups), or run it where more memory is free",
        )


def run_compare(args: argparse.Namespace) -> int:
    """``pgregistry layout --compare A B``: what differs between two layouts.

    Also the communicators they share (and pictures, placement), in one world of ``--world-size``
    ranks (default: where the later span ends)."""
    from pgregistry._runtime.communicators import compare_layouts
    from pgregistry.cli._layout_svg import render_compare_svg

    check_span(
        args.num_ranks, args.rank_offset, None
    )  # the default span; each spec's is checked as it is parsed
    (name_a, a), (name_b, b) = (
        parse_layout_spec(spec, args.num_ranks, default, args.rank_offset, args.world_size)
        for spec, default in zip(args.compare, ("A", "B"), strict=True)
    )
    if name_a == name_b:
        raise ValueError(f"both layouts are named {name_a!r}; name them NAME:sizes")
    names = (name_a, name_b)
    _check_compare_memory(a, b)
    comparison = compare_layouts(a, b, world_size=args.world_size)
    world = comparison.world_size
    placements = [
        p for p in (placement_of(a, args, world), placement_of(b, args, world)) if p is not None
    ]
    if args.svg or args.html:
        svg = render_compare_svg(comparison, args.gpus_per_node, names)
        _write_svg_and_html(args, svg, f"pgregistry layout --compare {name_a} {name_b}")
    shared = comparison.group_shared_by_kinds()
    overlap = comparison.overlap
    per_rank = comparison.communicators_per_rank()
    report: dict[str, Any] = {
        "world_size": world,
        "layouts": {
            name: {
                "num_ranks": layout.num_ranks,
                "rank_offset": layout.rank_offset,
                "sizes": layout.axis_sizes(),
                "order": layout.order,
                "communicators": len(comms),
            }
            for name, layout, comms in ((name_a, a, comparison.a), (name_b, b, comparison.b))
        },
        "differences": [
            {"what": what, name_a: in_a, name_b: in_b}
            for what, in_a, in_b in comparison.differences()
        ],
        "overlap": [overlap.start, overlap.stop] if overlap else None,
        "communicators_per_rank": {"min": min(per_rank), "max": max(per_rank)},
        "shared": len(comparison.shared),
        "shared_by_kinds": [
            {
                "count": row.count,
                "size": row.size,
                name_a: list(row.kinds_a),
                name_b: list(row.kinds_b),
            }
            for row in shared
        ],
    }
    if placements:
        report["placement"] = {
            name: placement_report(layout, placement)
            for name, layout, placement in zip(names, (a, b), placements, strict=True)
        }
    if args.json:
        print(json.dumps(report))
    else:
        print(_compare_table(report, names))
    return warn_and_check(args, placements, names)


def _compare_table(report: dict[str, Any], names: tuple[str, str]) -> str:
    a, b = (report["layouts"][name]["communicators"] for name in names)
    world = report["world_size"]
    lines = [f"compare on {world} ranks:"]
    for name in names:
        info = report["layouts"][name]
        first, stop = info["rank_offset"], info["rank_offset"] + info["num_ranks"]
        span = "" if (first, stop) == (0, world) else f"ranks {first}-{stop - 1}; "
        sizes = [f"{axis} {size}" for axis, size in info["sizes"].items() if size > 1] or [
            "every axis 1"
        ]
        lines.append(f"  {name}: {span}{', '.join(sizes)}; order {info['order']}")
    differences = [
        f"{row['what']} ({row[names[0]]} / {row[names[1]]})" for row in report["differences"]
    ]
    lines.append(f"differ in: {', '.join(differences)}" if differences else "the same layout twice")
    if report["overlap"] is None:
        lines.append("their spans are disjoint: no communicator can be shared")
    per_rank = report["communicators_per_rank"]
    joins = _range_text(per_rank["min"], per_rank["max"])
    created = f"{a + b - report['shared']}, not {a + b}" if report["shared"] else f"{a + b}"
    lines += [
        f"{names[0]}: {a} communicators, {names[1]}: {b}, shared: {report['shared']} "
        f"(the registry creates {created}); each rank of the world joins {joins} of them",
        "",
    ]
    rows = [("shared", "ranks", f"kinds in {names[0]}", f"kinds in {names[1]}")]
    rows += [
        (str(row["count"]), str(row["size"]), ", ".join(row[names[0]]), ", ".join(row[names[1]]))
        for row in report["shared_by_kinds"]
    ]
    lines += (
        align_columns(rows, numeric=(0, 1))
        if report["shared_by_kinds"]
        else ["no communicator is shared"]
    )
    for name, placement in report.get("placement", {}).items():
        lines += ["", f"{name} " + placement_table(placement)]
    return "\n".join(lines)

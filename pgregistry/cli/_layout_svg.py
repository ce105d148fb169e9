"""A picture of a layout on its nodes: SVG (or an HTML page holding it).

Written with the standard library only.

The sheet shows, top to bottom: the placement table (every kind, its groups, how many nodes a group
spans, a red mark on kinds that should stay on one node and do not), a rank map (nodes as boxes,
each rank labelled with its coordinates) and one small panel per group kind in which every group has
its own colour, and the groups of a kind that should stay on one node but cross a node boundary are
outlined in red. :func:`render_compare_svg` draws two layouts of one world side by side, the
communicators they share in full colour and the others faded.

A layout over a span of the world (``rank_offset``) is drawn on the nodes its global ranks run on:
whole nodes, the ranks of a node outside the span drawn as empty cells (class ``outside``), so a
span that starts or ends mid-node shows which ranks it shares the node with. At most
:data:`MAX_DRAWN_RANKS` ranks are drawn (whole nodes, from the first node of the layout): a larger
layout is summarised by its table, which covers every rank, and its first nodes, with a note saying
so. Every drawn element carries ``data-*`` attributes (rank, node, group, kind) so tools and tests
can read the picture back.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Final
from xml.sax.saxutils import escape, quoteattr

import attrs

from pgregistry.layout import GROUP_KINDS
from pgregistry.placement import KindPlacement, Placement, node_of

if TYPE_CHECKING:
    from pgregistry._runtime.communicators import LayoutComparison
    from pgregistry.layout import ParallelLayout

__all__ = ["MAX_DRAWN_RANKS", "render_compare_svg", "render_svg", "svg_to_html"]

MAX_DRAWN_RANKS: Final = 256
"""Worlds larger than this are summarised: the table has every rank, the drawing the first nodes."""

_SHEET_WIDTH: Final = 1360
_MARGIN: Final = 20
_PAD: Final = 4
_GAP: Final = 10
_NODE_LABEL_H: Final = 13
_ROW_H: Final = 17
_RED: Final = "#c62828"
_GREEN: Final = "#2e7d32"
_FONT: Final = "font-family:DejaVu Sans,Helvetica,Arial,sans-serif"

# Short names for the coordinates in a rank's label; the legend spells them out.
_DENSE_AXES: Final = (("tp", "tp"), ("gtp_remat", "gtp"), ("cp", "cp"), ("dp", "dp"), ("pp", "pp"))
_EXPERT_AXES: Final = (
    ("ep", "ep"),
    ("expt_tp", "expt_tp"),
    ("expt_gtp_remat", "egtp"),
    ("expt_dp", "edp"),
)


# ----------------------------------------------------------------------------------------- geometry


@attrs.frozen(slots=True, kw_only=True)
class _NodeGrid:
    """Where the drawn ``nodes`` and their rank cells go inside a box at most ``max_width`` wide."""

    nodes: range
    gpus_per_node: int
    cell_w: int
    cell_h: int
    max_width: int

    @property
    def cols_in_node(self) -> int:
        return max(1, min(self.gpus_per_node, 16, (self.max_width - 2 * _PAD) // self.cell_w))

    @property
    def node_w(self) -> int:
        return self.cols_in_node * self.cell_w + 2 * _PAD

    @property
    def node_h(self) -> int:
        return (
            _NODE_LABEL_H
            + math.ceil(self.gpus_per_node / self.cols_in_node) * self.cell_h
            + 2 * _PAD
        )

    @property
    def nodes_per_row(self) -> int:
        return max(1, (self.max_width + _GAP) // (self.node_w + _GAP))

    @property
    def num_nodes(self) -> int:
        return len(self.nodes)

    @property
    def width(self) -> int:
        per_row = min(self.nodes_per_row, self.num_nodes)
        return per_row * self.node_w + (per_row - 1) * _GAP

    @property
    def height(self) -> int:
        rows = math.ceil(self.num_nodes / self.nodes_per_row)
        return rows * self.node_h + (rows - 1) * _GAP

    def node_origin(self, node: int) -> tuple[int, int]:
        row, col = divmod(node - self.nodes.start, self.nodes_per_row)
        return col * (self.node_w + _GAP), row * (self.node_h + _GAP)

    def cell_origin(self, rank: int) -> tuple[int, int]:
        nx, ny = self.node_origin(node_of(rank, self.gpus_per_node))
        row, col = divmod(rank % self.gpus_per_node, self.cols_in_node)
        return nx + _PAD + col * self.cell_w, ny + _NODE_LABEL_H + _PAD + row * self.cell_h


def _drawn_nodes(first: int, stop: int, gpus_per_node: int) -> range:
    """The whole nodes holding ranks ``first`` to ``stop - 1`` that fit in one picture.

    From the first one, at most :data:`MAX_DRAWN_RANKS` ranks (one node at least)."""
    first_node, last_node = node_of(first, gpus_per_node), node_of(stop - 1, gpus_per_node)
    most = max(1, MAX_DRAWN_RANKS // gpus_per_node)
    return range(first_node, min(last_node + 1, first_node + most))


def _ranks_of(nodes: range, gpus_per_node: int) -> range:
    return range(nodes.start * gpus_per_node, nodes.stop * gpus_per_node)


def _panel_cell(drawn: int) -> int:
    return 30 if drawn <= 16 else 22 if drawn <= 64 else 14


# ------------------------------------------------------------------------------------------ drawing


def _svg_attributes(**values: object) -> str:
    return " ".join(
        f"{name.rstrip('_').replace('_', '-')}={quoteattr(str(v))}" for name, v in values.items()
    )


class _Svg:
    """Collects SVG elements; ``y`` is where the next section starts."""

    def __init__(self) -> None:
        self.parts: list[str] = []
        self.y = _MARGIN
        self.width = _SHEET_WIDTH

    def open(self, tag: str, **values: object) -> None:
        self.parts.append(f"<{tag} {_svg_attributes(**values)}>")

    def close(self, tag: str) -> None:
        self.parts.append(f"</{tag}>")

    def rect(self, x: float, y: float, w: float, h: float, **values: object) -> None:
        self.parts.append(f"<rect {_svg_attributes(x=x, y=y, width=w, height=h, **values)}/>")

    def text(self, x: float, y: float, content: str, size: int = 11, **values: object) -> None:
        self.parts.append(
            f"<text {_svg_attributes(x=x, y=y, font_size=size, **values)}>{escape(content)}</text>"
        )

    def title(self, content: str) -> None:
        """A tooltip for the enclosing element."""
        self.parts.append(f"<title>{escape(content)}</title>")

    def heading(self, content: str, size: int = 14) -> None:
        self.y += size + 6
        self.text(_MARGIN, self.y, content, size=size, font_weight="bold")
        self.y += 8

    def document(self, title: str) -> str:
        height = self.y + _MARGIN
        return "\n".join(
            [
                '<?xml version="1.0" encoding="UTF-8"?>',
                f'<svg xmlns="http://www.w3.org/2000/svg" width="{self.width}" height="{height}" '
                f'viewBox="0 0 {self.width} {height}" style="{_FONT}">',
                f"<title>{escape(title)}</title>",
                f'<rect x="0" y="0" width="{self.width}" height="{height}" fill="white"/>',
                *self.parts,
                "</svg>",
                "",
            ]
        )


def _group_colour(group: int) -> str:
    """Distinct neighbouring colours: hues a golden angle apart.

    The lightness cycles so close hues still differ.
    """
    return f"hsl({group * 137.508 % 360:.1f},62%,{(68, 56, 82)[group % 3]}%)"


def _draw_nodes(
    svg: _Svg, grid: _NodeGrid, x: int, y: int, draw_cell: Callable[[int, int, int], None]
) -> None:
    """Node boxes of ``grid`` at (x, y), each holding its ranks' cells.

    Cells are drawn by ``draw_cell(rank, cx, cy)``.
    """
    g = grid.gpus_per_node
    for node in grid.nodes:
        nx, ny = grid.node_origin(node)
        first, last = node * g, (node + 1) * g - 1
        svg.open("g", class_="node", data_node=node)
        svg.rect(
            x + nx,
            y + ny,
            grid.node_w,
            grid.node_h,
            class_="node-box",
            fill="#f7f7f7",
            stroke="#555",
            stroke_width=1,
            rx=3,
        )
        label = f"node {node}: {first}-{last}" if grid.node_w >= 90 else f"n{node}"
        svg.text(
            x + nx + _PAD,
            y + ny + _NODE_LABEL_H - 2,
            label,
            size=9,
            class_="node-label",
            fill="#333",
        )
        for rank in range(first, last + 1):
            cx, cy = grid.cell_origin(rank)
            draw_cell(rank, x + cx, y + cy)
        svg.close("g")


def _summary_note(
    svg: _Svg, num_ranks: int, drawn: range, num_nodes: int, gpus_per_node: int
) -> None:
    """A note when the ``drawn`` nodes are fewer than the ``num_nodes`` the ranks run on."""
    if len(drawn) < num_nodes:
        ranks = _ranks_of(drawn, gpus_per_node)
        svg.y += 14
        svg.text(
            _MARGIN,
            svg.y,
            (
                f"Drawn: ranks {ranks.start}-{ranks.stop - 1} ({len(drawn)} of {num_nodes} nodes); "
                f"the table covers all {num_ranks} ranks. Groups continue beyond the drawn nodes."
            ),
            size=12,
            class_="summary-note",
            fill=_RED,
        )
        svg.y += 6


def _span_label(layout: ParallelLayout, world_size: int) -> str:
    """``"ranks 4-7 · "`` for a layout over part of the world, ``""`` for one over all of it."""
    first, stop = layout.rank_range()
    return "" if (first, stop) == (0, world_size) else f"ranks {first}-{stop - 1} · "


# ---------------------------------------------------------------------------------------- the sheet


def render_svg(placement: Placement, kinds: Sequence[str] | None = None) -> str:
    """The sheet of a placed layout as an SVG document.

    ``kinds`` chooses the group kinds drawn as panels (default: every kind whose groups have more
    than one rank); ``ValueError`` for an unknown kind.
    """
    layout = placement.layout
    panels = _panel_kinds(placement, kinds)
    g = placement.gpus_per_node
    drawn = _drawn_nodes(*layout.rank_range(), g)
    svg = _Svg()
    span = _span_label(layout, placement.world_size)
    if span:
        first, stop = layout.rank_range()
        title = (
            f"pgregistry layout: ranks {first}-{stop - 1} "
            f"of a world of {placement.world_size} ranks"
        )
    else:
        title = f"pgregistry layout: {layout.num_ranks} ranks on {placement.describe_nodes()}"
    svg.heading(title, size=18)
    if span:  # where the span lies: its nodes, and the ranks outside it it shares them with
        svg.text(
            _MARGIN,
            svg.y + 6,
            placement.describe_nodes(),
            size=12,
            class_="span-nodes",
            fill="#333",
        )
        svg.y += 16
    svg.text(_MARGIN, svg.y + 6, _sizes_line(layout), size=12, fill="#333")
    svg.y += 16
    _summary_note(svg, layout.num_ranks, drawn, placement.num_nodes, g)
    _placement_table(svg, placement)
    _rank_map(svg, layout, drawn, g)
    svg.heading(
        "Groups of each kind: one colour per group; red "
        "outline: a group that should stay on one node does not"
    )
    _flow_panels(svg, [_kind_panel(layout, placement, kind, drawn) for kind in panels])
    return svg.document(title)


def _panel_kinds(placement: Placement, kinds: Sequence[str] | None) -> list[str]:
    if kinds is None:
        return [entry.kind for entry in placement.kinds if entry.group_size > 1]
    for kind in kinds:
        placement.kind(kind)  # ValueError naming an unknown kind
    return list(kinds)


def _sizes_line(layout: ParallelLayout) -> str:
    sizes = layout.axis_sizes()
    return " · ".join(
        [*(f"{axis} {size}" for axis, size in sizes.items()), f"order {layout.order}"]
    )


def _placement_table(svg: _Svg, placement: Placement) -> None:
    svg.heading(f"Placement: rank r runs on node r // {placement.gpus_per_node}")
    columns = (0, 170, 290, 410)  # the longest kind, tp_ep_pp_with_egtp_remat, is about 150 wide
    for x, name in zip(
        columns, ("kind", "groups x ranks", "nodes per group", "placement"), strict=True
    ):
        svg.text(_MARGIN + x, svg.y + 4, name, size=11, font_weight="bold", fill="#333")
    svg.y += 6
    for entry in placement.kinds:
        svg.y += _ROW_H
        verdict, colour = _verdict_mark(entry)
        nodes = (
            f"{entry.min_nodes}"
            if entry.min_nodes == entry.max_nodes
            else f"{entry.min_nodes}-{entry.max_nodes}"
        )
        svg.open(
            "g",
            class_="placement-row",
            data_kind=entry.kind,
            data_groups=entry.num_groups,
            data_size=entry.group_size,
            data_min_nodes=entry.min_nodes,
            data_max_nodes=entry.max_nodes,
            data_crossing=entry.crossing_groups,
            data_violated=str(entry.violated).lower(),
        )
        cells = (entry.kind, f"{entry.num_groups} x {entry.group_size}", nodes, verdict)
        for x, cell in zip(columns, cells, strict=True):
            svg.text(_MARGIN + x, svg.y, cell, size=11, fill=colour if x == columns[-1] else "#111")
        svg.close("g")
    svg.y += 8


def _verdict_mark(entry: KindPlacement) -> tuple[str, str]:
    """The entry's verdict with a mark, and its colour."""
    if entry.group_size == 1:
        return entry.verdict, "#777"
    if entry.violated:
        return f"✗ {entry.verdict}", _RED
    return (f"✓ {entry.verdict}", _GREEN) if entry.within_node else (entry.verdict, "#333")


def _label_axes(layout: ParallelLayout) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """The coordinates a rank's label shows.

    Dense axes of size > 1, and expert ones when experts are sharded differently from the dense
    grid."""
    sizes = layout.axis_sizes()
    dense = [(axis, short) for axis, short in _DENSE_AXES if sizes[axis] > 1]
    expert = [(axis, short) for axis, short in _EXPERT_AXES if sizes[axis] > 1]
    if layout.ep == 1 and layout.expt_tp == layout.tp and layout.expt_gtp_remat == 1:
        expert = []
    return dense or [("dp", "dp")], expert


def _rank_map(svg: _Svg, layout: ParallelLayout, drawn: range, gpus_per_node: int) -> None:
    dense, expert = _label_axes(layout)
    svg.heading("Ranks on nodes, each labelled with its coordinates")
    legend = "cell: rank / dense (" + "·".join(s for _, s in dense) + ")"
    if expert:
        legend += " / expert (" + "·".join(s for _, s in expert) + ")"
    svg.text(_MARGIN, svg.y + 4, legend, size=11, class_="legend", fill="#333")
    svg.y += 12
    sizes = layout.axis_sizes()
    # The widest label: every coordinate at its largest value.
    longest = max(len("·".join(str(sizes[a] - 1) for a, _ in axes)) for axes in (dense, expert))
    size = 10 if len(drawn) * gpus_per_node <= 64 else 9
    cell_w = max(30, 8 + math.ceil(longest * size * 0.62))
    line_h = size + 1
    cell_h = (3 if expert else 2) * line_h + 6
    grid = _NodeGrid(
        nodes=drawn,
        gpus_per_node=gpus_per_node,
        cell_w=cell_w,
        cell_h=cell_h,
        max_width=_SHEET_WIDTH - 2 * _MARGIN,
    )
    first, stop = layout.rank_range()

    def draw_rank_cell(rank: int, x: int, y: int) -> None:
        if not first <= rank < stop:
            _outside_cell(svg, rank, x, y, cell_w, cell_h, gpus_per_node, (first, stop))
            return
        coords = layout.coords(rank)
        dense_label = "·".join(str(coords[a]) for a, _ in dense)
        expert_label = "·".join(str(coords[a]) for a, _ in expert)
        svg.open("g", class_="rank", data_rank=rank, data_node=node_of(rank, gpus_per_node))
        svg.title(f"rank {rank}: " + ", ".join(f"{a} {v}" for a, v in coords.items()))
        svg.rect(x, y, cell_w - 2, cell_h - 2, fill="white", stroke="#999", stroke_width=0.8, rx=2)
        svg.text(x + 3, y + line_h, str(rank), size=size, font_weight="bold", class_="rank-label")
        svg.text(
            x + 3, y + 2 * line_h, dense_label, size=size, class_="dense-coords", fill="#1a237e"
        )
        if expert:
            svg.text(
                x + 3,
                y + 3 * line_h,
                expert_label,
                size=size,
                class_="expert-coords",
                fill="#6a1b9a",
            )
        svg.close("g")

    svg.y += 4
    svg.open("g", class_="rank-map")
    _draw_nodes(svg, grid, _MARGIN, svg.y, draw_rank_cell)
    svg.close("g")
    svg.y += grid.height + 6


def _outside_cell(
    svg: _Svg,
    rank: int,
    x: int,
    y: int,
    w: int,
    h: int,
    gpus_per_node: int,
    span: tuple[int, int],
) -> None:
    """A rank the drawn nodes hold but the layout does not: an empty dashed cell (``outside``)."""
    svg.open("g", class_="rank outside", data_rank=rank, data_node=node_of(rank, gpus_per_node))
    svg.title(f"rank {rank}: outside the layout (ranks {span[0]}-{span[1] - 1})")
    svg.rect(
        x,
        y,
        w - 2,
        h - 2,
        fill="white",
        stroke="#bbb",
        stroke_width=0.8,
        stroke_dasharray="3,2",
        rx=2,
    )
    if h >= 20:
        svg.text(x + 3, y + 11, str(rank), size=9, fill="#aaa", class_="rank-label")
    svg.close("g")


@attrs.frozen(slots=True, kw_only=True)
class _Panel:
    """A titled drawing of width ``width`` and height ``height``.

    ``draw_panel(svg, x, y)`` puts it at (x, y).
    """

    width: int
    height: int
    draw: Callable[[_Svg, int, int], None]


_PANEL_TITLE_H: Final = 30


def _flow_panels(svg: _Svg, panels: Sequence[_Panel]) -> None:
    """Panels left to right, wrapping at the sheet width."""
    x, row_h = _MARGIN, 0
    for panel in panels:
        if x > _MARGIN and x + panel.width > _SHEET_WIDTH - _MARGIN:
            svg.y += row_h + _GAP
            x, row_h = _MARGIN, 0
        panel.draw(svg, x, svg.y)
        x += panel.width + 2 * _GAP
        row_h = max(row_h, panel.height)
    svg.y += row_h + _GAP


def _groups_panel(
    layout: ParallelLayout,
    kind: str,
    drawn: range,
    gpus_per_node: int,
    heading: Sequence[tuple[str, str]],
    group_class: Callable[[tuple[int, ...]], str],
    **panel_data: object,
) -> _Panel:
    """A panel colouring the ranks of the ``drawn`` nodes by their group of ``kind``.

    Ranks outside the layout are empty; ``group_class(group)`` gives the CSS-like classes of a
    group's cells (``crossing``, ``shared``, ...), ``heading`` the title lines and their colours."""
    cell = _panel_cell(len(drawn) * gpus_per_node)
    half = (_SHEET_WIDTH - 2 * _MARGIN - 2 * _GAP) // 2
    grid = _NodeGrid(
        nodes=drawn, gpus_per_node=gpus_per_node, cell_w=cell, cell_h=cell, max_width=half
    )
    full = attrs.evolve(grid, max_width=_SHEET_WIDTH - 2 * _MARGIN)
    if grid.nodes_per_row < grid.num_nodes <= full.nodes_per_row:
        grid = full  # every node on one row reads better than two panels side by side
    group_index: dict[int, int] = {}
    classes: dict[int, str] = {}
    groups = layout.groups(kind)
    group_size = len(groups[0])
    drawn_stop = _ranks_of(drawn, gpus_per_node).stop
    first, stop = layout.rank_range()
    for index, group in enumerate(groups):
        if group[0] >= drawn_stop:  # a group lists its ranks in grid order, smallest first
            continue
        group_classes = group_class(group)
        for rank in group:
            group_index[rank] = index
            classes[rank] = group_classes
    title_w = min(
        max(len(text) for text, _ in heading) * 7, half
    )  # 12 px bold: about 7 px a character
    if (
        group_size == 1
    ):  # the kind is off: its heading says so, a grid of grey cells would say nothing more
        return _Panel(
            width=title_w,
            height=_PANEL_TITLE_H,
            draw=lambda svg, x, y: _panel_heading(svg, x, y, heading, kind, panel_data),
        )
    width = max(grid.width, title_w)

    def draw_panel(svg: _Svg, x: int, y: int) -> None:
        _panel_heading(svg, x, y, heading, kind, panel_data, close=False)

        def rank_cell(rank: int, cx: int, cy: int) -> None:
            if not first <= rank < stop:
                _outside_cell(svg, rank, cx, cy, cell, cell, gpus_per_node, (first, stop))
                return
            index = group_index.get(rank)
            cls = "rank" + (f" {classes[rank]}" if index is not None and classes[rank] else "")
            data = {"data_group": index} if index is not None else {}
            svg.open(
                "g", class_=cls, data_rank=rank, data_node=node_of(rank, gpus_per_node), **data
            )
            svg.title(f"rank {rank}: " + ("no group" if index is None else f"{kind} group {index}"))
            faded = "faded" in cls
            fill = "#eeeeee" if index is None or group_size == 1 else _group_colour(index)
            alarm = "violated" in cls
            svg.rect(
                cx,
                cy,
                cell - 2,
                cell - 2,
                fill=fill,
                fill_opacity=0.25 if faded else 1,
                stroke=_RED if alarm else "#888",
                stroke_width=2 if alarm else 0.6,
                rx=2,
            )
            if cell >= 20:
                svg.text(
                    cx + (cell - 2) / 2,
                    cy + cell / 2 + 2,
                    str(rank),
                    size=9,
                    text_anchor="middle",
                    fill="#222",
                    class_="rank-label",
                )
            svg.close("g")

        _draw_nodes(svg, grid, x, y + _PANEL_TITLE_H, rank_cell)
        svg.close("g")

    return _Panel(width=width, height=_PANEL_TITLE_H + grid.height, draw=draw_panel)


def _groups_of(count: int, size: int) -> str:
    return f"{count} group{'' if count == 1 else 's'} of {size}"


def _panel_heading(
    svg: _Svg,
    x: int,
    y: int,
    heading: Sequence[tuple[str, str]],
    kind: str,
    panel_data: dict[str, object],
    close: bool = True,
) -> None:
    """Open a panel's group and write its title lines (closing the group unless cells follow)."""
    svg.open("g", class_="kind-panel", data_kind=kind, **panel_data)
    for i, (text, colour) in enumerate(heading):
        svg.text(
            x,
            y + 12 + 13 * i,
            text,
            size=11 if i else 12,
            font_weight="normal" if i else "bold",
            fill=colour,
            class_="panel-title",
        )
    if close:
        svg.close("g")


def _kind_panel(layout: ParallelLayout, placement: Placement, kind: str, drawn: range) -> _Panel:
    entry = placement.kind(kind)
    g = placement.gpus_per_node
    heading = [
        (f"{kind}: {_groups_of(entry.num_groups, entry.group_size)}", "#111"),
        _verdict_mark(entry),
    ]

    def group_class(group: tuple[int, ...]) -> str:
        if len({node_of(r, g) for r in group}) == 1:
            return ""
        return "crossing violated" if entry.violated else "crossing"

    return _groups_panel(
        layout, kind, drawn, g, heading, group_class, data_violated=str(entry.violated).lower()
    )


# ------------------------------------------------------------------------------------------ compare


def render_compare_svg(
    comparison: LayoutComparison, gpus_per_node: int, names: tuple[str, str] = ("A", "B")
) -> str:
    """Two layouts of one world side by side, the communicators they share in full colour.

    For every kind with more than one rank per group in either layout, A's panel left and B's right;
    groups the other layout also creates a communicator for are in full colour (class ``shared``),
    the others faded."""
    a, b = comparison.layout_a, comparison.layout_b
    world = comparison.world_size
    if world % gpus_per_node:
        raise ValueError(
            f"the world of {world} ranks is not a multiple of gpus_per_node "
            f"{gpus_per_node}: launchers start the same number of ranks on every node"
        )
    # The nodes of both spans: from the first one's node to the last one's.
    first, stop = (
        min(a.rank_range()[0], b.rank_range()[0]),
        max(a.rank_range()[1], b.rank_range()[1]),
    )
    drawn = _drawn_nodes(first, stop, gpus_per_node)
    shared = comparison.shared
    svg = _Svg()
    title = f"pgregistry layout --compare: {names[0]} and {names[1]} on {world} ranks"
    svg.heading(title, size=18)
    for name, layout in zip(names, (a, b), strict=True):
        line = f"{name}: {_span_label(layout, world)}{_sizes_line(layout)}"
        svg.text(_MARGIN, svg.y + 6, line, size=12, fill="#333")
        svg.y += 16
    svg.y += 4
    svg.text(
        _MARGIN,
        svg.y + 8,
        (
            f"{names[0]}: {len(comparison.a)} communicators, {names[1]}: "
            f"{len(comparison.b)}, shared: {len(shared)} (created once; "
            f"{len(comparison.a) + len(comparison.b) - len(shared)} in all)"
        ),
        size=13,
        font_weight="bold",
        class_="compare-summary",
        data_a=len(comparison.a),
        data_b=len(comparison.b),
        data_shared=len(shared),
    )
    svg.y += 14
    differences = [f"{what} ({in_a} / {in_b})" for what, in_a, in_b in comparison.differences()]
    disjoint = (
        "; their spans are disjoint: no communicator can be shared"
        if not comparison.overlap
        else ""
    )
    svg.text(
        _MARGIN,
        svg.y + 8,
        ("differ in: " + ", ".join(differences) if differences else "the same layout twice")
        + disjoint,
        size=12,
        class_="compare-differences",
        fill="#333",
    )
    svg.y += 14
    num_nodes = node_of(stop - 1, gpus_per_node) - node_of(first, gpus_per_node) + 1
    _summary_note(svg, stop - first, drawn, num_nodes, gpus_per_node)
    _draw_shared_table(svg, comparison, names)
    svg.heading(
        f"Groups of each kind, {names[0]} left and {names[1]} right: "
        "full colour = shared communicator, faded = only in this layout"
    )

    def build_panel(layout: ParallelLayout, side: str, kind: str) -> _Panel:
        other = comparison.b if side == "a" else comparison.a
        groups = layout.groups(kind)
        shared_here = sum(1 for group in groups if group in other)
        other_kinds = sorted(
            {k for group in groups if group in other for k in other[group]}, key=GROUP_KINDS.index
        )
        name = names[0] if side == "a" else names[1]
        if len(groups[0]) == 1:
            status, colour = "off (one rank per group)", "#777"
        else:
            status = f"{shared_here} shared" + (
                f" (as {', '.join(other_kinds)})" if other_kinds else ""
            )
            colour = _GREEN if shared_here else "#777"
        heading = [
            (f"{name} {kind}: {_groups_of(len(groups), len(groups[0]))}", "#111"),
            (status, colour),
        ]
        return _groups_panel(
            layout,
            kind,
            drawn,
            gpus_per_node,
            heading,
            lambda group: "shared" if group in other else "faded",
            data_side=side,
            data_shared_groups=shared_here,
        )

    rows = [
        (build_panel(a, "a", kind), build_panel(b, "b", kind))
        for kind in GROUP_KINDS
        if max(len(a.groups(kind)[0]), len(b.groups(kind)[0])) > 1
    ]
    right = (
        _MARGIN + max((left.width for left, _ in rows), default=0) + 2 * _GAP
    )  # B's column lines up
    for left, right_panel in rows:
        left.draw(svg, _MARGIN, svg.y)
        right_panel.draw(svg, right, svg.y)
        svg.y += max(left.height, right_panel.height) + _GAP
    svg.width = max(svg.width, right + max((p.width for _, p in rows), default=0) + _MARGIN)
    return svg.document(title)


def _draw_shared_table(svg: _Svg, comparison: LayoutComparison, names: tuple[str, str]) -> None:
    svg.heading("Shared communicators: the same ranks, named by these kinds")
    rows = comparison.group_shared_by_kinds()
    widest = max((len(", ".join(row.kinds_a)) for row in rows), default=0)
    columns = (0, 60, 130, max(480, 130 + 7 * widest))  # 11 px: under 7 px a character
    for x, name in zip(
        columns, ("count", "ranks", f"kinds in {names[0]}", f"kinds in {names[1]}"), strict=True
    ):
        svg.text(_MARGIN + x, svg.y + 4, name, size=11, font_weight="bold", fill="#333")
    svg.y += 6
    for row in rows:
        svg.y += _ROW_H
        svg.open(
            "g",
            class_="shared-row",
            data_count=row.count,
            data_size=row.size,
            data_kinds_a=" ".join(row.kinds_a),
            data_kinds_b=" ".join(row.kinds_b),
        )
        cells = (str(row.count), str(row.size), ", ".join(row.kinds_a), ", ".join(row.kinds_b))
        for x, cell in zip(columns, cells, strict=True):
            svg.text(_MARGIN + x, svg.y, cell, size=11)
        svg.close("g")
    if not comparison.shared:
        svg.y += _ROW_H
        svg.text(_MARGIN, svg.y, "none", size=11, fill="#777")
    svg.y += 8


# --------------------------------------------------------------------------------------------- HTML


def svg_to_html(svg: str, title: str) -> str:
    """An HTML page showing ``svg`` inline (so it scales and its tooltips work in any browser)."""
    body = svg.split("?>", 1)[1] if svg.startswith("<?xml") else svg
    return "\n".join(
        [
            "<!DOCTYPE html>",
            '<html lang="en">',
            '<head><meta charset="utf-8">',
            f"<title>{escape(title)}</title>",
            "<style>body{margin:0;background:#fff} svg{max-width:100%;height:auto}</style>",
            "</head>",
            "<body>",
            body.strip(),
            "</body>",
            "</html>",
            "",
        ]
    )

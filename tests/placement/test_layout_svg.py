"""The picture is valid SVG / HTML and shows what the placement says: parsed back, its rows, node boxes, rank labels,
group colours and shared communicators are checked against membership the test computes itself (node = rank //
gpus_per_node, coordinates from the default order's formula, groups from the layout's rank sets)."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from collections import defaultdict
from html.parser import HTMLParser

import pytest

from pgregistry._runtime.communicators import compare_layouts
from pgregistry.cli._layout_svg import MAX_DRAWN_RANKS, render_compare_svg, render_svg, svg_to_html
from pgregistry.layout import GROUP_KINDS, ParallelLayout
from pgregistry.placement import DEFAULT_INTRA_NODE_KINDS, place

_SVG = "{http://www.w3.org/2000/svg}"


def _classes(element: ET.Element) -> set[str]:
    return set(element.get("class", "").split())


def _groups(root: ET.Element, cls: str) -> list[ET.Element]:
    return [g for g in root.iter(f"{_SVG}g") if cls in _classes(g)]


def _text(element: ET.Element, cls: str) -> str:
    (found,) = [t for t in element.iter(f"{_SVG}text") if cls in _classes(t)]
    return found.text or ""


def _spans(group: tuple[int, ...], gpus_per_node: int) -> int:
    return len({rank // gpus_per_node for rank in group})


def _dense_coords(layout: ParallelLayout, rank: int) -> dict[str, int]:
    """The default order tp-cp-ep-dp-pp: rank = tp + tp * (cp + cp * (dp + dp * pp))."""
    tp, cp, dp = layout.tp, layout.cp, layout.dp
    return {"tp": rank % tp, "cp": rank // tp % cp, "dp": rank // (tp * cp) % dp, "pp": rank // (tp * cp * dp)}


def _expert_coords(layout: ParallelLayout, rank: int) -> dict[str, int]:
    etp, ep = layout.expt_tp, layout.ep
    return {"ep": rank // etp % ep, "edp": rank // (etp * ep) % layout.expt_dp}


CASES = [
    ({"num_ranks": 8, "tp": 2, "ep": 2, "expt_tp": 1}, 4),
    ({"num_ranks": 16, "tp": 2, "pp": 2, "ep": 4, "expt_tp": 1}, 8),
    ({"num_ranks": 16, "tp": 2, "ep": 4, "expt_tp": 1, "order": "dp-tp-cp-ep-pp"}, 8),
    ({"num_ranks": 256, "tp": 4, "pp": 2, "ep": 8, "expt_tp": 1}, 8),
]


@pytest.mark.parametrize(("sizes", "gpus_per_node"), CASES)
def test_sheet_shows_the_placement(sizes: dict[str, object], gpus_per_node: int) -> None:
    layout = ParallelLayout(**sizes)  # type: ignore[arg-type]
    root = ET.fromstring(render_svg(place(layout, gpus_per_node)))
    assert root.tag == f"{_SVG}svg"

    rows = {row.get("data-kind"): row for row in _groups(root, "placement-row")}
    assert list(rows) == list(GROUP_KINDS)
    for kind, row in rows.items():
        groups = layout.groups(kind)
        spans = [_spans(group, gpus_per_node) for group in groups]
        crossing = sum(span > 1 for span in spans)
        assert row.get("data-groups") == str(len(groups)) and row.get("data-size") == str(len(groups[0]))
        assert (row.get("data-min-nodes"), row.get("data-max-nodes")) == (str(min(spans)), str(max(spans)))
        assert row.get("data-crossing") == str(crossing)
        violated = kind in DEFAULT_INTRA_NODE_KINDS and crossing > 0
        assert row.get("data-violated") == str(violated).lower()
        assert ("✗" in "".join(row.itertext())) == violated

    (rank_map,) = _groups(root, "rank-map")
    nodes = _groups(rank_map, "node")
    assert [int(node.get("data-node", -1)) for node in nodes] == list(range(layout.num_ranks // gpus_per_node))
    seen = []
    for node in nodes:
        for cell in _groups(node, "rank"):
            rank = int(cell.get("data-rank", -1))
            seen.append(rank)
            assert rank // gpus_per_node == int(node.get("data-node", -1))
            assert _text(cell, "rank-label") == str(rank)
            if layout.order == "tp-cp-ep-dp-pp":
                dense = _dense_coords(layout, rank)
                shown = [axis for axis in ("tp", "cp", "dp", "pp") if getattr(layout, axis) > 1]
                assert _text(cell, "dense-coords") == "·".join(str(dense[axis]) for axis in shown)
                expert = _expert_coords(layout, rank)
                assert _text(cell, "expert-coords") == f"{expert['ep']}·{expert['edp']}"
    assert seen == list(range(layout.num_ranks))

    panels = {panel.get("data-kind"): panel for panel in _groups(root, "kind-panel")}
    assert list(panels) == [kind for kind in GROUP_KINDS if len(layout.groups(kind)[0]) > 1]
    for kind, panel in panels.items():
        members: dict[str, set[int]] = defaultdict(set)
        for node in _groups(panel, "node"):
            for cell in _groups(node, "rank"):
                rank = int(cell.get("data-rank", -1))
                assert rank // gpus_per_node == int(node.get("data-node", -1))
                (group,) = [g for g in layout.groups(kind) if rank in g] or [None]
                if group is None:
                    assert cell.get("data-group") is None
                    continue
                members[cell.get("data-group", "")].add(rank)
                crosses = _spans(group, gpus_per_node) > 1
                assert ("crossing" in _classes(cell)) == crosses, (kind, rank)
                assert ("violated" in _classes(cell)) == (crosses and kind in DEFAULT_INTRA_NODE_KINDS)
        assert sorted(map(sorted, members.values())) == sorted(map(sorted, layout.groups(kind)))


def test_large_worlds_are_summarised() -> None:
    layout = ParallelLayout(num_ranks=1024, tp=2, pp=2, ep=4, expt_tp=1)
    root = ET.fromstring(render_svg(place(layout, 8)))
    (rank_map,) = _groups(root, "rank-map")
    drawn = [int(cell.get("data-rank", -1)) for cell in _groups(rank_map, "rank")]
    assert drawn == list(range(MAX_DRAWN_RANKS))
    note = _text(root, "summary-note")
    assert note.startswith("Drawn: ranks 0-255 (32 of 128 nodes); the table covers all 1024 ranks.")
    rows = {row.get("data-kind"): row for row in _groups(root, "placement-row")}
    assert rows["dp"].get("data-max-nodes") == str(max(_spans(g, 8) for g in layout.groups("dp"))) == "64"


def test_chosen_kinds_only_and_unknown_kinds_refused() -> None:
    layout = ParallelLayout(num_ranks=16, tp=2, ep=4, expt_tp=1)
    root = ET.fromstring(render_svg(place(layout, 8), kinds=["ep", "tp"]))
    assert [panel.get("data-kind") for panel in _groups(root, "kind-panel")] == ["ep", "tp"]
    with pytest.raises(ValueError, match="unknown group kind 'tensor'"):
        render_svg(place(layout, 8), kinds=["tensor"])


class _Tags(HTMLParser):
    """Start/end tags in order (void elements have no end tag), and every element's attributes."""

    _VOID = {"meta", "rect"}

    def __init__(self) -> None:
        super().__init__()
        self.stack: list[str] = []
        self.elements: list[tuple[str, dict[str, str | None]]] = []
        self.balanced = True

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.elements.append((tag, dict(attrs)))
        if tag not in self._VOID:
            self.stack.append(tag)

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.elements.append((tag, dict(attrs)))

    def handle_endtag(self, tag: str) -> None:
        self.balanced &= bool(self.stack) and self.stack.pop() == tag


def test_html_page_is_valid_and_holds_the_same_picture() -> None:
    layout = ParallelLayout(num_ranks=16, tp=2, ep=4, expt_tp=1, order="dp-tp-cp-ep-pp")
    svg = render_svg(place(layout, 8))
    html = svg_to_html(svg, "layout")
    assert html.startswith("<!DOCTYPE html>")
    parser = _Tags()
    parser.feed(html)
    parser.close()
    assert parser.balanced and parser.stack == []
    tags = [tag for tag, _ in parser.elements]
    assert tags[:3] == ["html", "head", "meta"] and "body" in tags and tags.count("svg") == 1
    from_html = [(a.get("data-kind"), a.get("data-violated")) for _, a in parser.elements
                 if a.get("class") == "placement-row"]
    from_svg = [(r.get("data-kind"), r.get("data-violated")) for r in _groups(ET.fromstring(svg), "placement-row")]
    assert from_html == from_svg and ("tp", "true") in from_html


@pytest.mark.parametrize("gpus_per_node", [4, 8])
def test_compare_sheet_marks_exactly_the_shared_communicators(gpus_per_node: int) -> None:
    a = ParallelLayout(num_ranks=16, tp=2, pp=2, ep=4, expt_tp=1)
    b = ParallelLayout(num_ranks=16, tp=4)
    root = ET.fromstring(render_compare_svg(compare_layouts(a, b), gpus_per_node, ("policy", "reference")))

    def rank_sets(layout: ParallelLayout) -> set[tuple[int, ...]]:
        return {g for kind in GROUP_KINDS for g in layout.groups(kind) if len(g) > 1}

    sets_a, sets_b = rank_sets(a), rank_sets(b)
    (summary,) = [t for t in root.iter(f"{_SVG}text") if "compare-summary" in _classes(t)]
    assert (summary.get("data-a"), summary.get("data-b"), summary.get("data-shared")) == (
        str(len(sets_a)), str(len(sets_b)), str(len(sets_a & sets_b)),
    )
    rows = _groups(root, "shared-row")
    assert sum(int(row.get("data-count", 0)) for row in rows) == len(sets_a & sets_b)
    panels = _groups(root, "kind-panel")
    drawn_kinds = [kind for kind in GROUP_KINDS if max(len(a.groups(kind)[0]), len(b.groups(kind)[0])) > 1]
    assert [(p.get("data-kind"), p.get("data-side")) for p in panels] == [
        (kind, side) for kind in drawn_kinds for side in ("a", "b")
    ]
    for panel in panels:
        layout, other = (a, sets_b) if panel.get("data-side") == "a" else (b, sets_a)
        groups = layout.groups(panel.get("data-kind", ""))
        assert panel.get("data-shared-groups") == str(sum(g in other for g in groups))
        for cell in _groups(panel, "rank"):
            rank = int(cell.get("data-rank", -1))
            (group,) = [g for g in groups if rank in g]
            assert ("shared" in _classes(cell)) == (group in other)
            assert ("faded" in _classes(cell)) == (group not in other)


def test_a_large_span_is_summarised_from_its_first_node() -> None:
    # Ranks 515-1538 of a 2048-rank world on nodes of 8: the span starts mid-node 64, so node 64's ranks 512-514
    # are drawn empty, and 32 nodes (256 ranks) are drawn of the 129 the span touches.
    layout = ParallelLayout(num_ranks=1024, tp=2, pp=2, ep=4, expt_tp=1, rank_offset=515)
    root = ET.fromstring(render_svg(place(layout, 8, world_size=2048)))
    (rank_map,) = _groups(root, "rank-map")
    cells = _groups(rank_map, "rank")
    assert [int(cell.get("data-rank", -1)) for cell in cells] == list(range(512, 512 + MAX_DRAWN_RANKS))
    assert [int(c.get("data-rank", -1)) for c in cells if "outside" in _classes(c)] == [512, 513, 514]
    note = _text(root, "summary-note")
    assert note.startswith("Drawn: ranks 512-767 (32 of 129 nodes); the table covers all 1024 ranks.")

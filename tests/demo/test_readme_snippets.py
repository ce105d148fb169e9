"""The documentation's code is the examples' code: every line of a ``python`` block in README.md or docs/dtensor.md
appears in the example file its paragraph links to (``...`` lines stand for what the page leaves out), so the pages
cannot drift from code the suite runs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = {"README.md": 2, "docs/dtensor.md": 2}
"""Page -> how many of its python blocks link an example (at least)."""


def _blocks(page: str) -> list[tuple[str, list[str]]]:
    """(example, the block's lines) for every python block whose preceding text links an example (the last link)."""
    text = (ROOT / page).read_text()
    out = []
    position = 0
    for block in re.finditer(r"```python\n(.*?)```", text, re.DOTALL):
        links = re.findall(r"\((?:\.\./)?(examples/[\w/]+\.py)\)", text[position : block.start()])
        if links:
            out.append((links[-1], block.group(1).splitlines()))
        position = block.end()
    return out


def _missing(example: str, lines: list[str]) -> list[str]:
    source = {line.strip() for line in (ROOT / example).read_text().splitlines()}
    wanted = [line.strip() for line in lines if line.strip() and not line.strip().startswith("...")]
    return [line for line in wanted if line not in source]


@pytest.mark.parametrize("page", sorted(PAGES))
def test_every_code_line_is_in_the_example_the_page_links(page: str) -> None:
    blocks = _blocks(page)
    assert len(blocks) >= PAGES[page]
    for example, lines in blocks:
        assert _missing(example, lines) == [], (page, example)


def test_a_line_the_example_lacks_is_found() -> None:
    (example, lines), *_ = _blocks("README.md")
    assert _missing(example, [*lines, "registry.attach(model, pg)"]) == ["registry.attach(model, pg)"]

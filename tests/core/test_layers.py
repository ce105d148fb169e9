"""The layering docs/architecture.md states holds: each module imports only modules of its own layer
or of the layers above it, or the few every module may use, and each layer names the layers above it
that it imports from.

The doc's module map is the list of layers, read as text: each ``### `` heading starts a layer, in
order from the top. A list item ``- `a.py`, `b.py`: job`` names the layer's modules before its colon
(``grad_stats/_fused.py``, ``_triton_kernels.py``: a name without a folder is in the folder of the
name before it). The paragraph ``Imports from the layers above: ...`` names, by heading, the layers
above whose modules the layer's modules import (``none`` for none). The paragraph ``Every module may
use: ...`` names the modules exempt as targets. Imports are read as the import-cycle test reads them
(every import statement: module level, inside a function, under ``TYPE_CHECKING``). A package's
``__init__`` belongs to the lowest layer of its modules (it imports them); the root ``__init__`` and
the ``__main__`` entry points, which nothing imports, stand outside.
"""

from __future__ import annotations

import re
from pathlib import Path

from fixtures.source_trees import write_package
from test_import_cycles import import_graph

import pgregistry

PACKAGE = Path(pgregistry.__file__).resolve().parent
DOC = PACKAGE.parent / "docs" / "architecture.md"

_SHARED_LINE = re.compile(r"^Every module may use: (?P<modules>.+?)\n\n", re.MULTILINE | re.DOTALL)
_MODULES_OF_ITEM = re.compile(r"^- (?P<modules>`[\w/]+\.py`(?:, `[\w/]+\.py`)*): ")
_IMPORTS_PREFIX = "Imports from the layers above: "


def _module_name(package: str, relative_path: str) -> str:
    dotted = relative_path.removesuffix(".py").replace("/", ".").removesuffix("__init__").rstrip(".")
    return f"{package}.{dotted}" if dotted else package


def _module_map(doc: str) -> str:
    return doc.split("## Module map", 1)[1].split("\n## ", 1)[0]


def _joined_lines(text: str) -> list[str]:
    """The lines of ``text``, a list item's indented continuation lines joined onto it."""
    joined: list[str] = []
    for line in text.splitlines():
        if line.startswith("  ") and joined:
            joined[-1] += " " + line.strip()
        else:
            joined.append(line)
    return joined


def modules_of_item(modules: str, package: str) -> list[str]:
    """The modules a list item names before its colon (``grad_stats/_fused.py``, ``_triton_kernels.py``: a
    name without a folder is in the folder of the name before it)."""
    named = []
    folder = ""
    for path in re.findall(r"`([\w/]+\.py)`", modules):
        if "/" in path:
            folder = path.rpartition("/")[0] + "/"
        else:
            path = folder + path
        named.append(_module_name(package, path))
    return named


def layers_of(doc: str, package: str) -> dict[str, int]:
    """Module -> its layer's position in the doc's module map (0 = top); ``ValueError`` for a module named twice."""
    layers: dict[str, int] = {}
    layer = -1
    for line in _joined_lines(_module_map(doc)):
        if line.startswith("### "):
            layer += 1
        item = _MODULES_OF_ITEM.match(line)
        if item is None:
            continue
        for name in modules_of_item(item["modules"], package):
            if name in layers:
                raise ValueError(f"{name} is in two rows of the module map")
            layers[name] = layer
    return layers


def stated_imports(doc: str) -> dict[int, set[int]]:
    """Layer -> the layers above it that its ``Imports from the layers above:`` paragraph names."""
    headings: list[str] = []
    named: dict[int, list[str]] = {}
    for paragraph in _module_map(doc).split("\n\n"):
        text = " ".join(paragraph.split())
        if text.startswith("### "):
            headings.append(text.removeprefix("### ").lower())
        elif text.startswith(_IMPORTS_PREFIX):
            listed = text.removeprefix(_IMPORTS_PREFIX).removesuffix(".")
            named[len(headings) - 1] = [] if listed == "none" else listed.lower().split(", ")
    unknown = {name for names in named.values() for name in names} - set(headings)
    if unknown:
        raise ValueError(f"the module map has no layer named {sorted(unknown)}")
    return {layer: {headings.index(name) for name in names} for layer, names in named.items()}


def shared_modules(doc: str, package: str) -> set[str]:
    """The modules the doc's ``Every module may use:`` line names."""
    found = _SHARED_LINE.search(doc)
    assert found, "docs/architecture.md has no 'Every module may use: ...' line"
    return {_module_name(package, path) for path in re.findall(r"`([\w/]+\.py)`", found["modules"])}


def layering_faults(
    graph: dict[str, set[str]],
    layers: dict[str, int],
    shared: set[str],
    package: str,
    stated: dict[int, set[int]],
) -> list[str]:
    """Every module the map leaves out, every import of a module of a lower layer and every layer
    whose ``Imports from the layers above:`` paragraph names other layers than its modules import
    from, as text."""
    entry_points = {package} | {name for name in graph if name.endswith(".__main__")}
    packages = {name.rpartition(".")[0] for name in graph if name.count(".") > 1} - {package}
    placed = dict(layers)
    for name in packages - set(layers):  # a package's __init__: the lowest layer of its modules
        inside = [layer for module, layer in layers.items() if module.startswith(f"{name}.")]
        if inside:
            placed[name] = max(inside)
    faults = [f"{name} is in no row of the module map" for name in sorted(set(graph) - set(placed) - entry_points)]
    faults += [f"the module map names {name}, which is no module" for name in sorted(set(placed) - set(graph))]
    imported_layers: dict[int, set[int]] = {layer: set() for layer in placed.values()}
    for name in sorted(set(graph) & set(placed)):
        for target in sorted(graph[name] - shared - entry_points):
            if target in placed and placed[target] > placed[name]:
                faults.append(f"{name} (layer {placed[name]}) imports {target} of the lower layer {placed[target]}")
            elif target in placed and placed[target] != placed[name]:
                imported_layers[placed[name]].add(placed[target])
    for layer, imported in sorted(imported_layers.items()):
        if stated.get(layer) != imported:
            named = sorted(stated[layer]) if layer in stated else "no layers"
            faults.append(
                f"layer {layer} imports from the layers {sorted(imported)}, its paragraph names {named}"
            )
    return faults


def test_every_import_goes_to_the_same_or_a_higher_layer_of_the_module_map() -> None:
    doc = DOC.read_text(encoding="utf-8")
    faults = layering_faults(import_graph(PACKAGE), layers_of(doc, "pgregistry"), shared_modules(doc, "pgregistry"),
                             "pgregistry", stated_imports(doc))
    assert faults == []


DOC_OF_A_TOY_PACKAGE = """
Every module may use: `log.py`.

## Module map

### Arithmetic

Imports from the layers above: none.

- `layout.py`: rank arithmetic
- `log.py`: logging, which `layout.py` and
  `registry.py` may use

### Groups

Imports from the layers above: none.

- `registry.py`, `sub/_cache.py`,
  `_agree.py`: groups

### Commands

Imports from the layers above:
groups.

- `cli/__init__.py`: main

## After the map
"""


_TOY_FILES = {
    "__init__.py": "import pkg.cli\n", "__main__.py": "from pkg.cli import main\n", "layout.py": "",
    "log.py": "", "registry.py": "", "sub/__init__.py": "from pkg.sub._cache import cache\n",
    "sub/_cache.py": "", "sub/_agree.py": "", "cli/__init__.py": "from pkg import registry\n",
}


def _toy_faults(tmp_path: Path, files: dict[str, str]) -> list[str]:
    root = write_package(tmp_path, {**_TOY_FILES, **files})
    doc = DOC_OF_A_TOY_PACKAGE
    return layering_faults(
        import_graph(root), layers_of(doc, "pkg"), shared_modules(doc, "pkg"), "pkg", stated_imports(doc)
    )


def test_the_map_is_read_as_layers_in_order(tmp_path: Path) -> None:
    assert layers_of(DOC_OF_A_TOY_PACKAGE, "pkg") == {
        "pkg.layout": 0, "pkg.log": 0, "pkg.registry": 1, "pkg.sub._cache": 1, "pkg.sub._agree": 1, "pkg.cli": 2,
    }
    assert shared_modules(DOC_OF_A_TOY_PACKAGE, "pkg") == {"pkg.log"}
    assert stated_imports(DOC_OF_A_TOY_PACKAGE) == {0: set(), 1: set(), 2: {1}}
    assert _toy_faults(tmp_path, {"layout.py": "from pkg import log\n"}) == []


def test_a_layer_importing_other_layers_than_it_names_is_named(tmp_path: Path) -> None:
    assert _toy_faults(tmp_path / "more", {"registry.py": "import pkg.layout\n"}) == [
        "layer 1 imports from the layers [0], its paragraph names []",
    ]
    assert _toy_faults(tmp_path / "fewer", {"cli/__init__.py": ""}) == [
        "layer 2 imports from the layers [], its paragraph names [1]",
    ]
    unnamed = DOC_OF_A_TOY_PACKAGE.replace("Imports from the layers above:\ngroups.\n\n", "")
    root = write_package(tmp_path / "unnamed", _TOY_FILES)
    faults = layering_faults(
        import_graph(root), layers_of(unnamed, "pkg"), shared_modules(unnamed, "pkg"), "pkg",
        stated_imports(unnamed),
    )
    assert faults == ["layer 2 imports from the layers [1], its paragraph names no layers"]


def test_an_import_from_a_lower_layer_is_named_type_checking_and_function_level_ones_too(tmp_path: Path) -> None:
    assert _toy_faults(tmp_path, {
        "layout.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.registry import build\n"
                     "def draw():\n    from pkg.sub import cache\n",
    }) == [
        "pkg.layout (layer 0) imports pkg.registry of the lower layer 1",
        "pkg.layout (layer 0) imports pkg.sub of the lower layer 1",
    ]


def test_a_module_outside_the_map_and_a_module_in_two_rows_are_named(tmp_path: Path) -> None:
    assert _toy_faults(tmp_path, {"stray.py": ""}) == ["pkg.stray is in no row of the module map"]
    twice = DOC_OF_A_TOY_PACKAGE.replace("- `log.py`:", "- `log.py`, `registry.py`:")
    try:
        layers_of(twice, "pkg")
    except ValueError as error:
        assert str(error) == "pkg.registry is in two rows of the module map"
    else:  # pragma: no cover - the assertion above is the test
        raise AssertionError("a module in two rows was not refused")

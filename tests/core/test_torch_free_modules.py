"""The modules docs/architecture.md's module map calls torch-free import no torch.

A row of the map (``- `a.py`, `b.py`: job``) whose text says "torch-free" claims it for each module it
names; each is imported alone in a fresh interpreter, which must not have loaded torch afterwards. The
allowlist's pre-commit hook and the command table rely on these modules staying light.
"""

from __future__ import annotations

import subprocess
import sys

from test_layers import _MODULES_OF_ITEM, DOC, _joined_lines, _module_map, modules_of_item


def torch_free_modules(doc: str, package: str) -> list[str]:
    """The modules of the map's rows whose text says torch-free, in the map's order."""
    modules: list[str] = []
    for line in _joined_lines(_module_map(doc)):
        item = _MODULES_OF_ITEM.match(line)
        if item is not None and "torch-free" in line:
            modules += modules_of_item(item["modules"], package)
    return modules


def modules_loading_torch(modules: list[str]) -> list[str]:
    """Those of ``modules`` that, imported alone in a fresh interpreter, load torch."""
    loading = []
    for module in modules:
        check = f"import sys, {module}; sys.exit('torch' in sys.modules)"
        if subprocess.run([sys.executable, "-c", check], check=False, timeout=60).returncode:
            loading.append(module)
    return loading


def test_the_map_calls_some_modules_torch_free() -> None:
    named = torch_free_modules(DOC.read_text(encoding="utf-8"), "pgregistry")
    assert {"pgregistry.layout", "pgregistry._runtime.flags", "pgregistry._source.scanner"} <= set(named)


def test_every_module_the_map_calls_torch_free_imports_no_torch() -> None:
    assert modules_loading_torch(torch_free_modules(DOC.read_text(encoding="utf-8"), "pgregistry")) == []


def test_a_module_that_loads_torch_is_named() -> None:
    assert modules_loading_torch(["pgregistry._runtime.flags", "pgregistry.rng"]) == ["pgregistry.rng"]

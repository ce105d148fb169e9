"""The package root: every public name resolves, ``__all__`` lists them all, and importing it loads no torch."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pgregistry


def test_all_lists_the_eager_and_every_lazy_name() -> None:
    eager = {
        "NOT_MEMBER", "UNSET", "ParallelLayout", "ProcessGroupCollection", "ProcessGroupFallbackWarning", "attach",
        "collection_of",
    }
    assert set(pgregistry.__all__) == eager | set(pgregistry._LAZY)
    for name in pgregistry.__all__:
        assert getattr(pgregistry, name) is not None


def test_lazy_names_are_their_modules_objects() -> None:
    for name, module in pgregistry._LAZY.items():
        assert getattr(pgregistry, name) is getattr(importlib.import_module(module), name), name


def test_unknown_name_raises_attribute_error() -> None:
    try:
        pgregistry.no_such_name  # noqa: B018
    except AttributeError as exc:
        assert str(exc) == "module 'pgregistry' has no attribute 'no_such_name'"
    else:  # pragma: no cover - the assertion above is the test
        raise AssertionError("expected AttributeError")


def test_star_import_loads_torch_only_on_first_use() -> None:
    code = (
        "import sys, pgregistry; assert 'torch' not in sys.modules; "
        "assert {'build', 'grad_norm'} <= set(pgregistry._LAZY) <= set(dir(pgregistry)); "
        "assert {'attach', 'collection_of'} <= set(dir(pgregistry)); "
        "pgregistry.grad_norm; assert 'torch' in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)

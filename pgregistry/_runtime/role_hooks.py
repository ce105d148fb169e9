"""Install :mod:`pgregistry.params`'s registration hooks once pgregistry and torch are imported.

Roles set as plain attributes (Megatron-Core's ``shared``, ``allreduce``, ``tensor_model_parallel``)
survive ``fully_shard`` only if torch's parameter-registration hook saw the parameter when the model
was built (:mod:`pgregistry.params`). Installing it only when :mod:`pgregistry.params` happened to
be imported made the grad norm depend on import order: Megatron-Core's tie was counted twice (8.3079
for 6.5945) unless the helpers were imported before the model was built. ``import pgregistry`` must
not import torch, so the package root calls :func:`install`: with torch already imported it imports
:mod:`pgregistry.params` now; otherwise it waits for torch's import (a finder on ``sys.meta_path``
that lets the usual finders find torch, imports the helpers right after torch's module has run, and
leaves). Nothing is imported that the program would not import anyway.
"""

from __future__ import annotations

import importlib.abc
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

__all__ = ["install"]


def install() -> None:
    """Import :mod:`pgregistry.params` now if torch is imported, else right after torch is."""
    if "torch" in sys.modules:
        _import_helpers()
    elif not any(isinstance(finder, _AfterTorch) for finder in sys.meta_path):
        sys.meta_path.insert(0, _AfterTorch())


class _AfterTorch(importlib.abc.MetaPathFinder):
    """Finds nothing itself: has the helpers imported once torch's module has run.

    Asked for torch, it asks the finders after it for torch's spec and has its loader import the
    helpers once torch's module has run; it leaves ``sys.meta_path`` then (a spec asked for without
    an import, ``importlib.util.find_spec("torch")``, leaves it in place)."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> Any:
        if fullname != "torch":
            return None
        spec = None
        for finder in sys.meta_path[sys.meta_path.index(self) + 1 :]:
            find = getattr(finder, "find_spec", None)
            if find is not None and (spec := find(fullname, path, target)) is not None:
                break
        loader = spec.loader if spec is not None else None
        if loader is None:
            return spec
        run = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run(module)
            if self in sys.meta_path:
                sys.meta_path.remove(self)
            _import_helpers()

        try:
            loader.exec_module = exec_module
        except (
            AttributeError
        ):  # a loader without an instance dictionary: the helpers install on their import
            pass
        return spec


def _import_helpers() -> None:
    import pgregistry.params  # noqa: F401  (importing it installs the hooks)

"""The interop modules import without the framework they bridge (and without torch): the framework is imported
inside their functions, so ``import pgregistry.interop.<framework>`` works where the optional extra is missing."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize("module, framework", [("megatron", "megatron"), ("torchtitan", "torchtitan")])
def test_interop_module_imports_without_its_framework_or_torch(module: str, framework: str) -> None:
    code = (
        f"import sys; sys.modules[{framework!r}] = None; "  # `import {framework}` now raises ImportError
        f"import pgregistry.interop.{module}; assert 'torch' not in sys.modules, 'torch was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)

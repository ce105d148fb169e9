#!/usr/bin/env python3
"""The pre-commit entry of the ``pgregistry-allowlist`` hook: the allowlist command with the
standard library alone.

pre-commit installs a ``language: python`` hook with ``pip install .``, which would pull in
pgregistry's runtime dependencies (torch, hundreds of MB, plus attrs and structlog) for a scanner
that needs none of them. So the hook is ``language: script``: pre-commit runs this file from its
clone of the pgregistry repository with the machine's ``python3`` and installs nothing. It registers
the ``pgregistry`` package from that clone without executing ``pgregistry/__init__.py`` (which
imports attrs) and runs the torch-free ``pgregistry.allowlist`` sub-package. Python 3.11+ (3.10 also
needs ``tomli`` to read ``pyproject.toml``).
"""

from __future__ import annotations

import sys
import types
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "pgregistry"


def main(argv: list[str]) -> int:
    package = types.ModuleType(
        "pgregistry", "pgregistry's allowlist scanner, loaded without its dependencies"
    )
    package.__path__ = [str(PACKAGE)]
    sys.modules["pgregistry"] = package
    from pgregistry.allowlist import main as allowlist

    return allowlist(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Regenerate this repository's allowlist of reads of global process-group state.

Run it after removing a read (the check then reports a stale entry) or, with a reviewer's agreement,
after adding one: ``python tools/regenerate_allowlist.py``. It is ``pgregistry allowlist update``
run from the repository root with the settings in ``pyproject.toml`` ([tool.pgregistry.allowlist]),
followed by the check, so it fails (exit 2) on a source file that does not parse. Extra arguments go
to both commands (e.g. ``--format json``).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def main(argv: list[str]) -> int:
    os.chdir(REPO)
    sys.path.insert(0, str(REPO))
    from pgregistry.allowlist import main as allowlist

    code = allowlist(["update", *argv])
    return code if code else allowlist(["check", *argv])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""The git directory a benchmark reads a project's history from, checked before any work starts.

The benchmarks over real trees (Megatron-LM, projects built on it) take its path on the command line;
a path that is no repository failed deep inside the run with git's exit status 128 and a traceback.
Torch-free, as the allowlist benchmarks that use it are.
"""

from __future__ import annotations

import argparse
import subprocess
from pathlib import Path

__all__ = ["git_directory"]


def git_directory(text: str) -> Path:
    """The absolute git directory of ``text`` (a bare clone, a checkout's ``.git`` or the checkout),
    for ``git --git-dir`` and ``git -C`` alike; an argparse type, so a path that is no repository is
    a usage error naming it (exit 2)."""
    found = subprocess.run(
        ["git", "-C", text, "rev-parse", "--absolute-git-dir"], capture_output=True, text=True, check=False
    )
    if found.returncode != 0:
        raise argparse.ArgumentTypeError(
            f"{text} is no git repository (give a bare clone, a checkout or its .git): "
            f"{found.stderr.strip()}"
        )
    return Path(found.stdout.strip())

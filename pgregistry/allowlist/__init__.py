"""The allowlist ratchet: find every read of global process-group state, fail CI on new ones, shrink only.

``pgregistry allowlist check|update|stats`` scans Python sources with :mod:`ast` (never importing them, never
importing torch) and compares what it finds with a committed allowlist keyed by file, enclosing scope and
accessor, so edits that only move code do not disturb it. The scan, its settings and the files it covers are
:mod:`pgregistry._source`'s (shared with ``pgregistry migrate``, which rewrites the same reads). The modules here:

- :mod:`~pgregistry.allowlist._ratchet`: the allowlist file and the comparison with a scan;
- :mod:`~pgregistry.allowlist._moves`: stale and new entries paired as reads moved by a refactor;
- :mod:`~pgregistry.allowlist._baseline`: what a git revision tells (renames, added sites, the tree then);
- :mod:`~pgregistry.allowlist._megatron_list`: importing Megatron-LM's line-keyed allowlist;
- :mod:`~pgregistry.allowlist._report`: text, JSON and GitHub-annotation output;
- :mod:`~pgregistry.allowlist._cli`: the ``allowlist`` sub-command.

``pgregistry migrate``, which rewrites the reads this package finds, is its own package:
:mod:`pgregistry.migrate`.

This package root imports nothing at load, so ``import pgregistry.allowlist`` stays as cheap as
``import pgregistry``. Its one name, :func:`main`, is the command itself: what ``python -m pgregistry.allowlist``,
the pre-commit hook and ``pgregistry migrate --write`` (which regenerates the allowlist) run.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``allowlist check|update|stats|import`` on ``argv`` (``sys.argv[1:]`` when None), as
    ``python -m pgregistry.allowlist`` does; returns the exit code (0 ok, 1 check failed, 2 error)."""
    from pgregistry.allowlist._cli import main as run_command

    return run_command(argv)

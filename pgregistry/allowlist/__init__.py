"""The allowlist ratchet: find every read of global process-group state, fail CI on new ones.

The allowlist only shrinks.

``pgregistry allowlist check|update|stats|import`` scans Python sources with :mod:`ast` (never
importing them, never importing torch) and compares what it finds with a committed allowlist keyed
by file, enclosing scope and accessor, so edits that only move code do not disturb it. The scan,
its settings and the files it covers are :mod:`pgregistry._source`'s (shared with ``pgregistry
migrate``, which rewrites the same reads). The modules here:

- :mod:`~pgregistry.allowlist._ratchet`: the allowlist file and the comparison with a scan;
- :mod:`~pgregistry.allowlist._moves`: stale and new entries paired as reads moved by a refactor;
- :mod:`~pgregistry.allowlist._baseline`: what a git revision tells (renames, added sites, the tree
  then);
- :mod:`~pgregistry.allowlist._megatron_list`: importing Megatron-LM's line-keyed allowlist;
- :mod:`~pgregistry.allowlist._report`: text, JSON and GitHub-annotation output;
- :mod:`~pgregistry.allowlist._cli`: the ``allowlist`` sub-command.

``pgregistry migrate``, which rewrites the reads this package finds, is its own package:
:mod:`pgregistry.migrate`.

This package root imports nothing at load, so ``import pgregistry.allowlist`` stays as cheap as
``import pgregistry``. Its one name, :func:`main`, is the command itself: what ``python -m
pgregistry.allowlist``, the pre-commit hook and ``pgregistry migrate --write`` (which regenerates
the allowlist) run.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the allowlist's ``check``, ``update``, ``stats`` or ``import`` action on ``argv``.

    What ``python -m pgregistry.allowlist`` runs: the ratchet's command line without the rest of
    the ``pgregistry`` CLI (``pgregistry allowlist ...`` runs the same actions).

    Args:
        argv: The action and its options (``None``: ``sys.argv[1:]``).

    Returns:
        The exit code: 0 ok, 1 the check failed (a new read of global process-group state, or a
        stale entry), 2 an error (bad input or an OS error, named on stderr).

    Raises:
        SystemExit: For a usage error argparse catches (code 2), and after ``--help`` (code 0).

    Example::

        code = main(["check"])  # 1 when the scan finds a read the allowlist does not allow
    """
    from pgregistry.allowlist._cli import main as run_command

    return run_command(argv)

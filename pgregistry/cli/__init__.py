"""The ``pgregistry`` command line: the command table and :func:`main`.

One convention for every command: a module of this package (:mod:`~pgregistry.cli._layout`,
:mod:`~pgregistry.cli._seed_plan`, :mod:`~pgregistry.cli._verify`,
:mod:`~pgregistry.cli._allowlist`, :mod:`~pgregistry.cli._migrate`) exposes
``add_command(subparsers)``, which adds the command's parser (with ``help`` text on every option)
and sets ``handler``, a callable taking the parsed namespace and returning the exit code. Bad input
is reported as ``pgregistry COMMAND: error: ...`` on stderr.

Exit codes: 0 success, 1 a check failed, 2 a usage error or bad input (argparse's own convention).

The command modules must not import torch at module load: ``pgregistry allowlist`` runs in lint jobs
where torch is absent or slow to import, so torch is imported inside handlers only.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Sequence

from pgregistry._runtime.exact_options import ExactOptionParser

__all__ = ["main"]

_COMMAND_MODULES: tuple[str, ...] = (
    "pgregistry.cli._layout",
    "pgregistry.cli._allowlist",
    "pgregistry.cli._migrate",
    "pgregistry.cli._seed_plan",
    "pgregistry.cli._verify",
)
"""The modules whose ``add_command`` registers a sub-command, in ``--help`` order."""


def _build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every sub-command registered."""
    parser = ExactOptionParser(
        prog="pgregistry",
        description="Explicit process-group collections for distributed PyTorch training.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module_name in _COMMAND_MODULES:
        importlib.import_module(module_name).add_command(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` and run the chosen sub-command; returns the process exit code.

    The ``pgregistry`` console script's entry point; callable from Python for scripts and tests.

    Args:
        argv: The arguments after the program name (``None``: ``sys.argv[1:]``).

    Returns:
        0 on success, 1 when a check failed, 2 for bad input the command reported itself (its
        message ``pgregistry COMMAND: error: ...`` on stderr).

    Raises:
        SystemExit: With code 2 for a usage error argparse catches (an unknown command or option),
            and with 0 after ``--help``, as argparse does.

    Example::

        main(["layout", "--num-ranks", "4", "--tp", "2"])  # prints the table of groups; 0
        main(["layout", "--num-ranks", "4", "--tp", "3"])  # "... not divisible ..."; 2
    """
    args = _build_parser().parse_args(argv)
    code: int = args.handler(args)
    return code

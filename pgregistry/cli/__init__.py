"""The ``pgregistry`` command line: the command table and :func:`main`.

One convention for every command: a module of this package (:mod:`~pgregistry.cli._layout`,
:mod:`~pgregistry.cli._seed_plan`, :mod:`~pgregistry.cli._verify`,
:mod:`~pgregistry.cli._allowlist`, :mod:`~pgregistry.cli._migrate`) exposes
``add_command(subparsers)``, which adds the command's parser (with ``help`` text on every option)
and sets ``handler``, a callable taking the parsed namespace and returning the exit code. Bad input
is reported as ``pgregistry COMMAND: error: ...`` on stderr.

Exit codes: 0 success, 1 a check failed, 2 a usage error or bad input (argparse's own convention);
141 when the reader of standard output closed it first (``pgregistry layout ... | head``): the
shell's code for a command ended by ``SIGPIPE``, as ``cat`` or ``git`` end, so a pipeline under
``set -o pipefail`` still sees that the command did not finish.

The command modules must not import torch at module load: ``pgregistry allowlist`` runs in lint jobs
where torch is absent or slow to import, so torch is imported inside handlers only.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
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
        message ``pgregistry COMMAND: error: ...`` on stderr), 141 when standard output's reader
        closed it before the command finished (:data:`CLOSED_OUTPUT`).

    Raises:
        SystemExit: With code 2 for a usage error argparse catches (an unknown command or option),
            and with 0 after ``--help``, as argparse does.

    Example:
        >>> main(["layout", "--num-ranks", "4", "--tp", "2"])  # the table of groups on stdout
        layout: 4 ranks, order tp-cp-ep-dp-pp; tp 2, gtp_remat 1, cp 1, dp 2, pp 1, ...
        <BLANKLINE>
        kind                      spans                                groups  size  first groups
        tp                        dense tp                                  2     2  [0, 1] [2, 3]
        ...
        0
        >>> main(["layout", "--num-ranks", "4", "--tp", "3"])  # "... not divisible ..." on stderr
        2
    """
    args = _build_parser().parse_args(argv)
    try:
        code: int = args.handler(args)
        sys.stdout.flush()  # a closed pipe is found here when the output fit in the buffer
    except BrokenPipeError:
        _drop_standard_output()
        return CLOSED_OUTPUT
    return code


CLOSED_OUTPUT = 141
"""128 + ``SIGPIPE`` (13): the exit code when standard output's reader closed it first, the code a
shell gives a command that ``SIGPIPE`` ended. Not 0: what the command would have said after that
point (a failed check's 1) is unknown."""


def _drop_standard_output() -> None:
    """Point standard output at ``os.devnull``.

    Python's flush at exit would raise on the closed pipe again and print a traceback (the remedy
    the ``signal`` module's documentation gives)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)

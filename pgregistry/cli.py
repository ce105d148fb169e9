"""The ``pgregistry`` command line.

Each sub-command lives beside the code it drives and exposes ``add_command(subparsers)``, which adds its parser
and sets ``handler`` (a callable taking the parsed namespace and returning an exit code). The modules named in
``_COMMAND_MODULES`` must not import torch at module load: ``pgregistry allowlist`` runs in lint jobs where
torch is absent or slow to import, so torch is imported inside handlers only.

Exit codes: 0 success, 1 a check failed, 2 a usage error or bad input (argparse's own convention).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

__all__ = ["build_parser", "main"]

_COMMAND_MODULES: tuple[str, ...] = (
    "pgregistry.layout_cli",
    "pgregistry.allowlist.cli",
    "pgregistry.rng_cli",
    "pgregistry.demo.job",
    "pgregistry.verify",
)


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every sub-command registered."""
    parser = argparse.ArgumentParser(
        prog="pgregistry",
        description="Explicit process-group collections for distributed PyTorch training.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module_name in _COMMAND_MODULES:
        importlib.import_module(module_name).add_command(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` and run the chosen sub-command; returns the process exit code."""
    args = build_parser().parse_args(argv)
    code: int = args.handler(args)
    return code


if __name__ == "__main__":
    sys.exit(main())

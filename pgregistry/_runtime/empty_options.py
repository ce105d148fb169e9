"""Command-line options given an empty value, refused: ``--base "$BASE"`` with the CI var unset.

An empty string is falsy, so an option read as ``if args.base:`` passes as if it were left out
(``allowlist check --base ''`` checked without a base, ``layout --svg ''`` drew nothing), and an
empty path is ``Path('.')``, the current directory. Both command tables
(:mod:`pgregistry.allowlist._cli`, which also runs alone, and :mod:`pgregistry.cli`) name such an
option the same way through :func:`empty_option`. Torch-free.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping

__all__ = ["empty_option"]


def empty_option(args: argparse.Namespace, options: Mapping[str, tuple[str, str]]) -> str | None:
    """The message for the first of ``options`` whose value in ``args`` is empty or blank.

    ``options`` maps dest -> (option, what to set it to); for a repeatable or multi-value option,
    any of its values counts. None when none is."""
    for dest, (option, give) in options.items():
        value = getattr(args, dest, None)
        values = value if isinstance(value, list) else [value]
        if any(isinstance(v, str) and not v.strip() for v in values):
            return (
                f'{option} is empty (an unset variable, as in {option} "$VAR"?): set it to {give}'
            )
    return None

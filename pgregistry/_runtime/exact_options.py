"""The command line's parser class: an option is spelled in full, never taken from a prefix.

argparse by default reads any unambiguous prefix as the option it begins. ``seed-plan`` has no
``--rank`` (``layout`` has), so ``seed-plan --rank 2`` was read as ``--rank-offset 2`` and printed
the seeds of a layout moved to ranks 2 and up, exit 0. Sub-commands made by ``add_subparsers`` are
of their parent's class, so every level refuses prefixes alike.
"""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["ExactOptionParser"]


class ExactOptionParser(argparse.ArgumentParser):
    """An ``argparse.ArgumentParser`` with ``allow_abbrev=False`` unless told otherwise."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

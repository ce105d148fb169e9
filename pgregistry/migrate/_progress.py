"""Progress of a long ``migrate`` run, on stderr (never stdout, where the diff goes).

Quiet while a run is short.

Nothing is printed in a run's first :data:`QUIET_S` seconds; after that, a line at most every
:data:`EVERY_S` seconds, saying which step the run is in and how far it is (a generated 5 MB file,
or a large tree, takes long enough to look hung otherwise). Worker processes report their own share
the same way.
"""

from __future__ import annotations

import time
from typing import TextIO

__all__ = ["EVERY_S", "QUIET_S", "SILENT", "Progress"]

#: Seconds a run stays quiet; then seconds between two lines.
QUIET_S = 5.0
EVERY_S = 5.0


class Progress:
    """Where a run is, said now and then (module docstring); ``stream`` None: said nowhere."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = stream
        self.started = time.monotonic()
        self.said = self.started + QUIET_S - EVERY_S  # the first line comes QUIET_S after the start

    def __call__(self, step: str, done: int, total: int) -> None:
        """Say that ``done`` of ``total`` items of ``step`` are done, when it is time to."""
        if self.stream is None:
            return
        now = time.monotonic()
        if now - self.said < EVERY_S:
            return
        self.said = now
        print(
            f"pgregistry migrate: {step}: {done} of {total} ({now - self.started:.0f} s)",
            file=self.stream,
            flush=True,
        )


#: Progress said nowhere (the default of the engine, and of ``--quiet``).
SILENT = Progress()

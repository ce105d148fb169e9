"""The memory guard of commands enumerating every rank of a layout (``layout``, ``seed-plan``).

At 2**31 - 1 ranks a listing needs far more memory than a machine has free: instead of dying in the
allocator, or running for hours before it does, a command estimates what it needs from the layout's
arithmetic before enumerating anything, and exits 2 with the estimate and what would help. The
estimates are bytes per rank measured with ``ru_maxrss`` (in each command's module), with a margin.
"""

from __future__ import annotations

import os

__all__ = ["available_memory", "memory_shortfall", "not_enough_memory"]


def available_memory() -> int | None:
    """Bytes of memory available to a new allocation (Linux ``MemAvailable``); None if unknown."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def memory_shortfall(needed: int) -> int | None:
    """The bytes available if ``needed`` is more; None if it fits (or the platform won't tell)."""
    available = available_memory()
    return available if available is not None and needed > available else None


def not_enough_memory(doing: str, needed: int, available: int, advice: str) -> ValueError:
    """The error for a command needing ``needed`` bytes ``doing`` its work, with ``advice``."""
    return ValueError(
        f"{doing} needs about {needed / 2**30:.1f} GiB of memory, more "
        f"than the {available / 2**30:.1f} GiB available; {advice}"
    )

"""Adopting pgregistry under Megatron-LM's ratchet: its line-keyed allowlist to pgregistry's keys.

Megatron-LM's pull request 6258 keeps ``tools/process_group_usage_allowlist.json``::

    {"_comment": "...",
     "allowed": {"megatron/core/x.py": ["120:accessor:parallel_state.get_x_group"]},
     "total": 1}

Line numbers break on any edit above a read, so the list cannot be carried over as it is.
``allowlist import --from FILE`` matches each of its entries to the read pgregistry finds on that
line of today's tree (same accessor), then writes pgregistry's allowlist of the whole scan. Every
entry must match: one that does not means the list and the tree disagree (Megatron's own check would
fail too), and nothing is written. The reads its rule does not see (fallback helpers, references,
gloo getters, the preset's accessors) are grandfathered as well and counted, so switching tools
changes what is allowed by exactly those, in the open.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from pgregistry._source.scanner import FileResult, Site
from pgregistry.allowlist._ratchet import AllowlistError, parse_json

__all__ = ["Imported", "match_megatron_list", "parse_megatron_list"]


def parse_megatron_list(text: str, name: str) -> dict[str, list[tuple[int, str]]]:
    """Path -> [(line, accessor)] from Megatron-LM's list (JSON).

    Raises :class:`AllowlistError` if it is malformed.
    """
    payload = parse_json(text, name, "JSON")
    allowed = payload.get("allowed") if isinstance(payload, dict) else None
    if not isinstance(allowed, dict) or "version" in payload:
        raise AllowlistError(
            f"{name}: not Megatron-LM's allowlist format (an object with 'allowed': path -> list)"
        )
    entries: dict[str, list[tuple[int, str]]] = {}
    for path, items in allowed.items():
        if not isinstance(items, list) or not all(isinstance(item, str) for item in items):
            raise AllowlistError(f"{name}: {path!r}: expected a list of 'line:kind:detail' strings")
        for item in items:
            line, _, rest = item.partition(":")
            detail = rest.partition(":")[2]
            if not line.isdigit() or not detail:
                raise AllowlistError(f"{name}: {path!r}: {item!r} is not 'line:kind:detail'")
            entries.setdefault(path, []).append((int(line), detail.rpartition(".")[2]))
    return entries


@dataclass(frozen=True)
class Imported:
    """The outcome of matching Megatron-LM's list to a scan."""

    matched: int
    unmatched: tuple[str, ...]
    unseen: Counter[str]


def match_megatron_list(
    entries: dict[str, list[tuple[int, str]]], results: Sequence[FileResult]
) -> Imported:
    """Megatron-LM's entries with no read on their line, and the reads its list does not hold.

    ``unmatched``: the entries with no read on their line, as ``path:line accessor``; ``unseen``:
    the reads of the scan that its list does not hold, by accessor."""
    sites: dict[str, list[Site]] = {result.path: list(result.sites) for result in results}
    covered: set[tuple[str, int, str]] = set()
    unmatched: list[str] = []
    for path, items in sorted(entries.items()):
        for line, accessor in sorted(items):
            if any(site.line == line and site.accessor == accessor for site in sites.get(path, ())):
                covered.add((path, line, accessor))
            else:
                unmatched.append(f"{path}:{line} {accessor}")
    unseen = Counter(
        site.accessor
        for path, found in sites.items()
        for site in found
        if (path, site.line, site.accessor) not in covered
    )
    return Imported(len(covered), tuple(unmatched), unseen)

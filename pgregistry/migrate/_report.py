"""What ``pgregistry migrate`` did, per family: reads found, rewritten each way, left and why."""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Sequence

from pgregistry._source.scanner import FAMILIES, FileResult, family_of
from pgregistry.migrate._plan import REWRITTEN_WAYS, Read, Way
from pgregistry.migrate._spec_fields import SpecCallLeft

__all__ = ["render_failures", "render_report", "tally_reads_by_family"]


def render_failures(failures: Sequence[FileResult]) -> str:
    """One ``path:line:col: message`` line per file that cannot be migrated."""
    return "".join(
        f"{r.path}:{r.failure.line}:{r.failure.col}: {r.failure.message}\n"
        for r in failures
        if r.failure is not None
    )


def tally_reads_by_family(reads: Sequence[tuple[str, Read]]) -> dict[str, Counter[str]]:
    """Per family: ``found`` and each way's count (``in-scope``, ``threaded``, ``fallback``, ...).

    The ways are ``in-scope``, ``threaded``, ``fallback`` and ``left``.
    """
    table: dict[str, Counter[str]] = {family: Counter() for family in FAMILIES}
    for _, read in reads:
        row = table[family_of(read.site)]
        row["found"] += 1
        row[read.way] += 1
    return table


def render_report(
    reads: Sequence[tuple[str, Read]],
    threaded: int,
    passed: int,
    changed: int,
    verb: str,
    spec_calls_left: Sequence[SpecCallLeft] = (),
) -> str:
    """The table per family, then every read left in place and every spec call left, with reasons.

    The reads left in place are grouped by reason (``path:line accessor``); every call of a spec's
    field left without the collection (``spec_calls_left``) comes with its reason. ``verb``: what
    happened to the ``changed`` files (``"would change"``, ``"changed"``)."""
    table = tally_reads_by_family(reads)
    columns = ("found", *REWRITTEN_WAYS, Way.LEFT)
    lines = [f"{'family':<10}" + "".join(f"{c:>10}" for c in columns)]
    for family in FAMILIES:
        row = table[family]
        if row["found"]:
            lines.append(f"{family:<10}" + "".join(f"{row[c]:>10}" for c in columns))
    total = Counter[str]()
    for row in table.values():
        total.update(row)
    lines.append(f"{'total':<10}" + "".join(f"{total[c]:>10}" for c in columns))
    lines.append(
        f"{changed} file{'s' if changed != 1 else ''} {verb}; a collection "
        f"threaded into {threaded} function{'s' if threaded != 1 else ''}; "
        f"{passed} call{'s' if passed != 1 else ''} now pass one"
    )
    left: defaultdict[str, list[str]] = defaultdict(list)
    for path, read in reads:
        if read.way == Way.LEFT:
            left[read.reason].append(
                f"{path}:{read.site.line} {read.site.expr} ({family_of(read.site)})"
            )
    for call in spec_calls_left:
        built = f"{call.field} (local)" if call.local else f"submodules.{call.field} (spec field)"
        left[call.reason].append(f"{call.path}:{call.line} {built}")
    if left:
        lines.append("left in place:")
        for reason, where in sorted(left.items(), key=lambda item: (-len(item[1]), item[0])):
            lines.append(f"  {len(where)} {reason}")
            lines += [f"      {spot}" for spot in where]
    return "\n".join(lines) + "\n"

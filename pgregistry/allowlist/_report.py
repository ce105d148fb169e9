"""What the allowlist commands print: ``text`` for people, ``json`` for tools, ``github`` for
workflow annotations (``::error file=...,line=...::message``, shown inline on the pull request's
diff)."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pgregistry._source.fields import fix_for
from pgregistry._source.scanner import FAMILIES, FileResult, Site, family_of
from pgregistry.allowlist._moves import Move
from pgregistry.allowlist._ratchet import Allowlist, Comparison, Mismatch

__all__ = [
    "FORMATS",
    "Baseline",
    "render_check",
    "render_failures",
    "render_skipped",
    "render_stats",
    "render_update",
]

FORMATS = ("text", "json", "github")

UPDATE = "`pgregistry allowlist update`"

_FIX_TAIL = f"; if the read must stay for now, run {UPDATE} and commit the allowlist"
_FIX_STALE = f"run {UPDATE} to shrink the allowlist (it may only shrink) and commit it"
_FIX_MOVED = f"not a failure; run {UPDATE} to rewrite their keys"
_FIX_SHRINK = (
    f"can shrink: run {UPDATE} and commit the smaller "
    "allowlist (not a failure against the base revision)"
)
_FIX_SLACK = (
    "the allowlist lists {listed}, but the base revision reads "
    "{allowed}: a removed read's leftover entry does not allow a new one. "
    f"If the read must stay, run {UPDATE} on the base branch first, then here"
)

#: GitHub shows about 10 error annotations per step; past this many keys, the rest go to the log
#: only.
GITHUB_ANNOTATION_CAP = 10


def _to_json(payload: Any) -> str:
    return json.dumps(payload, indent=2, sort_keys=True) + "\n"


def _escape_for_workflow(text: str, property_value: bool = False) -> str:
    text = text.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")
    return text.replace(":", "%3A").replace(",", "%2C") if property_value else text


def _format_annotation(
    title: str,
    message: str,
    path: str,
    line: int | None = None,
    col: int | None = None,
    level: str = "error",
) -> str:
    where = f"file={_escape_for_workflow(path, True)}"
    if line is not None:
        where += f",line={line}" + (f",col={col}" if col is not None else "")
    return (
        f"::{level} {where},title={_escape_for_workflow(title, True)}"
        f"::{_escape_for_workflow(message)}"
    )


def render_skipped(skipped: Sequence[tuple[str, str]], fmt: str) -> str:
    """Files left out of the scan, each with why: listed, never silent (allowlist entries kept)."""
    if fmt == "github":
        title = "pgregistry allowlist: file not scanned"
        return "".join(
            _format_annotation(title, why, path, level="warning") + "\n" for path, why in skipped
        )
    return "".join(
        f"{path}: warning: {why}; its allowlist entries are kept, not checked\n"
        for path, why in skipped
    )


def _plural_of(count: int, word: str, plural: str | None = None) -> str:
    return f"{count} {word if count == 1 else plural or word + 's'}"


def render_failures(failures: Sequence[FileResult], fmt: str) -> str:
    """Files that could not be parsed: always an error (exit 2), never a skip."""
    summary = (
        f"pgregistry allowlist: {_plural_of(len(failures), 'file')} could not be parsed; fix "
        "them and re-run (a file the scanner cannot read could hide any number of reads)"
    )
    if fmt == "json":
        errors = [
            {
                "path": r.path,
                "line": r.failure.line,
                "col": r.failure.col,
                "message": r.failure.message,
                "needs_python": r.failure.needs or None,
            }
            for r in failures
            if r.failure is not None
        ]
        return _to_json({"ok": False, "errors": errors})
    lines = []
    for result in failures:
        failure = result.failure
        assert failure is not None
        if fmt == "github":
            title = "pgregistry allowlist: unparseable source"
            lines.append(
                _format_annotation(title, failure.message, result.path, failure.line, failure.col)
            )
        else:
            lines.append(f"{result.path}:{failure.line}:{failure.col}: error: {failure.message}")
    return "\n".join([*lines, summary]) + "\n"


def _describe_site(site: Site) -> str:
    return f"{site.form} of {site.accessor} (`{site.expr}`) in {site.scope}"


def _how_to_fix(item: Mismatch, stale_fails: bool = True) -> str:
    if not item.is_new:
        return _FIX_STALE if stale_fails else _FIX_SHRINK
    if item.listed is not None:
        return (
            fix_for(item.sites[0])
            + "; "
            + _FIX_SLACK.format(listed=item.listed, allowed=item.allowed)
        )
    return fix_for(item.sites[0]) + _FIX_TAIL


def _sites_shown(item: Mismatch) -> tuple[Site, ...]:
    """The sites to point at for a new read: the added ones if a base revision told them apart.

    Else all of them.
    """
    return item.added or item.sites


def _describe_counts(item: Mismatch) -> str:
    moved = f", {item.moved} moved here" if item.is_new and item.moved else ""
    moved = f", {item.moved} moved away" if not item.is_new and item.moved else moved
    return f"found {item.found}, allowed {item.allowed} in this scope{moved}"


def _mismatch_json(item: Mismatch, stale_fails: bool) -> dict[str, Any]:
    scope, accessor, form = item.key.split("|")
    return {
        "path": item.path,
        "key": item.key,
        "scope": scope,
        "accessor": accessor,
        "form": form,
        "allowed": item.allowed,
        "found": item.found,
        "moved": item.moved,
        "sites": [
            {"line": s.line, "col": s.col, "expr": s.expr, "family": s.family, "guarded": s.guarded}
            for s in item.sites
        ],
        "added_lines": [s.line for s in item.added],
        "listed": item.listed,
        "fix": _how_to_fix(item, stale_fails),
    }


def _move_json(move: Move) -> dict[str, Any]:
    return {
        "from": {"path": move.old_path, "key": move.old_key},
        "to": {"path": move.new_path, "key": move.new_key},
        "count": move.count,
    }


def _move_line(move: Move) -> str:
    where = (
        move.new_path if move.new_path == move.old_path else f"{move.old_path} -> {move.new_path}"
    )
    return f"{where}: moved {_plural_of(move.count, 'read')}: {move.old_key!r} -> {move.new_key!r}"


def _text_lines(comparison: Comparison) -> list[str]:
    """Per file, every new site and stale entry in line order, then the fix of each key once."""
    state = "global process-group state"
    lines: list[str] = []
    by_path: dict[str, list[Mismatch]] = {}
    for item in comparison.mismatches:
        by_path.setdefault(item.path, []).append(item)
    for path in sorted(by_path):
        located: list[tuple[int, int, str]] = []
        for item in by_path[path]:
            if item.is_new:
                for site in _sites_shown(item):
                    message = (
                        f"new read of {state}: {_describe_site(site)}; {_describe_counts(item)}"
                    )
                    located.append(
                        (site.line, site.col, f"{path}:{site.line}:{site.col}: {message}")
                    )
            else:
                first = item.sites[0] if item.sites else None
                message = f"stale allowlist entry {item.key!r}: {_describe_counts(item)}"
                if not comparison.stale_fails:
                    message = (
                        f"notice: allowlist entry {item.key!r} "
                        f"{_FIX_SHRINK}; {_describe_counts(item)}"
                    )
                where = f"{path}:{first.line}:{first.col}" if first else path
                located.append(
                    (first.line if first else 0, first.col if first else 0, f"{where}: {message}")
                )
        lines.extend(text for _, _, text in sorted(located))
        lines.extend(
            f"    fix for {item.key}: {_how_to_fix(item)}"
            for item in by_path[path]
            if item.is_new or comparison.stale_fails
        )
    return lines


def _github_lines(comparison: Comparison) -> list[str]:
    """One GitHub annotation per key (at its first added site), capped, then a summary.

    At most :data:`GITHUB_ANNOTATION_CAP` errors and as many notices (GitHub caps each level
    apart)."""
    annotations: list[str] = []
    notices: list[str] = []
    for item in sorted(
        comparison.mismatches,
        key=lambda m: (m.path, (_sites_shown(m) or m.sites or (None,))[0] or 0),
    ):
        if item.is_new:
            flagged = _sites_shown(item)
            others = ", ".join(str(site.line) for site in flagged[1:])
            also = f" (also line {others})" if others else ""
            message = (
                f"new read: {_describe_site(flagged[0])}{also}; {_describe_counts(item)}. "
                f"Fix: {_how_to_fix(item)}."
            )
            annotations.append(
                _format_annotation(
                    "New global process-group read",
                    message,
                    item.path,
                    flagged[0].line,
                    flagged[0].col,
                )
            )
        else:
            first = item.sites[0] if item.sites else None
            line, col = (first.line, first.col) if first else (None, None)
            if comparison.stale_fails:
                message = (
                    f"stale allowlist entry {item.key!r}: "
                    f"{_describe_counts(item)}. Fix: {_how_to_fix(item)}."
                )
                annotations.append(
                    _format_annotation("Stale allowlist entry", message, item.path, line, col)
                )
            else:
                message = f"allowlist entry {item.key!r} {_FIX_SHRINK}; {_describe_counts(item)}."
                notices.append(
                    _format_annotation(
                        "Allowlist entry can shrink", message, item.path, line, col, "notice"
                    )
                )
    shown: list[str] = []
    for level, found in (("error", annotations), ("notice", notices)):
        shown += found[:GITHUB_ANNOTATION_CAP]
        if len(found) > GITHUB_ANNOTATION_CAP:
            shown.append(
                f"::{level} title=pgregistry allowlist::{len(found) - GITHUB_ANNOTATION_CAP} "
                "more allowlist finding(s) not annotated (GitHub shows about "
                f"{GITHUB_ANNOTATION_CAP} per step); every finding is listed in the log below"
            )
    overflow = max(len(annotations), len(notices)) > GITHUB_ANNOTATION_CAP
    return shown + _text_lines(comparison) if overflow else shown


def render_check(
    comparison: Comparison, allowlist: Allowlist, files: int, allowlist_name: str, fmt: str
) -> str:
    """Each new read and stale entry with file:line and the fix, the moved reads; then a verdict."""
    state = "global process-group state"
    moved = sum(move.count for move in comparison.moves)
    moved_text = f"; {_plural_of(moved, 'read')} moved ({_FIX_MOVED})" if moved else ""
    if comparison.ok:
        shrink = len(comparison.stale)
        shrink_text = (
            f"; {_plural_of(shrink, 'entry', 'entries')} can shrink (run {UPDATE})"
            if shrink
            else ""
        )
        verdict = (
            f"allowlist check passed: {_plural_of(allowlist.total, 'allowed read')} of "
            f"{state} in {_plural_of(len(allowlist.entries), 'file')}; "
            f"{_plural_of(files, 'file')} scanned ({allowlist_name}){moved_text}{shrink_text}"
        )
    else:
        verdict = (
            f"allowlist check failed: {_plural_of(comparison.new_sites, 'new read')} of {state}, "
            f"{_plural_of(len(comparison.stale), 'stale entry', 'stale entries')}"
            f"{'' if comparison.stale_fails else ' (not failures: they can shrink)'} "
            f"({allowlist_name}){moved_text}"
        )
    if fmt == "json":
        return _to_json(
            {
                "ok": comparison.ok,
                "allowlist": allowlist_name,
                "files_scanned": files,
                "new": [_mismatch_json(item, comparison.stale_fails) for item in comparison.new],
                "stale": [
                    _mismatch_json(item, comparison.stale_fails) for item in comparison.stale
                ],
                "stale_fails": comparison.stale_fails,
                "moved": [_move_json(move) for move in comparison.moves],
            }
        )
    lines = _github_lines(comparison) if fmt == "github" else _text_lines(comparison)
    lines += [_move_line(move) for move in comparison.moves]
    return "\n".join([*lines, verdict]) + "\n"


def render_update(
    previous: Allowlist | None, current: Allowlist, name: str, changed: bool, fmt: str
) -> str:
    before = previous.entries if previous is not None else {}
    added = removed = 0
    for path in set(before) | set(current.entries):
        old, new = before.get(path, {}), current.entries.get(path, {})
        for key in set(old) | set(new):
            delta = new.get(key, 0) - old.get(key, 0)
            added, removed = added + max(delta, 0), removed + max(-delta, 0)
    if fmt == "json":
        return _to_json(
            {
                "ok": True,
                "allowlist": name,
                "changed": changed,
                "total": current.total,
                "previous_total": previous.total if previous is not None else None,
                "added": added,
                "removed": removed,
            }
        )
    state = "updated" if changed else "unchanged"
    return (
        f"allowlist {state}: {name} allows {_plural_of(current.total, 'read')} in "
        f"{_plural_of(len(current.entries), 'file')} (+{added} added, -{removed} removed)\n"
    )


def _directory_at_depth(path: str, depth: int) -> str:
    parts = path.split("/")[:-1]
    return "/".join(parts[:depth]) or "."


@dataclass(frozen=True)
class Baseline:
    """The scan of the tree at an earlier revision, for ``stats --since``."""

    rev: str
    results: Sequence[FileResult]


def _tally_sites(results: Sequence[FileResult], depth: int) -> tuple[Counter[str], Counter[str]]:
    families: Counter[str] = Counter()
    directories: Counter[str] = Counter()
    for result in results:
        for site in result.sites:
            families[family_of(site)] += 1
            directories[_directory_at_depth(result.path, depth)] += 1
    return families, directories


def _burn_down_bar(now: int, then: int, width: int = 20) -> str:
    """``now`` as a share of ``then`` (or itself): filled cells remain, empty ones were burnt."""
    scale = max(then, now, 1)
    filled = round(width * now / scale)
    return "#" * filled + "." * (round(width * then / scale) - filled if then > now else 0)


def _format_table(
    title: str, now: Counter[str], then: Counter[str] | None, rev: str | None, order: Sequence[str]
) -> list[str]:
    names = [name for name in order if now.get(name) or (then and then.get(name))]
    width = max([len(title), *map(len, names)])
    if then is None:
        rows = [f"{title:<{width}}  {'reads':>7}"]
        rows += [f"{name:<{width}}  {now[name]:>7}" for name in names]
        return rows
    label = f"at {rev}"
    column = max(len(label), 7)
    rows = [f"{title:<{width}}  {label:>{column}}  {'now':>7}  {'change':>7}"]
    for name in names:
        change = now[name] - then[name]
        bar = _burn_down_bar(now[name], then[name])
        rows.append(f"{name:<{width}}  {then[name]:>{column}}  {now[name]:>7}  {change:>+7}  {bar}")
    total_now, total_then = sum(now.values()), sum(then.values())
    rows.append(
        f"{'total':<{width}}  {total_then:>{column}}  {total_now:>7}  {total_now - total_then:>+7}"
    )
    return rows


def render_stats(
    results: Sequence[FileResult],
    allowed: Allowlist | None,
    fmt: str,
    since: Baseline | None = None,
    depth: int = 2,
) -> str:
    """Counts of the sites found by family and directory, then by accessor, file and scope.

    By family and directory against ``since`` when given; by accessor, file and scope largest first.
    ``allowed``: the allowlist's entries for the paths scanned only."""
    sites = [(result.path, site) for result in results for site in result.sites]
    by_accessor = Counter(site.accessor for _, site in sites)
    by_file = Counter(path for path, _ in sites)
    by_scope = Counter((path, site.scope) for path, site in sites)
    by_form = Counter(site.form for _, site in sites)
    by_family, by_directory = _tally_sites(results, depth)
    then = _tally_sites(since.results, depth) if since is not None else None

    def rank_by_count(counter: Counter[Any]) -> list[tuple[Any, int]]:
        return sorted(counter.items(), key=lambda item: (-item[1], item[0]))

    if fmt == "json":
        payload: dict[str, Any] = {
            "total": len(sites),
            "files": len(by_file),
            "allowed_total": allowed.total if allowed is not None else None,
            "by_family": dict(by_family),
            "by_directory": dict(by_directory),
            "by_accessor": dict(by_accessor),
            "by_form": dict(by_form),
            "by_file": dict(by_file),
            "by_scope": [
                {"path": p, "scope": s, "count": n} for (p, s), n in rank_by_count(by_scope)
            ],
        }
        if since is not None and then is not None:
            payload["since"] = {
                "rev": since.rev,
                "total": sum(then[0].values()),
                "by_family": dict(then[0]),
                "by_directory": dict(then[1]),
            }
        return _to_json(payload)
    allowed_text = (
        f"; the allowlist allows {allowed.total} of them here" if allowed is not None else ""
    )
    rev = since.rev if since is not None else None
    directories = sorted(
        set(by_directory) | set(then[1] if then else ()), key=lambda d: (-by_directory[d], d)
    )
    lines = [
        f"{_plural_of(len(sites), 'read')} of global process-group "
        f"state in {_plural_of(len(by_file), 'file')}{allowed_text}",
        "by form: " + ", ".join(f"{form} {count}" for form, count in rank_by_count(by_form)),
        "",
        *_format_table("family", by_family, then[0] if then else None, rev, FAMILIES),
        "",
        *_format_table("directory", by_directory, then[1] if then else None, rev, directories),
        "",
        "by accessor:",
        *(f"{count:7d}  {accessor}" for accessor, count in rank_by_count(by_accessor)),
        "",
        "by file:",
        *(f"{count:7d}  {path}" for path, count in rank_by_count(by_file)),
        "",
        "by scope:",
        *(f"{count:7d}  {path}  {scope}" for (path, scope), count in rank_by_count(by_scope)),
    ]
    return "\n".join(lines) + "\n"

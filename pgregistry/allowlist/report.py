"""What the allowlist commands print: ``text`` for people, ``json`` for tools, ``github`` for workflow
annotations (``::error file=...,line=...::message``, shown inline on the pull request's diff)."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from typing import Any

from pgregistry.allowlist.ratchet import Allowlist, Comparison, Mismatch
from pgregistry.allowlist.scanner import LEGACY, REGISTRY, SHIM, FileResult, Site

__all__ = ["FORMATS", "render_check", "render_failures", "render_skipped", "render_stats", "render_update"]

FORMATS = ("text", "json", "github")

UPDATE = "`pgregistry allowlist update`"

_FIX_NEW = {
    LEGACY: "take the group from the ProcessGroupCollection the caller passes in (e.g. `pg_collection.tp`) "
    "instead of reading parallel_state",
    REGISTRY: "pass a ProcessGroupCollection down instead of reading pgregistry's global grid",
    SHIM: "build the collection once at start-up and pass it down instead of copying the globals with a shim",
}
_FIX_TAIL = f"; if the read must stay for now, run {UPDATE} and commit the allowlist"
_FIX_STALE = f"run {UPDATE} to shrink the allowlist (it may only shrink) and commit it"


def _json(payload: Any) -> str:
    return json.dumps(payload, indent=2, sort_keys=True) + "\n"


def _escape(text: str, property_value: bool = False) -> str:
    text = text.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")
    return text.replace(":", "%3A").replace(",", "%2C") if property_value else text


def _annotation(
    title: str,
    message: str,
    path: str,
    line: int | None = None,
    col: int | None = None,
    level: str = "error",
) -> str:
    where = f"file={_escape(path, True)}"
    if line is not None:
        where += f",line={line}" + (f",col={col}" if col is not None else "")
    return f"::{level} {where},title={_escape(title, True)}::{_escape(message)}"


def render_skipped(skipped: Sequence[tuple[str, str]], fmt: str) -> str:
    """Files left out of the scan, each with why: listed, never silent (their allowlist entries are kept)."""
    if fmt == "github":
        title = "pgregistry allowlist: file not scanned"
        return "".join(_annotation(title, why, path, level="warning") + "\n" for path, why in skipped)
    return "".join(f"{path}: warning: {why}; its allowlist entries are kept, not checked\n" for path, why in skipped)


def _plural(count: int, word: str, plural: str | None = None) -> str:
    return f"{count} {word if count == 1 else plural or word + 's'}"


def render_failures(failures: Sequence[FileResult], fmt: str) -> str:
    """Files that could not be parsed: always an error (exit 2), never a skip."""
    summary = (
        f"pgregistry allowlist: {_plural(len(failures), 'file')} could not be parsed; fix them and re-run "
        "(a file the scanner cannot read could hide any number of reads)"
    )
    if fmt == "json":
        errors = [
            {"path": r.path, "line": r.failure.line, "col": r.failure.col, "message": r.failure.message}
            for r in failures
            if r.failure is not None
        ]
        return _json({"ok": False, "errors": errors})
    lines = []
    for result in failures:
        failure = result.failure
        assert failure is not None
        if fmt == "github":
            title = "pgregistry allowlist: unparseable source"
            lines.append(_annotation(title, failure.message, result.path, failure.line, failure.col))
        else:
            lines.append(f"{result.path}:{failure.line}:{failure.col}: error: {failure.message}")
    return "\n".join([*lines, summary]) + "\n"


def _describe(site: Site) -> str:
    return f"{site.form} of {site.accessor} (`{site.expr}`) in {site.scope}"


def _fix(item: Mismatch) -> str:
    if not item.is_new:
        return _FIX_STALE
    return _FIX_NEW[item.sites[0].family] + _FIX_TAIL


def _mismatch_json(item: Mismatch) -> dict[str, Any]:
    scope, accessor, form = item.key.split("|")
    return {
        "path": item.path,
        "key": item.key,
        "scope": scope,
        "accessor": accessor,
        "form": form,
        "allowed": item.allowed,
        "found": item.found,
        "sites": [{"line": s.line, "col": s.col, "expr": s.expr, "family": s.family} for s in item.sites],
        "fix": _fix(item),
    }


def render_check(
    comparison: Comparison, allowlist: Allowlist, files: int, allowlist_name: str, fmt: str
) -> str:
    """Each new read and each stale entry with its file:line and the fix; then a one-line verdict."""
    state = "global process-group state"
    if comparison.ok:
        verdict = (
            f"allowlist check passed: {_plural(allowlist.total, 'allowed read')} of {state} in "
            f"{_plural(len(allowlist.entries), 'file')}; {_plural(files, 'file')} scanned ({allowlist_name})"
        )
    else:
        verdict = (
            f"allowlist check failed: {_plural(comparison.new_sites, 'new read')} of {state}, "
            f"{_plural(len(comparison.stale), 'stale entry', 'stale entries')} ({allowlist_name})"
        )
    if fmt == "json":
        return _json(
            {
                "ok": comparison.ok,
                "allowlist": allowlist_name,
                "files_scanned": files,
                "new": [_mismatch_json(item) for item in comparison.new],
                "stale": [_mismatch_json(item) for item in comparison.stale],
            }
        )
    lines = []
    for item in comparison.mismatches:
        counts = f"found {item.found}, allowed {item.allowed} in this scope"
        if item.is_new:
            for site in item.sites:
                message = f"new read of {state}: {_describe(site)}; {counts}"
                if fmt == "github":
                    message += f". Fix: {_fix(item)}."
                    lines.append(
                        _annotation("New global process-group read", message, item.path, site.line, site.col)
                    )
                else:
                    lines.append(f"{item.path}:{site.line}:{site.col}: {message}")
        else:
            first = item.sites[0] if item.sites else None
            message = f"stale allowlist entry {item.key!r}: {counts}"
            if fmt == "github":
                message += f". Fix: {_fix(item)}."
                line, col = (first.line, first.col) if first else (None, None)
                lines.append(_annotation("Stale allowlist entry", message, item.path, line, col))
            else:
                where = f"{item.path}:{first.line}:{first.col}" if first else item.path
                lines.append(f"{where}: {message}")
        if fmt == "text":
            lines.append(f"    fix: {_fix(item)}")
    return "\n".join([*lines, verdict]) + "\n"


def render_update(previous: Allowlist | None, current: Allowlist, name: str, changed: bool, fmt: str) -> str:
    before = previous.entries if previous is not None else {}
    added = removed = 0
    for path in set(before) | set(current.entries):
        old, new = before.get(path, {}), current.entries.get(path, {})
        for key in set(old) | set(new):
            delta = new.get(key, 0) - old.get(key, 0)
            added, removed = added + max(delta, 0), removed + max(-delta, 0)
    if fmt == "json":
        return _json(
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
        f"allowlist {state}: {name} allows {_plural(current.total, 'read')} in "
        f"{_plural(len(current.entries), 'file')} (+{added} added, -{removed} removed)\n"
    )


def render_stats(results: Sequence[FileResult], allowed: Allowlist | None, fmt: str) -> str:
    """Counts of the sites found, by accessor, by file and by scope (largest first)."""
    sites = [(result.path, site) for result in results for site in result.sites]
    by_accessor = Counter(site.accessor for _, site in sites)
    by_file = Counter(path for path, _ in sites)
    by_scope = Counter((path, site.scope) for path, site in sites)
    by_form = Counter(site.form for _, site in sites)

    def ranked(counter: Counter[Any]) -> list[tuple[Any, int]]:
        return sorted(counter.items(), key=lambda item: (-item[1], item[0]))

    if fmt == "json":
        return _json(
            {
                "total": len(sites),
                "files": len(by_file),
                "allowed_total": allowed.total if allowed is not None else None,
                "by_accessor": dict(by_accessor),
                "by_form": dict(by_form),
                "by_file": dict(by_file),
                "by_scope": [{"path": p, "scope": s, "count": n} for (p, s), n in ranked(by_scope)],
            }
        )
    allowed_text = f"; the allowlist allows {allowed.total}" if allowed is not None else ""
    lines = [
        f"{_plural(len(sites), 'read')} of global process-group state in {_plural(len(by_file), 'file')}"
        f"{allowed_text}",
        "by form: " + ", ".join(f"{form} {count}" for form, count in ranked(by_form)),
        "",
        "by accessor:",
        *(f"{count:7d}  {accessor}" for accessor, count in ranked(by_accessor)),
        "",
        "by file:",
        *(f"{count:7d}  {path}" for path, count in ranked(by_file)),
        "",
        "by scope:",
        *(f"{count:7d}  {path}  {scope}" for (path, scope), count in ranked(by_scope)),
    ]
    return "\n".join(lines) + "\n"

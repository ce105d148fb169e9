"""``pgregistry allowlist check|update|stats|import``: the ratchet on global process-group reads.

- ``check`` exits 1 when the scan finds a read the allowlist does not allow, or an entry the code no
  longer needs (the list may only shrink); it prints each with its file:line and the fix. With
  ``--base REV`` each key is also held to what REV read, so a stale entry is a "can shrink" notice,
  not a failure.
- ``update`` rewrites the allowlist from the scan (sorted, byte-identical when nothing changed).
- ``stats`` prints counts by accessor, file and scope.
- ``import --from LIST`` writes the allowlist from Megatron-LM's line-keyed list, each entry matched
  to the read on its line of today's tree (exit 2, nothing written, when one matches none).

Exit 2 for usage errors, bad settings, a malformed or wrongly-versioned allowlist, and source files
that do not parse. Settings come from ``[tool.pgregistry.allowlist]`` in the nearest
``pyproject.toml`` that has that table (its directory is the project root all paths are relative
to); command-line options override them.

This module and everything it imports are torch-free: the check runs in lint jobs where torch is
absent or slow to import. It also runs without the rest of the CLI as ``python -m
pgregistry.allowlist``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from pgregistry._runtime.empty_options import empty_option
from pgregistry._runtime.exact_options import ExactOptionParser
from pgregistry._source.cache import ScanCache
from pgregistry._source.config import ConfigError, Settings
from pgregistry._source.engine import ScanReport, default_jobs, scan_files, scan_sources
from pgregistry._source.files import (
    PathError,
    discover_files,
    is_excluded,
    is_under,
    make_absolute,
    project_path,
    read_regular_file,
)
from pgregistry._source.options import add_settings_options, path_argument, settings_from_options
from pgregistry._source.scanner import FileResult
from pgregistry._source.storage import StorageError, exclusive_lock, file_to_rewrite
from pgregistry.allowlist._baseline import GitError, GitTree, base_limits, mark_added
from pgregistry.allowlist._megatron_list import match_megatron_list, parse_megatron_list
from pgregistry.allowlist._ratchet import (
    Allowlist,
    AllowlistError,
    Comparison,
    FutureAllowlistError,
    compare_counts,
    read_bytes,
)
from pgregistry.allowlist._report import (
    FORMATS,
    Baseline,
    render_check,
    render_failures,
    render_skipped,
    render_stats,
    render_update,
)

__all__ = ["add_actions", "add_command", "main", "run_action"]

_ACTIONS = {
    "check": "fail (exit 1) on a new read of global process-group state or a stale allowlist entry",
    "update": "rewrite the allowlist from the current code (deterministic, sorted)",
    "stats": "print counts of reads by family, directory, accessor, file and scope",
    "import": (
        "write the allowlist from Megatron-LM's line-keyed "
        "list (tools/process_group_usage_allowlist.json)"
    ),
}

_DESCRIPTION = (
    "Find every read of global process-group state (parallel_state accessors however "
    "imported, use_mpu_process_groups, pgregistry's global grid) and ratchet it against a "
    "committed allowlist keyed by file, scope and accessor, so the list can only shrink."
)


def _job_count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


_TEXT_OPTIONS = {
    "base": ("--base", "a git revision, or leave the option out to check without a base"),
    "since": ("--since", "a git revision, or leave the option out"),
    "exclude": ("--exclude", "a pattern, or leave the option out"),
    "extend_exclude": ("--extend-exclude", "a pattern, or leave the option out"),
    "module": ("--module", "a module name, or leave the option out"),
}
"""Options whose empty value would pass as the option left out (or match nothing): dest -> (option,
what to give). ``--base ''`` (an unset CI variable) checked without a base."""


def _add_scan_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "paths",
        nargs="*",
        type=path_argument,
        metavar="PATH",
        help=(
            "files or directories to scan instead of the "
            "configured roots; only their entries are judged"
        ),
    )
    parser.add_argument(
        "--allowlist",
        type=path_argument,
        metavar="FILE",
        help="the allowlist file (default: configured)",
    )
    parser.add_argument(
        "--format", choices=FORMATS, default="text", help="output format (default: text)"
    )
    add_settings_options(parser)
    parser.add_argument(
        "--jobs", type=_job_count, metavar="N", help="processes to parse with (default: cores)"
    )
    parser.add_argument(
        "--no-cache", action="store_true", help="neither read nor write the scan cache"
    )
    parser.add_argument(
        "--cache-dir", type=path_argument, metavar="DIR", help="the scan cache directory"
    )
    parser.add_argument(
        "--skip-newer-syntax",
        action="store_true",
        help=(
            "skip, with a listed warning, files using syntax newer than this "
            "Python (their entries are kept and not judged) instead of failing"
        ),
    )


def add_actions(parser: argparse.ArgumentParser) -> None:
    """Add the check/update/stats actions to ``parser``."""
    actions = parser.add_subparsers(dest="allowlist_action", metavar="ACTION", required=True)
    for name, text in _ACTIONS.items():
        # The action's own sentence only: the command's paragraph is in `pgregistry allowlist
        # --help`.
        action = actions.add_parser(name, help=text, description=f"{text[0].upper()}{text[1:]}.")
        _add_scan_options(action)
        if name == "check":
            action.add_argument(
                "--base",
                metavar="REV",
                help=(
                    "git revision the change is against (in CI: the target branch): "
                    "reads in files git saw renamed since count as moved, only the "
                    "added sites of a key are flagged, and each key may read no more "
                    "than at REV plus what this change adds to the allowlist, so "
                    "stale entries are notices (run update to shrink), not failures"
                ),
            )
        if name == "import":
            action.add_argument(
                "--from",
                dest="source",
                type=path_argument,
                required=True,
                metavar="FILE",
                help="Megatron-LM's allowlist",
            )
        if name == "stats":
            action.add_argument(
                "--since",
                metavar="REV",
                help="compare with the tree at this git revision (burn-down table)",
            )
            action.add_argument(
                "--depth",
                type=_job_count,
                default=2,
                metavar="N",
                help="directory depth of the by-directory table",
            )
        action.set_defaults(handler=run_action)


def add_command(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``pgregistry allowlist`` (the hook :mod:`pgregistry.cli` calls)."""
    parser = subparsers.add_parser(
        "allowlist", help="ratchet reads of global process-group state", description=_DESCRIPTION
    )
    add_actions(parser)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m pgregistry.allowlist``: the same command without the rest of the CLI."""
    parser = ExactOptionParser(prog="python -m pgregistry.allowlist", description=_DESCRIPTION)
    add_actions(parser)
    args = parser.parse_args(argv)
    code: int = args.handler(args)
    return code


def _scan_targets(
    args: argparse.Namespace, settings: Settings
) -> tuple[list[Path], Callable[[str], bool]]:
    """What to scan, and which allowlist paths the scan judges (all unless paths were given)."""
    if not args.paths:
        return [
            make_absolute(settings.resolve(Path(root))) for root in settings.roots
        ], lambda path: True
    targets = [make_absolute(path) for path in args.paths]
    prefixes = [project_path(target, settings.root) for target in targets]
    return targets, lambda path: is_under(path, prefixes)


def _print_error(message: str, fmt: str) -> int:
    if fmt == "github":
        print(f"::error title=pgregistry allowlist::{message}")
    print(f"pgregistry allowlist: error: {message}", file=sys.stderr)
    return 2


def _split_off_newer_syntax(
    report: ScanReport, allowed: bool
) -> tuple[list[FileResult], list[FileResult]]:
    """(failures, skipped): failures on syntax newer than this Python split off when ``allowed``.

    Files whose only fault is syntax newer than this Python are skipped when ``allowed``
    (``--skip-newer-syntax``); every other failure stays an error."""
    failures = [
        r for r in report.failures if not (allowed and r.failure is not None and r.failure.needs)
    ]
    skipped = [r for r in report.failures if r not in failures]
    return failures, skipped


def run_action(args: argparse.Namespace) -> int:
    """The handler of every action; returns the exit code (0 ok, 1 check failed, 2 error)."""
    fmt: str = args.format
    empty = empty_option(args, _TEXT_OPTIONS)
    if empty is not None:
        return _print_error(empty, fmt)
    try:
        settings = settings_from_options(args)
        targets, covers = _scan_targets(args, settings)
        found = discover_files(targets, settings.root, settings.exclude)
    except (ConfigError, PathError) as error:
        return _print_error(str(error), fmt)
    cache = None
    if not args.no_cache and settings.cache_dir is not None:
        cache = ScanCache(settings.resolve(settings.cache_dir), settings.scan)
    report = scan_files(found.files, settings.scan, cache=cache, jobs=args.jobs or default_jobs())
    failures, newer = _split_off_newer_syntax(report, args.skip_newer_syntax)
    if failures:
        print(
            render_failures(failures, fmt), end="", file=sys.stdout if fmt != "text" else sys.stderr
        )
        return 2
    warnings = [(path, "skipped: not a regular file") for path in found.skipped]
    warnings += [
        (r.path, f"skipped: needs Python >= {r.failure.needs}")
        for r in newer
        if r.failure is not None
    ]
    if warnings:
        print(
            render_skipped(warnings, fmt),
            end="",
            file=sys.stdout if fmt == "github" else sys.stderr,
        )
    unjudged = {path for path, _ in warnings}
    results = [result for result in report.results if result.failure is None]

    def is_judged(path: str) -> bool:  # a skipped file's entries are neither judged nor rewritten
        return covers(path) and path not in unjudged

    allowlist_path = settings.resolve(settings.allowlist)
    name = project_path(allowlist_path, settings.root)
    if args.allowlist_action == "import":
        code = _check_import(args, results)
        if code:
            return code
    if args.allowlist_action in ("update", "import"):
        try:
            rewritten = file_to_rewrite(allowlist_path, settings.root)
        except StorageError as error:
            return _print_error(str(error), fmt)
        return _update_allowlist(
            args, results, is_judged, rewritten, name, partial=bool(args.paths or unjudged)
        )
    try:
        if args.allowlist_action == "check":
            allowed = Allowlist.load(allowlist_path, name)
            comparison = _compare_with_base(args, settings, results, allowed, is_judged, cache)
            print(render_check(comparison, allowed, len(found.files), name, fmt), end="")
            return 0 if comparison.ok else 1
        previous = Allowlist.load(allowlist_path, name) if allowlist_path.exists() else None
        since = _scan_at_since(args, settings, targets, cache) if args.since else None
    except (AllowlistError, GitError) as error:
        return _print_error(str(error), fmt)
    # Only the entries of the paths scanned: ``stats PATH`` compares like with like.
    subset = (
        Allowlist({p: keys for p, keys in previous.entries.items() if is_judged(p)})
        if previous
        else None
    )
    print(render_stats(results, subset, fmt, since, args.depth), end="")
    return 0


def _compare_with_base(
    args: argparse.Namespace,
    settings: Settings,
    results: list[FileResult],
    allowed: Allowlist,
    judged: Callable[[str], bool],
    cache: ScanCache | None,
) -> Comparison:
    """The ratchet's comparison, held to the base revision with ``--base``.

    With ``--base``, git's renames pair moved reads, added sites are marked, and each key's
    allowance is held to what the base read
    (:func:`~pgregistry.allowlist._baseline.base_limits`)."""
    if not args.base:
        return compare_counts(results, allowed, judged)
    base = GitTree(settings.root, args.base)
    changes = base.changes()

    def read_today(path: str) -> bytes | None:
        return read_bytes(settings.root / path)

    def scan_at_base(sources: list[tuple[str, bytes]]) -> list[FileResult]:
        return _scan_at(args, settings, cache, args.base, sources)

    limits = _base_limits(settings, base, changes.renames, allowed, judged, results, scan_at_base)
    comparison = compare_counts(results, allowed, judged, changes.renames, changes.added, limits)
    return mark_added(comparison, settings.scan, read_today, base, changes.renames)


def _base_limits(
    settings: Settings,
    base: GitTree,
    renames: dict[str, str],
    allowed: Allowlist,
    judged: Callable[[str], bool],
    results: list[FileResult],
    scan: Callable[[list[tuple[str, bytes]]], list[FileResult]],
) -> Allowlist:
    """The allowances at ``--base``, from the allowlist and the judged files as they were there.

    The judged files are those listed or reading today, scanned with the same settings (a file
    unchanged since is not rescanned: today's result is its)."""
    name = project_path(settings.resolve(settings.allowlist), settings.root)
    listed = base.source(name)
    base_allowlist = (
        Allowlist.from_bytes(listed, f"{name} at {base.rev}")
        if listed is not None
        else Allowlist({})
    )
    old_of = {new: old for old, new in renames.items()}
    counts = Allowlist.from_results(results).entries
    today_of = {
        old_of.get(path, path): path for path in {*allowed.entries, *counts} if judged(path)
    }
    base_counts: dict[str, Mapping[str, int]] = {}
    changed: list[tuple[str, bytes]] = []
    for old, data in sorted(base.python_files(sorted(today_of)).items() if today_of else ()):
        if old not in today_of:
            continue
        if data == read_bytes(settings.root / today_of[old]):
            base_counts[old] = counts.get(today_of[old], {})
        else:
            changed.append((old, data))
    base_counts.update(Allowlist.from_results(scan(changed)).entries)
    return base_limits(
        allowed, base_allowlist, base_counts, lambda path: old_of.get(path, path), counts
    )


def _scan_at_since(
    args: argparse.Namespace, settings: Settings, targets: list[Path], cache: ScanCache | None
) -> Baseline:
    """The scan of the same roots, with the same excludes, at revision ``--since``."""
    tree = GitTree(settings.root, args.since)
    prefixes = [project_path(target, settings.root) for target in targets]
    sources = [
        (path, data)
        for path, data in sorted(tree.python_files(prefixes).items())
        if not is_excluded(path, settings.exclude)
    ]
    return Baseline(args.since, _scan_at(args, settings, cache, args.since, sources))


def _scan_at(
    args: argparse.Namespace,
    settings: Settings,
    cache: ScanCache | None,
    rev: str,
    sources: list[tuple[str, bytes]],
) -> list[FileResult]:
    """Scan ``sources`` read at git revision ``rev``.

    A file there that does not parse is a :class:`GitError`.
    """
    report = scan_sources(sources, settings.scan, cache=cache, jobs=args.jobs or default_jobs())
    if report.failures:
        first = report.failures[0]
        raise GitError(
            f"{first.path} at {rev} does not parse: {first.failure and first.failure.message}"
        )
    return report.results


def _check_import(args: argparse.Namespace, results: list[FileResult]) -> int:
    """Check every entry of Megatron-LM's list reads today's tree; 0 when the update may go ahead.

    Every entry must be a read of today's tree (exit 2 naming the entries that are not); say what
    the import grandfathers beyond it."""
    fmt: str = args.format
    try:
        text = read_regular_file(args.source)[0].decode("utf-8")  # a FIFO is not waited on
        entries = parse_megatron_list(text, str(args.source))
    except OSError as error:
        return _print_error(f"{args.source}: cannot read: {error.strerror or error}", fmt)
    except (AllowlistError, UnicodeDecodeError) as error:
        return _print_error(str(error), fmt)
    imported = match_megatron_list(entries, results)
    if imported.unmatched:
        shown = "; ".join(imported.unmatched[:5]) + ("; ..." if len(imported.unmatched) > 5 else "")
        return _print_error(
            f"{len(imported.unmatched)} entries of {args.source} have no such "
            f"read on their line in the scanned tree ({shown}): regenerate it "
            "with Megatron-LM's checker (--update) on this tree, then import",
            fmt,
        )
    unseen = ", ".join(f"{accessor} {count}" for accessor, count in imported.unseen.most_common())
    print(
        f"imported {imported.matched} entries of {args.source}; "
        f"grandfathered too, {sum(imported.unseen.values())} reads "
        f"its rule does not list{': ' + unseen if unseen else ''}",
        file=sys.stderr,
    )
    return 0


def _update_allowlist(
    args: argparse.Namespace,
    results: list[FileResult],
    judged: Callable[[str], bool],
    path: Path,
    name: str,
    partial: bool,
) -> int:
    """Rewrite the allowlist under the update lock: read, merge, write atomically.

    Exit 2 on any OS error, the old file intact. ``partial``: some paths are not rescanned, so their
    old entries must be kept."""
    fmt: str = args.format
    try:
        with exclusive_lock(path):
            try:
                expected = read_bytes(path)
            except OSError as error:
                return _print_error(
                    f"{name}: cannot read the allowlist: {error.strerror or error}", fmt
                )
            previous = None
            if expected is not None:
                try:
                    previous = Allowlist.from_bytes(expected, name)
                except FutureAllowlistError as error:
                    return _print_error(str(error), fmt)
                except AllowlistError as error:
                    if partial:
                        return _print_error(
                            f"{error}. A partial update (PATH given, or files skipped) "
                            "only edits a readable allowlist: run `pgregistry "
                            "allowlist update` with no PATH to regenerate it whole",
                            fmt,
                        )
                    # A full update regenerates the whole list, so it may replace an unreadable (or
                    # old) file.
                    print(
                        f"pgregistry allowlist: replacing unreadable allowlist: {error}",
                        file=sys.stderr,
                    )
            current = (previous or Allowlist({})).merge_scanned(
                Allowlist.from_results(results), judged
            )
            changed = current.write(path, expected)
    except StorageError as error:
        return _print_error(str(error), fmt)
    print(render_update(previous, current, name, changed, fmt), end="")
    return 0

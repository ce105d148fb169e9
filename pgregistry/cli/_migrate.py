"""``pgregistry migrate [PATH ...]``: rewrite reads of global process-group state into reads of a collection.

``--diff`` (the default) prints a unified diff and writes nothing; ``--write`` applies it (every file checked
first, each replaced atomically, none overwritten that changed on disk since it was read) and then regenerates
the allowlist when ``[tool.pgregistry.allowlist]`` configures one, so the ratchet shrinks in the same commit;
``--check`` exits 1 when anything would change (for CI). The report per family goes to stderr with ``--diff``,
to stdout otherwise. Settings are the ratchet's (pyproject table, ``--preset``, ``--isolated``, excludes,
``--module``); see docs/migrating.md.

Exit codes: 0 done (``--check``: nothing to change), 1 ``--check`` found changes, 2 bad input (a file that
does not parse or needs a newer Python, a read-only file, a path outside the project, conflicting settings, an
unknown target, libcst missing); nothing is written then.

libcst is an optional extra (``pip install 'pgregistry[migrate]'``), imported by the handler only.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pgregistry.allowlist._cli import add_settings_options, settings_from_options
from pgregistry.allowlist._cli import run as allowlist_run
from pgregistry.allowlist._config import ConfigError, Settings, find_config_file
from pgregistry.allowlist._files import PathError, discover, project_path

__all__ = ["add_command"]

_DESCRIPTION = (
    "Rewrite reads of global process-group state (parallel_state accessors, fallback helpers) into reads of "
    "a process-group collection: the collection in scope, else one threaded into the enclosing function as "
    "an optional keyword-only parameter that falls back to the global grid with ProcessGroupFallbackWarning."
)


def _error(message: str) -> int:
    print(f"pgregistry migrate: error: {message}", file=sys.stderr)
    return 2


def add_command(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``pgregistry migrate`` (the hook :mod:`pgregistry.cli` calls)."""
    parser = subparsers.add_parser(
        "migrate", help="rewrite reads of global process-group state into a collection", description=_DESCRIPTION
    )
    parser.add_argument(
        "paths", nargs="*", type=Path, metavar="PATH", help="files or directories to migrate (default: the roots)"
    )
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--diff", action="store_true", help="print a unified diff, write nothing (the default)")
    mode.add_argument(
        "--write", action="store_true", help="apply the rewrite atomically per file and regenerate the allowlist"
    )
    mode.add_argument("--check", action="store_true", help="exit 1 when anything would change (write nothing)")
    parser.add_argument(
        "--target",
        choices=("megatron", "pgregistry"),
        default="megatron",
        help="whose collection the code reads: Megatron-Core's ProcessGroupCollection (default) or pgregistry's",
    )
    parser.add_argument(
        "--collection-name",
        default="pg_collection",
        metavar="NAME",
        help="the collection's parameter, local and attribute name (default: pg_collection)",
    )
    add_settings_options(parser)
    parser.add_argument(
        "--allowlist", type=Path, metavar="FILE", help="the allowlist --write regenerates (default: configured)"
    )
    parser.add_argument("--quiet", action="store_true", help="print no report, only the diff or errors")
    # What a read becomes: the fallback helper module --target megatron writes into the tree.
    parser.add_argument(
        "--helper-module",
        metavar="MODULE",
        help="the dotted module the rewritten reads import pg_group/pg_rank/pg_size/pg_read from, written into "
        "the tree by --write (default: [tool.pgregistry.migrate] helper-module, else "
        "<top package>._process_group_fallback)",
    )
    parser.set_defaults(handler=run)


def _settings(args: argparse.Namespace) -> tuple[Settings, bool]:
    """The ratchet's settings for these options, and whether a pyproject table configured them."""
    if args.isolated and args.config is not None:
        raise ConfigError("--isolated and --config contradict each other: pass one")
    args.cache_dir = None
    configured = not args.isolated and (args.config is not None or find_config_file(Path.cwd()) is not None)
    return settings_from_options(args), configured


def _regenerate(args: argparse.Namespace) -> int:
    """``pgregistry allowlist update`` with the same settings and paths (its exit code)."""
    update = argparse.Namespace(**vars(args))
    update.allowlist_action = "update"
    update.format = "text"
    update.jobs = None
    update.no_cache = True
    update.skip_newer_syntax = False
    code: int = allowlist_run(update)
    return code


def run(args: argparse.Namespace) -> int:
    """The handler; returns the exit code (see the module docstring)."""
    try:
        import libcst  # noqa: F401
    except ImportError:
        return _error("needs libcst, an optional extra: pip install 'pgregistry[migrate]'")
    from pgregistry.allowlist._engine import default_jobs
    from pgregistry.migrate._engine import Helper, migrate
    from pgregistry.migrate._megatron_release import megatron_source
    from pgregistry.migrate._report import render_failures, render_report
    from pgregistry.migrate._style import line_length, migrate_settings
    from pgregistry.migrate._writing import WriteError, unified_diff, write_changes

    try:
        settings, configured = _settings(args)
        targets = [Path(p).absolute() for p in args.paths] or [settings.resolve(Path(r)) for r in settings.roots]
        for target in targets:
            if project_path(target, settings.root).startswith("../") or project_path(target, settings.root) == "..":
                raise PathError(f"{target}: outside the project root {settings.root}; run from the project, or "
                                "pass --isolated to make the current directory the root")
        found = discover(targets, settings.root, settings.exclude)
        source = megatron_source(settings.root)
        configured_helper = None if args.isolated else migrate_settings(settings.root).get("helper-module")
        helper = Helper(args.helper_module or configured_helper, source.accessors, line_length(settings.root))
        migration = migrate(found.files, settings.scan, target=args.target, name=args.collection_name,
                            jobs=default_jobs(), gtp_remat=source.gtp_remat, helper=helper)
    except (ConfigError, PathError, ValueError) as error:
        return _error(str(error))
    if migration.failures:
        print(render_failures(migration.failures), end="", file=sys.stderr)
        return _error(f"{len(migration.failures)} file(s) cannot be migrated (above); nothing was written")
    changes = migration.changes
    verb = "changed" if args.write else "would change"
    report = render_report(migration.reads, len(migration.threaded), migration.passed, len(changes), verb)
    report += source.describe() + "\n"
    if args.write:
        try:
            write_changes(changes)
        except WriteError as error:
            return _error(str(error))
        if not args.quiet:
            print(report, end="")
        if changes and configured:
            allowlist = settings.resolve(settings.allowlist)
            if allowlist.exists():
                return _regenerate(args)
        return 0
    if args.check:
        if not args.quiet:
            print(report, end="")
        return 1 if changes else 0
    for change in changes:
        print(unified_diff(change), end="")
    if not args.quiet:
        print(report, end="", file=sys.stderr)
    return 0

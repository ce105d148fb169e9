"""``pgregistry migrate [PATH ...]``: rewrite reads of global process-group state to a collection's.

``--diff`` (the default) prints a unified diff and writes nothing; ``--write`` applies it (every
file checked first, all written or none under a journal that the next run finishes if this one is
killed, none overwritten that changed on disk since it was read) and then regenerates the allowlist
``--allowlist`` names, else the configured one, so the ratchet shrinks in the same commit;
``--check`` exits 1 when anything would change (for CI). The report per family goes to stderr with
``--diff``, to stdout otherwise; progress of a long run to stderr. Settings are the ratchet's
(pyproject table, ``--preset``, ``--isolated``, excludes, ``--module``); see docs/migrating.md.

Exit codes: 0 done (``--check``: nothing to change), 1 ``--check`` found changes, 2 bad input (a
file that does not parse or needs a newer Python, a read-only or hard-linked file, a path outside
the project, conflicting settings, an unknown target, libcst missing, ``--check`` on a tree an
interrupted ``--write`` left half-written, an allowlist to regenerate that is no regular file) or an
error of this tool; nothing is written then, unless the allowlist's update after ``--write`` failed:
then a last line names the files that were rewritten.

libcst is an optional extra (``pip install 'pgregistry[migrate]'``), imported by the handler only.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pgregistry._source.config import ConfigError, Settings, find_config_file
from pgregistry._source.files import PathError, discover_files, path_kind, project_path
from pgregistry._source.options import (
    add_settings_options,
    path_argument,
    settings_arguments,
    settings_from_options,
)
from pgregistry._source.storage import StorageError, file_to_rewrite

__all__ = ["add_command"]

_DESCRIPTION = (
    "Rewrite reads of global process-group state (parallel_state accessors, fallback "
    "helpers) into reads of a process-group collection: the collection in scope, "
    "else one threaded into the enclosing function as an optional keyword-only "
    "parameter that falls back to the global grid with ProcessGroupFallbackWarning."
)


def _print_error(message: str) -> int:
    print(f"pgregistry migrate: error: {message}", file=sys.stderr)
    return 2


def add_command(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``pgregistry migrate`` (the hook :mod:`pgregistry.cli` calls)."""
    parser = subparsers.add_parser(
        "migrate",
        help="rewrite reads of global process-group state into a collection",
        description=_DESCRIPTION,
    )
    parser.add_argument(
        "paths",
        nargs="*",
        type=path_argument,
        metavar="PATH",
        help="files or directories to migrate (default: the roots)",
    )
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument(
        "--diff", action="store_true", help="print a unified diff, write nothing (the default)"
    )
    mode.add_argument(
        "--write",
        action="store_true",
        help="apply the rewrite atomically per file and regenerate the allowlist",
    )
    mode.add_argument(
        "--check", action="store_true", help="exit 1 when anything would change (write nothing)"
    )
    parser.add_argument(
        "--target",
        choices=("megatron", "pgregistry"),
        default="megatron",
        help=(
            "whose collection the code reads: Megatron-Core's "
            "ProcessGroupCollection (default) or pgregistry's"
        ),
    )
    parser.add_argument(
        "--collection-name",
        default="pg_collection",
        metavar="NAME",
        help="the collection's parameter, local and attribute name (default: pg_collection)",
    )
    add_settings_options(parser)
    parser.add_argument(
        "--allowlist",
        type=path_argument,
        metavar="FILE",
        help="the allowlist --write regenerates (default: configured)",
    )
    parser.add_argument(
        "--quiet", action="store_true", help="print no report, only the diff or errors"
    )
    # What a read becomes: the fallback helper module --target megatron writes into the tree.
    parser.add_argument(
        "--helper-module",
        metavar="MODULE",
        help=(
            "the dotted module the rewritten reads import pg_group/pg_rank/pg_size/pg_read "
            "from, written into the tree by --write (default: [tool.pgregistry.migrate] "
            "helper-module, else <top package>._process_group_fallback)"
        ),
    )
    parser.set_defaults(handler=_run_migrate)


def _ratchet_settings(args: argparse.Namespace) -> tuple[Settings, bool]:
    """The ratchet's settings for these options, and whether a pyproject table configured them."""
    if args.isolated and args.config is not None:
        raise ConfigError("--isolated and --config contradict each other: pass one")
    args.cache_dir = None
    configured = not args.isolated and (
        args.config is not None or find_config_file(Path.cwd()) is not None
    )
    return settings_from_options(args), configured


def _print_bytes(data: bytes) -> None:
    """``data`` on stdout as is (a diff in a file's own encoding, as ``git diff`` prints it)."""
    sys.stdout.flush()
    buffer = getattr(sys.stdout, "buffer", None)
    if (
        buffer is None
    ):  # a text-only stream (an embedding's): the bytes as close as it can take them
        sys.stdout.write(data.decode("utf-8", "backslashreplace"))
        return
    buffer.write(data)
    buffer.flush()


def _allowlist_to_write(
    args: argparse.Namespace, settings: Settings, configured: bool
) -> Path | None:
    """The allowlist ``--write`` regenerates; None for none.

    The one ``--allowlist`` names (``ConfigError`` when it does not exist: nothing is written then),
    else the configured one where it exists (a line on stderr when it does not). With ``--write``,
    one the update would refuse (no regular file, a link out of the project) is refused first
    (``ConfigError``, ``StorageError``)."""
    allowlist = settings.resolve(settings.allowlist)
    kind = path_kind(allowlist)
    if args.write and kind not in (None, "a regular file"):
        raise ConfigError(
            f"the allowlist {allowlist} is {kind}, not a regular file: --write regenerates it; "
            "name the allowlist file (--allowlist), or move that out of its way"
        )
    if args.write:  # one the update refuses (a link out of the project) is refused before writing
        file_to_rewrite(allowlist, settings.root)
    if args.allowlist is not None:
        if args.write and not allowlist.is_file():
            raise ConfigError(
                f"--allowlist {args.allowlist}: no such file; create it first (`pgregistry "
                f"allowlist update --allowlist {args.allowlist}`), or leave the option out"
            )
        return allowlist
    if not configured:
        return None
    if allowlist.is_file():
        return allowlist
    if args.write and not args.quiet:
        print(
            "pgregistry migrate: no allowlist regenerated: "
            f"the configured {allowlist} does not exist",
            file=sys.stderr,
        )
    return None


def _regenerate_allowlist(args: argparse.Namespace, written: list[str]) -> int:
    """``pgregistry allowlist update`` with the same settings, allowlist, paths (its exit code).

    ``written``: the files just rewritten, named (the first ten) when the update fails: exit 2 says
    "nothing was written" everywhere else."""
    from pgregistry.allowlist import main as allowlist

    chosen = [f"--allowlist={args.allowlist}"] if args.allowlist is not None else []
    code = allowlist(
        ["update", "--no-cache", *settings_arguments(args), *chosen, "--", *map(str, args.paths)]
    )
    if code:
        named = ", ".join(written[:10]) + (
            f", {len(written) - 10} more" if len(written) > 10 else ""
        )
        _print_error(
            f"{len(written)} file(s) were rewritten ({named}), but the allowlist was not "
            "regenerated (above): fix that, then run `pgregistry allowlist update`"
        )
    return code


def _not_regular(skipped: list[str], root: Path) -> list[str]:
    """A line for each ``*.py`` the run skipped as no regular file, saying what it is.

    A FIFO, a socket, a device or a dangling link (reading one could block, or fail): never read nor
    written, and said so, as ``allowlist`` says it."""
    kinds = {path: path_kind(root / path) or "a link to nothing" for path in skipped}
    return [f"{path}: {kind}, not a regular file: left untouched" for path, kind in kinds.items()]


def _run_migrate(args: argparse.Namespace) -> int:
    """The handler; returns the exit code (see the module docstring).

    An exception of this tool (a bug) is exit 2 with one line, never a traceback that exits 1, which
    ``--check`` keeps for "would change"."""
    try:
        import libcst  # noqa: F401
    except ImportError:
        return _print_error("needs libcst, an optional extra: pip install 'pgregistry[migrate]'")
    try:
        return _migrate_files(args)
    except Exception as error:
        return _print_error(f"internal error ({type(error).__name__}: {error}); please report it")


def _migrate_files(args: argparse.Namespace) -> int:
    from pgregistry._source.engine import default_jobs
    from pgregistry.migrate._diff import render_unified_diff
    from pgregistry.migrate._engine import Helper, migrate
    from pgregistry.migrate._links import own_files
    from pgregistry.migrate._megatron_release import megatron_source
    from pgregistry.migrate._progress import Progress
    from pgregistry.migrate._report import render_failures, render_report
    from pgregistry.migrate._style import line_length, migrate_settings
    from pgregistry.migrate._writing import JOURNAL, WriteError, finish_interrupted, write_changes

    try:
        settings, configured = _ratchet_settings(args)
        allowlist = _allowlist_to_write(args, settings, configured)
        if args.check and (settings.root / JOURNAL).exists():
            return _print_error(
                f"{settings.root / JOURNAL}: an interrupted `pgregistry "
                "migrate --write` left the tree half-written; run `pgregistry "
                "migrate` (any mode but --check) to finish it first"
            )
        finished = finish_interrupted(settings.root)
        if finished is not None:
            print(f"pgregistry migrate: {finished}", file=sys.stderr)
        targets = [Path(p).absolute() for p in args.paths] or [
            settings.resolve(Path(r)) for r in settings.roots
        ]
        for target in targets:
            if (
                project_path(target, settings.root).startswith("../")
                or project_path(target, settings.root) == ".."
            ):
                raise PathError(
                    f"{target}: outside the project root {settings.root}; run from the project, or "
                    "pass --isolated to make the current directory the root"
                )
        discovered = discover_files(targets, settings.root, settings.exclude)
        found = own_files(discovered.files, settings.root, settings.exclude)
        for line in [*_not_regular(discovered.skipped, settings.root), *found.left]:
            if not args.quiet:
                print(f"pgregistry migrate: {line}", file=sys.stderr)
        source = megatron_source(settings.root)
        configured_helper = (
            None if args.isolated else migrate_settings(settings.root).get("helper-module")
        )
        helper = Helper(
            args.helper_module or configured_helper,
            source.accessors,
            line_length(settings.root),
            source.shims,
            source.virtual_stages,
        )
        migration = migrate(
            found.files,
            settings.scan,
            target=args.target,
            name=args.collection_name,
            jobs=default_jobs(),
            gtp_remat=source.gtp_remat,
            helper=helper,
            progress=Progress(None if args.quiet else sys.stderr),
        )
    except (ConfigError, PathError, StorageError, ValueError, WriteError) as error:
        return _print_error(str(error))
    if migration.failures:
        print(render_failures(migration.failures), end="", file=sys.stderr)
        return _print_error(
            f"{len(migration.failures)} file(s) cannot be migrated (above); nothing was written"
        )
    changes = migration.changes
    verb = "changed" if args.write else "would change"
    report = render_report(
        migration.reads,
        len(migration.threaded),
        migration.passed,
        len(changes),
        verb,
        migration.spec_calls_left,
    )
    report += source.describe() + "\n"
    if args.write:
        try:
            write_changes(changes, settings.root, found.hard_links)
        except WriteError as error:
            return _print_error(str(error))
        if not args.quiet:
            print(report, end="")
        if changes and allowlist is not None:
            return _regenerate_allowlist(args, [change.path for change in changes])
        return 0
    if args.check:
        if not args.quiet:
            print(report, end="")
        return 1 if changes else 0
    for change in changes:
        _print_bytes(
            render_unified_diff(change.path, change.before, change.after, created=change.created)
        )
    if not args.quiet:
        print(report, end="", file=sys.stderr)
    return 0

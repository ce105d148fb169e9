"""The command-line options that choose the scan settings, shared by ``allowlist`` and ``migrate``:
one set of names and meanings, so a migration reads exactly what the ratchet counts.

Each command adds them to its parser (:func:`add_settings_options`) and reads its settings from them
(:func:`settings_from_options`); ``migrate --write`` hands them on to ``allowlist update``
(:func:`settings_arguments`).
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from pgregistry._source.config import (
    PRESETS,
    ConfigError,
    Settings,
    find_config_file,
    load_settings,
)
from pgregistry._source.files import make_absolute, path_kind

__all__ = ["add_settings_options", "path_argument", "settings_arguments", "settings_from_options"]


def path_argument(text: str) -> Path:
    """An argparse ``type`` for a path option that refuses an empty one.

    An empty one (``--allowlist "$UNSET"``) would be ``Path('.')``, the current directory,
    silently."""
    if not text.strip():
        raise argparse.ArgumentTypeError(
            'is empty (an unset variable, as in "$VAR"?): give a path, or leave the option out'
        )
    return Path(text)


def add_settings_options(parser: argparse.ArgumentParser) -> None:
    """The options that choose the scan settings, for both commands."""
    parser.add_argument(
        "--config",
        type=path_argument,
        metavar="PYPROJECT",
        help="read settings from this pyproject.toml",
    )
    parser.add_argument(
        "--isolated", action="store_true", help="ignore pyproject.toml; the root is the cwd"
    )
    parser.add_argument(
        "--exclude",
        action="append",
        metavar="PATTERN",
        help="exclude pattern (repeatable; replaces the configured)",
    )
    parser.add_argument(
        "--extend-exclude", action="append", default=[], metavar="PATTERN", help="add an exclude"
    )
    parser.add_argument(
        "--module",
        action="append",
        metavar="NAME",
        help="legacy module name whose accessors count (repeatable; replaces the configured)",
    )
    parser.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        help="built-in scan settings for a known code base (replaces the configured scan settings)",
    )


def settings_arguments(args: argparse.Namespace) -> list[str]:
    """The :func:`add_settings_options` options ``args`` was given, as arguments of another command.

    They are written as ``--name=value``, so a value starting with a dash stays a value."""
    given = [f"--config={args.config}"] if args.config is not None else []
    given += ["--isolated"] if args.isolated else []
    given += [f"--exclude={pattern}" for pattern in args.exclude or ()]
    given += [f"--extend-exclude={pattern}" for pattern in args.extend_exclude]
    given += [f"--module={name}" for name in args.module or ()]
    return given + ([f"--preset={args.preset}"] if args.preset is not None else [])


def settings_from_options(args: argparse.Namespace) -> Settings:
    """The scan settings a command's options give.

    The config file (or none with ``--isolated``), overridden by the options (``--allowlist`` and
    ``--cache-dir`` too, where the command has them)."""
    cwd = Path.cwd()
    if args.isolated:
        config_file = None
    elif args.config is not None:
        _check_config_file(args.config)
        config_file = args.config
    else:
        config_file = find_config_file(cwd)
    settings = load_settings(config_file, cwd)
    exclude = tuple(args.exclude) if args.exclude is not None else settings.exclude
    settings = dataclasses.replace(settings, exclude=exclude + tuple(args.extend_exclude))
    if args.allowlist is not None:
        settings = dataclasses.replace(settings, allowlist=make_absolute(args.allowlist))
    if args.cache_dir is not None:
        _check_cache_dir(args.cache_dir)
        settings = dataclasses.replace(settings, cache_dir=make_absolute(args.cache_dir))
    if args.preset is not None:
        settings = dataclasses.replace(settings, scan=PRESETS[args.preset])
    if args.module is not None:
        settings = dataclasses.replace(
            settings, scan=dataclasses.replace(settings.scan, modules=tuple(args.module))
        )
    return settings


def _check_config_file(path: Path) -> None:
    """``ConfigError`` unless ``--config`` names a regular file, saying what it names instead.

    ``--config /dev/null`` or a directory exists: "no such file" would send the user looking for a
    typo."""
    kind = path_kind(path)
    if kind is None:
        raise ConfigError(f"--config {path}: no such file")
    if kind != "a regular file":
        raise ConfigError(
            f"--config {path} is {kind}, not a regular file: name a pyproject.toml, or pass "
            "--isolated"
        )


def _check_cache_dir(path: Path) -> None:
    """``ConfigError`` if ``--cache-dir`` names something that exists and is no directory.

    The cache would be neither read nor written there, and every run would parse every file again,
    silently. A missing directory is fine: it is created on the first write."""
    kind = path_kind(path)
    if kind not in (None, "a directory"):
        raise ConfigError(
            f"--cache-dir {path} is {kind}, not a directory: name a directory (it is created if "
            "missing), or pass --no-cache"
        )

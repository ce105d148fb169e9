"""Which files a run covers: the ``*.py`` files under the given paths, minus the excluded ones.

Exclude patterns follow ``.gitignore`` habits: a pattern without ``/`` (``build``, ``.*``,
``*_pb2.py``) matches any single path component; a pattern with ``/`` (``pkg/vendored/*``) matches
the project-relative path of a file or of any directory above it. Excludes apply to explicitly named
files too, so a run that passes file names cannot bring an excluded file back.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from fnmatch import fnmatchcase
from pathlib import Path

__all__ = [
    "Discovery",
    "PathError",
    "SourceFile",
    "discover_files",
    "is_excluded",
    "is_under",
    "make_absolute",
    "path_kind",
    "project_path",
    "read_regular_file",
]


class PathError(ValueError):
    """A path given to scan does not exist."""


@dataclass(frozen=True, order=True)
class SourceFile:
    """A file to scan, by its project path and its absolute path.

    ``path`` is project-relative and POSIX-style (the allowlist's key), ``absolute`` is for reading
    it."""

    path: str
    absolute: Path


def make_absolute(path: Path) -> Path:
    """``path`` made absolute and normalised without resolving symbolic links.

    ``Path.resolve`` would turn a root that is a link, ``src -> /elsewhere/src``, into a path
    outside the project."""
    return Path(os.path.abspath(path))


def project_path(path: Path, root: Path) -> str:
    """``path`` relative to ``root``, with ``/`` separators ("." for the root itself).

    Tried as spelled first (a symlinked directory inside the project keeps its project path), then
    with links resolved on both sides (the project reached through a linked working directory); only
    a path outside the project in both senses is given as ``../...``."""
    for candidate, base in (
        (make_absolute(path), make_absolute(root)),
        (path.resolve(), root.resolve()),
    ):
        try:
            return candidate.relative_to(base).as_posix() or "."
        except ValueError:
            continue
    return Path(os.path.relpath(path, root)).as_posix()


def is_under(path: str, prefixes: Iterable[str]) -> bool:
    """Whether the project path ``path`` is one of ``prefixes`` or lies below one of them."""
    return any(
        prefix == "." or path == prefix or path.startswith(prefix + "/") for prefix in prefixes
    )


class _Excluder:
    def __init__(self, patterns: Sequence[str]) -> None:
        cleaned = [pattern.strip().removeprefix("./").rstrip("/") for pattern in patterns]
        self.names = [pattern for pattern in cleaned if pattern and "/" not in pattern]
        self.paths = [pattern for pattern in cleaned if "/" in pattern]

    def name(self, name: str) -> bool:
        return name not in (".", "..") and any(fnmatchcase(name, pattern) for pattern in self.names)

    def path(self, path: str) -> bool:
        return any(fnmatchcase(path, pattern) for pattern in self.paths)

    def entry(self, path: str) -> bool:
        """Whether the file or directory at ``path`` is excluded by its own name or path.

        Not by those of the directories above it.
        """
        return self.name(path.rpartition("/")[2]) or self.path(path)

    def any_level(self, path: str) -> bool:
        """Whether ``path`` or a directory above it is excluded."""
        parts = path.split("/")
        return any(self.entry("/".join(parts[: i + 1])) for i in range(len(parts)))


def is_excluded(path: str, exclude: Sequence[str]) -> bool:
    """Whether the project path ``path`` (maybe not on disk, e.g. read from git) is excluded."""
    return _Excluder(exclude).any_level(path)


@dataclass(frozen=True)
class Discovery:
    """The files to scan (sorted by project path), and the ``*.py`` entries skipped.

    An entry is skipped because it is not a regular file (a FIFO, a socket, a device, a dangling
    link): reading one could block the scan forever."""

    files: list[SourceFile]
    skipped: list[str]


_KINDS = (
    (stat.S_ISREG, "a regular file"),
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISSOCK, "a socket"),
)


def path_kind(path: Path) -> str | None:
    """What ``path`` is, in words (``"a directory"``), or None if nothing is there.

    A dangling link is nothing. For a message refusing a path of the wrong kind:
    ``--config /dev/null`` is a device, not a missing file, and the message says so."""
    try:
        mode = path.stat().st_mode
    except OSError:
        return None
    return next((kind for is_kind, kind in _KINDS if is_kind(mode)), "not a regular file")


def read_regular_file(path: Path) -> tuple[bytes, int]:
    """The bytes and modification time (ns) of the regular file at ``path``.

    ``OSError`` for any other thing there. Opened non-blocking and checked with ``fstat`` before it
    is read: a FIFO (a device, a socket) where a file was expected, or swapped in after the walk, is
    refused at once, never waited on."""
    handle = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    try:
        status = os.fstat(handle)
        if not stat.S_ISREG(status.st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(path))
        with os.fdopen(handle, "rb", closefd=False) as stream:
            return stream.read(), status.st_mtime_ns
    finally:
        os.close(handle)


def _is_regular_file(path: Path) -> bool:
    try:
        return stat.S_ISREG(path.stat().st_mode)
    except OSError:
        return False


def _refuse_unlisted(error: OSError) -> None:
    """``os.walk``'s ``onerror``: a directory it cannot list is :class:`PathError` naming it.

    ``os.walk`` passes over one silently: its files would be neither scanned nor migrated (and a
    full ``allowlist update`` would drop their entries)."""
    raise PathError(
        f"{error.filename}: cannot list it: {error.strerror or error}; make it readable, or "
        "exclude it (--extend-exclude)"
    )


def discover_files(targets: Sequence[Path], root: Path, exclude: Sequence[str]) -> Discovery:
    """The files to scan under ``targets`` (absolute files or directories).

    Directories contribute their ``*.py`` files that are regular files (the others are listed as
    skipped); a file named directly is scanned whatever its suffix. Raises :class:`PathError` for a
    target that does not exist or is neither a regular file nor a directory, and for a directory
    that cannot be listed."""
    excluder = _Excluder(exclude)
    found: dict[str, SourceFile] = {}
    skipped: list[str] = []
    for target in targets:
        relative = project_path(target, root)
        if target.exists() and not target.is_dir() and not _is_regular_file(target):
            raise PathError(f"{target}: not a regular file or directory")
        if target.is_file():
            if relative == "." or not excluder.any_level(relative):
                found.setdefault(relative, SourceFile(relative, target))
        elif target.is_dir():
            if relative != "." and excluder.any_level(relative):
                continue
            for directory, subdirectories, filenames in os.walk(target, onerror=_refuse_unlisted):
                base = project_path(Path(directory), root)
                prefix = "" if base == "." else base + "/"
                subdirectories[:] = [
                    name for name in subdirectories if not excluder.entry(prefix + name)
                ]
                for name in filenames:
                    path = prefix + name
                    if name.endswith(".py") and not excluder.entry(path):
                        if _is_regular_file(Path(directory, name)):
                            found.setdefault(path, SourceFile(path, Path(directory, name)))
                        elif path not in skipped:
                            skipped.append(path)
        else:
            raise PathError(f"{target}: no such file or directory")
    return Discovery(sorted(found.values()), sorted(skipped))

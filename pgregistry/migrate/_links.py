"""Which files a ``migrate`` run reads and may rewrite, once each.

Symbolic links are followed to the file they name.

A link is the user's: a rewrite replaces the file a link names, never the link itself (a rename over
the link's path would turn it into a regular file holding a copy). The file it names is rewritten
once, however many links (and the file's own path) the run was given, under its own project path; a
link to a file outside the project is left as it is, and said so. So is a file reached through a
link to a directory (a path given to the run, below a link): taken by where it really is. Hard
links cannot be kept apart from this: see :func:`~pgregistry.migrate._writing.write_changes`, which
refuses a file with several.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from pgregistry._source.files import SourceFile, is_excluded, project_path

__all__ = ["OwnFiles", "own_files"]


@dataclass
class OwnFiles:
    """The files to migrate (each real file once), what was left, and each file's other links.

    What was left is one line each; for each file with several hard links in the run, the run's
    other paths to the same file."""

    files: list[SourceFile] = field(default_factory=list)
    left: list[str] = field(default_factory=list)
    hard_links: dict[str, list[str]] = field(default_factory=dict)


def own_files(files: Sequence[SourceFile], root: Path, exclude: Sequence[str] = ()) -> OwnFiles:
    """``files`` (as discovered under ``root``), each link replaced by the project file it names.

    Each file once; a link to a file the ``exclude`` patterns exclude is left like one out of the
    project."""
    found = OwnFiles()
    real_root = root.resolve()
    seen: dict[str, SourceFile] = {}  # resolved path -> the file kept for it
    for source in sorted(
        files, key=lambda f: f.absolute.is_symlink()
    ):  # a file's own path before links to it
        real = Path(os.path.realpath(source.absolute))
        link = "a link to" if source.absolute.is_symlink() else "through a link,"
        if not real.is_relative_to(real_root):
            found.left.append(f"{source.path}: {link} {real}, outside the project: left untouched")
            continue
        path = project_path(real, real_root)
        if path == source.path:
            seen.setdefault(str(real), source)
            continue
        if is_excluded(path, exclude):
            found.left.append(f"{source.path}: {link} {path}, which is excluded: left untouched")
            continue
        seen.setdefault(str(real), SourceFile(path, real))
    found.files = sorted(seen.values())
    inodes: dict[tuple[int, int], list[str]] = {}
    for source in found.files:
        try:
            status = os.stat(source.absolute)
        except OSError:  # reading it fails later, naming it
            continue
        inodes.setdefault((status.st_dev, status.st_ino), []).append(source.path)
    for paths in inodes.values():
        for path in paths if len(paths) > 1 else ():
            found.hard_links[path] = [other for other in paths if other != path]
    return found

"""The files ``pgregistry migrate`` changes: their diffs, and writing them so nothing is lost or half-written.

Every file to write is checked before any is written: it must be writable (a read-only file is refused even
though a rename into its directory would replace it) and still hold the bytes it was planned from, with the
same modification time. Each is then replaced atomically (temporary file, ``fsync``, rename; its permissions
kept, :func:`~pgregistry.allowlist._storage.atomic_write`), after checking once more that it did not change
since it was read: a file edited meanwhile is never overwritten.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from pgregistry.allowlist._storage import StorageError, atomic_write

__all__ = ["Change", "WriteError", "unified_diff", "write_changes"]


class WriteError(OSError):
    """A file could not be written, or changed on disk since it was read; the message names it."""

    def __str__(self) -> str:
        return str(self.args[0])


@dataclass(frozen=True)
class Change:
    """One file's planned rewrite: its project path, where it is, the bytes read (and their mtime), the new text;
    ``created``: a new file (the fallback helper module), which must still not exist when it is written."""

    path: str
    absolute: Path
    before: bytes
    mtime_ns: int
    after: bytes
    created: bool = False


def unified_diff(change: Change) -> str:
    """The change as a unified diff (``a/PATH`` to ``b/PATH``), as ``git diff`` names them."""
    old = change.before.decode("utf-8").splitlines(keepends=True)
    new = change.after.decode("utf-8").splitlines(keepends=True)
    lines = difflib.unified_diff(old, new, "/dev/null" if change.created else f"a/{change.path}", f"b/{change.path}")
    return "".join(line if line.endswith("\n") else line + "\n\\ No newline at end of file\n" for line in lines)


def _unchanged(change: Change) -> str | None:
    """None when the file still holds what it was planned from (a new one: still does not exist); else why
    not."""
    if change.created:
        return "created since the run began; run the migration again" if os.path.lexists(change.absolute) else None
    try:
        now = os.stat(change.absolute)
        data = change.absolute.read_bytes()
    except OSError as error:
        return f"cannot read it again: {error.strerror or error}"
    if data != change.before or now.st_mtime_ns != change.mtime_ns:
        return "changed on disk since it was read; run the migration again"
    return None


def write_changes(changes: Sequence[Change]) -> None:
    """Write every change, or (``WriteError`` naming the file) none when one cannot be written."""
    for change in changes:
        if change.created:
            if not os.access(change.absolute.parent, os.W_OK | os.X_OK):
                raise WriteError(f"{change.path}: its directory is not writable (the new file is renamed in)")
            problem = _unchanged(change)
            if problem is not None:
                raise WriteError(f"{change.path}: {problem}")
            continue
        mode = os.stat(change.absolute).st_mode
        if not os.access(change.absolute, os.W_OK) or not mode & 0o222:  # read-only to its owner, even root
            raise WriteError(f"{change.path}: read-only; make it writable, or leave it out of the paths")
        if not os.access(change.absolute.parent, os.W_OK | os.X_OK):
            raise WriteError(f"{change.path}: its directory is not writable (the rewrite renames a new file in)")
        problem = _unchanged(change)
        if problem is not None:
            raise WriteError(f"{change.path}: {problem}")
    for change in changes:
        problem = _unchanged(change)
        if problem is not None:
            raise WriteError(f"{change.path}: {problem} (files listed before it were written)")
        try:
            atomic_write(change.absolute, change.after)
            if change.created:  # mkstemp's 0600 would hide the module from other users of the tree
                umask = os.umask(0)
                os.umask(umask)
                os.chmod(change.absolute, 0o666 & ~umask)
        except (StorageError, OSError) as error:
            raise WriteError(f"{change.path}: {error} (files listed before it were written)") from error

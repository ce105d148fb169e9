"""Writing the files ``pgregistry migrate`` changes: all of them or none, even if the run is killed.

A rewrite changes callers together with the functions they call (a call passing ``pg_collection=``
to a function not yet given the parameter is a ``TypeError``), so the files of one run are one
change. Every file is checked before any is written: it must be writable (a read-only file is
refused even though a rename into its directory would replace it), have one hard link (a rename
would split it from the others, and writing through the link is not atomic: refused, naming the
other paths), and still hold the bytes it was planned from, with the same modification time. Then:

1. a journal at the project root (:data:`JOURNAL`) lists, for each file, its temporary file beside
   it and the hashes of its old and new bytes, in the state ``writing``; every temporary file is
   written and ``fsync``-ed;
2. the journal is rewritten in the state ``renaming`` (atomically: it is itself replaced by a
   rename);
3. each file is checked once more (a file edited meanwhile is never overwritten: the files already
   renamed are put back and nothing is left written) and its temporary file renamed over it;
4. the journal is removed.

A run killed at any moment leaves every file old or new, and the journal. The next ``migrate`` (any
mode but ``--check``, which exits 2 naming it) finishes it first (:func:`finish_interrupted`): in
the state ``writing`` nothing was renamed yet, so the temporary files are removed (rolled back); in
``renaming`` every new text is on disk, so the renames are completed (rolled forward). No temporary
file remains either way. A file that holds neither its old nor its new bytes by then (edited after
the kill) stops the recovery, naming it, the journal kept. So does a journal this tool did not
write (:func:`_journal_row`): a row whose target is outside the project, or whose temporary file is
not the one beside it, would have a run remove or replace any file.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from pgregistry._source.files import read_regular_file
from pgregistry._source.storage import StorageError, atomic_write, exclusive_lock

__all__ = ["JOURNAL", "Change", "WriteError", "finish_interrupted", "write_changes"]

#: The journal of a ``--write`` in progress, at the project root.
JOURNAL = ".pgregistry-migrate-journal.json"


class JournalState(str, Enum):
    """Where a ``--write`` stood when its journal was last written: ``writing`` or ``renaming``.

    ``writing``: temporary files only, rolled back; ``renaming``: every new text on disk, finished.
    Any other value is a journal this tool did not write, refused rather than read as one of
    these."""

    WRITING = "writing"
    RENAMING = "renaming"


class WriteError(OSError):
    """A file could not be written, or changed on disk since it was read; the message names it."""

    def __str__(self) -> str:
        return str(self.args[0])


@dataclass(frozen=True)
class Change:
    """One file's planned rewrite: its project path, where it is, the bytes read, the new text.

    The bytes read come with their mtime; ``created``: a new file (the fallback helper module),
    which must still not exist when it is written."""

    path: str
    absolute: Path
    before: bytes
    mtime_ns: int
    after: bytes
    created: bool = False


def _sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _hash_of(path: Path) -> str | None:
    """The SHA-256 of the file at ``path``; None when there is none, ``"?"`` when it is unreadable.

    ``"?"`` too where it is no regular file (a FIFO there is not waited on): no hash matches it."""
    try:
        return _sha256_hex(read_regular_file(path)[0])
    except FileNotFoundError:
        return None
    except OSError:
        return "?"


def _why_changed_on_disk(change: Change) -> str | None:
    """None when the file still holds what it was planned from; else why not.

    For a new one: when it still does not exist."""
    if change.created:
        return (
            "created since the run began; run the migration again"
            if os.path.lexists(change.absolute)
            else None
        )
    try:
        data, mtime_ns = read_regular_file(change.absolute)  # a FIFO swapped in is not waited on
    except OSError as error:
        return f"cannot read it again: {error.strerror or error}"
    if data != change.before or mtime_ns != change.mtime_ns:
        return "changed on disk since it was read; run the migration again"
    return None


def _check_writable(change: Change, hard_links: Mapping[str, Sequence[str]]) -> None:
    """``WriteError`` unless ``change`` may be written (see the module docstring).

    A new file: unless its directory is writable and it still does not exist. Whether it changed on
    disk is checked first, so a file deleted meanwhile is named as such."""
    problem = _why_changed_on_disk(change)
    if problem is not None:
        raise WriteError(f"{change.path}: {problem}")
    if change.created:
        if not os.access(change.absolute.parent, os.W_OK | os.X_OK):
            raise WriteError(
                f"{change.path}: its directory is not writable (the new file is renamed in)"
            )
        return
    status = os.stat(change.absolute)
    if (
        not os.access(change.absolute, os.W_OK) or not status.st_mode & 0o222
    ):  # read-only to its owner, even root
        raise WriteError(
            f"{change.path}: read-only; make it writable, or leave it out of the paths"
        )
    if not os.access(change.absolute.parent, os.W_OK | os.X_OK):
        raise WriteError(
            f"{change.path}: its directory is not writable (the rewrite renames a new file in)"
        )
    if status.st_nlink > 1:
        others = (
            ", ".join(hard_links.get(change.path, ())) or "none of them among the migrated files"
        )
        raise WriteError(
            f"{change.path}: has {status.st_nlink} hard links (others: "
            f"{others}); a rewrite would split them into differing copies: make "
            "them one file or symbolic links, or leave it out of the paths"
        )


def _sync_directories(paths: Sequence[Path]) -> None:
    """Make the renames and creations in the directories of ``paths`` durable."""
    for directory in sorted({str(path.parent) for path in paths}):
        with contextlib.suppress(OSError):
            handle = os.open(directory, os.O_RDONLY)
            try:
                os.fsync(handle)
            finally:
                os.close(handle)


def _write_journal(
    journal: Path, state: JournalState, entries: Sequence[tuple[Change, Path]]
) -> None:
    """The journal, in ``state``: each file's paths and the hashes of its old and new bytes.

    The paths are the file's and its temporary file's, absolute (a link in the project's path cannot
    make them name other files)."""
    rows = [
        {
            "target": str(change.absolute),
            "temporary": str(temporary),
            "old": None if change.created else _sha256_hex(change.before),
            "new": _sha256_hex(change.after),
        }
        for change, temporary in entries
    ]
    try:
        atomic_write(
            journal, json.dumps({"state": state.value, "files": rows}, indent=1).encode() + b"\n"
        )
    except StorageError as error:
        raise WriteError(f"{error}; nothing was written") from error


def _write_temporary(change: Change, temporary: Path) -> None:
    """The new bytes beside the file, with its permissions, flushed to disk.

    A new file is opened with ``0666``, so the umask applies as to any new file (not ``0600``, which
    would hide the helper module from the tree's other users), as
    :func:`~pgregistry._source.storage.atomic_write` makes one."""
    mode = None if change.created else os.stat(change.absolute).st_mode & 0o7777
    handle = os.open(
        temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666 if mode is None else 0o600
    )
    with os.fdopen(handle, "wb") as stream:
        stream.write(change.after)
        stream.flush()
        os.fsync(stream.fileno())
    if mode is not None:
        os.chmod(temporary, mode)


#: The random part of a run's temporary files' names, in bytes (twice as many hex digits).
_TOKEN_BYTES = 4
_SUFFIX = ".pgregistry-migrate.tmp"


def _temporary_of(target: Path, token: str) -> Path:
    """The temporary file beside ``target`` of the run ``token`` (hex digits) names."""
    return target.with_name(f".{target.name}.{token}{_SUFFIX}")


def _journal_row(row: Mapping[str, object], root: Path) -> tuple[Path, Path, str | None, str]:
    """A journal's ``row``: (target, temporary file, old hash, new hash), if this tool wrote it.

    ``ValueError`` otherwise. It did when the target is a file of the project at ``root`` and the
    temporary file is beside it under the name :func:`_temporary_of` gives: a journal made otherwise
    (committed, copied from another tree, edited) must not make a run remove or replace any other
    file."""
    target, temporary, old, new = (row[key] for key in ("target", "temporary", "old", "new"))
    if not (isinstance(target, str) and isinstance(temporary, str)):
        raise ValueError(f"a row names no target and temporary file: {dict(row)}")
    target_path, temporary_path = Path(target), Path(temporary)
    inside = Path(os.path.realpath(target)).is_relative_to(os.path.realpath(root))
    if not (target_path.is_absolute() and inside):
        raise ValueError(f"it lists {target}, which is not a file of the project {root}")
    token = temporary_path.name.removeprefix(f".{target_path.name}.").removesuffix(_SUFFIX)
    if (
        temporary_path != _temporary_of(target_path, token)
        or len(token) != 2 * _TOKEN_BYTES
        or not all(digit in "0123456789abcdef" for digit in token)
    ):
        raise ValueError(
            f"it lists {temporary} as the temporary file of {target}, a name this tool never gives"
        )
    if not (old is None or isinstance(old, str)) or not isinstance(new, str):
        raise ValueError(f"the hashes of {target} are not strings: {old!r}, {new!r}")
    return target_path, temporary_path, old, new


def _remove_files(paths: Sequence[Path]) -> None:
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


@contextlib.contextmanager
def _journal_lock(root: Path) -> Iterator[Path]:
    """The journal's path, with the lock keeping two runs from writing or finishing one at once."""
    journal = root / JOURNAL
    try:
        with exclusive_lock(journal):
            yield journal
    except StorageError as error:
        raise WriteError(str(error)) from error


def write_changes(
    changes: Sequence[Change], root: Path, hard_links: Mapping[str, Sequence[str]] | None = None
) -> None:
    """Write every change, or (``WriteError`` naming the file) none.

    ``root``: the project root, where the journal goes; ``hard_links``: each path's other paths to
    the same file among those migrated."""
    for change in changes:
        _check_writable(change, hard_links or {})
    if not changes:
        return
    with _journal_lock(root) as journal:
        if journal.exists():
            raise WriteError(
                f"{journal}: another run's journal appeared meanwhile; run the migration again"
            )
        token = secrets.token_hex(_TOKEN_BYTES)
        entries = [(c, _temporary_of(c.absolute, token)) for c in changes]
        temporaries = [temporary for _, temporary in entries]
        _write_journal(journal, JournalState.WRITING, entries)
        try:
            for change, temporary in entries:
                _write_temporary(change, temporary)
            _sync_directories(temporaries)
        except OSError as error:
            _remove_files(temporaries)
            journal.unlink()
            raise WriteError(
                f"{change.path}: cannot write it: {error.strerror or error}; nothing was written"
            ) from error
        _write_journal(journal, JournalState.RENAMING, entries)
        try:
            _rename_all(entries)
        except WriteError:
            journal.unlink()
            raise
        _sync_directories([change.absolute for change in changes])
        journal.unlink()
        _sync_directories([journal])


def _rename_all(entries: Sequence[tuple[Change, Path]]) -> None:
    """Rename each temporary file over its file, each checked once more just before.

    When one changed on disk meanwhile (or cannot be renamed), put back those renamed already: none
    is left written."""
    renamed: list[Change] = []
    for change, temporary in entries:
        problem = _why_changed_on_disk(change)
        try:
            if problem is None:
                os.replace(temporary, change.absolute)
                renamed.append(change)
                continue
        except OSError as error:
            problem = f"cannot rename its new text into place: {error.strerror or error}"
        for done in renamed:
            if done.created:
                os.unlink(done.absolute)
            else:
                atomic_write(done.absolute, done.before)
        _remove_files([temporary for _, temporary in entries])
        raise WriteError(
            f"{change.path}: {problem}; nothing was written (the {len(renamed)} file(s) already "
            "rewritten were put back)"
        )


def finish_interrupted(root: Path) -> str | None:
    """Finish the ``--write`` that left a journal at ``root``; what was done, None without one.

    See the module docstring. ``WriteError`` naming the files when it cannot (the journal kept)."""
    with _journal_lock(root) as journal:
        # A run killed while writing the journal itself left its temporary file, and nothing else.
        stale = sorted(root.glob(f".{JOURNAL}.*.tmp"))
        _remove_files(stale)
        if not journal.exists():
            return (
                "an interrupted `pgregistry migrate --write` had written "
                "nothing; its journal's temporary file is removed"
                if stale
                else None
            )
        try:
            record = json.loads(read_regular_file(journal)[0])
            state, rows = JournalState(record["state"]), record["files"]
            files = [_journal_row(row, root) for row in rows]
        except (OSError, ValueError, KeyError, TypeError) as error:
            raise WriteError(
                f"{journal}: an interrupted run's journal that cannot be read ({error}); "
                "restore the files it lists from version control, then delete it"
            ) from error
        if state is JournalState.WRITING:
            _remove_files([temporary for _, temporary, _, _ in files])
            journal.unlink()
            return (
                "an interrupted `pgregistry migrate --write` was rolled back: none of its "
                f"{len(files)} file(s) had been written; its temporary files are removed"
            )
        conflicts, completed = [], 0
        for target, temporary, old, new in files:
            current, ready = _hash_of(target), _hash_of(temporary)  # None: a file the run creates
            if current == new:
                _remove_files([temporary])
            elif current == old and ready == new:
                os.replace(temporary, target)
                completed += 1
            else:
                conflicts.append(str(target))
        if conflicts:
            raise WriteError(
                f"{journal}: an interrupted `pgregistry migrate --write` cannot be finished: "
                f"{', '.join(conflicts)} changed since; restore them (from version control), run "
                "again, or delete the journal and its temporary files to keep the tree as it is"
            )
        _sync_directories([target for target, _, _, _ in files])
        journal.unlink()
        return (
            "an interrupted `pgregistry migrate --write` was finished: "
            f"{completed} of its {len(files)} file(s) were renamed into place now"
        )

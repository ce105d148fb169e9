"""Writing a file so it is never lost or half-written, and serialising the processes rewriting it.

The allowlist is the one file the ratchet writes that a person cares about, so a rewrite goes to a
temporary file in the same directory, is flushed to disk (``fsync``) and only then renamed over the
old file: a crash, a ``kill -9`` or a full disk at any point leaves either the old file or the new
one, never a truncated mix.

Two updates running at once (two partial ``update PATH`` runs, or a pre-commit hook beside a manual
run) would each read the old list and the last rename would drop the other's entries.
:func:`exclusive_lock` holds an advisory lock on the file's directory for the whole
read-merge-write, so the second waits for the first and merges into its result. As a second line of
defence (for writers that take no lock, and for Windows, which has no ``flock``), the allowlist's
writer re-reads the file before the rename and refuses when it changed since it was read (see
:meth:`pgregistry.allowlist._ratchet.Allowlist.write`).
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

__all__ = ["LOCK_TIMEOUT_S", "StorageError", "atomic_write", "exclusive_lock", "file_to_rewrite"]

#: How long to wait for another process's update before giving up (nothing may hang forever).
LOCK_TIMEOUT_S = 120.0

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]


class StorageError(OSError):
    """A file could not be written or locked; ``str()`` is one line naming the file and cause."""

    def __str__(self) -> str:
        return str(self.args[0])


def _reason_of(error: OSError) -> str:
    return error.strerror or str(error) or type(error).__name__


def atomic_write(
    path: Path, data: bytes, *, durable: bool = True, make_parents: bool = True
) -> None:
    """Replace ``path`` with ``data`` all at once, leaving it untouched on failure.

    Temporary file in the same directory (created first with ``make_parents``), ``fsync`` (when
    ``durable``), rename. Raises :class:`StorageError` on any OS error; ``path`` is then untouched
    and no temporary file is left behind. The file keeps its mode; a new one gets the mode any new
    file gets (``0666`` less the umask, as ``open`` makes it), not ``mkstemp``'s ``0600``."""
    try:
        if make_parents:
            path.parent.mkdir(parents=True, exist_ok=True)
        handle, temporary = _new_temporary(path)
    except OSError as error:
        raise StorageError(f"cannot write {path}: {_reason_of(error)}") from error
    try:
        with os.fdopen(handle, "wb") as stream:
            stream.write(data)
            stream.flush()
            if durable:
                os.fsync(stream.fileno())
        with contextlib.suppress(OSError):  # keep the old file's permissions (none: a new file)
            os.chmod(temporary, path.stat().st_mode & 0o7777)
        os.replace(temporary, path)
    except BaseException as error:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        if isinstance(error, OSError):
            raise StorageError(
                f"cannot write {path}: {_reason_of(error)}; the previous file is unchanged"
            ) from error
        raise
    if durable:  # make the rename itself durable
        with contextlib.suppress(OSError):
            directory = os.open(path.parent, os.O_RDONLY)
            try:
                os.fsync(directory)
            finally:
                os.close(directory)


def _new_temporary(path: Path) -> tuple[int, str]:
    """A new file beside ``path`` opened for writing, and its name.

    Made by ``open`` with mode ``0666``, so the umask (and a directory's default ACL) applies as to
    any new file."""
    for _ in range(tempfile.TMP_MAX):
        name = str(path.parent / f".{path.name}.{secrets.token_hex(8)}.tmp")
        try:
            return os.open(
                name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666
            ), name
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, f"no unused temporary name beside {path}")


@contextlib.contextmanager
def exclusive_lock(path: Path, timeout: float = LOCK_TIMEOUT_S) -> Iterator[None]:
    """Hold the advisory lock that serialises rewrites of ``path``.

    It is a lock on its directory, so it survives the rename that replaces the file. Waits up to
    ``timeout`` seconds, then raises :class:`StorageError`."""
    if (
        fcntl is None
    ):  # pragma: no cover - Windows: the writer's re-read still detects a concurrent change
        yield
        return
    directory = path.parent
    try:
        directory.mkdir(parents=True, exist_ok=True)
        handle = os.open(directory, os.O_RDONLY)
    except OSError as error:
        raise StorageError(f"cannot lock {path}: {_reason_of(error)}") from error
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as error:
                if error.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                    raise StorageError(f"cannot lock {path}: {_reason_of(error)}") from error
                if time.monotonic() >= deadline:
                    raise StorageError(
                        f"cannot lock {path}: another process has "
                        f"been updating it for {timeout:.0f} s"
                    ) from None
                time.sleep(0.05)
        yield
    finally:
        os.close(handle)  # closing the descriptor releases the lock


def file_to_rewrite(path: Path, root: Path) -> Path:
    """The file an update of the allowlist at ``path`` rewrites: it, or the one a link there names.

    A rename over a symbolic link would make it a regular file holding a copy, and leave the file
    it named with the old list: the link stays, the file it names is rewritten. Only one of the
    project at ``root`` (links resolved): :class:`StorageError` for a link to any other, which a
    repository's link must not have an update write over (a full update replaces a file that is no
    allowlist). A read-only one is refused too, as ``migrate --write`` refuses a read-only source:
    the rename would replace it, even as root."""
    target = path
    if path.is_symlink():
        target = Path(os.path.realpath(path))
        if not target.is_relative_to(os.path.realpath(root)):
            raise StorageError(
                f"{path} is a link to {target}, outside the project {root}: an update writes only "
                "the project's files; update that list from its own project, or put the file in "
                "the link's place"
            )
    if target.is_file() and not (os.access(target, os.W_OK) and target.stat().st_mode & 0o222):
        raise StorageError(f"{path}: read-only; make it writable to update it")
    return target

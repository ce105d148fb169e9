"""Writing one checkpoint file: complete under its name or not there at all; a failed write named.

A file is written under a temporary name beside its final one (``.<name>.partial``), flushed to
disk, and only renamed once the caller says so (:mod:`~pgregistry.checkpoint._rank_files` renames
once every rank's file is complete). The temporary name is fixed per file, so a save killed half-way
(``kill -9``, a node lost) leaves at most one stale ``.partial`` per rank file, which the next save
of that file replaces: nothing accumulates on the disk, and loaders never look at those names.

``torch.save`` reports a failed write as its own ``enforce fail at inline_container.cc`` error and
drops the ``OSError`` under it: here every byte goes through :func:`os.write`, the first ``OSError``
is kept, and the error raised names the file and the disk (device, mount point and free space), e.g.
``[Errno 28] No space left on device: writing /ckpt/step-100/rank-00003.pt on /dev/nvme1n1 mounted
at /ckpt (0 bytes free)``.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import IO, Any, cast

import torch

__all__ = ["partial_path", "rename_durably", "write_partial"]

_OCTAL = re.compile(r"\\([0-7]{3})")

_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)


class _Sink:
    """The file object ``torch.save`` writes to, keeping the first ``OSError``.

    Each write goes whole to the descriptor, and the first ``OSError`` is kept (torch replaces it by
    an error that names neither the cause nor the file)."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        size = len(view)
        try:
            while view:
                view = view[os.write(self._fd, view) :]
        except OSError as exc:
            self.error = self.error or exc
            raise
        return size

    def flush(self) -> None:
        """Nothing to flush: every write went to the descriptor (``torch.save`` calls it last)."""


def partial_path(path: Path) -> Path:
    """Where ``path`` is written before it is renamed into place."""
    return path.with_name(f".{path.name}.partial")


def write_partial(path: Path, payload: Any) -> Path:
    """``torch.save(payload)`` to :func:`partial_path` of ``path``, flushed to disk; return it.

    A stale partial file (of a save that was killed) is replaced. On any failure the partial file is
    removed; a failed write, flush or close raises ``OSError`` with its errno, naming ``path`` and
    its disk.
    """
    partial = partial_path(path)
    partial.unlink(missing_ok=True)
    fd = os.open(partial, _CREATE_FLAGS, 0o666)
    sink = _Sink(fd)
    try:
        try:
            torch.save(payload, cast("IO[bytes]", sink))  # torch needs write() and flush() only
            os.fsync(fd)
        finally:
            os.close(fd)
    except Exception as exc:
        cause = sink.error or (exc if isinstance(exc, OSError) else None)
        # The disk is described before the partial file is removed: its free space as the write saw
        # it.
        named = (
            None
            if cause is None
            else OSError(
                cause.errno, f"{cause.strerror or cause}: writing {path} on {_disk_of(path.parent)}"
            )
        )
        partial.unlink(missing_ok=True)
        if named is None:
            raise  # not the disk (a value that cannot be pickled): the error as it was
        raise named from exc
    return partial


def rename_durably(partial: Path, path: Path) -> None:
    """Rename the complete ``partial`` file to ``path`` and make the rename durable."""
    os.replace(partial, path)
    _fsync_directory(path.parent)


def _disk_of(directory: Path) -> str:
    """``<device> mounted at <mount point> (<free> bytes free)``, as far as the platform tells."""
    mount = directory.resolve()
    while not os.path.ismount(mount) and mount != mount.parent:
        mount = mount.parent
    try:
        free = f" ({shutil.disk_usage(mount).free} bytes free)"
    except OSError:
        free = ""
    return f"{_device_of(mount)} mounted at {mount}{free}"


def _device_of(mount: Path) -> str:
    """The device (or file system source) mounted at ``mount``, from ``/proc/self/mounts``.

    ``the device`` where that is not available."""
    device = "the device"
    try:
        with open("/proc/self/mounts") as mounts:
            for line in mounts:
                fields = line.split()
                # Mount points escape blanks as octal (\040); the last mount on a point is the
                # visible one.
                if len(fields) > 1 and _OCTAL.sub(
                    lambda m: chr(int(m.group(1), 8)), fields[1]
                ) == str(mount):
                    device = fields[0]
    except OSError:
        pass
    return device


def _fsync_directory(directory: Path) -> None:
    """Make the renames in ``directory`` durable (where the platform lets a directory be opened)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)

"""Clean-up of a :func:`pgregistry.testing.run_world` world, surviving the death of its process.

The parent of a world kills its ranks' process groups and removes the store directory in a
``finally``; a parent killed outright (``kill -9``, an out-of-memory kill, a CI job cancelled) runs
none of it. Ranks die with it (``PR_SET_PDEATHSIG``), but processes they spawned would not, and the
store directory would stay in ``/tmp``. :class:`WorldWatcher` starts a small process before the
ranks (a :mod:`multiprocessing` process, ``fork``-started: it needs nothing but a pipe and a path,
and starts in milliseconds) that waits on a pipe only the parent writes: the parent sends each
rank's pid, then "done" once it has cleaned up; end-of-file without "done" means the parent died,
and the watcher ends every rank's process group and removes the store directory itself.
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import signal

__all__ = ["WorldWatcher", "end_process_group"]

_DONE = b"done\n"


class WorldWatcher:
    """The watcher process of one world.

    The parent calls :meth:`watch` per rank and :meth:`dismiss` at the end.
    """

    def __init__(self, store_dir: str) -> None:
        read_fd, self._write_fd = os.pipe()
        self._process = multiprocessing.get_context("fork").Process(
            target=_watch_parent,
            args=(read_fd, self._write_fd, store_dir),
            name="pgregistry-world-watcher",
        )
        self._process.start()
        os.close(read_fd)

    def watch(self, rank_pid: int) -> None:
        """Have the watcher end ``rank_pid``'s process group if the parent dies."""
        os.write(self._write_fd, f"{rank_pid}\n".encode())

    def close_in_child(self) -> None:  # pragma: no cover - runs in a rank
        """Close the parent's pipe end in a forked rank: the watcher sees EOF if the parent dies."""
        os.close(self._write_fd)

    def dismiss(self) -> None:
        """The parent has cleaned up: tell the watcher to leave without acting, and reap it."""
        try:
            os.write(self._write_fd, _DONE)
        finally:
            os.close(self._write_fd)
            self._process.join()


def end_process_group(pid: int) -> None:
    """Kill the process group led by ``pid`` (a rank and all it spawned), then reap ``pid`` if ours.

    A rank that has not yet made its own group (killed right after the fork) is killed alone.
    """
    for kill, target in ((os.killpg, pid), (os.kill, pid)):
        try:
            kill(target, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:
        pass


def _watch_parent(
    read_fd: int, parent_write_fd: int, store_dir: str
) -> None:  # pragma: no cover - runs in the watcher
    try:
        os.close(parent_write_fd)  # only the parent holds it: its death is our end-of-file
        # Out of the parent's process group: a Ctrl-C or a group kill of the parent leaves it
        # running.
        os.setsid()
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in (
            0,
            1,
            2,
        ):  # hold none of the parent's streams open (a pipeline reading them waits for EOF)
            os.dup2(devnull, fd)
        received = bytearray()
        while chunk := os.read(read_fd, 4096):
            received += chunk
        if not received.endswith(_DONE):
            for line in received.decode().split():
                if line.isdigit():
                    try:
                        os.killpg(int(line), signal.SIGKILL)
                    except (ProcessLookupError, PermissionError):
                        pass
            shutil.rmtree(store_dir, ignore_errors=True)
    finally:
        os._exit(0)

"""Work in forked child processes, none of which outlives the process that started it for long.

Both parallel runs over a source tree (the scan's buckets, ``migrate``'s two phases) start their
children the same way: a :class:`multiprocessing.Process` of the ``fork`` start method, named
explicitly (a child inherits the files, so nothing is sent to it, and runs closures over this run's
objects, which a spawned one could not receive), talking to its parent through one
:func:`multiprocessing.Pipe`. Not a :class:`concurrent.futures.ProcessPoolExecutor`: each of its
forked workers holds the write end of the queue it waits on, so a worker left waiting when its
parent is killed (SIGKILL: no cleanup runs) waits forever. A child started here closes every
parent's end it inherited, its own pipe's too, so its next read or write of the pipe after the
parent died fails, and it exits.

A child that fails (an exception, a signal, a payload that does not unpickle) prints nothing and
exits 1: its caller does the child's share again, so a result never depends on how the work was
split.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

__all__ = ["Child", "can_fork", "start_child"]


def can_fork() -> bool:
    """Whether work may go to forked children: ``fork`` exists and no other thread holds a lock."""
    return hasattr(os, "fork") and threading.active_count() == 1


@dataclass
class Child:
    """A child process as its parent sees it: its pipe end, and whether it failed or was reaped."""

    process: BaseProcess
    connection: Connection
    failed: bool = False
    reaped: bool = False

    def receive(self) -> object:
        """The next object the child sends; ``failed`` (and None) when none it sends unpickles."""
        if self.failed:
            return None
        try:
            return self.connection.recv()
        except Exception:  # EOF, a truncated or foreign payload: the child failed
            self.failed = True
            return None

    def send(self, instruction: object) -> None:
        try:
            self.connection.send(instruction)
        except OSError:  # it exited already
            self.failed = True

    def wait(self) -> None:
        """Reap the child once it has sent everything: ``failed`` unless it exited cleanly."""
        self.connection.close()
        self.process.join()
        self.failed = self.failed or self.process.exitcode != 0
        self._close_and_mark_reaped()

    def kill(self) -> None:
        """Stop and reap the child, whatever it is doing (on the way out, or after it failed)."""
        if self.reaped:
            return
        self.connection.close()
        self.process.kill()  # harmless once it exited: it is a zombie until joined
        self.process.join()
        self._close_and_mark_reaped()

    def _close_and_mark_reaped(self) -> None:
        self.process.close()
        self.reaped = True


def start_child(work: Callable[[Connection], object], started: Sequence[Child]) -> Child:
    """Fork a child that runs ``work`` on its end of a new pipe.

    ``started``: the children this process started before it and has not reaped (their pipes' parent
    ends are closed in the new child)."""
    context = multiprocessing.get_context("fork")
    here_end, child_end = context.Pipe()
    parent_ends = [here_end, *(child.connection for child in started if not child.reaped)]
    process = context.Process(target=_run_child, args=(work, child_end, parent_ends))
    process.start()
    child_end.close()
    return Child(process, here_end)


def _run_child(
    work: Callable[[Connection], object], connection: Connection, parent_ends: Sequence[Connection]
) -> None:
    """In the child: ``work``, with no parent's end of any pipe held.

    A failure exits 1 and prints nothing (the parent does the share again), Ctrl-C included (the
    parent, interrupted too, stops every child)."""
    for end in parent_ends:  # a child holding one would not see EOF when the parent dies
        end.close()
    try:
        work(connection)
    except BaseException:  # noqa: BLE001 - whatever failed, the parent redoes this share
        sys.exit(1)

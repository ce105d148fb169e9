"""Work in two phases split across forked processes, with one exchange between the phases.

``migrate`` plans each file alone, then needs what every file's plan says (which functions were threaded) before
it can finish any file (which calls pass a collection). Each worker keeps its state (libcst trees, far too large
to send) across the exchange, so each one stays in one process: worker 0 runs here, every other in a forked
child, which inherits the inputs (nothing is sent to it) and sends back only its phases' results, pickled,
through a pipe; the instructions for its second phase come down another pipe.

A child that fails (an exception, a signal, a result that does not unpickle) is not trusted: its worker is run
again here, both phases, so a result never depends on how the work was split. Children are reaped before this
returns, also when it raises.

What cannot be split well before the work starts is shared out as it goes, through a :class:`TaskQueue`.
"""

from __future__ import annotations

import os
import pickle
import signal
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import IO, Protocol, TypeVar

__all__ = ["TaskQueue", "Worker", "two_phases"]

First = TypeVar("First")
Second = TypeVar("Second")
Instruction = TypeVar("Instruction")
First_co = TypeVar("First_co", covariant=True)
Second_co = TypeVar("Second_co", covariant=True)
Instruction_contra = TypeVar("Instruction_contra", contravariant=True)


class Worker(Protocol[First_co, Instruction_contra, Second_co]):
    """One share of the work: ``first()``, then ``second(instruction)`` in the same process."""

    def first(self) -> First_co: ...

    def second(self, instruction: Instruction_contra) -> Second_co: ...


class TaskQueue:
    """Tasks taken one at a time by whichever process asks first, across forks: a pipe made before forking and
    filled once, before anyone takes, by the process that made it. Each task is a 4-byte record (pipe writes and
    reads this small are whole), at most :attr:`RECORDS` of them so the filling never waits for a reader; a
    reader finds the pipe empty (not blocking) when every task is taken."""

    RECORDS = 4096

    def __init__(self) -> None:
        self._read, self._write = os.pipe()
        os.set_blocking(self._read, False)

    def fill(self, count: int) -> None:
        """Offer tasks ``0 .. count - 1`` (``count`` at most :attr:`RECORDS`)."""
        if not 0 <= count <= self.RECORDS:
            raise ValueError(f"a task queue holds at most {self.RECORDS} tasks, not {count}")
        if count:
            os.write(self._write, struct.pack(f"<{count}I", *range(count)))
        os.close(self._write)
        self._write = -1

    def take(self) -> int | None:
        """The next task, or None when all are taken."""
        try:
            record = os.read(self._read, 4)
        except BlockingIOError:
            return None
        if len(record) != 4:  # the end (the filling closed its end and no writer is left)
            return None
        return int(struct.unpack("<I", record)[0])

    def close(self) -> None:
        for fd in (self._read, self._write):
            if fd >= 0:
                os.close(fd)
        self._read = self._write = -1


@dataclass
class _Child:
    """A forked worker as its parent sees it: its pipes, and whether it has failed or been reaped."""

    pid: int
    up: IO[bytes]
    down: IO[bytes] | None
    failed: bool = False
    reaped: bool = False

    def fds(self) -> list[int]:
        return [self.up.fileno(), *([self.down.fileno()] if self.down is not None else [])]

    def receive(self) -> object:
        """The next result the child sends; ``failed`` (and None) when it sends none that unpickles."""
        if self.failed:
            return None
        try:
            return pickle.load(self.up)
        except Exception:  # EOF, a truncated or foreign payload: the child failed
            self.failed = True
            return None

    def send(self, instruction: object) -> None:
        assert self.down is not None
        try:
            pickle.dump(instruction, self.down)
            self.down.flush()
        except OSError:  # it exited already
            self.failed = True
        finally:
            self.down.close()
            self.down = None

    def wait(self) -> None:
        """Reap the child once it has sent everything: ``failed`` unless it exited cleanly."""
        self._close()
        _, status = os.waitpid(self.pid, 0)
        self.reaped = True
        self.failed = self.failed or status != 0

    def kill(self) -> None:
        """Stop and reap the child, whatever it is doing (on the way out, or after it failed)."""
        if self.reaped:
            return
        self._close()
        try:
            os.kill(self.pid, signal.SIGKILL)  # harmless once it exited: it is a zombie until reaped
        except ProcessLookupError:
            pass
        os.waitpid(self.pid, 0)
        self.reaped = True

    def _close(self) -> None:
        self.up.close()
        if self.down is not None:
            self.down.close()
            self.down = None


def _run_child(make: Callable[[], Worker[object, object, object]], up: int, down: int) -> None:
    """In the child: both phases, results up, then exit without running any of the parent's cleanup."""
    status = 1
    try:
        worker = make()
        with os.fdopen(up, "wb") as stream:
            pickle.dump(worker.first(), stream, protocol=pickle.HIGHEST_PROTOCOL)
            stream.flush()
            with os.fdopen(down, "rb") as instructions:
                instruction = pickle.load(instructions)
            pickle.dump(worker.second(instruction), stream, protocol=pickle.HIGHEST_PROTOCOL)
        status = 0
    finally:
        os._exit(status)


def two_phases(
    makers: Sequence[Callable[[], Worker[First, Instruction, Second]]],
    between: Callable[[list[First]], list[Instruction] | None],
    *,
    fork: bool,
) -> tuple[list[First], list[Second] | None]:
    """Each worker's first phase, then ``between`` on their results in order (the instruction for each worker,
    or None to stop there), then each worker's second phase. Every worker runs here unless ``fork``."""
    children: list[_Child | None] = [None]
    try:
        for make in makers[1:] if fork else ():
            up_read, up_write = os.pipe()
            down_read, down_write = os.pipe()
            pid = os.fork()
            if pid == 0:
                for stream in [up_read, down_write, *(fd for c in children if c is not None for fd in c.fds())]:
                    os.close(stream)  # a child holding another's pipe would keep it open after the parent closed it
                _run_child(make, up_write, down_read)  # type: ignore[arg-type]
            os.close(up_write)
            os.close(down_read)
            children.append(_Child(pid, os.fdopen(up_read, "rb"), os.fdopen(down_write, "wb")))
        children += [None] * (len(makers) - len(children))
        here: dict[int, Worker[First, Instruction, Second]] = {}
        firsts: list[First] = []
        for index, make in enumerate(makers):
            child = children[index]
            result = child.receive() if child is not None else None
            if child is None or child.failed:
                if child is not None:
                    child.kill()
                here[index] = make()
                result = here[index].first()
            firsts.append(result)  # type: ignore[arg-type]
        instructions = between(firsts)
        if instructions is None:
            return firsts, None
        for index, child in enumerate(children):
            if child is not None and index not in here:
                child.send(instructions[index])
        seconds: dict[int, Second] = {index: worker.second(instructions[index]) for index, worker in here.items()}
        for index, child in enumerate(children):
            if child is None or index in here:
                continue
            result = child.receive()
            child.wait()
            if child.failed:
                worker = makers[index]()
                worker.first()
                result = worker.second(instructions[index])
            seconds[index] = result  # type: ignore[assignment]
        return firsts, [seconds[index] for index in range(len(makers))]
    finally:
        for child in children:
            if child is not None:
                child.kill()

"""Work in two phases split across processes, with one exchange between the phases.

``migrate`` plans each file alone, then needs what every file's plan says (which functions were
threaded) before it can finish any file (which calls pass a collection). Each worker keeps its state
(libcst trees, far too large to send) across the exchange, so each one stays in one process: worker
0 runs here, every other in a forked child of its own (:mod:`pgregistry._source.processes`; a pool's
task could not keep its state across the exchange), which inherits the inputs (nothing is sent to
it), sends back only its phases' results through its pipe and receives its second phase's
instruction down the same pipe.

A child that fails (an exception, a signal, a result that does not unpickle) is not trusted: its
worker is run again here, both phases, so a result never depends on how the work was split. Children
are reaped before this returns, also when it raises.

What cannot be split well before the work starts is shared out as it goes, through a
:class:`TaskQueue`.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable, Sequence
from functools import partial
from multiprocessing.connection import Connection
from typing import Protocol, TypeVar

from pgregistry._source.processes import Child, start_child

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
    """Tasks taken one at a time by whichever process asks first, across forks, through a pipe.

    The pipe is made before forking and filled once, before anyone takes, by the process that made
    it. Each task is a 4-byte record (pipe writes and reads this small are whole, so no lock is
    shared: a child killed while taking leaves none held), at most :attr:`RECORDS` of them so the
    filling never waits for a reader; a reader finds the pipe empty (not blocking) when every task
    is taken."""

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


def _both_phases(
    make: Callable[[], Worker[object, object, object]], connection: Connection
) -> None:
    """In a child: both phases of the worker ``make`` makes; results up the pipe, orders down."""
    worker = make()
    connection.send(worker.first())
    connection.send(worker.second(connection.recv()))


def two_phases(
    makers: Sequence[Callable[[], Worker[First, Instruction, Second]]],
    between: Callable[[list[First]], list[Instruction] | None],
    *,
    fork: bool,
) -> tuple[list[First], list[Second] | None]:
    """Each worker's first phase, then ``between`` on their results, then each one's second phase.

    ``between`` gets the first phases' results in order and returns the instruction for each worker,
    or None to stop there. Every worker runs here unless ``fork``."""
    children: list[Child | None] = [None]
    try:
        for make in makers[1:] if fork else ():
            work = partial(_both_phases, make)  # type: ignore[arg-type]
            children.append(start_child(work, [c for c in children if c is not None]))
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
        seconds: dict[int, Second] = {
            index: worker.second(instructions[index]) for index, worker in here.items()
        }
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

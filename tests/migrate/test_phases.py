"""Two phases across forked workers: results in order, a stop between the phases, and no child left behind."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pytest
from fixtures.processes import children_left, gone_within, killed_parents_child

from pgregistry.migrate._phases import TaskQueue, two_phases


@dataclass
class _Square:
    value: int
    fails_here: bool = False

    def first(self) -> tuple[int, int]:
        return self.value, os.getpid()

    def second(self, offset: int) -> int:
        if self.fails_here and os.getpid() == PARENT:
            raise RuntimeError("worker failed")
        return self.value * self.value + offset


PARENT = os.getpid()


def _makers(count: int, fails_here: bool = False) -> list[object]:
    return [lambda v=value: _Square(v, fails_here) for value in range(count)]


def _no_child_left() -> bool:
    return not children_left()


@pytest.mark.parametrize("fork", [False, True])
def test_each_worker_keeps_its_state_across_the_exchange(fork: bool) -> None:
    firsts, seconds = two_phases(_makers(4), lambda firsts: [sum(v for v, _ in firsts)] * 4, fork=fork)  # type: ignore[arg-type]
    assert [value for value, _ in firsts] == [0, 1, 2, 3]
    pids = [pid for _, pid in firsts]
    assert pids[0] == PARENT and all((pid != PARENT) == fork for pid in pids[1:])
    assert seconds == [6, 7, 10, 15]
    assert _no_child_left()


def test_a_stop_between_the_phases_ends_every_child() -> None:
    firsts, seconds = two_phases(_makers(3), lambda firsts: None, fork=True)  # type: ignore[arg-type]
    assert len(firsts) == 3 and seconds is None
    assert _no_child_left()


def test_an_error_here_is_raised_and_every_child_is_reaped() -> None:
    with pytest.raises(RuntimeError, match="worker failed"):
        two_phases(_makers(3, fails_here=True), lambda firsts: [0, 0, 0], fork=True)  # type: ignore[arg-type]
    assert _no_child_left()


_KILLED_HERE = """
import os, signal, sys, time
from pgregistry.migrate._phases import two_phases

class Worker:
    def __init__(self, index):
        self.index = index

    def first(self):
        if self.index == 1:  # the child: say who it is, then wait for its instruction
            with open(sys.argv[1] + ".tmp", "w") as record:
                record.write(str(os.getpid()))
            os.rename(sys.argv[1] + ".tmp", sys.argv[1])
            return 1
        while not os.path.exists(sys.argv[1]):  # here, once the child sent its first result: killed
            time.sleep(0.01)
        time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGKILL)

    def second(self, instruction):
        return instruction

two_phases([lambda: Worker(0), lambda: Worker(1)], lambda firsts: [0, 0], fork=True)
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads /proc")
def test_a_child_exits_when_the_process_running_the_phases_is_killed(tmp_path: Path) -> None:
    """SIGKILL leaves no cleanup to run: a child waiting for its instruction must see the parent's end of its pipe
    close, so it may hold no parent's end itself."""
    child = killed_parents_child(_KILLED_HERE, tmp_path)
    assert gone_within(child, 20), f"the child {child} outlived the process that ran the phases"


def test_a_task_queue_hands_each_task_to_exactly_one_process() -> None:
    """As in migrate: the child is forked first, the queue filled after, then both take until it is empty."""
    queue = TaskQueue()
    go_read, go_write = os.pipe()
    out_read, out_write = os.pipe()
    try:
        pid = os.fork()
        if pid == 0:
            status = 1
            try:
                os.read(go_read, 1)
                os.write(out_write, " ".join(str(task) for task in iter(queue.take, None)).encode() + b"\n")
                status = 0
            finally:
                os._exit(status)
        os.close(out_write)
        queue.fill(3000)
        os.write(go_write, b"x")
        mine = list(iter(queue.take, None))
        with os.fdopen(out_read, "rb") as stream:
            theirs = [int(task) for task in stream.read().split()]
        assert os.waitpid(pid, 0)[1] == 0
    finally:
        queue.close()
        os.close(go_read)
        os.close(go_write)
    assert sorted(mine + theirs) == list(range(3000))


def test_a_task_queue_refuses_more_tasks_than_it_can_hold_without_a_reader() -> None:
    queue = TaskQueue()
    try:
        with pytest.raises(ValueError, match="at most 4096 tasks"):
            queue.fill(TaskQueue.RECORDS + 1)
    finally:
        queue.close()

"""A multi-rank harness: run a function on every rank of a real local world and collect the results.

``run_world(4, fn, x)`` forks 4 processes, initialises the default process group on each (gloo on
CPU by default), calls ``fn(x)`` and returns the four results in rank order. It exists because the
traps of local multi-process tests are many and silent:

* ranks are *forked*, not spawned: spawning re-imports torch in every rank, seconds each (the
  figures are at the ``os.fork`` call);
* each child calls ``torch.set_num_threads(1)`` first, since a forked child can deadlock in a
  threaded matmul;
* each call gets its own ``FileStore`` in a fresh directory, so concurrent tests never share a port
  or a key;
* a rank that skips a collective hangs the others past every torch timeout, so the parent holds a
  hard deadline and kills every rank when it passes, naming the ranks that had not finished and
  where each one was (a ``faulthandler`` stack dump taken just before the kill);
* the deadline counts from when the last rank has joined the process group (each rank says so on its
  pipe): on a loaded machine forking and joining can take seconds, which a short deadline must not
  spend; start-up itself may take up to ``_STARTUP_GRACE_S`` beyond the deadline;
* each rank runs in its own session (process group), and the whole group is killed at the end, so
  processes a rank spawned do not outlive it holding the test's stdout open (which hangs a pipeline
  reading it);
* ranks die with the parent (``PR_SET_PDEATHSIG``), and a small watcher process
  (:mod:`pgregistry.testing._world_watcher`) ends their process groups and removes the store
  directory when the parent dies without cleaning up;
* an exception on any rank is re-raised in the parent with its rank and the child's formatted
  traceback; one that cannot be rebuilt in the parent, or that is no ``Exception`` (a rank's
  ``KeyboardInterrupt``, which re-raised would stop a whole pytest session), is reported as
  :class:`RankFailure` with the same text. The other ranks, which may be blocked in a collective
  with it, are killed after a short grace period;
* a rank that dies without reporting is named with its exit code or the signal that killed it;
* ranks are forked with the caller's objects frozen (``_frozen_heap``): a full collection in a rank
  visited every object it inherited, and copied the caller's whole heap, seconds a rank late in a
  test session.

Functions and results cross the fork/pipe boundary by pickle (results) and by inheritance (the
function), so a closure or lambda works as ``fn``; results must be picklable.

The package also holds what the harness and the checks on a real world use: the watcher
(``_world_watcher``), the heap frozen while forking (``_frozen_heap``), the ``pytest11`` plugin
(``_pytest_plugin``) and the toy models ``pgregistry verify`` runs (``_toy_models``).
"""

from __future__ import annotations

import ctypes
import enum
import faulthandler
import math
import os
import pickle
import select
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

from pgregistry._runtime.integers import positive_int
from pgregistry.testing._frozen_heap import heap_frozen_while_forking
from pgregistry.testing._world_watcher import WorldWatcher, end_process_group

__all__ = ["RankFailure", "WorldTimeout", "run_world"]

T = TypeVar("T")

_PR_SET_PDEATHSIG = 1
_ERROR_GRACE_S = 3.0
_STACK_DUMP_WAIT_S = 10.0  # the longest wait for a stuck rank's stack dump; usually milliseconds
_STARTUP_GRACE_S = 30.0
_JOINED = b"J"  # what a rank writes first once in the process group (a pickle starts with b"\x80")
_STACK_DUMP_SIGNAL = signal.SIGUSR1


class RankFailure(RuntimeError):
    """A rank failed: it raised, or its process died without reporting.

    The original exception is chained as ``__cause__`` when it could be rebuilt here.

    Args:
        rank: the rank that failed.
        detail: the child's formatted traceback, or how it died; the message is
            ``"rank {rank} failed: {detail}"``.

    Attributes:
        rank: the rank that failed.
        detail: the child's formatted traceback, or how it died.

    Example:
        >>> import os
        >>> try:
        ...     run_world(2, os._exit, 3)  # each rank's process exits at once
        ... except RankFailure as failure:
        ...     print(failure.detail)  # and failure.rank is the first rank found dead
        process exited without a result (exit code 3)
    """

    def __init__(self, rank: int, detail: str) -> None:
        super().__init__(f"rank {rank} failed: {detail}")
        self.rank = rank
        self.detail = detail


class WorldTimeout(TimeoutError):
    """The world did not finish before the deadline; every rank was killed.

    Args:
        message: the deadline, the stuck ranks and where each was.
        stuck_ranks: kept as the attribute of that name.
        stacks: kept as the attribute of that name.

    Attributes:
        stuck_ranks: the ranks that had not finished.
        stacks: each of them -> its Python stack at the deadline (``faulthandler`` format, every
            thread), or why none could be taken.

    Example:
        >>> import time
        >>> try:
        ...     run_world(2, time.sleep, 100, timeout=1)
        ... except WorldTimeout as timeout:
        ...     print(timeout.stuck_ranks)
        ...     print(timeout.stacks[0])  # rank 0's Python stack at the deadline, every thread
        [0, 1]
        ...in _child_main
        ...
    """

    def __init__(self, message: str, stuck_ranks: list[int], stacks: dict[int, str]) -> None:
        super().__init__(message)
        self.stuck_ranks = stuck_ranks
        self.stacks = stacks


def run_world(
    world_size: int,
    fn: Callable[..., T],
    *args: Any,
    backend: str = "gloo",
    timeout: float = 60.0,
    **kwargs: Any,
) -> list[T]:
    """Run ``fn(*args, **kwargs)`` on each rank of a fresh ``world_size`` world.

    Each rank is a forked process with the default process group initialised (gloo on CPU by
    default); ``fn`` is inherited, not pickled, and its results come back by pickle.

    Args:
        world_size: how many ranks.
        fn: what each rank runs.
        *args: ``fn``'s positional arguments.
        backend: the default process group's backend.
        timeout: the hard deadline (seconds) for ``fn`` on every rank, counted from when the last
            rank has joined the process group; start-up (forking and joining) may take up to
            ``_STARTUP_GRACE_S`` (30 s) more, so the world ends at most ``timeout + 30`` seconds
            after the call. It also bounds torch's own collective timeout.
        **kwargs: ``fn``'s keyword arguments.

    Returns:
        ``fn``'s result on each rank, in rank order.

    Raises:
        ValueError: ``world_size`` not a positive integer (a bool, a float); ``timeout`` not a
            positive, finite number of seconds (0 timed every world out, blaming its ranks; -1 and
            inf failed inside torch or time).
        Exception: the failing rank's own exception, with a :class:`RankFailure` carrying its rank
            and traceback attached as a note and as the exception's cause.
        RankFailure: a rank whose own exception cannot be rebuilt here, or whose process died
            without reporting.
        WorldTimeout: the world did not finish by the deadline; every rank was killed.

    Example:
        >>> from pgregistry import ParallelLayout, build
        >>> from pgregistry.collection import group_size
        >>> def tp_size() -> int:
        ...     return group_size(build(ParallelLayout(num_ranks=4, tp=2)).tp)
        >>> run_world(4, tp_size)
        [2, 2, 2, 2]
    """
    world_size = positive_int(world_size, "world_size")
    check_deadline(timeout)
    # Import torch once here, so every forked rank inherits it instead of importing it again
    # (seconds each).
    import torch.distributed  # noqa: F401

    store_dir = tempfile.mkdtemp(prefix="pgregistry-world-")
    sys.stdout.flush()
    sys.stderr.flush()
    # Every process of the world (the watcher, each rank) is forked with this process's objects
    # frozen: a full collection in a rank would copy every page of the heap it inherits, seconds
    # a rank late in a test session (pgregistry.testing._frozen_heap).
    with heap_frozen_while_forking():
        watcher = WorldWatcher(store_dir)
    children: dict[int, tuple[int, int]] = {}  # rank -> (pid, read fd)
    try:
        # Ranks that reported wait on this pipe until every rank has, so none leaves while a peer
        # may still be exchanging with it; closing the write end releases them all.
        release_read, release_write = os.pipe()
        try:
            with heap_frozen_while_forking():
                for rank in range(world_size):
                    read_fd, write_fd = os.pipe()
                    # By hand, not multiprocessing. Measured on this project's 2-core machine,
                    # loaded: an 8-rank gloo world starts, joins and ends in 0.20 s forked here,
                    # 0.45 s from a forkserver with torch preloaded (3.2 s for the first world),
                    # 25 s spawned (torch imported by every rank). Nor does
                    # get_context("fork").Process serve: multiprocessing reaps a finished child when
                    # the next one starts, so a rank that died early could no longer be described
                    # (_describe_exit's waitid with WNOWAIT) nor its pid, and the process group it
                    # leads, be kept from reuse until end_process_group kills and reaps it. A fork
                    # also lets fn be a closure or a lambda.
                    pid = os.fork()
                    if pid == 0:  # pragma: no cover - runs in the child, reported through the pipe
                        os.close(read_fd)
                        os.close(release_write)
                        watcher.close_in_child()
                        _child_main(
                            rank,
                            world_size,
                            store_dir,
                            backend,
                            timeout,
                            write_fd,
                            release_read,
                            fn,
                            args,
                            kwargs,
                        )
                    os.close(write_fd)
                    children[rank] = (pid, read_fd)
                    watcher.watch(pid)
            return _collect_results(children, timeout, store_dir)
        finally:
            os.close(release_read)
            os.close(release_write)
            for pid, read_fd in children.values():
                end_process_group(pid)
                os.close(read_fd)
    finally:
        shutil.rmtree(store_dir, ignore_errors=True)
        watcher.dismiss()


def check_deadline(timeout: object) -> None:
    """``ValueError`` unless ``timeout`` is a positive, finite number of seconds (no bool).

    0 timed every world out, blaming its ranks; -1 failed inside gloo, inf inside ``time``.

    Args:
        timeout: the deadline a caller gave :func:`run_world`.

    Raises:
        ValueError: ``timeout`` is no int or float, a bool, or not in (0, inf); naming it.

    Example:
        >>> check_deadline(30)
        >>> check_deadline(float("inf"))
        Traceback (most recent call last):
        ValueError: timeout must be a positive, finite number of seconds, got inf
    """
    if (
        not isinstance(timeout, int | float)
        or isinstance(timeout, bool)
        or not 0 < timeout < math.inf
    ):
        raise ValueError(f"timeout must be a positive, finite number of seconds, got {timeout!r}")


def _child_main(
    rank: int,
    world_size: int,
    store_dir: str,
    backend: str,
    timeout: float,
    write_fd: int,
    release_fd: int,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> None:  # pragma: no cover - runs in the child
    exit_code = 0
    try:
        # Its own session and process group: the parent ends the whole tree with one killpg.
        os.setsid()
        _die_with_parent()
        # Held open until os._exit.
        stack_file = open(_stack_path(store_dir, rank), "w")  # noqa: SIM115
        faulthandler.register(_STACK_DUMP_SIGNAL, file=stack_file, all_threads=True)
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        store = dist.FileStore(os.path.join(store_dir, "store"), -1)
        dist.init_process_group(
            backend,
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout),
        )
        os.write(write_fd, _JOINED)
        result = fn(*args, **kwargs)
        payload = pickle.dumps((_Outcome.OK, result))
    except BaseException as exc:  # noqa: BLE001 - every failure is reported to the parent
        exit_code = 1
        text = traceback.format_exc()
        try:
            pickled: bytes | None = pickle.dumps(exc)
        except Exception:  # noqa: BLE001 - an unpicklable exception still reports its text
            pickled = None
        payload = pickle.dumps((_Outcome.ERROR, pickled, text))
    try:
        _write_all(write_fd, payload)
        os.read(release_fd, 1)  # EOF once the parent has every rank's report (or we are killed)
    finally:
        os._exit(exit_code)


def _die_with_parent() -> None:  # pragma: no cover - runs in the child
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    # The parent may have died between fork and prctl.
    if os.getppid() == 1:
        os._exit(1)


def _stack_path(store_dir: str, rank: int) -> str:
    return os.path.join(store_dir, f"stack-rank-{rank}.txt")


def _write_all(fd: int, data: bytes) -> None:  # pragma: no cover - runs in the child
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]
    os.close(fd)


def _collect_results(
    children: dict[int, tuple[int, int]], timeout: float, store_dir: str
) -> list[Any]:
    start = time.monotonic()
    latest = start + timeout + _STARTUP_GRACE_S  # whatever start-up took
    deadline = latest  # until the last rank joins; then timeout after that
    buffers: dict[int, bytearray] = {rank: bytearray() for rank in children}
    open_fds = {read_fd: rank for rank, (_, read_fd) in children.items()}
    joined: set[int] = set()
    results: dict[int, Any] = {}
    first_error: tuple[int, bytes | None, str] | None = None
    while open_fds:
        remaining = deadline - time.monotonic()
        if first_error is not None:
            remaining = min(remaining, _ERROR_GRACE_S)
        if remaining <= 0:
            break
        ready, _, _ = select.select(list(open_fds), [], [], remaining)
        if not ready and first_error is not None:
            break
        for fd in sorted(ready, key=open_fds.__getitem__):
            chunk = os.read(fd, 1 << 20)
            rank = open_fds[fd]
            if chunk:
                buffers[rank] += chunk
                if rank not in joined and buffers[rank].startswith(_JOINED):
                    joined.add(rank)
                    if len(joined) == len(children):
                        deadline = min(time.monotonic() + timeout, latest)
                continue
            del open_fds[fd]
            outcome = _decode_report(bytes(buffers[rank]), children[rank][0])
            if outcome[0] is _Outcome.OK:
                results[rank] = outcome[1]
            elif first_error is None:
                # The first report is the root cause; later ones are usually peers losing their
                # connection.
                first_error = (rank, outcome[1], outcome[2])
    if first_error is not None:
        _raise_rank_error(*first_error)
    if open_fds:
        unjoined = sorted(set(children) - joined)
        _raise_timeout(children, sorted(open_fds.values()), timeout, store_dir, unjoined)
    return [results[rank] for rank in sorted(children)]


class _Outcome(enum.Enum):
    """How a rank's call ended, as its report to the parent says."""

    OK = "ok"
    ERROR = "error"


def _decode_report(data: bytes, pid: int) -> tuple[_Outcome, Any, str]:
    """``(OK, result, "")`` or ``(ERROR, pickled exception or None, text)`` from a rank's report.

    The report follows the byte that says the rank joined, when it did.
    """
    data = data.removeprefix(_JOINED)
    if data:
        message = pickle.loads(data)
        if message[0] is _Outcome.OK:
            return (_Outcome.OK, message[1], "")
        return (_Outcome.ERROR, message[1], message[2])
    return (_Outcome.ERROR, None, f"process exited without a result ({_describe_exit(pid)})")


def _describe_exit(pid: int) -> str:
    """How child ``pid`` ended, in words; waits for it to end.

    For example ``exit code 7`` or ``killed by signal 9 (SIGKILL)``.

    The child is left unreaped (``WNOWAIT``), so its pid, and the process group it leads, cannot be
    reused before :func:`~pgregistry.testing._world_watcher.end_process_group` kills the group and
    reaps it.
    """
    info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
    assert info is not None  # only WNOHANG makes waitid return None
    if info.si_code == os.CLD_EXITED:
        return f"exit code {info.si_status}"
    try:
        name = f" ({signal.Signals(info.si_status).name})"
    except ValueError:
        name = ""
    return f"killed by signal {info.si_status}{name}"


def _raise_rank_error(rank: int, pickled: bytes | None, text: str) -> None:
    exc: BaseException | None = None
    if pickled is not None:
        try:
            exc = pickle.loads(pickled)
        except Exception as rebuild_error:  # noqa: BLE001
            # E.g. a class whose __init__ is keyword-only.
            text += f"(the exception could not be rebuilt in the parent: {rebuild_error!r})\n"
    failure = RankFailure(rank, text)
    if not isinstance(exc, Exception):
        # Not rebuilt, or a KeyboardInterrupt / SystemExit of the rank: raised as such here it would
        # stop the caller (a whole pytest session) instead of failing it.
        raise failure
    exc.add_note(f"raised on rank {rank}; its traceback:\n{text}")
    raise exc from failure


def _raise_timeout(
    children: dict[int, tuple[int, int]],
    stuck: list[int],
    timeout: float,
    store_dir: str,
    unjoined: list[int],
) -> None:
    stacks = _dump_stacks({rank: children[rank][0] for rank in stuck}, store_dir)
    where = "\n".join(f"  rank {rank}: {_where_stuck(stacks[rank])}" for rank in stuck)
    dumps = "\n".join(f"--- rank {rank} ---\n{stacks[rank].rstrip()}" for rank in stuck)
    if unjoined:
        when = (
            f"did not start within {timeout + _STARTUP_GRACE_S:.1f} "
            f"s: ranks {unjoined} never joined the process group"
        )
    else:
        when = f"did not finish within {timeout:.1f} s of joining the process group"
    raise WorldTimeout(
        f"world of {len(children)} ranks {when}; ranks still running: {stuck} (a rank skipped "
        "or mismatched a collective or group creation?); all ranks were killed. Where each "
        f"stuck rank was:\n{where}\nTheir stacks (most recent call first):\n{dumps}",
        stuck,
        stacks,
    )


def _dump_stacks(pids: dict[int, int], store_dir: str) -> dict[int, str]:
    """rank -> its faulthandler dump of every thread.

    Asked for with a signal and read back from its file.
    """
    for pid in pids.values():
        try:
            os.kill(pid, _STACK_DUMP_SIGNAL)
        except ProcessLookupError:
            pass
    stacks: dict[int, str] = {}
    seen: dict[int, str] = {}
    give_up = time.monotonic() + _STACK_DUMP_WAIT_S
    while len(stacks) < len(pids) and time.monotonic() < give_up:
        time.sleep(0.05)
        for rank in pids.keys() - stacks.keys():
            text = _read_text(_stack_path(store_dir, rank))
            if text and text == seen.get(rank):  # written and no longer growing
                stacks[rank] = text
            seen[rank] = text
    return {
        rank: stacks.get(rank, "(no stack: the rank had not started its stack dump handler)")
        for rank in pids
    }


def _read_text(path: str) -> str:
    try:
        with open(path) as file:
            return file.read()
    except OSError:
        return ""


def _where_stuck(stack: str) -> str:
    """The main thread's innermost call outside torch and the torch calls below it.

    Read from a faulthandler dump.

    E.g. ``_skip_a_collective (test_x.py:99) -> new_group -> _new_group_with_tag ->
    _new_process_group_helper``.
    """
    lines = stack.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("Current thread")), 0)
    frames = []  # (path, lineno, function), most recent first
    for line in lines[start + 1 :]:
        path, found, rest = line.strip().removeprefix('File "').partition('", line ')
        if not found:
            break
        lineno, _, function = rest.partition(" in ")
        frames.append((path, lineno, function))
    torch_dir = os.path.dirname(sys.modules["torch"].__file__ or "") + os.sep
    inside_torch: list[str] = []
    for path, lineno, function in frames:
        if not path.startswith(torch_dir):
            calls = [
                f for f in reversed(inside_torch) if f != "wrapper"
            ]  # decorators add "wrapper" frames
            return " -> ".join([f"{function} ({os.path.basename(path)}:{lineno})", *calls])
        inside_torch.append(function)
    return stack.strip().splitlines()[0] if stack.strip() else "(no stack)"

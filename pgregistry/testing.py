"""A multi-rank harness: run a function on every rank of a real local world and collect the results.

``run_world(4, fn, x)`` forks 4 processes, initialises the default process group on each (gloo on CPU by
default), calls ``fn(x)`` and returns the four results in rank order. It exists because the traps of local
multi-process tests are many and silent:

* ranks are *forked*, not spawned: spawning re-imports torch in every rank, seconds each;
* each child calls ``torch.set_num_threads(1)`` first, since a forked child can deadlock in a threaded matmul;
* each call gets its own ``FileStore`` in a fresh directory, so concurrent tests never share a port or a key;
* a rank that skips a collective hangs the others past every torch timeout, so the parent holds a hard deadline
  and kills every rank when it passes, naming the ranks that had not finished;
* children die with the parent (``PR_SET_PDEATHSIG``), so a killed test leaves no orphan ranks;
* an exception on any rank is re-raised in the parent with its rank and the child's traceback; the other ranks,
  which may be blocked in a collective with it, are killed after a short grace period.

Functions and results cross the fork/pipe boundary by pickle (results) and by inheritance (the function), so a
closure or lambda works as ``fn``; results must be picklable.
"""

from __future__ import annotations

import ctypes
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

__all__ = ["RankFailure", "WorldTimeout", "run_world"]

T = TypeVar("T")

_PR_SET_PDEATHSIG = 1
_ERROR_GRACE_S = 3.0


class RankFailure(RuntimeError):
    """A rank failed: it raised (the original exception is chained as ``__cause__`` when it unpickles), or its
    process died without reporting."""

    def __init__(self, rank: int, detail: str) -> None:
        super().__init__(f"rank {rank} failed: {detail}")
        self.rank = rank
        self.detail = detail


class WorldTimeout(TimeoutError):
    """The world did not finish before the deadline; every rank was killed."""


def run_world(
    world_size: int,
    fn: Callable[..., T],
    *args: Any,
    backend: str = "gloo",
    timeout: float = 60.0,
    **kwargs: Any,
) -> list[T]:
    """Run ``fn(*args, **kwargs)`` on each rank of a fresh ``world_size`` world; results in rank order.

    ``timeout`` (seconds) is the hard deadline for the whole world, start-up included; it also bounds torch's own
    collective timeout. Raises the failing rank's exception (with ``RankFailure`` carrying its rank and
    traceback attached as a note and as the exception's context) or :class:`WorldTimeout`.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be positive, got {world_size}")
    # Import torch once here, so every forked rank inherits it instead of importing it again (seconds each).
    import torch.distributed  # noqa: F401

    store_dir = tempfile.mkdtemp(prefix="pgregistry-world-")
    sys.stdout.flush()
    sys.stderr.flush()
    children: dict[int, tuple[int, int]] = {}  # rank -> (pid, read fd)
    # Ranks that reported wait on this pipe until every rank has, so none leaves while a peer may still be
    # exchanging with it; closing the write end releases them all.
    release_read, release_write = os.pipe()
    try:
        for rank in range(world_size):
            read_fd, write_fd = os.pipe()
            pid = os.fork()
            if pid == 0:  # pragma: no cover - runs in the child, reported through the pipe
                os.close(read_fd)
                os.close(release_write)
                _child_main(
                    rank, world_size, store_dir, backend, timeout, write_fd, release_read, fn, args, kwargs
                )
            os.close(write_fd)
            children[rank] = (pid, read_fd)
        os.close(release_read)
        return _collect(children, timeout)
    finally:
        os.close(release_write)
        for pid, read_fd in children.values():
            _kill(pid)
            try:
                os.close(read_fd)
            except OSError:
                pass
        shutil.rmtree(store_dir, ignore_errors=True)


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
        _die_with_parent()
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        store = dist.FileStore(os.path.join(store_dir, "store"), -1)
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout)
        )
        result = fn(*args, **kwargs)
        payload = pickle.dumps(("ok", result))
    except BaseException as exc:  # noqa: BLE001 - every failure is reported to the parent
        exit_code = 1
        text = traceback.format_exc()
        try:
            payload = pickle.dumps(("error", exc, text))
        except Exception:  # noqa: BLE001 - an unpicklable exception still reports its text
            payload = pickle.dumps(("error", None, text))
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


def _write_all(fd: int, data: bytes) -> None:  # pragma: no cover - runs in the child
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]
    os.close(fd)


def _collect(children: dict[int, tuple[int, int]], timeout: float) -> list[Any]:
    deadline = time.monotonic() + timeout
    buffers: dict[int, bytearray] = {rank: bytearray() for rank in children}
    open_fds = {read_fd: rank for rank, (_, read_fd) in children.items()}
    results: dict[int, Any] = {}
    first_error: tuple[int, BaseException | None, str] | None = None
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
                continue
            del open_fds[fd]
            outcome = _decode(rank, bytes(buffers[rank]), children[rank][0])
            if outcome[0] == "ok":
                results[rank] = outcome[1]
            elif first_error is None:
                # The first report is the root cause; later ones are usually peers losing their connection.
                first_error = (rank, outcome[1], outcome[2])
    if first_error is not None:
        _raise_rank_error(*first_error)
    if open_fds:
        pending = sorted(open_fds.values())
        raise WorldTimeout(
            f"world of {len(children)} ranks did not finish within {timeout:.1f} s; ranks still running: "
            f"{pending} (a rank skipped or mismatched a collective or group creation?); all ranks were killed"
        )
    return [results[rank] for rank in sorted(children)]


def _decode(rank: int, data: bytes, pid: int) -> tuple[str, Any, str]:
    if data:
        message = pickle.loads(data)
        if message[0] == "ok":
            return ("ok", message[1], "")
        return ("error", message[1], message[2])
    _, status = os.waitpid(pid, 0)
    return ("error", None, f"process exited without a result (wait status {status})")


def _raise_rank_error(rank: int, exc: BaseException | None, text: str) -> None:
    failure = RankFailure(rank, text)
    if exc is None:
        raise failure
    if hasattr(exc, "add_note"):
        exc.add_note(f"raised on rank {rank}; its traceback:\n{text}")
    raise exc from failure


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:
        pass

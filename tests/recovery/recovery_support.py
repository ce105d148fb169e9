"""A world whose ranks may die: forked ranks on a store the parent hosts, as a launcher's agent hosts it.

``pgregistry.testing.run_world`` treats a rank that dies as the test's failure and ends the others; recovery needs
the opposite (the survivors go on), and a store that outlives every rank. Here the parent hosts a ``TCPStore``,
forks the ranks (each joins the world through it, with a short collective timeout), and collects how each one
ended: its result, the exception it raised (type name and message), or the signal that killed it. A rank that
reported waits until every rank has ended, so none closes its sockets under a peer that still talks to it. A hard
deadline kills every rank and names the stuck ones; ranks die with the parent.
"""

from __future__ import annotations

import ctypes
import faulthandler
import os
import pickle
import shutil
import signal
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch._dynamo  # noqa: F401 - see below
import torch.distributed as dist

from pgregistry.testing._frozen_heap import heap_frozen_while_forking

# torch.optim's first step imports torch._dynamo (seconds of CPU, 9 s on a loaded 2-core machine): imported here,
# once, every forked rank inherits it instead of all importing it at once in their first step.
_PR_SET_PDEATHSIG = 1
WORLD_PREFIX = "job/world"


def run_faulty_world(
    world_size: int, fn: Callable[[int, dist.Store], Any], *, collective_timeout: float, deadline: float = 60.0
) -> dict[int, tuple[str, Any]]:
    """Run ``fn(rank, store)`` on each rank; rank -> ``("ok", result)``, ``("raised", (type name, message,
    traceback))`` or ``("died", signal number or exit code)``."""
    # Forked as run_world forks, this process's objects frozen: no child copies its heap in a collection.
    with heap_frozen_while_forking():
        store_pid, port = _store_process(world_size, deadline)
    out_dir = tempfile.mkdtemp(prefix="pgregistry-recovery-")
    release_read, release_write = os.pipe()
    pids: dict[int, int] = {}
    with heap_frozen_while_forking():
        for rank in range(world_size):
            pid = os.fork()
            if pid == 0:  # pragma: no cover - runs in the child
                os.close(release_write)
                _child(rank, world_size, port, collective_timeout, deadline, out_dir, release_read, fn)
            pids[rank] = pid
    os.close(release_read)
    ended: dict[int, int] = {}
    stop = time.monotonic() + deadline
    try:
        while len(ended) < world_size and time.monotonic() < stop:
            for rank, pid in pids.items():
                if rank in ended:
                    continue
                if os.path.exists(os.path.join(out_dir, f"{rank}.done")):
                    ended[rank] = 0
                    continue
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    ended[rank] = status
            time.sleep(0.02)
        stuck = sorted(set(pids) - set(ended))
        stacks = _stacks({rank: pids[rank] for rank in stuck}, out_dir)
    finally:
        os.close(release_write)
        for pid in (*pids.values(), store_pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass
    if stuck:
        raise TimeoutError(f"ranks {stuck} had not ended after {deadline} s (hung): {stacks}")
    results = {}
    for rank in range(world_size):
        path = os.path.join(out_dir, f"{rank}.pkl")
        if os.path.exists(path):
            with open(path, "rb") as f:
                results[rank] = pickle.load(f)
        else:
            status = ended[rank]
            results[rank] = ("died", os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status))
    shutil.rmtree(out_dir, ignore_errors=True)
    return results


def _store_process(world_size: int, deadline: float) -> tuple[int, int]:
    """Fork the process hosting the ``TCPStore`` (the launcher's role); its pid and port. The store's server runs
    threads, so it lives in a process of its own: a rank forked from a process running them could inherit a held
    lock."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the store process
        try:
            os.close(read_fd)
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
            server = dist.TCPStore("127.0.0.1", 0, world_size, True, timeout=timedelta(seconds=deadline),
                                   wait_for_workers=False)
            os.write(write_fd, f"{server.port}\n".encode())
            while True:
                time.sleep(1.0)
        finally:
            os._exit(0)
    os.close(write_fd)
    with os.fdopen(read_fd) as f:
        port = int(f.readline())
    return pid, port


def _stacks(stuck: dict[int, int], out_dir: str) -> dict[int, str]:
    """Each stuck rank's Python stack (every thread), taken by its ``faulthandler`` before the kill."""
    for pid in stuck.values():
        os.kill(pid, signal.SIGUSR1)
    time.sleep(1.0)
    out = {}
    for rank in stuck:
        with open(os.path.join(out_dir, f"{rank}.stack")) as f:
            out[rank] = f.read()
    return out


def _child(
    rank: int, world_size: int, port: int, collective_timeout: float, deadline: float, out_dir: str,
    release_fd: int, fn: Callable[[int, dist.Store], Any],
) -> None:  # pragma: no cover - runs in the child
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        stack_file = open(os.path.join(out_dir, f"{rank}.stack"), "w")  # noqa: SIM115 - open until os._exit
        faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
        torch.set_num_threads(1)
        store = dist.TCPStore("127.0.0.1", port, world_size, False, timeout=timedelta(seconds=deadline))
        dist.init_process_group(
            "gloo", store=dist.PrefixStore(WORLD_PREFIX, store), rank=rank, world_size=world_size,
            timeout=timedelta(seconds=collective_timeout),
        )
        outcome: tuple[str, Any] = ("ok", fn(rank, store))
    except BaseException as exc:  # noqa: BLE001 - every way a rank ends is reported
        outcome = ("raised", (type(exc).__name__, str(exc), traceback.format_exc()))
    with open(os.path.join(out_dir, f"{rank}.pkl.tmp"), "wb") as f:
        pickle.dump(outcome, f)
    os.rename(os.path.join(out_dir, f"{rank}.pkl.tmp"), os.path.join(out_dir, f"{rank}.pkl"))
    open(os.path.join(out_dir, f"{rank}.done"), "w").close()
    os.read(release_fd, 1)  # EOF once every rank has ended
    os._exit(0)

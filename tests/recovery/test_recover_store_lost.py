"""The store ``recover`` was given dies with the rank hosting it: every survivor raises ``StoreLost`` (issue 41, 4).

A TCPStore hosted by a training rank dies with it, and the survivors meet nowhere else: not survivable, and said so
on every survivor, with the store's address, the phase it was lost in, and what to do, instead of
``DistNetworkError: Broken pipe``. A 4-rank gloo world (TP 2 x DP 2) joined through the harness's store; rank
``HOST`` hosts a second TCPStore that every rank passes to ``recover``. Lost while the survivors agree: rank 0 hosts
it and is killed before the others call ``recover``. Lost while the world is re-formed: rank 2 hosts it, leaves
with the lost rank 3 and dies once ranks 0 and 1 are about to re-form the world, which they do once it is dead.
"""

from __future__ import annotations

import os
import signal
import time
from datetime import timedelta
from typing import Any

import pytest
import torch.distributed as dist
from recovery_support import run_faulty_world

TIMEOUT_S = 4.0
PHASES = {
    "agreement": (0, "while the survivors agreed on who is alive"),
    "re-formation": (2, "while the default group of generation 1 was re-formed over old ranks [0, 1]"),
}


def _lose_the_store(rank: int, store: dist.Store, host: int) -> tuple[str, str]:
    from pgregistry import build
    from pgregistry.layout import ParallelLayout
    from pgregistry.recovery import LeftWithReplica, recover

    pg = build(ParallelLayout(num_ranks=4, tp=2), name="job", timeout=TIMEOUT_S)
    if rank == host:
        hosted = dist.TCPStore("127.0.0.1", 0, 4, True, timeout=timedelta(seconds=TIMEOUT_S), wait_for_workers=False)
        store.set("test/port", str(hosted.port))
    else:
        port = int(store.get("test/port"))
        hosted = dist.TCPStore("127.0.0.1", port, 4, False, timeout=timedelta(seconds=TIMEOUT_S))
    store.add("test/connected", 1)
    store.wait(["test/connected"])
    while store.add("test/connected", 0) < 4:
        time.sleep(0.01)
    if host == 0:  # lost before the survivors meet
        if rank == 0:
            _die(store)
        _after_the_death(store)
    else:  # lost once the survivors are about to re-form the world: they go on once it is dead
        real = dist.init_process_group

        def init_once_the_host_is_dead(*args: Any, **kwargs: Any) -> None:
            store.add("test/re-forming", 1)
            _after_the_death(store)
            real(*args, **kwargs)

        dist.init_process_group = init_once_the_host_is_dead  # type: ignore[assignment]
    try:
        recover(pg, hosted, committed_step=0, lost=[3] if host == 2 else None, wait=2.0, timeout=TIMEOUT_S)
    except LeftWithReplica:
        while store.add("test/re-forming", 0) < 2:
            time.sleep(0.01)
        _die(store)
    except RuntimeError as error:
        return type(error).__name__, str(error)
    return "ok", "recovered"


def _die(store: dist.Store) -> None:
    store.set("test/dying", "")
    os.kill(os.getpid(), signal.SIGKILL)


def _after_the_death(store: dist.Store) -> None:
    store.wait(["test/dying"])
    time.sleep(0.5)  # the kill lands and the host's sockets close


@pytest.mark.parametrize("phase", list(PHASES))
def test_the_stores_host_lost_is_named_on_every_survivor_as_not_survivable(phase: str) -> None:
    host, when = PHASES[phase]
    results = run_faulty_world(4, lambda rank, store: _lose_the_store(rank, store, host),
                               collective_timeout=TIMEOUT_S)
    assert results[host] == ("died", signal.SIGKILL), results[host]
    survivors = [rank for rank in range(4) if rank != host and (host, rank) != (2, 3)]
    for rank in survivors:
        kind, (name, message) = results[rank]
        assert (kind, name) == ("ok", "StoreLost"), results[rank]
        assert message.startswith("the store recover was given (the TCPStore at 127.0.0.1:"), message
        assert f") stopped answering rank {rank} {when}: its host is lost" in message, message
        assert ("this loss is not survivable: end every process and restart the job from the last checkpoint, and "
                "give recover a store no training rank hosts") in message, message

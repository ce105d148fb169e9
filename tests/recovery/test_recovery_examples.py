"""The recovery's docstring examples, run as they stand on 2-rank worlds whose rank 1 dies.

The examples are code blocks (a rank must die, and the store is the launcher's): each test defines
the names an example leaves to the reader and runs the block verbatim on each rank (rank 1 never
reaches it). ``recover``'s: a step whose rank 1 is SIGKILLed before the commit; rank 0's collective
fails, it recovers alone, and the block leaves it what the example says: the failed step not
counted, and ``pg`` the one-rank layout's collection on the re-formed world.
``carry_optimizer_state``'s: after one Adam step on both ranks rank 1 dies; rank 0, told so,
recovers and carries the state into an optimizer built on the new collection, which then holds
Adam's moments of that step. ``LeftWithReplica``'s and ``Recovered``'s, on one 6-rank world (TP 2 x
DP 3) whose rank 5 dies in a step: rank 4, its TP peer, runs the first and leaves with exit 0,
logging who was lost; ranks 0-3 run the second and go on at the next step, the sampler over the
smaller data-parallel group (each recover waits its default 10 s for the dead rank: the slowest
example test). ``StoreLost``'s, on a 2-rank world whose rank 0 hosts the store ``recover`` is given
and dies: rank 1 logs the loss and exits with 1. Expected: written here, from the layout's
arithmetic (one replica of two lost; the TP pair of rank 5 lost from TP 2 x DP 3) and Adam's
first-step moments computed in float64.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from fixtures.docstring_examples import example_code
from recovery_support import run_faulty_world

from pgregistry import ParallelLayout, build, build_optimizer
from pgregistry.recovery import carry_optimizer_state, commit, recover

TIMEOUT_S = 2.0  # the example's timeout: its recover waits twice as long for the survivors
FAILED_STEP = 3


def _step_once(model: torch.nn.Module, optimizer: torch.optim.Optimizer, pg: Any) -> None:
    """A step whose rank 1 dies before the commit (its peers' commit fails)."""
    model(torch.ones(1, 2)).sum().backward()
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    commit(pg)
    optimizer.step()


def _run_the_example(rank: int, store: dist.Store) -> dict[str, Any]:
    model = torch.nn.Linear(2, 1)
    names: dict[str, Any] = {
        "build": build,
        "recover": recover,
        "layout": ParallelLayout(num_ranks=2),
        "timeout": TIMEOUT_S,
        "step_once": _step_once,
        "model": model,
        "optimizer": torch.optim.SGD(model.parameters(), lr=0.1),
        "store": store,
        "step": FAILED_STEP,
    }
    exec(example_code(recover), names)  # noqa: S102 - the docstring's example, as a reader runs it
    return {
        "step": names["step"],
        "layout": names["pg"].layout,
        "world": (dist.get_rank(), dist.get_world_size()),
        "lost": names["recovered"].shrunk.lost,
    }


def test_recover_docstring_example_leaves_the_survivor_on_the_smaller_world() -> None:
    outcomes = run_faulty_world(2, _run_the_example, collective_timeout=TIMEOUT_S, deadline=60.0)
    assert outcomes[1] == ("died", signal.SIGKILL)
    assert outcomes[0] == (
        "ok",
        {
            "step": FAILED_STEP,
            "layout": ParallelLayout(num_ranks=1),
            "world": (0, 1),
            "lost": (1,),
        },
    )


GRAD = (3.0, 4.0)
BETAS = (0.9, 0.999)


def _carry_in_the_example(rank: int, store: dist.Store) -> dict[str, list[float]]:
    pg = build(ParallelLayout(num_ranks=2), name="job", timeout=TIMEOUT_S)
    model = torch.nn.Linear(2, 1, bias=False)
    optimizer = build_optimizer(model, pg, optimizer="adam", betas=BETAS)
    model(torch.tensor([GRAD])).sum().backward()  # the grad is the input: the same on both ranks
    optimizer.step()
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    names: dict[str, Any] = {
        "recover": recover,
        "build_optimizer": build_optimizer,
        "carry_optimizer_state": carry_optimizer_state,
        "pg": pg,
        "store": store,
        "step": 0,
        "lost_ranks": [1],
        "model": model,
        "optimizer": optimizer,
    }
    exec(example_code(carry_optimizer_state), names)  # noqa: S102 - the example, verbatim
    state = names["new_optimizer"].param_state()[model.weight]
    return {key: torch.as_tensor(state[key]).flatten().tolist() for key in ("exp_avg", "exp_avg_sq")}


def test_carry_optimizer_state_docstring_example_keeps_adams_moments() -> None:
    outcomes = run_faulty_world(2, _carry_in_the_example, collective_timeout=TIMEOUT_S)
    assert outcomes[1] == ("died", signal.SIGKILL)
    status, moments = outcomes[0]
    assert status == "ok", moments
    grad = torch.tensor(GRAD, dtype=torch.float64)
    expected = {"exp_avg": (1 - BETAS[0]) * grad, "exp_avg_sq": (1 - BETAS[1]) * grad**2}
    for key, value in expected.items():
        torch.testing.assert_close(torch.tensor(moments[key], dtype=torch.float64), value)


class _Log:
    """The ``log`` the exception examples write to: what they logged, in order."""

    def __init__(self) -> None:
        self.records: list[tuple[str, str, dict[str, Any]]] = []

    def info(self, event: str, **fields: Any) -> None:
        self.records.append(("info", event, fields))

    def exception(self, event: str, **fields: Any) -> None:
        self.records.append(("exception", event, fields))


def _run_leaving_or_going_on(rank: int, store: dist.Store) -> dict[str, Any]:
    """TP 2 x DP 3; rank 5 dies in a step, so rank 4, its TP peer, leaves with it (``LeftWithReplica``'s
    example) and ranks 0-3 go on (``Recovered``'s)."""
    from torch.utils.data.distributed import DistributedSampler

    from pgregistry.collection import group_rank, group_size
    from pgregistry.recovery import LeftWithReplica, Recovered

    collection = build(ParallelLayout(num_ranks=6, tp=2), name="job", timeout=TIMEOUT_S)
    if rank == 5:
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        commit(collection)  # rank 5 died first: the others' commit fails
    except RuntimeError:
        pass
    log = _Log()
    names: dict[str, Any] = {
        "recover": recover, "collection": collection, "store": store, "step": FAILED_STEP, "log": log,
        "sys": sys, "LeftWithReplica": LeftWithReplica, "DistributedSampler": DistributedSampler,
        "data": list(range(10)), "group_size": group_size, "group_rank": group_rank,
    }
    example = LeftWithReplica if rank == 4 else Recovered
    try:
        exec(example_code(example), names)  # noqa: S102 - the docstring's example, verbatim
    except SystemExit as exit_:
        return {"exit": exit_.code, "log": log.records}
    sampler = names["sampler"]
    return {
        "step": names["step"],
        "layout": names["collection"].layout,
        "sampler": (sampler.num_replicas, sampler.rank, len(list(sampler))),
    }


def test_left_with_replica_and_recovered_docstring_examples_leave_or_go_on() -> None:
    outcomes = run_faulty_world(6, _run_leaving_or_going_on, collective_timeout=TIMEOUT_S, deadline=60.0)
    assert outcomes[5] == ("died", signal.SIGKILL)
    assert outcomes[4] == ("ok", {"exit": 0, "log": [("info", "leaving", {"lost": (5,)})]})
    # TP 2 x DP 2 over ranks 0-3: each survivor keeps its number, DP rank r // 2 of 2, 5 of the 10 items.
    for rank in range(4):
        expected = {"step": FAILED_STEP + 1, "layout": ParallelLayout(num_ranks=4, tp=2), "sampler": (2, rank // 2, 5)}
        assert outcomes[rank] == ("ok", expected), rank


def _lose_the_store_then_run_the_example(rank: int, store: dist.Store) -> dict[str, Any]:
    """Rank 0 hosts the store ``recover`` is given and dies before rank 1 calls it (``StoreLost``'s example)."""
    from pgregistry.recovery import StoreLost

    collection = build(ParallelLayout(num_ranks=2), name="job", timeout=TIMEOUT_S)
    if rank == 0:
        hosted = dist.TCPStore("127.0.0.1", 0, 2, True, timeout=timedelta(seconds=TIMEOUT_S), wait_for_workers=False)
        store.set("test/port", str(hosted.port))
        store.wait(["test/connected"])
        store.set("test/dying", "")
        os.kill(os.getpid(), signal.SIGKILL)
    hosted = dist.TCPStore("127.0.0.1", int(store.get("test/port")), 2, False, timeout=timedelta(seconds=TIMEOUT_S))
    store.set("test/connected", "")
    store.wait(["test/dying"])
    time.sleep(0.5)  # the kill lands and the host's sockets close
    log = _Log()
    names: dict[str, Any] = {
        "recover": recover, "collection": collection, "store": hosted, "step": FAILED_STEP, "log": log,
        "sys": sys, "StoreLost": StoreLost,
    }
    try:
        exec(example_code(StoreLost), names)  # noqa: S102 - the docstring's example, verbatim
    except SystemExit as exit_:
        return {"exit": exit_.code, "log": log.records}
    return {"recovered": repr(names.get("recovered"))}


def test_store_lost_docstring_example_ends_the_survivor_with_exit_1() -> None:
    outcomes = run_faulty_world(2, _lose_the_store_then_run_the_example, collective_timeout=TIMEOUT_S)
    assert outcomes[0] == ("died", signal.SIGKILL)
    logged = [("exception", "store lost: restart from the last checkpoint", {})]
    assert outcomes[1] == ("ok", {"exit": 1, "log": logged})

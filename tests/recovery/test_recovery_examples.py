"""The recovery's docstring examples, run as they stand on 2-rank worlds whose rank 1 dies.

The examples are code blocks (a rank must die, and the store is the launcher's): each test defines
the names an example leaves to the reader and runs the block verbatim on each rank (rank 1 never
reaches it). ``recover``'s: a step whose rank 1 is SIGKILLed before the commit; rank 0's collective
fails, it recovers alone, and the block leaves it what the example says: the failed step not
counted, and ``pg`` the one-rank layout's collection on the re-formed world.
``carry_optimizer_state``'s: after one Adam step on both ranks rank 1 dies; rank 0, told so,
recovers and carries the state into an optimizer built on the new collection, which then holds
Adam's moments of that step. Expected: written here, from the layout's arithmetic (one replica of
two lost) and Adam's first-step moments computed in float64.
"""

from __future__ import annotations

import os
import signal
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

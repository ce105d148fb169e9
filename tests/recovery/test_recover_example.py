"""recover's docstring example, run as it stands on a 2-rank world whose rank 1 dies in the step.

The example is a code block (a rank must die, and the store is the launcher's): this test defines
the names it leaves to the reader (the layout, the timeout, the model, its optimizer, the store,
the step, and a step whose rank 1 is SIGKILLed before the commit) and runs the block verbatim on
each rank. Rank 0's collective fails, it recovers alone, and the block leaves it what the example
says: the failed step not counted, and ``pg`` the one-rank layout's collection on the re-formed
world. Expected: written here, from the layout's arithmetic (one replica of two lost).
"""

from __future__ import annotations

import os
import signal
from typing import Any

import torch
import torch.distributed as dist
from fixtures.docstring_examples import example_code
from recovery_support import run_faulty_world

from pgregistry import ParallelLayout, build
from pgregistry.recovery import commit, recover

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

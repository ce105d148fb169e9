"""Megatron-Core's ``shared`` survives ``fully_shard`` in the README's order whatever was imported first, and where
it cannot be known, nothing is computed without it.

Reported: a model marked as Megatron-Core marks it (plain attributes), then ``fully_shard``, then ``grad_norm``:
8.3079 for 6.5945, the tie counted twice, unless ``pgregistry.params`` happened to be imported before the model
was built (its registration hook records each slot's attributes). Each order runs in a fresh interpreter
(``import_order_world.py``), as a 2-rank gloo world; the oracle is the float64 norm of the grads, the tie once.

Reported again (issue 41): with pgregistry first imported only after the model was sharded, ``grad_norm`` counted
the tie twice on every rank, silently (a warning was all). The roles of parameters ``fully_shard`` replaced before
pgregistry was imported cannot be known: every rank refuses, naming the parameters and the import to move.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from import_order_world import MODEL_FIRST, ORDERS, SHARDED_FIRST, grad

SCRIPT = Path(__file__).with_name("import_order_world.py")


def _world(order: str) -> list[Any]:
    run = subprocess.run(
        [sys.executable, str(SCRIPT), order], capture_output=True, text=True, timeout=90, check=False
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return list(json.loads(run.stdout.strip().splitlines()[-1]))


@pytest.mark.parametrize("order", ORDERS)
def test_the_tie_counts_once_whatever_the_import_order(order: str) -> None:
    once = math.sqrt(sum(float(grad(name).square().sum()) for name in ("embedding", "hidden")))
    twice = math.sqrt(once**2 + float(grad("output").square().sum()))
    for rank, (norm, error) in enumerate(_world(order)):
        assert error is None, (order, rank, error)
        assert norm == pytest.approx(once, rel=1e-6), (order, rank, norm, once, twice)


@pytest.mark.parametrize("order", [MODEL_FIRST, SHARDED_FIRST])
def test_roles_that_cannot_be_known_are_refused_on_every_rank_naming_the_import(order: str) -> None:
    """Nothing can bring back what went with the objects ``fully_shard`` dropped before pgregistry saw them: every
    rank raises, naming the parameters and the import to move, instead of a norm counting the tie twice."""
    results = _world(order)
    for rank, (norm, error) in enumerate(results):
        assert norm is None, (order, rank, norm)
        assert error.startswith("RuntimeError: the roles of 3 parameter(s) cannot be known: "
                                "['embedding', 'hidden', 'output'] were replaced by fully_shard"), (rank, error)
        assert "Move `import pgregistry` above the code that builds the model" in error, (rank, error)
    assert results[0] == results[1]

"""Megatron-Core's ``shared`` survives ``fully_shard`` in the README's order whatever was imported first.

Reported: a model marked as Megatron-Core marks it (plain attributes), then ``fully_shard``, then ``grad_norm``:
8.3079 for 6.5945, the tie counted twice, unless ``pgregistry.params`` happened to be imported before the model
was built (its registration hook records each slot's attributes). Each order runs in a fresh interpreter
(``import_order_world.py``), as a 2-rank gloo world; the oracle is the float64 norm of the grads, the tie once. A
model built before pgregistry is imported at all, and sharded before pgregistry walks it, is named in a warning.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from import_order_world import MODEL_FIRST, ORDERS, grad

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
    for rank, (norm, logged) in enumerate(_world(order)):
        assert norm == pytest.approx(once, rel=1e-6), (order, rank, norm, once, twice)
        assert logged == [], logged


def test_a_model_built_before_pgregistry_and_sharded_unseen_is_named_in_a_warning() -> None:
    """Nothing can bring back what went with the objects ``fully_shard`` dropped before pgregistry saw them: each
    rank says so, naming the parameters and what to do."""
    for _, logged in _world(MODEL_FIRST):
        assert len(logged) == 1, logged
        assert "roles_before_fully_shard_unknown" in logged[0], logged
        assert "['embedding', 'hidden', 'output']" in logged[0], logged
        assert "import pgregistry before building the model" in logged[0], logged

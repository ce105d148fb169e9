"""Megatron-Core's ``shared`` survives ``fully_shard`` in the README's order whatever was imported first.

Reported: a model marked as Megatron-Core marks it (plain attributes), then ``fully_shard``, then ``grad_norm``:
8.3079 for 6.5945, the tie counted twice, unless ``pgregistry.params`` happened to be imported before the model
was built (its registration hook records each slot's attributes). Each order runs in a fresh interpreter
(``import_order_world.py``), as a 2-rank gloo world; the oracle is the float64 norm of the grads, the tie once.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from import_order_world import ORDERS, grad

SCRIPT = Path(__file__).with_name("import_order_world.py")


@pytest.mark.parametrize("order", ORDERS)
def test_the_tie_counts_once_whatever_the_import_order(order: str) -> None:
    once = math.sqrt(sum(float(grad(name).square().sum()) for name in ("embedding", "hidden")))
    twice = math.sqrt(once**2 + float(grad("output").square().sum()))
    run = subprocess.run(
        [sys.executable, str(SCRIPT), order], capture_output=True, text=True, timeout=90, check=False
    )
    assert run.returncode == 0, run.stderr[-3000:]
    norms = json.loads(run.stdout.strip().splitlines()[-1])
    assert norms == [pytest.approx(once, rel=1e-6)] * 2, (order, norms, once, twice)

"""On the host, the 1- and 2-norm of float32 and bf16 grads are summed in float32 first, and read again in float64
where that sum over- or underflowed.

The float32 first sum (rows of ``HOST_ROW`` elements, blocks of ``HOST_NORM_BLOCK``) is what makes the host's exact norm
cost about what a float32 norm does; it is kept only where it is finite and at least ``numel * 2**-96``
(``float32_share_holds``). Checked on grads long enough to be read in several blocks and rows, beside a small grad
(the concatenated blocks of the list path), through the list path (``norm_of_grads``) and the flat grad buffer,
against the float64 norm of the same values: one element of 1e20 in a later block (its row's float32 sum is
infinite), grads of 1e-25 (every float32 square underflows), and ordinary grads (the float32 sum is kept).
"""

from __future__ import annotations

import pytest
import torch

from pgregistry import ProcessGroupCollection
from pgregistry.collection import FIELD_NAMES
from pgregistry.grad_stats import StatsGroups, norm_of_grads
from pgregistry.grad_stats._local import HOST_NORM_BLOCK, HOST_ROW
from pgregistry.optim._grad_buffer import GradBuffer

OFF = StatsGroups.from_collection(ProcessGroupCollection(**dict.fromkeys(FIELD_NAMES)))
SIZES = (2 * HOST_NORM_BLOCK + HOST_ROW + 3, 100)
"""A grad read in three blocks (the last one rows and a shorter row), and a small one concatenated on its own."""


def _grads(case: str, dtype: torch.dtype) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    grads = [torch.randn(size, generator=generator, dtype=torch.float64) for size in SIZES]
    if case == "one-1e20-in-a-later-block":
        grads[0][HOST_NORM_BLOCK + 5 * HOST_ROW + 7] = -1e20
    elif case == "1e-25":
        grads = [grad * 1e-25 for grad in grads]
    return [grad.to(dtype) for grad in grads]


def _float64_norm(grads: list[torch.Tensor], p: float) -> float:
    return float(torch.linalg.vector_norm(torch.cat([grad.double().reshape(-1) for grad in grads]), p))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bf16"])
@pytest.mark.parametrize(
    ("case", "p"),
    [("one-1e20-in-a-later-block", 2.0), ("1e-25", 2.0), ("ordinary", 2.0), ("ordinary", 1.0)],
    ids=["one-1e20-in-a-later-block-p2", "1e-25-p2", "ordinary-p2", "ordinary-p1"],
)
def test_the_host_norm_is_the_float64_norm(case: str, p: float, dtype: torch.dtype) -> None:
    grads = _grads(case, dtype)
    want = _float64_norm(grads, p)
    assert float(norm_of_grads({None: grads}, p)) == pytest.approx(want, rel=1e-6, abs=0.0), "list path"
    params = [torch.empty(size, dtype=dtype, device="meta") for size in SIZES]
    buffer = GradBuffer(params, OFF, dtype=dtype, device=torch.device("cpu"))
    torch._foreach_copy_(list(buffer.views), grads)
    assert float(buffer.grad_norm(p)) == pytest.approx(want, rel=1e-6, abs=0.0), "flat buffer"

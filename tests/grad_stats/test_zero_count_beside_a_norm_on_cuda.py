"""On a GPU, a zero count alone beside a norm on a peer shows in the results, without a host read: the count -1, the
norm NaN.

The CPU tests (``test_zero_count_beside_a_norm.py``) see every rank raise, since there the agreement is read for free;
on CUDA the entry points that return a device tensor (``zeros_of_grads``, an optimizer's ``count_zeros``, and the
norms) read nothing: the finishing kernel (float32 grads, the 2-norm and the zero count) or the torch path (float64
grads) makes the count -1 and the norm NaN. ``count_zeros``, which returns an int (a host read anyway), raises. Two gloo
ranks on one GPU as pipeline stages (gloo reduces CUDA tensors; NCCL takes one GPU per rank). Skipped without CUDA:
run on a GPU machine, alone (its ranks are forked, so no earlier test of the process may have initialised CUDA; the
availability check asks NVML, which does not)::

    .venv/bin/python -m pytest -q -p no:cacheprovider tests/grad_stats/test_zero_count_beside_a_norm_on_cuda.py
"""

from __future__ import annotations

import math
import os

# torch's own availability check initialises CUDA's driver in this process, after which a forked rank cannot
# use CUDA ("Cannot re-initialize CUDA in forked subprocess"); NVML's check leaves it alone.
os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")

import pytest
import torch
import torch.distributed as dist
from torch import nn

from pgregistry import ParallelLayout, count_zeros, grad_norm, registry
from pgregistry.grad_stats import norm_of_grads, zeros_of_grads
from pgregistry.grad_stats._fused import can_run_fused_stats
from pgregistry.optim import build_optimizer
from pgregistry.testing import run_world

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _grads(rank: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """Each stage's own grads, three zeros each."""
    weight = torch.arange(6, dtype=dtype).reshape(2, 3) * (rank + 1)
    weight[1, rank] = 0.0
    bias = torch.tensor([0.0, -2.0], dtype=dtype) if rank == 0 else torch.tensor([1.5, 0.0], dtype=dtype)
    return [weight, bias]


ZEROS = 6
"""Both stages' zeros."""


def _on_rank(calls: dict[int, str], dtype: torch.dtype) -> tuple[str, float, bool]:
    """This rank's call: its error (empty when none), its value (NaN where it raised), and whether the one-read kernels
    can run here (float32 on CUDA with triton: the finishing kernel)."""
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    pgc = registry.build(ParallelLayout(num_ranks=2, pp=2))
    grads = [grad.to(device) for grad in _grads(dist.get_rank(), dtype)]
    call = calls[dist.get_rank()]
    try:
        if call in ("get_grad_norm", "optimizer count_zeros"):
            model = nn.Linear(3, 2).to(device)  # its buffer float32 whatever the grads given
            optimizer = build_optimizer(model, pgc, optimizer="sgd", lr=0.1)
            for param, grad in zip(model.parameters(), grads, strict=True):
                param.main_grad.copy_(grad)
            optimizer.sync_grads()
            value = float(optimizer.get_grad_norm() if call == "get_grad_norm" else optimizer.count_zeros())
        elif call in ("count_zeros", "grad_norm"):
            model = nn.Linear(3, 2).to(device=device, dtype=dtype)
            for param, grad in zip(model.parameters(), grads, strict=True):
                param.grad = grad
            value = float(count_zeros(model, pgc) if call == "count_zeros" else grad_norm(model, pgc))
        else:
            lists = {pgc.mp: grads}
            value = float(zeros_of_grads(lists) if call == "zeros_of_grads" else norm_of_grads(lists))
    except ValueError as exc:
        return str(exc), math.nan, can_run_fused_stats(device)
    return "", value, can_run_fused_stats(device)


DTYPES = {"float32": torch.float32, "float64": torch.float64}
"""The finishing kernel's path (float32) and torch's (float64; an optimizer's buffer stays float32)."""


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize(
    "calls", [("zeros_of_grads", "norm_of_grads"), ("optimizer count_zeros", "get_grad_norm")], ids="-beside-".join
)
def test_a_device_zero_count_beside_a_norm_is_minus_one_and_the_norm_nan(calls: tuple[str, str], dtype: str) -> None:
    (zeros_error, zeros, fused), (norm_error, norm, _) = run_world(
        2, _on_rank, dict(enumerate(calls)), DTYPES[dtype], timeout=60.0
    )
    if dtype == "float32":
        assert fused, "the one-read kernels cannot run (triton missing?): this checks nothing of the finishing kernel"
    assert zeros_error == "" and zeros == -1, (zeros_error, zeros)
    assert norm_error == "" and math.isnan(norm), (norm_error, norm)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_count_zeros_reads_its_count_anyway_so_it_raises_on_a_gpu(dtype: str) -> None:
    (zeros_error, _, _), (norm_error, norm, _) = run_world(
        2, _on_rank, {0: "count_zeros", 1: "grad_norm"}, DTYPES[dtype], timeout=60.0
    )
    assert zeros_error.startswith("count_zeros: another rank reducing with this one computes a norm"), zeros_error
    assert norm_error == "" and math.isnan(norm), (norm_error, norm)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_agreeing_zero_counts_on_a_gpu_give_the_count(dtype: str) -> None:
    for call in ("zeros_of_grads", "optimizer count_zeros", "count_zeros"):
        for error, zeros, _ in run_world(2, _on_rank, {0: call, 1: call}, DTYPES[dtype], timeout=60.0):
            assert error == "" and zeros == ZEROS, (call, error, zeros)

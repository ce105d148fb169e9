"""On a GPU, a steady call whose reads are the one-read kernel's alone is handed only the pieces its launches read,
and gives the float64 oracle's answers (``tests/fixtures/kernel_only_reads.py``; on CPU, through triton's interpreter:
``test_kernel_only_steady_reads.py``). Skipped without CUDA, triton's kernels or the compiled checks::

    .venv/bin/python -m pytest -q -p no:cacheprovider tests/grad_stats/test_kernel_only_steady_reads_on_cuda.py
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from fixtures.interpreter import in_spawned_process
from fixtures.kernel_only_reads import CASES, calls_on, check_case

from pgregistry.grad_stats._compiled import steady_checks
from pgregistry.grad_stats._fused import can_run_fused_stats

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _on_cuda() -> dict[str, Any] | str:
    """:data:`CASES` on the GPU, else why they cannot run there (in a spawned process: see ``in_spawned_process``)."""
    device = torch.device("cuda", 0)
    if not can_run_fused_stats(device):
        return "the one-read kernels do not run on this GPU (triton missing or its probe failed)"
    if steady_checks() is None:
        return "the compiled checks are not built here (PGREGISTRY_COMPILED_CHECKS, or no compiler or ninja)"
    return calls_on(device)


@pytest.fixture(scope="module")
def on_cuda() -> dict[str, Any]:
    calls = in_spawned_process(_on_cuda, timeout=80.0)
    if isinstance(calls, str):
        pytest.skip(calls)
    return calls


@pytest.mark.parametrize("case", list(CASES), ids=[case.replace(" ", "-") for case in CASES])
def test_a_kernel_only_steady_read_on_cuda_gives_the_oracles_answers(on_cuda: dict[str, Any], case: str) -> None:
    check_case(case, on_cuda[case])

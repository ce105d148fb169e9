"""A steady call whose reads are the one-read kernel's alone is handed only the pieces its launches read, and gives the
float64 oracle's answers: run through triton's interpreter on CPU.

Issue 38: on an H100 host the compiled check of a steady 2,000-parameter ``grad_norm`` took 200 us, most of it making
each grad's Python reference into the list of pieces, of which a kind read by the kernel in full needs two (its first
piece and its launch's base). The check now checks every grad alike but keeps only those (``tests/fixtures/
kernel_only_reads.py`` says which, on a model where they are not the first pieces). The kernel reads only on CUDA, so
here its route is chosen for CPU tensors (``_local.one_read_applies``, the one place a kind's route is decided) in a
spawned process where triton interprets the kernels. Skipped where triton or the compiled checks are not here;
``test_kernel_only_steady_reads_on_cuda.py`` runs the same calls on a GPU.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from fixtures.interpreter import in_interpreter
from fixtures.kernel_only_reads import CASES, calls_on, check_case

from pgregistry.grad_stats._compiled import steady_checks


def _in_interpreter() -> dict[str, Any]:
    from pgregistry.grad_stats import _local

    readable = (torch.float32, torch.bfloat16, torch.float16)
    _local.one_read_applies = lambda device, dtype: dtype in readable  # type: ignore[assignment]
    return calls_on(torch.device("cpu"))


@pytest.fixture(scope="module")
def interpreted() -> dict[str, Any]:
    if steady_checks() is None:  # built here, before the spawned process imports it
        pytest.skip("the compiled checks are not built here (PGREGISTRY_COMPILED_CHECKS, or no compiler or ninja)")
    return in_interpreter(_in_interpreter, timeout=80.0)


@pytest.mark.parametrize("case", list(CASES), ids=[case.replace(" ", "-") for case in CASES])
def test_a_kernel_only_steady_read_gives_the_oracles_answers(interpreted: dict[str, Any], case: str) -> None:
    check_case(case, interpreted[case])

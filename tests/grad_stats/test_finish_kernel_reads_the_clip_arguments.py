"""The finishing kernel reads a clip's arguments as the torch path does: a NaN norm, bit for bit, where a rank refused
its ``max_norm`` or the values differ (``error_if_nonfinite`` too), the norm's own bits where they agree. So it reads
the statistic each rank reduces: a zero count alone beside a norm is -1 (and the norm NaN), on the device, where no
rank raises.

On CUDA the clip's verdict is finished by the kernel (``grad_stats/_fused.py``'s ``finish_rows``), where no rank reads
it on the host: that NaN is what keeps every rank from scaling. Run here through triton's interpreter on reduced
rows made as the reduction makes them (each rank's columns summed, exactly); ``scripts/gpu_check.py`` compares the
compiled kernel on a GPU through ``finished_side_by_side`` below.
"""

from __future__ import annotations

import math
import struct
from typing import Any

import pytest
import torch
from fixtures.finish_cases import bits
from fixtures.interpreter import in_interpreter

from pgregistry.grad_stats import _fused as fused_stats
from pgregistry.grad_stats import _reductions as reductions
from pgregistry.grad_stats._arguments import (
    ZEROS_ALONE,
    Agreement,
    Given,
    Statistic,
    agreement_columns,
    arguments_of_call,
)

S = 2.0**600
"""The range columns' scale (``_RANGE_SCALE``)."""


def _one_bit_above(value: float) -> float:
    return struct.unpack("<d", struct.pack("<q", struct.unpack("<q", struct.pack("<d", value))[0] + 1))[0]


CASES: dict[str, tuple[list[float | None], list[float]]] = {
    # name: (each rank's max_norm, None where refused; the verdict's [NaN, inf] counts); norm_type 2 on each rank
    "two-ranks-agree": ([1.0, 1.0], [0.0, 0.0]),
    "five-ranks-agree-on-01": ([0.1] * 5, [0.0, 0.0]),
    "one-bit-apart": ([1.0, _one_bit_above(1.0)], [0.0, 0.0]),
    "1-and-2": ([1.0, 2.0, 1.0], [0.0, 0.0]),
    "the-mean-of-the-others": ([1.0, 2.0, 3.0], [0.0, 0.0]),
    "one-refused": ([1.0, None], [0.0, 0.0]),
    "every-one-refused": ([None, None], [0.0, 0.0]),
    "agree-beside-an-inf": ([3.5, 3.5], [0.0, 1.0]),
    "differ-beside-an-inf": ([3.5, 7.0], [0.0, 1.0]),
    "agree-beside-a-nan": ([3.5, 3.5], [2.0, 0.0]),
    "max_norm-1-norm-types-2-and-1": ([1.0, 1.0], [0.0, 0.0]),
    "flags-differ": ([1.0, 1.0, 1.0], [0.0, 0.0]),
    "flags-agree-true": ([1.0, 1.0], [0.0, 0.0]),
}
"""Arguments over ranks, each finished by the kernel and by torch's operations; ``error_if_nonfinite`` False on each
rank but where the name says (:data:`FLAGS`)."""

FLAGS = {"flags-differ": [False, True, False], "flags-agree-true": [True, True]}
"""Each rank's ``error_if_nonfinite`` in the cases that give it."""

ROW = [12.5, 3.0, 0.0, 0.0]
"""A reduced 2-norm row: ``[middle, zeros, large, small]``."""


def _summed(
    values: list[float | None], norm_types: list[float] | None = None, flags: list[bool] | None = None
) -> torch.Tensor:
    """The summed form over ranks given ``values`` (``norm_types``, default 2 on each; ``flags``, the
    ``error_if_nonfinite`` of each, default False), as the SUM all-reduce makes it (whole numbers: exact)."""
    norm_types = norm_types or [2.0] * len(values)
    flags = flags or [False] * len(values)
    cpu = torch.device("cpu")
    columns = [
        agreement_columns(value, p, flag, Statistic.NORM, True, cpu)
        for value, p, flag in zip(values, norm_types, flags, strict=True)
    ]
    return torch.stack(columns).sum(0)


def _norm(zeros: bool) -> Given:
    return arguments_of_call(2.0, None, clip=False, zeros=zeros)


STATISTICS: dict[str, list[Given]] = {
    "zeros-alone-agree": [ZEROS_ALONE] * 3,
    "zeros-alone-beside-a-norm": [ZEROS_ALONE, _norm(False)],
    "zeros-alone-beside-a-norm-and-zeros": [_norm(True), ZEROS_ALONE, ZEROS_ALONE],
    "norm-beside-norm-and-zeros": [_norm(False), _norm(True)],
    "norm-and-zeros-agree": [_norm(True), _norm(True)],
}
"""Each rank's arguments and statistic (:class:`Statistic`): a zero count alone carries :data:`ZEROS_ALONE`."""


def finished_side_by_side(device: torch.device) -> dict[str, tuple[list[int | None], list[int | None]]]:
    """Each of :data:`CASES` finished by the kernel and by the reductions' torch operations: the bits of the norm,
    the zero count, the float32 norm and the clip's norm, side by side."""
    out = {}
    for name, (values, counts) in CASES.items():
        row = torch.tensor(ROW, dtype=torch.float64, device=device)
        norm_types = [2.0, 1.0] if "norm-types" in name else None
        summed = _summed(values, norm_types, FLAGS.get(name))
        riding = torch.cat([torch.tensor(counts, dtype=torch.float64), summed]).to(device)
        kernel = fused_stats.finish_rows(
            [row], riding, norm=True, zeros=True, narrow=True, scale=S, ranks=len(values)
        )
        norm = reductions._two_norm_from_ranges(row[0], row[2], row[3])
        norm = torch.where(riding[0] > 0, math.nan, torch.where(riding[1] > 0, math.inf, norm))
        disagrees = Agreement(riding[2:], len(values)).disagrees()
        norm = torch.where(disagrees, math.nan, norm)
        torch_path = reductions.Reduced(norm, torch.where(disagrees, -1, row[1].round().to(torch.int64)))
        finished = reductions.Reduced(kernel.norm64, kernel.zeros, False, kernel.narrow, kernel.clip_narrow)
        out[name] = (
            [bits(finished.norm64), bits(finished.zeros), bits(finished.norm), bits(finished.clip_norm)],
            [bits(torch_path.norm64), bits(torch_path.zeros), bits(torch_path.norm), bits(torch_path.clip_norm)],
        )
    for name, given in STATISTICS.items():
        row = torch.tensor(ROW, dtype=torch.float64, device=device)
        summed = torch.stack([arguments.columns(summed=True, device=torch.device("cpu")) for arguments in given])
        riding = torch.cat([torch.zeros(2, dtype=torch.float64), summed.sum(0)]).to(device)
        disagrees = Agreement(riding[2:], len(given)).disagrees()
        count = torch.where(disagrees, -1, row[1].round().to(torch.int64))
        for norm in (False, True):  # the zero count alone, and beside the norm
            kernel = fused_stats.finish_rows(
                [row], riding, norm=norm, zeros=True, narrow=False, scale=S, ranks=len(given)
            )
            two_norm = reductions._two_norm_from_ranges(row[0], row[2], row[3])
            torch_norm = torch.where(disagrees, math.nan, two_norm) if norm else None
            out[f"{name}-{'with' if norm else 'without'}-the-norm"] = (
                [bits(kernel.norm64), bits(kernel.zeros)],
                [bits(torch_norm), bits(count)],
            )
    return out


def _in_interpreter() -> dict[str, tuple[list[int | None], list[int | None]]]:
    return finished_side_by_side(torch.device("cpu"))


@pytest.fixture(scope="module")
def interpreted() -> dict[str, Any]:
    return in_interpreter(_in_interpreter, timeout=80.0)


@pytest.mark.parametrize("case", list(STATISTICS))
def test_the_kernel_makes_the_zero_count_minus_one_where_the_statistics_differ(
    interpreted: dict[str, Any], case: str
) -> None:
    """A zero count alone beside a norm, or a norm without its zero count beside one with it: the kernel's count is -1
    (the norm NaN), as the torch path's; the count itself where every rank reduces the same statistic."""
    agree = len({arguments.statistic for arguments in STATISTICS[case]}) == 1
    for norm in ("with", "without"):
        by_kernel, by_torch = interpreted[f"{case}-{norm}-the-norm"]
        assert by_kernel == by_torch, (case, norm)
        assert by_kernel[1] == (3 if agree else -1), (case, norm, by_kernel)


@pytest.mark.parametrize("case", list(CASES))
def test_the_kernel_finishes_a_clips_arguments_with_the_torch_paths_bits(
    interpreted: dict[str, Any], case: str
) -> None:
    by_kernel, by_torch = interpreted[case]
    assert by_kernel == by_torch, case
    values, counts = CASES[case]
    agree = None not in values and len(set(values)) == 1 and "norm-types" not in case and case != "flags-differ"
    nan = by_kernel[0] == -1
    assert nan == (counts[0] > 0 or not agree), (case, by_kernel)  # a disagreement is NaN beside an inf too


def test_the_summed_form_tells_equal_values_from_any_others_exactly() -> None:
    """The summed form's test (``n * sum(c**2) == sum(c)**2`` per byte) against plain equality, over many ranks:
    values one bit apart (each bit but the sign's), two values apart by the same amount either way of a third (each
    byte's sum that of three equal ones), and values equal to the others' mean in every byte."""
    base = 0.1
    base_bits = struct.unpack("<q", struct.pack("<d", base))[0]
    for ranks in (2, 3, 4, 1000):
        assert not bool(Agreement(_summed([base] * ranks), ranks).disagrees()), ranks
        for bit in range(63):
            other = struct.unpack("<d", struct.pack("<q", base_bits ^ (1 << bit)))[0]
            values = [base] * (ranks - 1) + [other]
            assert bool(Agreement(_summed(values), ranks).disagrees()), (ranks, bit)
    below, above = (struct.unpack("<d", struct.pack("<q", base_bits + step))[0] for step in (-2, 2))
    assert bool(Agreement(_summed([below, base, above]), 3).disagrees())
    assert bool(Agreement(_summed([1.0, 2.0, 3.0]), 3).disagrees())  # 2.0 is neither 1.0 nor 3.0
    assert bool(Agreement(_summed([1.0, 1.0], [1.0, 3.0]), 2).disagrees())  # the norm types differ
    for flags in ([True, False], [False, True, True], [True] + [False] * 999):  # error_if_nonfinite differs
        flagged = Agreement(_summed([base] * len(flags), flags=flags), len(flags))
        assert bool(flagged.disagrees()) and flagged.differing().tolist() == [False, False, True, False], flags
    assert not bool(Agreement(_summed([base] * 3, flags=[True] * 3), 3).disagrees())

"""The finishing kernel reads a clip's arguments as the torch path does: a NaN norm, bit for bit, where a rank refused
its ``max_norm`` or the values differ (``error_if_nonfinite`` too), the norm's own bits where they agree.

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
from pgregistry.grad_stats._arguments import Agreement, agreement_columns

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
        agreement_columns(value, p, flag, True, cpu)
        for value, p, flag in zip(values, norm_types, flags, strict=True)
    ]
    return torch.stack(columns).sum(0)


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
        norm = torch.where(Agreement(riding[2:], len(values)).disagrees(), math.nan, norm)
        torch_path = reductions.Reduced(norm, row[1].round().to(torch.int64))
        finished = reductions.Reduced(kernel.norm64, kernel.zeros, False, kernel.narrow, kernel.clip_narrow)
        out[name] = (
            [bits(finished.norm64), bits(finished.zeros), bits(finished.norm), bits(finished.clip_norm)],
            [bits(torch_path.norm64), bits(torch_path.zeros), bits(torch_path.norm), bits(torch_path.clip_norm)],
        )
    return out


def _in_interpreter() -> dict[str, tuple[list[int | None], list[int | None]]]:
    return finished_side_by_side(torch.device("cpu"))


@pytest.fixture(scope="module")
def interpreted() -> dict[str, Any]:
    return in_interpreter(_in_interpreter, timeout=80.0)


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
        assert bool(flagged.disagrees()) and flagged.differing().tolist() == [False, False, True], flags
    assert not bool(Agreement(_summed([base] * 3, flags=[True] * 3), 3).disagrees())

"""The seed plan's functions name a layout argument that is no layout.

Found by a hostile-input audit: ``seed_plan(None, 1)``, ``check_seed_plan`` and ``check_seed_plan_size`` raised
``AttributeError: 'NoneType' object has no attribute 'axis_sizes'``, and a layout's keyword dict failed likewise.
"""

from __future__ import annotations

import re

import pytest

from pgregistry.layout import ParallelLayout
from pgregistry.rng import check_seed_plan, check_seed_plan_size, seed_plan


@pytest.mark.parametrize("plan", [seed_plan, check_seed_plan, check_seed_plan_size])
@pytest.mark.parametrize("layout", [None, {"num_ranks": 4, "tp": 2}, 4])
def test_a_layout_that_is_no_parallel_layout_is_named(plan: object, layout: object) -> None:
    with pytest.raises(TypeError, match=re.escape("layout must be a pgregistry.layout.ParallelLayout (such as "
                                                  "ParallelLayout(num_ranks=8, tp=2)), got "
                                                  f"{type(layout).__name__}")):
        plan(layout, 1234)  # type: ignore[operator]
    assert seed_plan(ParallelLayout(num_ranks=4, tp=2), 1234)[1]["model-parallel-rng"] == 1234 + 2718 + 1

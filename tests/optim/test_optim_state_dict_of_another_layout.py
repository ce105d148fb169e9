"""A state dict that is no state dict of the optimizer loading it (another optimizer's, a list, a dict without
the keys its ``state_dict`` writes) is refused naming the layout it should have, and changes nothing.

The refusal names the keys the loading optimizer's ``state_dict`` writes and which ``state_dict`` that is, so the
reader sees which optimizer's state was handed to which.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch
from torch import nn

from pgregistry.collection import FIELD_NAMES, ProcessGroupCollection
from pgregistry.optim import (
    FlatOptimizer,
    MixedPrecisionOptimizer,
    ShardedOptimizer,
    inner_factory,
    setup_process_groups_for_optimizer,
)

ALL_OFF = ProcessGroupCollection(**dict.fromkeys(FIELD_NAMES))


def _optimizer(kind: str) -> FlatOptimizer:
    params = [nn.Parameter(torch.ones(3, dtype=torch.bfloat16))]
    params[0].main_grad = torch.ones(3)  # type: ignore[attr-defined]
    if kind == "mixed":
        groups = setup_process_groups_for_optimizer(ALL_OFF)
        opt: FlatOptimizer = MixedPrecisionOptimizer(params, groups, inner=inner_factory("adam", lr=1e-2))
    else:
        groups = setup_process_groups_for_optimizer(ALL_OFF, use_distributed_optimizer=True)
        opt = ShardedOptimizer(params, groups, inner=inner_factory("adam", lr=1e-2))
    opt.step()
    return opt


LAYOUTS = {
    "mixed": "it is no {'inner': ..., 'main_params': ...} dict (MixedPrecisionOptimizer.state_dict output)",
    "sharded": "it is no {'shards': ..., 'param_groups': ...} dict (ShardedOptimizer.state_dict output)",
}


@pytest.mark.parametrize("given", ["list", "other optimizer's", "keys missing"])
@pytest.mark.parametrize("kind", sorted(LAYOUTS))
def test_a_state_dict_of_another_layout_is_refused_naming_the_layout(kind: str, given: str) -> None:
    opt = _optimizer(kind)
    other = _optimizer("sharded" if kind == "mixed" else "mixed").state_dict()
    state = {"list": [], "other optimizer's": other, "keys missing": {}}[given]
    before = copy.deepcopy(opt.state_dict())
    with pytest.raises(ValueError, match=re.escape(f"(1 fault(s): {LAYOUTS[kind]}); nothing was loaded")):
        opt.load_state_dict(state)  # type: ignore[arg-type]
    after = opt.state_dict()
    assert repr(before) == repr(after)


def test_an_inner_state_of_another_layout_is_refused_naming_the_layout() -> None:
    opt = _optimizer("mixed")
    state = copy.deepcopy(opt.state_dict())
    state["inner"] = {"state": {}}  # no param_groups
    fault = "its inner state is no {'state': ..., 'param_groups': ...} dict"
    with pytest.raises(ValueError, match=re.escape(f"(1 fault(s): {fault}); nothing was loaded")):
        opt.load_state_dict(state)

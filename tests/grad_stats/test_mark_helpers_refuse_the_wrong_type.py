"""The role helpers refuse what is not theirs to mark, naming it and the helper to use.

Reported: ``mark_expert_module`` given a Parameter (instead of its module) failed with torch's "'Parameter' object has
no attribute 'modules'", having set its flag on the tensor: nothing said what to do. The same mistake the other way
round (a module given to a parameter helper) or any other type is a ``TypeError`` too, before anything is marked;
so is a ``partition_dim`` or ``stride`` that is not an int (``True`` read as dim 1).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from pgregistry.params import (
    copy_param_roles,
    mark_expert,
    mark_expert_module,
    mark_expert_replicated,
    mark_gtp_sharded,
    mark_shared,
    mark_tensor_parallel,
    param_roles,
)


def test_mark_expert_module_given_a_parameter_says_to_use_mark_expert() -> None:
    param = nn.Parameter(torch.zeros(4, 3))
    with pytest.raises(TypeError, match=r"mark_expert_module takes a module, but was given a Parameter of shape "
                                        r"\(4, 3\): use mark_expert \(or mark_expert_replicated\) for a parameter"):
        mark_expert_module(param)
    assert vars(param) == {}  # nothing marked
    with pytest.raises(TypeError, match="mark_expert_module takes an nn.Module, but was given a str"):
        mark_expert_module("experts")  # type: ignore[arg-type]


HELPERS: dict[str, Callable[[Any], Any]] = {
    "mark_expert": mark_expert,
    "mark_expert_replicated": mark_expert_replicated,
    "mark_shared": mark_shared,
    "mark_gtp_sharded": mark_gtp_sharded,
    "mark_tensor_parallel": lambda value: mark_tensor_parallel(value, 0),
    "copy_param_roles": lambda value: copy_param_roles(value, torch.zeros(1)),
}


@pytest.mark.parametrize("helper", HELPERS)
def test_a_parameter_helper_given_a_module_says_to_mark_its_parameters(helper: str) -> None:
    module = nn.Linear(3, 4)
    with pytest.raises(TypeError, match=rf"{helper} takes a parameter, but was given a Linear module: mark each of "
                                        r"its parameters \(module.weight, ...\)") as raised:
        HELPERS[helper](module)
    assert ("mark_expert_module marks a module of experts" in str(raised.value)) == ("expert" in helper)
    assert not any(param_roles(param) for param in module.parameters())
    assert not hasattr(module, "allreduce") and not hasattr(module, "shared")
    with pytest.raises(TypeError, match=rf"{helper} takes a parameter \(a torch.Tensor\), but was given a list"):
        HELPERS[helper]([module.weight])


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"partition_dim": True}, TypeError, "mark_tensor_parallel: partition_dim must be an int, got True"),
        ({"partition_dim": "0"}, TypeError, "mark_tensor_parallel: partition_dim must be an int, got '0'"),
        ({"partition_dim": 0, "stride": 1.0}, TypeError, "mark_tensor_parallel: stride must be an int, got 1.0"),
        ({"partition_dim": 2}, ValueError, r"partition_dim 2 is not a dim of a parameter of shape \(4, 3\)"),
        ({"partition_dim": 0, "stride": 0}, ValueError, "stride must be a positive integer, got 0"),
    ],
)
def test_mark_tensor_parallel_refuses_a_dim_or_stride_that_is_no_int_or_out_of_range(
    options: dict[str, Any], error: type[Exception], message: str
) -> None:
    param = nn.Parameter(torch.zeros(4, 3))
    with pytest.raises(error, match=message):
        mark_tensor_parallel(param, **options)
    assert param_roles(param) == {}

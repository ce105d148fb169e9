"""Hostile but plausible inputs to the optimizers: each is refused naming the culprit, before anything changes, or
gives torch's own numbers.

torch's optimizers skip a frozen parameter (its ``.grad`` is ``None``); the flat optimizers step every element of
their buffer, so a frozen parameter given to them was decayed. float32 main copies of a float64 parameter rounded it
(the model's value too). torch's SGD takes an ``lr`` of NaN, every rule an infinite one. Each of these gave a silently
wrong parameter; here each is refused."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn

from pgregistry import registry
from pgregistry.collection import FIELD_NAMES, ProcessGroupCollection
from pgregistry.layout import ParallelLayout
from pgregistry.optim import (
    MixedPrecisionOptimizer,
    ShardedOptimizer,
    build_optimizer,
    inner_factory,
    setup_process_groups_for_optimizer,
)
from pgregistry.testing import run_world

ALL_OFF = ProcessGroupCollection(**dict.fromkeys(FIELD_NAMES))
OFF = setup_process_groups_for_optimizer(ALL_OFF)


def _linear(dtype: torch.dtype = torch.float32) -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(3, 2).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bf16"])
@pytest.mark.parametrize("kind", [MixedPrecisionOptimizer, ShardedOptimizer], ids=["mixed", "sharded"])
def test_a_frozen_parameter_is_refused_naming_it_not_decayed(kind: type, dtype: torch.dtype) -> None:
    model = _linear(dtype)
    model.weight.requires_grad_(False)
    before = model.weight.detach().clone()
    with pytest.raises(ValueError, match=r"param\[0\] has requires_grad=False: .* trainable parameters only"):
        kind(list(model.parameters()), OFF, inner=inner_factory("adamw", lr=0.1, weight_decay=0.5))
    assert torch.equal(model.weight.detach(), before)


@pytest.mark.parametrize("kind", [MixedPrecisionOptimizer, ShardedOptimizer], ids=["mixed", "sharded"])
def test_float64_parameters_under_float32_main_copies_are_refused_not_rounded(kind: type) -> None:
    model = nn.Module()
    model.weight = nn.Parameter(torch.full((4,), 1 + 2**-40, dtype=torch.float64))
    if kind is MixedPrecisionOptimizer:  # a sharded build needs a world (below)
        rounded = r"would round the float64 parameters .*\['weight'\].* mixed_precision=False"
        with pytest.raises(ValueError, match=rounded):
            build_optimizer(model, ALL_OFF, optimizer="sgd", lr=2**-45)
    rounds = r"param\[0\] is torch.float64, which main copies of torch.float32 would round"
    with pytest.raises(ValueError, match=rounds):
        kind([model.weight], OFF, inner=inner_factory("sgd", lr=0.1))
    assert model.weight.detach().tolist() == [1 + 2**-40] * 4
    # Stepped in float64, it moves as torch's SGD moves it.
    optimizer = kind([model.weight], OFF, inner=inner_factory("sgd", lr=2**-45), main_dtype=None)
    model.weight.sum().backward()
    optimizer.step()
    assert model.weight.detach().tolist() == [1 + 2**-40 - 2**-45] * 4


BAD_OPTIONS = [
    pytest.param("lr", float("nan"), ValueError, "lr must be a non-negative, finite number, got nan", id="lr-nan"),
    pytest.param("lr", float("inf"), ValueError, "lr must be a non-negative, finite number, got inf", id="lr-inf"),
    pytest.param("lr", None, TypeError, r"lr must be a number, got None \(NoneType\)", id="lr-none"),
    pytest.param("lr", True, TypeError, r"lr must be a number, got True \(bool\)", id="lr-bool"),
    pytest.param(
        "weight_decay", float("nan"), ValueError, "weight_decay must be a non-negative, finite number",
        id="weight-decay-nan",
    ),
    pytest.param(
        "momentum", float("nan"), ValueError, "momentum must be a non-negative, finite number",
        id="momentum-nan",
    ),
    pytest.param("eps", None, TypeError, "eps must be a number", id="eps-none"),
    pytest.param("betas", (float("nan"), 0.9), ValueError, r"betas must each be in \[0, 1\)", id="beta-nan"),
    pytest.param("betas", None, TypeError, "betas must be a pair of numbers", id="betas-none"),
    pytest.param(
        "optimizer", None, ValueError, r"optimizer must be one of \['adam', 'adamw', 'sgd'\] or a factory, got None",
        id="optimizer-none",
    ),
    pytest.param("sharded", "no", TypeError, r"sharded must be True or False, got 'no' \(str\)", id="sharded-str"),
    pytest.param("mixed_precision", 1, TypeError, "mixed_precision must be True or False", id="mixed-precision-int"),
    pytest.param(
        "bucket_numel", True, TypeError, "bucket_numel must be a whole number of elements or None, got True",
        id="bucket-numel-bool",
    ),
    pytest.param("bucket_numel", -1, ValueError, "bucket_numel must be positive, got -1", id="bucket-numel-negative"),
]


@pytest.mark.parametrize("option,value,error,text", BAD_OPTIONS)
def test_a_bad_option_is_refused_naming_it_before_anything_is_built(
    option: str, value: Any, error: type[Exception], text: str
) -> None:
    model = _linear()
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = "sgd" if option == "momentum" else "adam"
    with pytest.raises(error, match=text):
        build_optimizer(model, ALL_OFF, **{"optimizer": optimizer, option: value})
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(p.detach(), b) for p, b in zip(model.parameters(), before, strict=True))
    if option in ("lr", "weight_decay", "momentum", "eps", "betas", "optimizer"):
        with pytest.raises(error, match=text):
            inner_factory(**{"optimizer": optimizer, "lr": 0.1, option: value})


def test_numpy_numbers_are_taken_as_their_values() -> None:
    model, reference = _linear(), _linear()
    optimizer = build_optimizer(model, ALL_OFF, optimizer="sgd", lr=np.float64(0.5), bucket_numel=np.int64(64))
    torch_sgd = torch.optim.SGD(reference.parameters(), lr=0.5)
    for module in (model, reference):
        module(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    torch_sgd.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), reference.parameters(), strict=True))


def test_parameters_on_several_devices_are_refused_naming_them() -> None:
    model = nn.Module()
    model.here = nn.Parameter(torch.ones(2))
    model.elsewhere = nn.Parameter(torch.ones(2, device="meta"))
    with pytest.raises(ValueError, match=r"the parameters lie on 2 devices \(\['cpu', 'meta'\]\)"):
        build_optimizer(model, ALL_OFF)


def _float64_on_rank_1() -> str:
    collection = registry.build(ParallelLayout(num_ranks=2, tp=2))
    model = _linear(torch.float64 if dist.get_rank() == 1 else torch.float32)
    try:
        build_optimizer(model, collection)
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_float64_parameters_on_one_rank_are_refused_on_every_rank() -> None:
    here, elsewhere = run_world(2, _float64_on_rank_1)
    assert "(none here)" in here
    assert "(here: ['weight', 'bias'])" in elsewhere

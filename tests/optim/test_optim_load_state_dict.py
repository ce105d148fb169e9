"""A refused ``load_state_dict`` leaves the optimizer exactly as it was: every optimizer checks the whole given
state (missing, extra, another shape or dtype; every child of a chained one) before it changes anything.

Each case loads the state of an optimizer stepped one step further (so a half-done load shows as changed values),
with one fault planted, and compares every tensor of the optimizer and its model, bit for bit, before and after.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from pgregistry import registry
from pgregistry.collection import FIELD_NAMES, ProcessGroupCollection
from pgregistry.layout import ParallelLayout
from pgregistry.optim import (
    ChainedOptimizer,
    FlatOptimizer,
    MixedPrecisionOptimizer,
    ShardedOptimizer,
    inner_factory,
    setup_process_groups_for_optimizer,
)
from pgregistry.testing import run_world

ALL_OFF = ProcessGroupCollection(**dict.fromkeys(FIELD_NAMES))
SHAPES = [(6, 4), (5,), (3, 2, 2)]


def _params(seed: int) -> list[nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(shape, generator=gen).to(torch.bfloat16)) for shape in SHAPES]


def _mixed(seed: int, inner: Any = None) -> MixedPrecisionOptimizer:
    groups = setup_process_groups_for_optimizer(ALL_OFF)
    return MixedPrecisionOptimizer(_params(seed), groups, inner=inner or inner_factory("adam", lr=1e-2))


def _sharded(seed: int) -> ShardedOptimizer:
    groups = setup_process_groups_for_optimizer(ALL_OFF, use_distributed_optimizer=True)
    return ShardedOptimizer(_params(seed), groups, inner=inner_factory("adam", lr=1e-2))


def _chained(seed: int) -> ChainedOptimizer:
    return ChainedOptimizer([_mixed(seed), _mixed(seed + 1)])


def _steps(opt: ChainedOptimizer | FlatOptimizer, count: int) -> None:
    children = opt.chained_optimizers if isinstance(opt, ChainedOptimizer) else [opt]
    for step in range(count):
        for child in children:
            gen = torch.Generator().manual_seed(step)
            for param in child.params:
                param.main_grad.copy_(torch.randn(param.shape, generator=gen))  # type: ignore[attr-defined]
        opt.step()


def _snapshot(opt: ChainedOptimizer | FlatOptimizer) -> list[tuple[str, Any]]:
    """Every value the optimizer holds (its state dict) and its parameters, cloned."""
    children = opt.chained_optimizers if isinstance(opt, ChainedOptimizer) else [opt]
    out: list[tuple[str, Any]] = [(f"param {i}", p.detach().clone()) for c in children for i, p in enumerate(c.params)]

    def walk(path: str, value: Any) -> None:
        if isinstance(value, dict):
            for key in sorted(value, key=str):
                walk(f"{path}/{key}", value[key])
        elif isinstance(value, list):
            for index, item in enumerate(value):
                walk(f"{path}/{index}", item)
        else:
            out.append((path, value.detach().clone() if isinstance(value, torch.Tensor) else value))

    walk("", opt.state_dict())
    return out


def _same(a: list[tuple[str, Any]], b: list[tuple[str, Any]]) -> None:
    assert [path for path, _ in a] == [path for path, _ in b]
    for (path, x), (_, y) in zip(a, b, strict=True):
        if isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and torch.equal(x, y), path
        else:
            assert x == y, path


def _inner(state: dict[str, Any]) -> dict[str, Any]:
    return state["children"][1]["inner"] if "children" in state else state["inner"]


def _reshaped_moment(state: dict[str, Any]) -> None:  # same numel: only a shape check sees it
    moments = _inner(state)["state"][0]
    moments["exp_avg"] = moments["exp_avg"].reshape(4, 6)


def _short_moment(state: dict[str, Any]) -> None:  # the flat step itself refuses it, after the main copies
    moments = _inner(state)["state"][2]
    moments["exp_avg_sq"] = moments["exp_avg_sq"][:1]


def _float64_main(state: dict[str, Any]) -> None:
    mains = (state["children"][1] if "children" in state else state)["main_params"]
    mains["param[1]"] = mains["param[1]"].double()


def _extra_main(state: dict[str, Any]) -> None:
    mains = (state["children"][1] if "children" in state else state)["main_params"]
    mains["param[9]"] = torch.zeros(2)


CASES: dict[str, tuple[Callable[[dict[str, Any]], None], str]] = {
    "reshaped": (_reshaped_moment, r"state 'exp_avg' of param\[0\] has shape \(4, 6\), this optimizer's \(6, 4\)"),
    "short": (_short_moment, r"'exp_avg_sq' of parameter 2 does not have the parameter's 12 elements"),
    "float64": (_float64_main, r"main copy 'param\[1\]' is torch.float64, this optimizer's torch.float32"),
    "extra": (_extra_main, r"holds unexpected 1 main copies, e.g. 'param\[9\]'"),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("make", [_mixed, _chained], ids=["mixed", "chained"])
def test_a_refused_load_changes_nothing(make: Callable[[int], Any], case: str) -> None:
    plant, message = CASES[case]
    opt, ahead = make(0), make(0)
    _steps(opt, 2)
    _steps(ahead, 3)
    state = copy.deepcopy(ahead.state_dict())
    plant(state)
    before = _snapshot(opt)
    with pytest.raises(ValueError, match=message) as refused:
        opt.load_state_dict(state)
    if make is _chained:
        assert "child 1: " in str(refused.value)  # child 0's state is good: it used to be loaded before child 1 failed
    _same(before, _snapshot(opt))
    opt.load_state_dict(copy.deepcopy(ahead.state_dict()))  # the good state still loads
    _same(_snapshot(ahead), _snapshot(opt))


def test_a_torch_inner_optimizer_refuses_moments_of_another_shape() -> None:
    """torch's own load_state_dict takes a moment of any shape (it fails at the next step, or broadcasts)."""
    make = functools.partial(_mixed, inner=functools.partial(torch.optim.Adam, lr=1e-2))
    opt, ahead = make(0), make(0)
    _steps(opt, 1)
    _steps(ahead, 2)
    state = copy.deepcopy(ahead.state_dict())
    state["inner"]["state"][1]["exp_avg"] = torch.zeros(1)
    del state["inner"]["state"][2]
    before = _snapshot(opt)
    with pytest.raises(
        ValueError,
        match=r"2 fault\(s\).*lacks the state of 1 parameters, e.g. 'param\[2\]'.*"
        r"'exp_avg' of param\[1\] has shape \(1,\)",
    ):
        opt.load_state_dict(state)
    _same(before, _snapshot(opt))


def test_a_sharded_optimizer_refuses_a_piece_of_another_shape_and_changes_nothing() -> None:
    opt, ahead = _sharded(0), _sharded(0)
    _steps(opt, 2)
    _steps(ahead, 3)
    state = copy.deepcopy(ahead.state_dict())
    state["shards"]["param[2]"]["state"]["exp_avg"] = state["shards"]["param[2]"]["state"]["exp_avg"].reshape(3, 4)
    before = _snapshot(opt)
    with pytest.raises(ValueError, match=r"state 'exp_avg' of param\[2\] has shape \(3, 4\), this optimizer's \(12,\)"):
        opt.load_state_dict(state)
    _same(before, _snapshot(opt))
    state["shards"]["param[0]"]["main"] = torch.zeros(3)
    with pytest.raises(ValueError, match=r"main copy in the piece of 'param\[0\]' has shape \(3,\)"):
        opt.load_state_dict(state)
    _same(before, _snapshot(opt))


def _refused_on_one_rank() -> dict[str, Any]:
    collection = registry.build(ParallelLayout(num_ranks=2))
    groups = setup_process_groups_for_optimizer(collection, use_distributed_optimizer=True)
    out: dict[str, Any] = {}
    for kind in ("sharded", "chained"):
        made = [ShardedOptimizer(_params(seed), groups, inner=inner_factory("adam", lr=1e-2)) for seed in (0, 0)]
        opt, ahead = (ChainedOptimizer([m]) for m in made) if kind == "chained" else made
        _steps(opt, 2)
        _steps(ahead, 3)
        state = copy.deepcopy(ahead.state_dict())
        if dist.get_rank() == 1:  # rank 1 only: a piece of a parameter this optimizer does not hold
            (state["children"][0] if kind == "chained" else state)["shards"]["bogus"] = {}
        before = _snapshot(opt)
        try:
            opt.load_state_dict(state)
            out[kind] = "no error"
        except ValueError as exc:
            out[kind] = str(exc)
        after = _snapshot(opt)
        out[f"{kind} unchanged"] = [path for path, _ in before] == [path for path, _ in after] and all(
            not isinstance(x, torch.Tensor) or torch.equal(x, y) for (_, x), (_, y) in zip(before, after, strict=True)
        )
    return out


def test_a_sharded_load_refused_on_one_rank_is_refused_on_every_rank() -> None:
    """A sharded load all-gathers: a rank refusing alone would leave the others waiting in it."""
    for rank, got in enumerate(run_world(2, _refused_on_one_rank, timeout=60.0)):
        for kind in ("sharded", "chained"):
            want = "holds unexpected 1 pieces, e.g. 'bogus'" if rank == 1 else "the state given to rank 1 does not fit"
            assert want in got[kind], (rank, kind, got[kind])
            assert got[f"{kind} unchanged"], (rank, kind)

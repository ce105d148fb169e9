"""One rank's load refused, every rank unchanged: a fault on one rank reaches every rank before any rank loads.

Reported (issue 41): a 2-rank world, ``load_optimizer_state_by_name`` with the right state on rank 1 and an
``exp_avg`` of 7 elements for a parameter of 3 on rank 0: rank 0 raised ``FlatStep.load_state_dict: ... does not
fit``, rank 1 loaded, and its next collective succeeded, so the replicas' optimizer states differed. The same held
for an optimizer's own ``load_state_dict`` and ``load_param_state`` (a data-parallel replica's load was local).

Each case runs in a real 2-rank gloo world (DP 2: the ranks are replicas) on a fresh pgregistry Adam optimizer,
stepped twice so that the state loaded (saved after the first step) differs from the state held. Rank 0 alone is given a
misshaped ``exp_avg``: in the state it passes, or in the checkpoint it loads (rank files and DCP: each rank loads
its own directory, holding the same keys, so only the values differ; these loads used to copy the parameters before
the optimizer refused). Every rank must raise the same exception type naming rank 0, and every tensor of every rank's
optimizer and model must be bit for bit as before (the snapshot is the optimizer's own state dict and parameters,
cloned before the call, compared with ``torch.equal`` and dtype). A collective after the cases ends the world: a
rank left inside one would fail it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from pgregistry import ParallelLayout, attach, build
from pgregistry.checkpoint import (
    load_distributed,
    load_optimizer_state_by_name,
    load_rank_files,
    save_distributed,
    save_rank_files,
    state_by_name,
)
from pgregistry.optim import ChainedOptimizer, build_optimizer
from pgregistry.testing import run_world

FAULTY_RANK = 0
LOADS = ["load_optimizer_state_by_name", "load_rank_files", "load_distributed", "load_state_dict", "load_param_state"]
MISSHAPED = torch.arange(7, dtype=torch.float32)
"""7 elements for the 3 of ``0.weight``."""


def _model() -> nn.Module:
    model = nn.Sequential(nn.Linear(3, 1, bias=False), nn.Linear(1, 2))
    with torch.no_grad():
        for index, param in enumerate(model.parameters()):
            param.copy_(torch.linspace(-1.0, 1.0, param.numel()).view(param.shape) + index)
    return model


def _step(model: nn.Module, optimizer: ChainedOptimizer, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    loss = model(torch.randn(4, 3, generator=generator)).square().sum()
    loss.backward()
    optimizer.sync_grads()
    optimizer.step()
    optimizer.zero_grad()


def _flat(value: Any, path: str = "") -> list[tuple[str, Any]]:
    """Every leaf of ``value`` (a state dict) with its path; tensors cloned."""
    if isinstance(value, dict):
        return [leaf for key in sorted(value, key=str) for leaf in _flat(value[key], f"{path}/{key}")]
    if isinstance(value, list | tuple):
        return [leaf for index, item in enumerate(value) for leaf in _flat(item, f"{path}/{index}")]
    return [(path, value.detach().clone() if isinstance(value, torch.Tensor) else value)]


def _snapshot(model: nn.Module, optimizer: ChainedOptimizer) -> list[tuple[str, Any]]:
    params = [(f"param {name}", param.detach().clone()) for name, param in model.named_parameters()]
    return params + _flat(optimizer.state_dict())


def _changed(before: list[tuple[str, Any]], after: list[tuple[str, Any]]) -> list[str]:
    """The paths whose value differs, bit for bit (a tensor's dtype and shape included)."""
    assert [path for path, _ in before] == [path for path, _ in after]
    return [
        path
        for (path, old), (_, new) in zip(before, after, strict=True)
        if (
            not (old.dtype == new.dtype and old.shape == new.shape and torch.equal(old, new))
            if isinstance(old, torch.Tensor)
            else old != new
        )
    ]


def _misshaped_on_the_faulty_rank(state: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    if dist.get_rank() != FAULTY_RANK:
        return state
    return {**state, "0.weight": {**state["0.weight"], "exp_avg": MISSHAPED}}


class _Misshaped:
    """An optimizer whose state, as the checkpoint functions read it, is ``optimizer``'s with ``0.weight``'s
    ``exp_avg`` misshaped: what a checkpoint saved through it holds (a checkpoint that loads on one rank only)."""

    def __init__(self, optimizer: ChainedOptimizer, weight: torch.Tensor) -> None:
        self.optimizer, self.weight = optimizer, weight

    def param_state(self) -> dict[torch.Tensor, dict[str, Any]]:
        state = self.optimizer.param_state()
        return {**state, self.weight: {**state[self.weight], "exp_avg": MISSHAPED}}

    def load_param_state(self, state: Mapping[torch.Tensor, Mapping[str, Any]]) -> None:
        raise AssertionError("never loaded")


def _stepped(collection: Any, steps: int) -> tuple[nn.Module, ChainedOptimizer]:
    """The model and its optimizer after ``steps`` steps (the same values on every call)."""
    model = _model()
    attach(model, collection)
    optimizer = build_optimizer(model, collection, optimizer="adam", lr=0.1)
    for seed in range(1, steps + 1):
        _step(model, optimizer, seed)
    return model, optimizer


def _cases(directory: str) -> dict[str, str]:
    collection = build(ParallelLayout(num_ranks=2))  # DP 2: the two ranks are replicas
    model, optimizer = _stepped(collection, steps=1)  # what is loaded: its state
    saved = {}  # the checkpoint each rank loads: a misshaped one on the faulty rank, the good one on the other
    for fmt, save in (("files", save_rank_files), ("dcp", save_distributed)):
        good, bad = Path(directory, fmt, "good"), Path(directory, fmt, "misshaped")
        save(good, model, optimizer)
        save(bad, model, _Misshaped(optimizer, model[0].weight))
        saved[fmt] = bad if dist.get_rank() == FAULTY_RANK else good
    by_name = state_by_name(model, optimizer)["optimizer"]
    by_name = {name: {key: _copy(value) for key, value in entry.items()} for name, entry in by_name.items()}
    state_dict = _flat_copy(optimizer.state_dict())
    names = {param: name for name, param in model.named_parameters()}
    whole = {names[param]: {key: _copy(value) for key, value in entry.items()}
             for param, entry in optimizer.param_state().items()}
    if dist.get_rank() == FAULTY_RANK:
        whole["0.weight"]["exp_avg"] = MISSHAPED

    def each_case(model: nn.Module, optimizer: ChainedOptimizer) -> dict[str, Callable[[], None]]:
        params = dict(model.named_parameters())
        return {
            "load_optimizer_state_by_name": lambda: load_optimizer_state_by_name(
                optimizer, model, _misshaped_on_the_faulty_rank(by_name)
            ),
            "load_rank_files": lambda: load_rank_files(saved["files"], model, optimizer),
            "load_distributed": lambda: load_distributed(saved["dcp"], model, optimizer),
            "load_state_dict": lambda: optimizer.load_state_dict(_misshaped_state_dict(state_dict)),
            "load_param_state": lambda: optimizer.load_param_state(
                {params[name]: entry for name, entry in whole.items()}
            ),
        }

    out = {}
    for label in LOADS:  # each case on a model and optimizer one step further than what it loads
        model, optimizer = _stepped(collection, steps=2)
        before = _snapshot(model, optimizer)
        try:
            each_case(model, optimizer)[label]()
            outcome = "loaded"
        except Exception as exc:  # noqa: BLE001 - the type and text are what is checked
            outcome = f"{type(exc).__name__}: {exc}"
        out[label] = f"{outcome}; changed {_changed(before, _snapshot(model, optimizer))}"
    flag = torch.ones(1)
    dist.all_reduce(flag)  # every rank is here, none left inside a collective of a load
    out["after"] = str(int(flag.item()))
    return out


def _copy(value: Any) -> Any:
    return value.detach().clone() if isinstance(value, torch.Tensor) else value


def _flat_copy(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _flat_copy(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_flat_copy(item) for item in value]
    return _copy(value)


def _misshaped_state_dict(state_dict: dict[str, Any]) -> dict[str, Any]:
    """``state_dict`` (a chained optimizer's), with rank 0's first ``exp_avg`` misshaped there."""
    if dist.get_rank() != FAULTY_RANK:
        return state_dict
    misshaped = _flat_copy(state_dict)
    inner_state = misshaped["children"][0]["inner"]["state"]
    inner_state[0]["exp_avg"] = MISSHAPED
    return misshaped


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, str]]:
    return run_world(2, _cases, str(tmp_path_factory.mktemp("checkpoints")), timeout=20.0)


@pytest.mark.parametrize("load", LOADS)
def test_one_rank_refused_means_every_rank_refused_and_unchanged(results: list[dict[str, str]], load: str) -> None:
    for rank, out in enumerate(results):
        message = out[load]
        assert message.startswith("ValueError: "), (rank, message)
        assert message.endswith("; changed []"), (rank, message)  # bit for bit as before, on every rank
        assert out["after"] == "2", (rank, out)


@pytest.mark.parametrize("load", LOADS)
def test_every_rank_names_the_rank_with_the_fault(results: list[dict[str, str]], load: str) -> None:
    for rank, out in enumerate(results):
        message = out[load]
        assert f"rank {FAULTY_RANK}" in message, (rank, message)
        if rank == FAULTY_RANK:
            assert "'exp_avg'" in message, message

"""Every checkpoint loader refuses what does not fit, on every rank and before anything is copied.

Before: ``load_distributed`` loaded a 2-layer checkpoint into a 1-layer model without a word (DCP reads only the
keys it is asked for), cast a checkpoint of another dtype silently, and a rank whose load failed raised alone;
``load_rank_files`` and ``pgregistry.modules.load_checkpoint`` given an optimizer loaded a checkpoint saved without
one and kept the optimizer's fresh state; ``load_optimizer_shards`` dropped the saved pieces of parameters no
optimizer held. Each case runs in a real 2-rank gloo world; the values loaded are compared with the ones the test
filled in (``filled``: parameter i holds ``value + i``), never with what the code under test read.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from checkpoint_support import filled, snapshot
from torch import nn

from pgregistry import ParallelLayout, attach, build
from pgregistry import modules as mm
from pgregistry.checkpoint import (
    load_distributed,
    load_rank_files,
    save_distributed,
    save_rank_files,
)
from pgregistry.testing import run_world

SAVE = {"dcp": save_distributed, "files": save_rank_files}
LOAD = {"dcp": load_distributed, "files": load_rank_files}


def _layers(count: int, value: float, pgc: Any) -> nn.Module:
    model = filled(nn.Sequential(*(nn.Linear(2, 2) for _ in range(count))), value)
    attach(model, pgc)
    return model


def _attempt(call: Any, model: nn.Module) -> str:
    """``call()``'s error (``ValueError: ...``) or ``loaded``, and which parameters it changed."""
    before = snapshot(model)
    try:
        call()
        message = "loaded"
    except ValueError as exc:
        message = f"ValueError: {exc}"
    after = snapshot(model)
    changed = sorted(name for name in before if not torch.equal(before[name], after[name]))
    return f"{message}; changed {changed}"


def _layer_counts(directory: str, fmt: str) -> dict[str, Any]:
    pgc = build(ParallelLayout(num_ranks=2))
    SAVE[fmt](f"{directory}/two", _layers(2, 1.0, pgc))
    SAVE[fmt](f"{directory}/one", _layers(1, 1.0, pgc))
    one = _layers(1, -5.0, pgc)
    out = {"two_into_one": _attempt(lambda: LOAD[fmt](f"{directory}/two", one), one)}
    out["one_into_two"] = _attempt(lambda: LOAD[fmt](f"{directory}/one", _layers(2, -5.0, pgc)), one)
    LOAD[fmt](f"{directory}/two", one, strict=False)  # the first layer, on purpose
    out["subset"] = [param.detach().clone() for param in one.parameters()]
    return out


def _check_layer_counts(fmt: str, tmp_path: Path) -> None:
    for rank, got in enumerate(run_world(2, _layer_counts, str(tmp_path), fmt, timeout=60.0)):
        assert got["two_into_one"] == (
            f"ValueError: the checkpoint {tmp_path}/two holds 2 keys no rank's model has, e.g. 'model/1.bias', "
            "'model/1.weight' (another model, more layers or more experts than this model's?); pass strict=False "
            "to load a subset on purpose; changed []"
        ), rank
        assert got["one_into_two"].startswith(
            "ValueError: the checkpoint lacks 2 of this rank's parameters, e.g. '1.bias', '1.weight'"
        ), (rank, got["one_into_two"])
        weight, bias = got["subset"]
        assert torch.equal(weight, torch.full((2, 2), 1.0)) and torch.equal(bias, torch.full((2,), 2.0)), rank


def test_dcp_refuses_a_checkpoint_of_more_layers_and_of_fewer_on_every_rank(tmp_path: Path) -> None:
    _check_layer_counts("dcp", tmp_path)


def test_rank_files_refuse_a_checkpoint_of_more_layers_and_of_fewer_on_every_rank(tmp_path: Path) -> None:
    _check_layer_counts("files", tmp_path)


def _dtype_on_rank_one(directory: str, fmt: str) -> dict[str, Any]:
    pgc = build(ParallelLayout(num_ranks=2))
    SAVE[fmt](directory, _layers(1, 1.0, pgc))
    model = _layers(1, -5.0, pgc)
    if dist.get_rank() == 1:
        model.double()
    out = {"strict": _attempt(lambda: LOAD[fmt](directory, model), model)}
    LOAD[fmt](directory, model, strict=False)  # casts on copy, on purpose
    out["cast"] = [param.detach().clone() for param in model.parameters()]
    return out


def _check_dtype(fmt: str, tmp_path: Path) -> None:
    results = run_world(2, _dtype_on_rank_one, str(tmp_path), fmt, timeout=60.0)
    assert results[0]["strict"] == (
        f"ValueError: the checkpoint {tmp_path} does not fit another rank's model (rank 1: see its error); changed []"
    )
    assert results[1]["strict"] == (
        "ValueError: parameter '0.weight' is torch.float64 but the checkpoint holds torch.float32 (make the model "
        "torch.float32 before loading, or pass strict=False to cast on copy) (and 1 more parameters of this rank do "
        "not fit, e.g. parameter '0.bias' is torch.float64 but the checkpoint holds torch.float32 (make the model "
        "torch.float32 before loading, or pass strict=False to cast on copy)); changed []"
    )
    for rank, got in enumerate(results):
        dtype = torch.float64 if rank == 1 else torch.float32
        weight, bias = got["cast"]
        assert torch.equal(weight, torch.full((2, 2), 1.0, dtype=dtype)), rank
        assert torch.equal(bias, torch.full((2,), 2.0, dtype=dtype)), rank


def test_dcp_refuses_another_dtype_on_every_rank_and_casts_with_strict_off(tmp_path: Path) -> None:
    _check_dtype("dcp", tmp_path)


def test_rank_files_refuse_another_dtype_on_every_rank_and_cast_with_strict_off(tmp_path: Path) -> None:
    _check_dtype("files", tmp_path)


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(list(params), lr=0.5, momentum=0.9)


def _stepped(model: nn.Module, params: Any) -> torch.optim.Optimizer:
    """An SGD with momentum over ``params`` after one step on grads of 1 (each momentum buffer is then all 1)."""
    optimizer = _sgd(params)
    for param in model.parameters():
        param.grad = torch.ones_like(param)
    optimizer.step()
    return optimizer


def _optimizer_state(directory: str, fmt: str) -> dict[str, Any]:
    pgc = build(ParallelLayout(num_ranks=2))
    saved = _layers(2, 1.0, pgc)
    SAVE[fmt](f"{directory}/none", saved)
    SAVE[fmt](f"{directory}/fresh", saved, torch.optim.SGD(saved.parameters(), lr=0.5))  # no state: none needed
    SAVE[fmt](f"{directory}/first-layer", saved, _stepped(saved, saved[0].parameters()))
    SAVE[fmt](f"{directory}/full", saved, _stepped(saved, saved.parameters()))
    out: dict[str, Any] = {}
    model = _layers(2, -5.0, pgc)
    optimizer = _sgd(model.parameters())
    out["saved_without"] = _attempt(lambda: LOAD[fmt](f"{directory}/none", model, optimizer), model)
    out["over_fewer"] = _attempt(lambda: LOAD[fmt](f"{directory}/first-layer", model, optimizer), model)
    out["over_more"] = _attempt(
        lambda: LOAD[fmt](f"{directory}/full", model, _sgd(model[0].parameters())), model
    )
    out["fresh"] = _attempt(lambda: LOAD[fmt](f"{directory}/fresh", model, torch.optim.SGD(model.parameters(), 0.5)),
                            model)
    LOAD[fmt](f"{directory}/none", model, optimizer, strict=False)  # keeps the fresh state, on purpose
    out["kept_fresh"] = dict(optimizer.state) == {}
    LOAD[fmt](f"{directory}/full", model, optimizer)
    out["momentum"] = [optimizer.state[param]["momentum_buffer"].clone() for param in model.parameters()]
    return out


def _check_optimizer_state(fmt: str, tmp_path: Path) -> None:
    for rank, got in enumerate(run_world(2, _optimizer_state, str(tmp_path), fmt, timeout=60.0)):
        assert got["saved_without"] == (
            "ValueError: the checkpoint holds no optimizer state: it was saved without an optimizer; load it with "
            "optimizer=None, or pass strict=False to keep the optimizer's fresh state; changed []"
        ), (rank, got["saved_without"])
        assert got["over_fewer"] == (
            "ValueError: the checkpoint holds no optimizer state for 2 of the parameters this rank's optimizer "
            "updates, e.g. '1.bias', '1.weight' (saved with an optimizer over other parameters?); pass strict=False "
            "to keep their fresh state; changed []"
        ), (rank, got["over_fewer"])
        assert got["over_more"] == (
            "ValueError: the checkpoint holds optimizer state for 2 parameters this rank's optimizer does not "
            "update, e.g. '1.bias', '1.weight'; pass strict=False to load a subset on purpose; changed []"
        ), (rank, got["over_more"])
        assert got["fresh"].startswith("loaded; changed ['0.bias', '0.weight', '1.bias', '1.weight']"), rank
        assert got["kept_fresh"], rank
        assert all(torch.equal(buffer, torch.ones_like(buffer)) for buffer in got["momentum"]), rank


def test_dcp_given_an_optimizer_refuses_a_checkpoint_without_its_state(tmp_path: Path) -> None:
    _check_optimizer_state("dcp", tmp_path)


def test_rank_files_given_an_optimizer_refuse_a_checkpoint_without_its_state(tmp_path: Path) -> None:
    _check_optimizer_state("files", tmp_path)


def _modules_job(directory: str) -> str:
    layouts = {"a": ParallelLayout(num_ranks=1), "b": ParallelLayout(num_ranks=1, rank_offset=1)}
    modules = mm.build_modules(layouts)
    models = {name: filled(nn.Linear(2, 2), 1.0) for name in modules.here()}
    mm.save_checkpoint(directory, models, modules)  # without the optimizer
    fresh = {name: filled(nn.Linear(2, 2), -5.0) for name in modules.here()}
    optimizer = mm.build_optimizer(fresh, modules, optimizer="adam", lr=0.1, mixed_precision=False)
    return _attempt(lambda: mm.load_checkpoint(directory, fresh, modules, optimizer), next(iter(fresh.values())))


def test_a_job_checkpoint_saved_without_the_optimizer_is_refused_on_every_rank(tmp_path: Path) -> None:
    for rank, message in enumerate(run_world(2, _modules_job, str(tmp_path), timeout=60.0)):
        assert message.startswith("ValueError: pgregistry.modules.load_checkpoint: ranks [0, 1] failed to load ("), (
            rank, message
        )
        assert "module 'a': ValueError: the checkpoint holds no optimizer state: it was saved without an optimizer" in (
            message
        ), (rank, message)
        assert "module 'b': ValueError: the checkpoint holds no optimizer state" in message, (rank, message)
        assert message.endswith("; changed []"), (rank, message)


def _state_by_name(_: None) -> dict[str, str]:
    from pgregistry.checkpoint import load_optimizer_state_by_name, state_by_name

    pgc = build(ParallelLayout(num_ranks=2))
    model = _layers(2, 1.0, pgc)
    saved = state_by_name(model, _stepped(model, model.parameters()))["optimizer"]
    fresh = state_by_name(model, torch.optim.SGD(model.parameters(), lr=0.5))["optimizer"]  # empty entries
    out = {}
    cases: dict[str, Any] = {
        "whole": saved,
        "fresh": fresh,
        "lacking": {name: entry for name, entry in saved.items() if not name.startswith("1.")},
        "extra": {**saved, "2.weight": {"momentum_buffer": torch.zeros(2, 2)}},
        "bad_on_rank_one": saved if dist.get_rank() == 0 else [("0.weight", {})],
    }
    for label, state in cases.items():
        optimizer = _sgd(model.parameters())
        try:
            load_optimizer_state_by_name(optimizer, model, state)
            out[label] = f"loaded {sorted(len(entry) for entry in optimizer.state.values())}"
        except (ValueError, TypeError) as exc:
            out[label] = f"{type(exc).__name__}: {exc}"
    optimizer = _sgd(model.parameters())
    load_optimizer_state_by_name(optimizer, model, cases["lacking"], strict=False)
    out["subset"] = f"loaded {len(optimizer.state)}"
    return out


def test_optimizer_state_given_by_name_is_refused_on_every_rank_unless_it_fits(tmp_path: Path) -> None:
    results = run_world(2, _state_by_name, None, timeout=60.0)
    for rank, got in enumerate(results):
        assert got["whole"] == "loaded [1, 1, 1, 1]" and got["fresh"] == "loaded []", (rank, got)
        assert got["lacking"] == (
            "ValueError: the checkpoint holds no optimizer state for 2 of the parameters this rank's optimizer "
            "updates, e.g. '1.bias', '1.weight' (saved with an optimizer over other parameters?); pass strict=False "
            "to keep their fresh state"
        ), (rank, got["lacking"])
        assert got["extra"].startswith(
            "ValueError: the optimizer state given holds 2 keys no rank's model has, e.g. "
            "'optimized/2.weight', 'optimizer/2.weight/momentum_buffer'"
        ), (rank, got["extra"])
        assert got["subset"] == "loaded 2", rank
    assert results[0]["bad_on_rank_one"] == (
        "ValueError: load_optimizer_state_by_name: another rank's state is not keyed by parameter name "
        "(rank 1: see its error)"
    )
    assert results[1]["bad_on_rank_one"] == (
        "TypeError: load_optimizer_state_by_name takes {name: {state key: value}}, got list"
    )


def _job_with_one_module_unloadable(directory: str) -> str:
    layouts = {"a": ParallelLayout(num_ranks=1), "b": ParallelLayout(num_ranks=1, rank_offset=1)}
    modules = mm.build_modules(layouts)
    mm.save_checkpoint(directory, {name: filled(nn.Linear(2, 2), 1.0) for name in modules.here()}, modules)
    if dist.get_rank() == 1:  # module b's checkpoint is of another shape: b cannot load, a could
        (Path(directory) / "b" / "rank-00000.pt").unlink()
    dist.barrier()
    if dist.get_rank() == 1:
        save_rank_files(f"{directory}/b", filled(nn.Linear(3, 2), 1.0), pg_collection=modules["b"])
    fresh = {name: filled(nn.Linear(2, 2), -5.0) for name in modules.here()}
    return _attempt(lambda: mm.load_checkpoint(directory, fresh, modules), next(iter(fresh.values())))


def test_a_job_whose_one_module_cannot_load_loads_no_module(tmp_path: Path) -> None:
    # Module a loaded and stayed loaded while module b failed: the job was half-loaded, though every rank raised.
    for rank, message in enumerate(run_world(2, _job_with_one_module_unloadable, str(tmp_path), timeout=60.0)):
        assert message.startswith("ValueError: pgregistry.modules.load_checkpoint: ranks [1] failed to load (rank 1: "
                                  "module 'b': ValueError: parameter 'weight' has shape (2, 2) but the checkpoint "
                                  "holds (2, 3)"), (rank, message)
        assert message.endswith("; changed []"), (rank, message)


def _load_from_another_directory(directory: str, fmt: str) -> str:
    pgc = build(ParallelLayout(num_ranks=2))
    SAVE[fmt](f"{directory}/two", _layers(2, 1.0, pgc))
    SAVE[fmt](f"{directory}/one", _layers(1, 1.0, pgc))
    model = _layers(1, -5.0, pgc)
    return _attempt(lambda: LOAD[fmt](f"{directory}/{['one', 'two'][dist.get_rank()]}", model), model)


def test_ranks_loading_different_checkpoints_are_refused_on_every_rank(tmp_path: Path) -> None:
    # The ranks' key lists differ in length: the flags per key must not be all-reduced before that is known.
    for fmt in ("dcp", "files"):
        for rank, message in enumerate(run_world(2, _load_from_another_directory, str(tmp_path / fmt), fmt)):
            assert message.startswith(
                "ValueError: ranks read different checkpoints: every rank must load the same one (the checkpoint "
            ) and message.endswith("; changed []"), (fmt, rank, message)


def _whole_state_on_every_ep_rank(_: None) -> bool:
    from checkpoint_support import MoE

    from pgregistry.checkpoint import load_optimizer_state_by_name, state_by_name
    from pgregistry.experts import named_global_parameters

    model = filled(MoE(4, ep_size=2), 1.0 + dist.get_rank())
    attach(model, build(ParallelLayout(num_ranks=2, ep=2, expt_tp=1)))
    mine = state_by_name(model, _stepped(model, model.parameters()))["optimizer"]
    everyone: list[Any] = [None, None]
    dist.all_gather_object(everyone, mine)
    whole = everyone[0] | everyone[1]  # every expert of both ranks: each rank takes its own
    optimizer = _sgd(model.parameters())
    load_optimizer_state_by_name(optimizer, model, whole)
    return all(
        torch.equal(optimizer.state[param]["momentum_buffer"], whole[name]["momentum_buffer"])
        for name, param in named_global_parameters(model)
    )


def test_optimizer_state_of_every_ep_rank_given_to_each_loads_strictly(tmp_path: Path) -> None:
    # The union over the ranks holds every expert: no false alarm for the other ranks' experts.
    assert run_world(2, _whole_state_on_every_ep_rank, None, timeout=60.0) == [True, True]

"""Hostile but plausible arguments to the checkpoint functions: refused naming the argument, nothing lost.

``save_distributed`` overwrote the checkpoint a directory held (``torch.distributed.checkpoint`` does), where rank
files refuse to: an earlier checkpoint was silently replaced. A directory that is a regular file failed with
``[Errno 17] File exists`` or torch's ``CheckpointException`` (a ``BaseException``); an empty directory (an unset
variable) saved into the current directory; ``strict=None`` loaded a subset without a word."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from checkpoint_support import filled, snapshot
from torch import nn

from pgregistry import ParallelLayout, attach, build
from pgregistry.checkpoint import (
    load_distributed,
    load_optimizer_shards,
    load_rank_files,
    save_distributed,
    save_optimizer_shards,
    save_rank_files,
    state_by_name,
)
from pgregistry.params import mark_expert, mark_tensor_parallel
from pgregistry.testing import run_world

SAVE = {"dcp": save_distributed, "files": save_rank_files}
LOAD = {"dcp": load_distributed, "files": load_rank_files}


def _model(value: float) -> nn.Module:
    model = filled(nn.Sequential(nn.Linear(2, 2)), value)
    attach(model, build(ParallelLayout(num_ranks=2)))
    return model


def _error_of(call: Any) -> str:
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - the test reports any
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def _second_save_and_a_file(directory: str) -> dict[str, dict[str, Any]]:
    outs = {}
    for fmt in SAVE:
        first = _model(1.0)
        SAVE[fmt](f"{directory}/{fmt}", first)
        out = {"again": _error_of(lambda fmt=fmt: SAVE[fmt](f"{directory}/{fmt}", _model(9.0)))}
        loaded = _model(-5.0)
        LOAD[fmt](f"{directory}/{fmt}", loaded)
        out["kept"] = all(
            torch.equal(a, b) for a, b in zip(snapshot(loaded).values(), snapshot(first).values(), strict=True)
        )
        Path(f"{directory}/afile").touch()
        out["file"] = _error_of(lambda fmt=fmt, first=first: SAVE[fmt](f"{directory}/afile", first))
        outs[fmt] = out
    return outs


def test_a_second_save_into_a_checkpoint_or_a_save_into_a_file_is_refused_on_every_rank(tmp_path: Path) -> None:
    for rank, outs in enumerate(run_world(2, _second_save_and_a_file, str(tmp_path), timeout=60.0)):
        for fmt, out in outs.items():
            assert out["again"].startswith(f"ValueError: {tmp_path}/{fmt} already holds a checkpoint"), (rank, out)
            assert "does not overwrite one: save to a new directory, or remove the old checkpoint first" in out["again"]
            assert out["kept"], (rank, fmt)  # the first checkpoint loads back bit for bit
            assert out["file"] == (
                f"NotADirectoryError: the checkpoint directory {tmp_path}/afile is a regular file, not a directory: "
                "name a directory (a save makes it when missing)"
            ), (rank, out)


@pytest.mark.parametrize(
    "call",
    [
        pytest.param(lambda: save_rank_files("", nn.Linear(2, 2)), id="save_rank_files"),
        pytest.param(lambda: save_distributed("  ", nn.Linear(2, 2)), id="save_distributed"),
        pytest.param(lambda: load_rank_files("", nn.Linear(2, 2)), id="load_rank_files"),
        pytest.param(lambda: save_optimizer_shards("", None), id="save_optimizer_shards"),  # type: ignore[arg-type]
    ],
)
def test_an_empty_directory_is_refused_not_read_as_the_current_one(call: Any, tmp_path: Path, monkeypatch: Any) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"directory is empty \(an unset variable\?\), which would mean the current"):
        call()
    assert list(tmp_path.iterdir()) == []


def test_a_directory_or_strict_of_the_wrong_type_is_named() -> None:
    with pytest.raises(TypeError, match=r"save_rank_files: directory must be a path .* got None \(NoneType\)"):
        save_rank_files(None, nn.Linear(2, 2))  # type: ignore[arg-type]
    for load in (load_rank_files, load_distributed):
        with pytest.raises(TypeError, match=rf"{load.__name__}: strict must be True or False, got None"):
            load("ckpt", nn.Linear(2, 2), strict=None)  # type: ignore[arg-type]  # read as False before
    with pytest.raises(TypeError, match="load_optimizer_shards: strict must be True or False, got 0"):
        load_optimizer_shards("ckpt", None, strict=0)  # type: ignore[arg-type]


class _MoE(nn.Module):
    """A dense layer and this EP rank's 2 of 4 experts, expert ``g`` all ``g + 1``: stacked in one tensor (as
    torchtitan's ``GroupedExperts`` holds them), or one parameter per expert under ``local_experts.<i>``."""

    def __init__(self, ep_rank: int, *, stacked: bool) -> None:
        super().__init__()
        self.dense = nn.Linear(2, 2)
        values = [torch.full((3,), 2.0 * ep_rank + local + 1) for local in range(2)]
        self.experts = nn.Module()
        if stacked:
            self.experts.w1 = mark_expert(nn.Parameter(torch.stack(values)))
        else:
            self.experts.local_experts = nn.ModuleList(nn.Module() for _ in values)
            for expert, value in zip(self.experts.local_experts, values, strict=True):
                expert.w1 = mark_expert(nn.Parameter(value.clone()))

    def experts_held(self) -> list[list[float]]:
        return [param.tolist() for name, param in self.named_parameters() if name.startswith("experts.")]


def _experts_named_alike_on_every_ep_rank(directory: str) -> dict[str, Any]:
    rank = torch.distributed.get_rank()
    collection = build(ParallelLayout(num_ranks=2, ep=2))

    def model(*, stacked: bool, blank: bool = False) -> _MoE:
        built = _MoE(rank, stacked=stacked)
        if blank:
            filled(built, 0.0)
        attach(built, collection)
        return built

    out: dict[str, Any] = {}
    for fmt in SAVE:
        stacked = model(stacked=True)
        out[f"save {fmt}"] = _error_of(lambda fmt=fmt, m=stacked: SAVE[fmt](f"{directory}/{fmt}", m, num_experts=4))
        out[f"nothing written {fmt}"] = not Path(f"{directory}/{fmt}").exists() or not any(
            Path(f"{directory}/{fmt}").iterdir()
        )
        # The experts one parameter each: every EP rank's own come back.
        SAVE[fmt](f"{directory}/{fmt}-indexed", model(stacked=False), num_experts=4)
        loaded = model(stacked=False, blank=True)
        LOAD[fmt](f"{directory}/{fmt}-indexed", loaded, num_experts=4)
        out[f"loaded {fmt}"] = loaded.experts_held()
        out[f"load {fmt}"] = _error_of(
            lambda fmt=fmt: LOAD[fmt](f"{directory}/{fmt}-indexed", model(stacked=True), num_experts=4)
        )
    out["state_by_name"] = _error_of(lambda: state_by_name(model(stacked=True), num_experts=4))
    return out


def test_experts_stacked_in_one_tensor_are_refused_at_ep_above_one_not_saved_as_one_ranks(tmp_path: Path) -> None:
    """Experts stacked in one parameter have no expert index in their name, so at EP 2 both EP ranks held other
    experts under one global name: the checkpoint kept EP rank 0's (1.0 and 2.0) and a load gave them to EP rank 1
    too, whose 3.0 and 4.0 were lost, without a word (rank files and DCP alike)."""
    outs = run_world(2, _experts_named_alike_on_every_ep_rank, str(tmp_path), timeout=60.0)
    for rank, out in enumerate(outs):
        oracle = [[2.0 * rank + local + 1] * 3 for local in range(2)]  # the experts this EP rank was built with
        for fmt in SAVE:
            save = "save_rank_files" if fmt == "files" else "save_distributed"
            assert out[f"save {fmt}"].startswith(
                f"ValueError: {save}: 1 routed-expert parameter(s) have no expert index in their name, e.g. "
                "'experts.w1' (experts stacked in one tensor?): at EP size 2 every EP rank holds other experts"
            ), (rank, out)
            assert "under 'local_experts.<i>.'" in out[f"save {fmt}"]
            assert out[f"nothing written {fmt}"], (rank, fmt)
            assert out[f"loaded {fmt}"] == oracle, (rank, fmt, out[f"loaded {fmt}"])
            assert "have no expert index in their name" in out[f"load {fmt}"], (rank, out)
        assert "state_by_name: 1 routed-expert parameter(s)" in out["state_by_name"], (rank, out)


def _pieces_of_other_shapes(directory: str) -> dict[str, Any]:
    rank = torch.distributed.get_rank()
    collection = build(ParallelLayout(num_ranks=2, tp=2))
    whole = torch.arange(5.0)  # 5 elements over TP 2: chunk cuts 3 and 2

    def model(pieces: list[torch.Tensor], *, blank: bool = False) -> nn.Module:
        built = nn.Module()
        built.w = mark_tensor_parallel(nn.Parameter(pieces[rank].clone()), 0)
        if blank:
            filled(built, 0.0)
        attach(built, collection)
        return built

    unequal, equal = list(whole.chunk(2)), list(torch.arange(6.0).chunk(2))
    out: dict[str, Any] = {}
    for fmt in SAVE:
        out[f"save {fmt}"] = _error_of(lambda fmt=fmt: SAVE[fmt](f"{directory}/{fmt}", model(unequal)))
        out[f"nothing written {fmt}"] = not Path(f"{directory}/{fmt}").exists() or not any(
            Path(f"{directory}/{fmt}").iterdir()
        )
        SAVE[fmt](f"{directory}/{fmt}-equal", model(equal))  # 3 and 3: joined, and cut again on load
        loaded = model(equal, blank=True)
        LOAD[fmt](f"{directory}/{fmt}-equal", loaded)
        out[f"loaded {fmt}"] = loaded.w.tolist()
        out[f"load {fmt}"] = _error_of(lambda fmt=fmt: LOAD[fmt](f"{directory}/{fmt}-equal", model(unequal)))
    out["state_by_name"] = _error_of(lambda: state_by_name(model(unequal)))
    return out


def test_tp_pieces_of_other_shapes_are_refused_on_every_rank_not_an_abort(tmp_path: Path) -> None:
    """A TP-sharded parameter whose size TP does not divide (5 elements cut 3 and 2) reached the all-gather that
    joins its pieces: gloo aborted the rank's process (SIGABRT, ``Received data size doesn't match expected
    size``) in every save and in ``state_by_name``; the load cut a whole of another size."""
    outs = run_world(2, _pieces_of_other_shapes, str(tmp_path), timeout=60.0)
    for rank, out in enumerate(outs):
        own = "'w' (3,)" if rank == 0 else "'w' (2,)"
        for fmt in SAVE:
            save = "save_rank_files" if fmt == "files" else "save_distributed"
            assert out[f"save {fmt}"] == (
                f"ValueError: {save}: the ranks [0, 1] of a TP group hold TP-sharded pieces of other shapes (or "
                f"other TP-sharded parameters); this rank's: {own}. pgregistry.checkpoint joins equal pieces: give "
                "each TP-sharded parameter a size the TP size divides (pad it, as Megatron-Core pads its "
                "vocabulary), and mark only parameters sharded on every TP rank"
            ), (rank, out)
            assert out[f"nothing written {fmt}"], (rank, fmt)
            assert out[f"loaded {fmt}"] == torch.arange(6.0).chunk(2)[rank].tolist(), (rank, out)  # the oracle
            assert "hold TP-sharded pieces of other shapes" in out[f"load {fmt}"], (rank, out)
        assert out["state_by_name"].startswith("ValueError: state_by_name: the ranks [0, 1] of a TP group"), out


class _Wrapper(nn.Module):
    """What DDP does to names: the model under ``module.``."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.module = model


def _compiled_inside(model: nn.Module) -> nn.Module:
    """What torch.compile of a layer (torchtitan compiles each block) does to names: ``0._orig_mod.weight``."""
    model[0] = torch.compile(model[0], backend="eager")
    return model


def _saved_through_a_wrapper(directory: str) -> dict[str, str]:
    out = {}
    for fmt in SAVE:
        SAVE[fmt](f"{directory}/{fmt}-wrapped", _Wrapper(_model(1.0)))
        out[f"bare {fmt}"] = _error_of(lambda fmt=fmt: LOAD[fmt](f"{directory}/{fmt}-wrapped", _model(0.0)))
        SAVE[fmt](f"{directory}/{fmt}-bare", _model(1.0))
        out[f"wrapped {fmt}"] = _error_of(lambda fmt=fmt: LOAD[fmt](f"{directory}/{fmt}-bare", _Wrapper(_model(0.0))))
        out[f"compiled {fmt}"] = _error_of(
            lambda fmt=fmt: LOAD[fmt](f"{directory}/{fmt}-bare", _compiled_inside(_model(0.0)))
        )
    return out


def test_a_checkpoint_saved_through_a_wrapper_names_what_it_holds(tmp_path: Path) -> None:
    """Saved through a wrapper (DDP's ``module.``) and loaded into the bare model, or into a model whose layer is
    compiled (``0._orig_mod.weight``): the load said the checkpoint lacks ``'0.bias', '0.weight'`` (or
    ``'0._orig_mod.bias', ...``), naming none of the keys it holds."""
    for rank, out in enumerate(run_world(2, _saved_through_a_wrapper, str(tmp_path), timeout=60.0)):
        for fmt in SAVE:
            for load, held in (("bare", "module.0.weight"), ("wrapped", "0.weight"), ("compiled", "0.weight")):
                assert out[f"{load} {fmt}"].startswith("ValueError: the checkpoint lacks 2 of this rank's"), out
                assert out[f"{load} {fmt}"].endswith(
                    f" (it holds {held!r}: saved through a wrapper (DDP's module., torch.compile's _orig_mod., "
                    "activation checkpointing's _checkpoint_wrapped_module.) and loaded without it, or the other way "
                    "round? Save and load the model wrapped alike)"
                ), (rank, fmt, load, out)


def _fully_sharded_models(directory: str) -> dict[str, Any]:
    from torch.distributed.fsdp import fully_shard

    from pgregistry.mesh import to_device_mesh

    collection = build(ParallelLayout(num_ranks=2))
    mesh = to_device_mesh(collection, ("dp_cp",), "cpu")

    def model(value: float, *, sharded: bool) -> nn.Module:
        built = nn.Sequential(nn.Linear(4, 4))
        with torch.no_grad():
            for param in built.parameters():
                param.copy_(torch.arange(float(param.numel())).reshape(param.shape) + value)
        if sharded:
            fully_shard(built, mesh=mesh)  # each rank's parameters: DTensors holding 2 of the 4 rows
        attach(built, collection)
        return built

    out: dict[str, Any] = {}
    for fmt in SAVE:
        out[f"save {fmt}"] = _error_of(lambda fmt=fmt: SAVE[fmt](f"{directory}/{fmt}", model(1.0, sharded=True)))
        out[f"nothing written {fmt}"] = not Path(f"{directory}/{fmt}").exists() or not any(
            Path(f"{directory}/{fmt}").iterdir()
        )
        SAVE[fmt](f"{directory}/{fmt}-plain", model(1.0, sharded=False))  # saved before fully_shard
        out[f"load {fmt}"] = _error_of(lambda fmt=fmt: LOAD[fmt](f"{directory}/{fmt}-plain", model(0.0, sharded=True)))
        loaded = model(0.0, sharded=False)
        LOAD[fmt](f"{directory}/{fmt}-plain", loaded)
        fully_shard(loaded, mesh=mesh)
        out[f"loaded {fmt}"] = {name: param.full_tensor() for name, param in loaded.named_parameters()}
    out["state_by_name"] = _error_of(lambda: state_by_name(model(1.0, sharded=True)))
    return out


def test_dtensor_parameters_of_fully_shard_are_refused_not_stored_as_one_ranks_shard(tmp_path: Path) -> None:
    """``fully_shard``'s parameters are DTensors holding each rank's shard: ``save_rank_files`` stored data-parallel
    rank 0's DTensor as the parameter, and a load into the same sharded model left it other than saved (its whole
    weight and bias, gathered, differed), without a word; a load into a plain model failed in torch's words
    (``aten.copy_.default got mixed torch.Tensor and DTensor``), ``save_distributed`` in DCP's planner."""
    oracle = {"0.weight": torch.arange(16.0).reshape(4, 4) + 1.0, "0.bias": torch.arange(4.0) + 1.0}  # as filled
    for rank, out in enumerate(run_world(2, _fully_sharded_models, str(tmp_path), timeout=60.0)):
        for fmt in SAVE:
            for call, verb in (("save", "save"), ("load", "load")):
                function = f"{verb}_{'rank_files' if fmt == 'files' else 'distributed'}"
                assert out[f"{call} {fmt}"].startswith(
                    f"ValueError: {function}: 2 parameter(s) are DTensors, e.g. '0.weight' (sharded by fully_shard "
                    "or distribute_tensor): each rank holds its own shard of them"
                ), (rank, out)
                assert "torch.distributed.checkpoint.state_dict.get_model_state_dict" in out[f"{call} {fmt}"]
            assert out[f"nothing written {fmt}"], (rank, fmt)
            assert all(torch.equal(out[f"loaded {fmt}"][name], oracle[name]) for name in oracle), (rank, out)
        assert out["state_by_name"].startswith("ValueError: state_by_name: 2 parameter(s) are DTensors"), out

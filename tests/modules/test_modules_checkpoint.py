"""A job's checkpoint in 8-rank worlds: each module saved and loaded over its own span, round trips exact, the
language model resharded from TP 2 to TP 1, and another module's checkpoint refused on every rank of the module.

One world trains a step of the disjoint job (encoder on ranks 0-3, language model on ranks 4-7 at TP 2 x PP 2,
Adam) and saves it; later worlds load it into fresh models. The whole tensors the saving world holds (each
module's TP shards gathered by ``state_by_name``) are the oracle for the resharded load: every rank's parameters
and Adam moments must be its shard of them on the new layout.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from modules_support import JOBS, module_grads

from pgregistry import modules as mm
from pgregistry.checkpoint import load_rank_files, state_by_name
from pgregistry.layout import ParallelLayout
from pgregistry.testing import run_world
from pgregistry.testing._toy_models import EXPERTS, local_model, set_main_grads, shards_of

NAMING: dict[str, Any] = {
    "encoder": {"num_experts": EXPERTS}, "language": {"num_experts": EXPERTS, "layer_offsets": [0]}
}
RESHARDED = {**JOBS["disjoint"], "language": ParallelLayout(num_ranks=4, pp=2, rank_offset=4)}  # TP 1, DP 2


def _job(layouts: dict[str, ParallelLayout], fill: float | None) -> tuple[Any, dict[str, Any], Any, Any]:
    """The modules, this rank's models (from each module's weights, or all ``fill``), shards and optimizer."""
    rank = dist.get_rank()
    modules = mm.build_modules(layouts)
    models, shards = {}, {}
    for name in modules.here():
        weights = module_grads(f"{name}/weights")
        models[name], shards[name] = local_model(layouts[name], rank, weights)
        params = dict(models[name].named_parameters())
        with torch.no_grad():
            for shard in shards[name]:
                params[shard.local_name].copy_(shard.take(weights[shard.full_name]) if fill is None else fill)
                params[shard.local_name].grad = None
    optimizer = mm.build_optimizer(models, modules, optimizer="adam", lr=0.05, mixed_precision=False)
    return modules, models, shards, optimizer


def _local(models: dict[str, Any], optimizer: Any) -> dict[str, Any]:
    """Each module's parameters and Adam state on this rank, by local name."""
    out = {}
    for name, model in models.items():
        state = optimizer.optimizers[name].param_state()
        out[name] = {
            key: (param.detach().clone(), {k: v.clone() for k, v in state[param].items()})
            for key, param in model.named_parameters()
        }
    return out


def _whole(models: dict[str, Any], optimizer: Any, modules: Any) -> dict[str, Any]:
    """Each module's whole tensors by global name (gathered over TP), as the checkpoint stores them."""
    return {
        name: state_by_name(model, optimizer.optimizers[name], pg_collection=modules[name], **NAMING[name])
        for name, model in models.items()
    }


def _save(directory: Path) -> dict[str, Any]:
    modules, models, shards, optimizer = _job(JOBS["disjoint"], None)
    for name, model in models.items():
        set_main_grads(model, shards[name], module_grads(f"{name}/step0"), JOBS["disjoint"][name])
    optimizer.sync_grads()
    assert optimizer.step(1.0)[0]
    mm.save_checkpoint(directory, models, modules, optimizer, naming=NAMING)
    return {"local": _local(models, optimizer), "whole": _whole(models, optimizer, modules)}


def _load(directory: Path, layouts: dict[str, ParallelLayout]) -> dict[str, Any]:
    modules, models, _, optimizer = _job(layouts, 0.0)
    mm.load_checkpoint(directory, models, modules, optimizer, naming=NAMING)
    out = {"local": _local(models, optimizer), "whole": _whole(models, optimizer, modules)}
    # A module loading another module's checkpoint is refused on each of its ranks (the other module's ranks make
    # no call and wait for nothing).
    other = {"encoder": "language", "language": "encoder"}
    out["refused"] = {}
    for name, model in models.items():
        try:
            load_rank_files(directory / other[name], model, pg_collection=modules[name], **NAMING[name])
            out["refused"][name] = "no error"
        except ValueError as exc:
            out["refused"][name] = str(exc)
    return out


def _load_swapped(directory: Path) -> str:
    modules, models, _, optimizer = _job(JOBS["disjoint"], 0.0)
    try:
        mm.load_checkpoint(directory, models, modules, optimizer, naming=NAMING)
    except ValueError as exc:
        return str(exc)
    return "no error"


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    directory = tmp_path_factory.mktemp("job")
    return directory, run_world(8, _save, directory, timeout=60)


def test_each_module_is_saved_into_its_own_directory_by_its_own_ranks(saved: tuple[Path, list[Any]]) -> None:
    directory, _ = saved
    assert sorted(p.name for p in directory.iterdir()) == ["encoder", "language"]
    for name in ("encoder", "language"):
        files = sorted(p.name for p in (directory / name).iterdir())
        assert files == [f"rank-{r:05d}.pt" for r in range(4)], files  # numbered over the module's span
        payload = torch.load(directory / name / "rank-00000.pt", weights_only=True, mmap=True)
        assert payload["module"] == name and payload["world_size"] == 4
        assert payload["span"] == ([0, 4] if name == "encoder" else [4, 4])


def test_a_job_checkpoint_round_trips_exactly_and_refuses_another_modules(saved: tuple[Path, list[Any]]) -> None:
    directory, before = saved
    after = run_world(8, _load, directory, JOBS["disjoint"], timeout=60)
    for rank, (old, new) in enumerate(zip(before, after, strict=True)):
        assert old["local"].keys() == new["local"].keys(), rank
        for name, params in old["local"].items():
            for key, (value, state) in params.items():
                got_value, got_state = new["local"][name][key]
                assert torch.equal(value, got_value), (rank, name, key)
                assert state.keys() == got_state.keys(), (rank, name, key)
                for k in state:
                    assert torch.equal(state[k], got_state[k]), (rank, name, key, k)
        for name, message in new["refused"].items():
            other = "language' (ranks 4-7)" if name == "encoder" else "encoder' (ranks 0-3)"
            span = "0-3" if name == "encoder" else "4-7"
            assert f"holds a checkpoint of module '{other}, and this load is of module '{name}' (ranks {span})" in (
                message
            ), (rank, message)


def test_the_language_model_reloads_at_another_tp_size_on_its_span(saved: tuple[Path, list[Any]]) -> None:
    directory, before = saved
    whole: dict[str, dict[str, Any]] = {}
    for rank_result in before:
        for name, state in rank_result["whole"].items():
            part = whole.setdefault(name, {"model": {}, "optimizer": {}})
            part["model"].update(state["model"])
            part["optimizer"].update(state["optimizer"])
    after = run_world(8, _load, directory, RESHARDED, timeout=60)
    for rank, got in enumerate(after):
        for name, state in got["whole"].items():
            for key, value in state["model"].items():
                assert torch.equal(value, whole[name]["model"][key]), (rank, name, key)
            for key, entries in state["optimizer"].items():
                for k, v in entries.items():
                    assert torch.equal(v, whole[name]["optimizer"][key][k]), (rank, name, key, k)
        # And each rank's own parameters are its TP 1 shards of the whole ones.
        if "language" in got["local"]:
            for shard in shards_of(RESHARDED["language"], rank):
                value, _ = got["local"]["language"][shard.local_name]
                assert torch.equal(value, shard.take(whole["language"]["model"][shard.full_name])), (rank, shard)
    assert any(getattr(shard.spec, "tp_dim", None) is not None for shard in shards_of(JOBS["disjoint"]["language"], 4))


def test_swapped_module_directories_are_refused_on_every_rank(
    saved: tuple[Path, list[Any]], tmp_path: Path
) -> None:
    directory, _ = saved
    swapped = tmp_path / "swapped"
    shutil.copytree(directory / "encoder", swapped / "language")
    shutil.copytree(directory / "language", swapped / "encoder")
    for rank, message in enumerate(run_world(8, _load_swapped, swapped, timeout=60)):
        every = "pgregistry.modules.load_checkpoint: ranks [0, 1, 2, 3, 4, 5, 6, 7] failed to load"
        assert message.startswith(every), (rank, message)
        assert "module 'encoder': ValueError: " in message and "holds a checkpoint of module 'language'" in message


def _distributed_and_world(directory: Path) -> dict[str, Any]:
    """Each module saved with DCP over its span and loaded back; a checkpoint of a whole-world layout and a
    module's refused in each other's place."""
    from pgregistry import build
    from pgregistry.checkpoint import load_distributed, save_distributed, save_rank_files

    rank = dist.get_rank()
    modules, models, _, _ = _job(JOBS["disjoint"], None)
    out: dict[str, Any] = {}
    for name in modules:  # every rank walks every module; only its ranks save it
        if name in models:
            save_distributed(directory / f"dcp-{name}", models[name], pg_collection=modules[name], **NAMING[name])
    _, fresh, _, _ = _job(JOBS["disjoint"], 0.0)
    for name, model in fresh.items():
        load_distributed(directory / f"dcp-{name}", model, pg_collection=modules[name], **NAMING[name])
        out[f"dcp_{name}"] = all(
            torch.equal(a, b) for a, b in zip(model.parameters(), models[name].parameters(), strict=True)
        )
        other = "language" if name == "encoder" else "encoder"
        try:
            load_distributed(directory / f"dcp-{other}", model, pg_collection=modules[name], **NAMING[name])
            out["dcp_refused"] = "no error"
        except ValueError as exc:
            out["dcp_refused"] = str(exc)
    # A layout over the whole world, checkpointed over the world, next to the modules' checkpoints.
    whole = build(ParallelLayout(num_ranks=8), name="whole")
    world_model = local_model(ParallelLayout(num_ranks=8), rank, module_grads("whole"))[0]
    save_rank_files(directory / "world", world_model, pg_collection=whole, num_experts=EXPERTS)
    if rank < 4:
        save_rank_files(directory / "encoder-only", models["encoder"], pg_collection=modules["encoder"],
                        **NAMING["encoder"])
    for label, call in (
        ("world_into_module", lambda: load_rank_files(
            directory / "world", next(iter(fresh.values())), pg_collection=modules[next(iter(fresh))],
            **NAMING[next(iter(fresh))],
        )),
        ("module_into_world", lambda: load_rank_files(
            directory / "encoder-only", world_model, pg_collection=whole, num_experts=EXPERTS
        )),
    ):
        try:
            call()
            out[label] = "no error"
        except ValueError as exc:
            out[label] = str(exc)
    return out


def test_dcp_runs_over_each_modules_span_and_world_and_module_checkpoints_do_not_mix(tmp_path: Path) -> None:
    for rank, got in enumerate(run_world(8, _distributed_and_world, tmp_path, timeout=60)):
        name = "encoder" if rank < 4 else "language"
        assert got[f"dcp_{name}"], rank
        other, span = ("language' (ranks 4-7)", "0-3") if name == "encoder" else ("encoder' (ranks 0-3)", "4-7")
        assert f"holds a checkpoint of module '{other}, and this load is of module '{name}' (ranks {span})" in (
            got["dcp_refused"]
        ), (rank, got["dcp_refused"])
        assert f"holds a checkpoint of the whole world (8 ranks), and this load is of module '{name}'" in (
            got["world_into_module"]
        ), (rank, got["world_into_module"])
        assert "holds a checkpoint of module 'encoder' (ranks 0-3), and this load is of the world" in (
            got["module_into_world"]
        ), (rank, got["module_into_world"])

"""Save a toy MoE model and its Adam state at one layout, load it at others, in real gloo worlds.

The chain EP 4 -> EP 2 -> EP 1 -> EP 4 with PP 2 -> EP 4 with PP 1 runs through per-rank files and through
``torch.distributed.checkpoint``. Oracle: the whole model (EP 1, PP 1, one process) initialised from the same
coordinate-derived values and gradients and stepped once by Adam. Every rank's every tensor must equal the
oracle's bit for bit, every expert must arrive exactly once per replica, and the storage must hold every tensor
exactly once.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from toy_moe import Key, adam, build_stage, initialise, names_by_key

from pgregistry import ProcessGroupFallbackWarning, attach
from pgregistry.checkpoint import (
    load_distributed,
    load_rank_files,
    save_distributed,
    save_rank_files,
)
from pgregistry.layout import ParallelLayout
from pgregistry.registry import build
from pgregistry.testing import run_world

SAVE = {"files": save_rank_files, "dcp": save_distributed}
LOAD = {"files": load_rank_files, "dcp": load_distributed}
ADAM_STATE = ("step", "exp_avg", "exp_avg_sq")

CHAIN = [
    ParallelLayout(num_ranks=8, ep=4),  # dp 8, expert dp 2
    ParallelLayout(num_ranks=4, ep=2),
    ParallelLayout(num_ranks=2, ep=1),
    ParallelLayout(num_ranks=8, pp=2, ep=4),  # expert dp 1
    ParallelLayout(num_ranks=4, pp=1, ep=4),
]


def _snapshot(model: Any, optimizer: torch.optim.Optimizer) -> dict[Key, dict[str, torch.Tensor]]:
    return {
        key: {"param": param.detach().clone(), **{k: v.clone() for k, v in optimizer.state[param].items()}}
        for param, key in model.catalog
    }


@pytest.fixture(scope="module")
def reference() -> tuple[dict[Key, dict[str, torch.Tensor]], dict[Key, str]]:
    whole = build_stage(0, 1, 0, 1)
    initialise(whole)
    optimizer = adam(list(whole.parameters()))
    optimizer.step()
    return _snapshot(whole, optimizer), names_by_key(whole)


def _rank(layout: ParallelLayout, fmt: str, load_from: Path | None, save_to: Path) -> dict[str, Any]:
    warnings.simplefilter("error", ProcessGroupFallbackWarning)  # the model's collection is complete
    pgc = build(layout)
    coords = layout.coords(dist.get_rank())
    model = build_stage(coords["ep"], layout.ep, coords["pp"], layout.pp)
    attach(model, pgc)
    optimizer = adam(list(model.parameters()))
    if load_from is None:
        initialise(model)
        optimizer.step()
    else:
        LOAD[fmt](load_from, model, optimizer)
    snapshot = _snapshot(model, optimizer)
    SAVE[fmt](save_to, model, optimizer)
    return {"coords": coords, "snapshot": snapshot}


def _check_ranks(layout: ParallelLayout, results: list[dict[str, Any]], oracle: dict[Key, Any]) -> None:
    for rank, result in enumerate(results):
        for key, states in result["snapshot"].items():
            assert set(states) == {"param", *ADAM_STATE}, (rank, key)
            for what, tensor in states.items():
                expected = oracle[key][what]
                assert tensor.dtype == expected.dtype and torch.equal(tensor, expected), (layout, rank, key, what)
    experts = sorted(k for k in oracle if k[1] >= 0)
    dense = sorted(k for k in oracle if k[1] < 0)
    for replica in range(layout.expt_dp):
        held = [k for r in results if r["coords"]["expt_dp"] == replica for k in r["snapshot"] if k[1] >= 0]
        assert sorted(held) == experts  # each expert exactly once in each expert-data-parallel replica
    for replica in range(layout.dp):
        held = [k for r in results if r["coords"]["dp"] == replica for k in r["snapshot"] if k[1] < 0]
        assert sorted(held) == dense


def _stored(fmt: str, directory: Path) -> dict[str, Any]:
    """Every stored entry, counted: a key stored twice fails here."""
    if fmt == "files":
        merged: dict[str, torch.Tensor] = {}
        for path in sorted(directory.glob("rank-*.pt")):
            for key, value in torch.load(path, weights_only=True)["state"].items():
                assert key not in merged, f"{key} stored twice"
                merged[key] = value
        return merged
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = dcp.FileSystemReader(str(directory)).read_metadata().state_dict_metadata
    loaded: dict[str, Any] = {}
    for key, entry in metadata.items():
        if key.startswith("optimized/"):  # a marker (True): the parameter's optimizer state was saved
            loaded[key] = None
            continue
        assert isinstance(entry, TensorStorageMetadata) and len(entry.chunks) == 1, key
        loaded[key] = torch.empty(entry.size, dtype=entry.properties.dtype)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(loaded, checkpoint_id=str(directory), no_dist=True)
    return loaded


def _check_storage(fmt: str, directory: Path, oracle: dict[Key, Any], names: dict[Key, str]) -> None:
    stored = _stored(fmt, directory)
    expected: dict[str, torch.Tensor] = {}
    for key, name in names.items():
        expected[f"model/{name}"] = oracle[key]["param"]
        expected[f"optimized/{name}"] = True
        for what in ADAM_STATE:
            expected[f"optimizer/{name}/{what}"] = oracle[key][what]
    assert sorted(stored) == sorted(expected)  # nothing lost, nothing extra
    for key, value in expected.items():
        assert stored[key] is True if value is True else torch.equal(stored[key], value), key


@pytest.mark.parametrize("fmt", ["files", "dcp"])
def test_expert_and_optimizer_state_reshard_across_ep_and_pp(
    fmt: str, tmp_path: Path, reference: tuple[dict[Key, Any], dict[Key, str]]
) -> None:
    oracle, names = reference
    previous: Path | None = None
    for step, layout in enumerate(CHAIN):
        directory = tmp_path / f"step{step}-ep{layout.ep}-pp{layout.pp}"
        results = run_world(layout.num_ranks, _rank, layout, fmt, previous, directory)
        _check_ranks(layout, results, oracle)
        _check_storage(fmt, directory, oracle, names)
        previous = directory

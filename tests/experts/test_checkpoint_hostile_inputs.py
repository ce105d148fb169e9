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
)
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

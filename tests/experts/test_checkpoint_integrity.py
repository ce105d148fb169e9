"""Rank-file checkpoints load nothing damaged or mixed.

Before: one flipped bit inside a stored tensor loaded silently; the rank files of two different saves (rank 1's
copied from a later one) loaded together. Multi-rank cases run in real gloo worlds, where each fault must raise on
every rank (none may hang).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from checkpoint_support import MoE, alone, filled, flip_a_byte_of, snapshot

from pgregistry import ParallelLayout
from pgregistry.checkpoint import load_rank_files, save_rank_files
from pgregistry.registry import attach, build
from pgregistry.testing import run_world


def _ep2_model(fill: float | None = None) -> MoE:
    """This rank's share of 8 experts over EP 2 (4 local experts), attached to the EP 2 collection."""
    model = MoE(8, ep_size=2)
    if fill is not None:
        filled(model, fill)
    attach(model, build(ParallelLayout(world_size=2, ep=2, etp=1)))
    return model


def _save(directory: str) -> None:
    save_rank_files(directory, _ep2_model())


def _load(directory: str, **naming: Any) -> str:
    model = _ep2_model(fill=-5.0)
    before = snapshot(model)
    try:
        load_rank_files(directory, model, **naming)
    except ValueError as exc:
        unchanged = all(torch.equal(before[n], p) for n, p in model.named_parameters())
        return f"{exc}{'' if unchanged else ' (and parameters were overwritten)'}"
    return "loaded"


# ------------------------------------------------------------------------------------------- damaged tensors


def test_a_flipped_bit_in_a_tensor_is_named_with_its_file_and_tensor(tmp_path: Path) -> None:
    saved = alone(filled(MoE(2), 1.0))
    save_rank_files(tmp_path, saved)
    path = tmp_path / "rank-00000.pt"
    flip_a_byte_of(path, saved.experts.local_experts[1].weight)
    model = alone(filled(MoE(2), -5.0))
    before = snapshot(model)
    with pytest.raises(ValueError, match=rf"^{path} is damaged: the bytes of tensor "
                       r"'model/experts\.local_experts\.1\.weight' do not match the checksum stored when it was "
                       r"saved; restore the file from a copy$"):
        load_rank_files(tmp_path, model)
    assert all(torch.equal(before[name], param) for name, param in model.named_parameters())  # nothing copied


def _save_filled(directory: str) -> None:
    save_rank_files(directory, _ep2_model(fill=1.0 + 10 * dist.get_rank()))


def test_a_damaged_tensor_one_rank_loads_fails_every_rank_before_any_copy(tmp_path: Path) -> None:
    run_world(2, _save_filled, str(tmp_path))
    # Rank 1 wrote its experts (global 4-7) and is the one rank that loads them: its local expert 1 (global 5)
    # is its model's parameter 4 (norm weight and bias, expert 0's weight and bias first), filled with 11 + 4.
    flip_a_byte_of(tmp_path / "rank-00001.pt", torch.full((2, 2), 15.0))
    assert run_world(2, _load, str(tmp_path), timeout=30.0) == [
        f"another rank found a damaged tensor in the checkpoint {tmp_path} (see its error)",
        f"{tmp_path / 'rank-00001.pt'} is damaged: the bytes of tensor 'model/experts.local_experts.5.weight' do "
        "not match the checksum stored when it was saved; restore the file from a copy",
    ]


# ------------------------------------------------------------------------------------------- files of two saves


def test_rank_files_of_two_saves_are_refused_on_every_rank(tmp_path: Path) -> None:
    first, later = tmp_path / "first", tmp_path / "later"
    run_world(2, _save, str(first))
    run_world(2, _save, str(later))
    shutil.copyfile(later / "rank-00001.pt", first / "rank-00001.pt")  # rank 1's file taken from a later save
    for message in run_world(2, _load, str(first), timeout=30.0):
        assert message.startswith(f"{first} mixes the files of 2 different saves (save 0x"), message
        assert message.endswith(": rank-00001.pt): a rank file copied from another checkpoint? Every rank file of "
                                "a checkpoint must come from one save"), message

"""Rank-file checkpoints load exactly what they should and are never destroyed or half-written.

Before: an 8-expert checkpoint loaded into a 4-expert model silently dropped experts 4-7 (and any unrelated extra
key); a save into a directory holding another checkpoint overwrote its rank files; a save that failed half-way
left a truncated rank file under the checkpoint's name; a truncated file gave a torch error naming no file.
Multi-rank cases run in real gloo worlds, where a check must raise on every rank alike (none may hang).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from checkpoint_support import MoE, alone, filled, snapshot
from torch import nn

from pgregistry import ParallelLayout, attach
from pgregistry.checkpoint import load_rank_files, save_rank_files
from pgregistry.registry import build
from pgregistry.testing import run_world

# ------------------------------------------------------------------------------------------------ one process


def test_more_experts_than_the_model_has_is_an_error_naming_them(tmp_path: Path) -> None:
    save_rank_files(tmp_path, alone(filled(MoE(8), 1.0)))
    four = alone(filled(MoE(4), -5.0))
    before = snapshot(four)
    with pytest.raises(ValueError, match=r"holds 8 keys no rank's model has, e\.g\. 'model/experts\.local_experts"
                       r"\.4\.bias', 'model/experts\.local_experts\.4\.weight'.*strict=False"):
        load_rank_files(tmp_path, four)
    after = snapshot(four)
    assert all(torch.equal(before[name], after[name]) for name in before)  # nothing copied before the refusal
    # The explicit opt-out loads the subset the model has.
    load_rank_files(tmp_path, four, strict=False)
    eight = filled(MoE(8), 1.0)
    whole = dict(eight.named_parameters())
    for name, param in four.named_parameters():
        assert torch.equal(param, whole[name]), name


def test_unrelated_extra_keys_are_an_error_naming_them(tmp_path: Path) -> None:
    save_rank_files(tmp_path / "extra-param", alone(MoE(2, extra=True)))
    with pytest.raises(ValueError, match=r"holds 2 keys no rank's model has, e\.g\. 'model/extra\.bias', "
                       r"'model/extra\.weight'"):
        load_rank_files(tmp_path / "extra-param", alone(MoE(2)))
    # A key that is no parameter at all, stored beside the model's.
    save_rank_files(tmp_path / "extra-key", alone(MoE(2)))
    path = tmp_path / "extra-key" / "rank-00000.pt"
    payload = torch.load(path, weights_only=True)
    payload["state"]["notes/step"] = torch.tensor(3)
    torch.save(payload, path)
    with pytest.raises(ValueError, match=r"holds 1 keys no rank's model has, e\.g\. 'notes/step'"):
        load_rank_files(tmp_path / "extra-key", alone(MoE(2)))
    load_rank_files(tmp_path / "extra-key", alone(MoE(2)), strict=False)


def test_a_missing_parameter_is_still_an_error_with_strict_off(tmp_path: Path) -> None:
    save_rank_files(tmp_path, alone(MoE(2)))
    with pytest.raises(ValueError, match=r"lacks 2 of this rank's parameters, e\.g\. 'extra\.bias'"):
        load_rank_files(tmp_path, alone(MoE(2, extra=True)), strict=False)


def test_saving_over_another_checkpoint_is_refused_and_leaves_it_intact(tmp_path: Path) -> None:
    first = alone(filled(MoE(2), 1.0))
    save_rank_files(tmp_path, first)
    stored = (tmp_path / "rank-00000.pt").read_bytes()
    with pytest.raises(ValueError, match=rf"{tmp_path} already holds a checkpoint \(rank-<rank>\.pt files, e\.g\. "
                       r"rank-00000\.pt\); pgregistry does not overwrite one"):
        save_rank_files(tmp_path, alone(filled(MoE(2), 9.0)))
    assert (tmp_path / "rank-00000.pt").read_bytes() == stored
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank-00000.pt"]
    reloaded = alone(MoE(2))
    load_rank_files(tmp_path, reloaded)
    assert all(torch.equal(a, b) for a, b in zip(reloaded.parameters(), first.parameters(), strict=True))


class _Unpicklable:
    def __reduce__(self) -> Any:
        raise RuntimeError("cannot pickle this state")


def test_a_save_that_fails_half_way_leaves_no_file_under_the_checkpoints_name(tmp_path: Path) -> None:
    model = alone(MoE(2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    # Optimizer state after the tensors: torch.save has written part of the file when pickling fails.
    last = list(model.parameters())[-1]
    optimizer.state[last] = {"momentum_buffer": torch.zeros(2), "zz_bad": _Unpicklable()}
    with pytest.raises(RuntimeError, match="cannot pickle this state"):
        save_rank_files(tmp_path, model, optimizer)
    assert list(tmp_path.iterdir()) == []  # no rank file, no temporary file


@pytest.mark.parametrize("damage", ["truncated", "garbage", "not a rank file"])
def test_a_damaged_rank_file_is_named(tmp_path: Path, damage: str) -> None:
    save_rank_files(tmp_path, alone(MoE(2)))
    path = tmp_path / "rank-00000.pt"
    if damage == "truncated":
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    elif damage == "garbage":
        path.write_bytes(b"\x00not a checkpoint" * 10)
    else:
        torch.save({"weights": torch.zeros(2)}, path)
    with pytest.raises(ValueError, match=rf"{path}"):
        load_rank_files(tmp_path, alone(MoE(2)))


# ------------------------------------------------------------------------------------------------ 2 ranks, EP 2


def _save_then_load(save_to: str, experts_on_load: int, extra_on_rank: int | None) -> str:
    warnings.simplefilter("error")
    pgc = build(ParallelLayout(num_ranks=2, ep=2, expt_tp=1))
    saved = filled(MoE(8, ep_size=2), 1.0 + dist.get_rank())
    attach(saved, pgc)
    save_rank_files(save_to, saved)
    loaded = MoE(experts_on_load, ep_size=2, extra=extra_on_rank == dist.get_rank())
    attach(loaded, pgc)
    try:
        load_rank_files(save_to, loaded)
    except ValueError as exc:
        return f"ValueError: {exc}"
    names = dict(loaded.named_parameters())
    first = dist.get_rank() * 4  # this rank's experts are global experts 4r .. 4r+3
    ok = all(torch.equal(names[f"experts.local_experts.{i}.weight"], saved.experts.local_experts[i].weight)
             for i in range(4))
    return f"loaded experts {first}-{first + 3}" if ok else "wrong values"


def test_ep_ranks_together_hold_the_whole_checkpoint(tmp_path: Path) -> None:
    assert run_world(2, _save_then_load, str(tmp_path), 8, None) == ["loaded experts 0-3", "loaded experts 4-7"]


def test_a_smaller_expert_model_is_refused_on_every_rank(tmp_path: Path) -> None:
    results = run_world(2, _save_then_load, str(tmp_path), 4, None)  # 2 local experts per rank: 4 in all
    for message in results:
        assert message.startswith("ValueError: the checkpoint ") and "holds 8 keys no rank's model has" in message
        assert "'model/experts.local_experts.4.bias'" in message


def test_a_parameter_missing_on_one_rank_raises_on_every_rank_without_a_hang(tmp_path: Path) -> None:
    results = run_world(2, _save_then_load, str(tmp_path), 8, 1, timeout=60.0)
    assert results[1].startswith("ValueError: the checkpoint lacks 2 of this rank's parameters, e.g. 'extra.bias'")
    assert results[0] == (
        f"ValueError: the checkpoint {tmp_path} lacks parameters of another rank's model (rank 1: see its error)"
    )


def _save_twice(directory: str) -> str:
    pgc = build(ParallelLayout(num_ranks=2, ep=2, expt_tp=1))
    model = MoE(8, ep_size=2)
    attach(model, pgc)
    save_rank_files(directory, model)
    try:
        save_rank_files(directory, model)
    except ValueError as exc:
        return f"ValueError: {exc}"
    return "saved twice"


def test_saving_over_another_checkpoint_is_refused_on_every_rank(tmp_path: Path) -> None:
    for message in run_world(2, _save_twice, str(tmp_path)):
        assert message.startswith(f"ValueError: {tmp_path} already holds a checkpoint (rank-<rank>.pt files, e.g. ")


def _save_failing_on_rank_one(directory: str) -> str:
    pgc = build(ParallelLayout(num_ranks=2, ep=2, expt_tp=1))
    model = MoE(8, ep_size=2)
    attach(model, pgc)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    if dist.get_rank() == 1:
        optimizer.state[model.experts.local_experts[3].bias] = {"zz_bad": _Unpicklable()}
    try:
        save_rank_files(directory, model, optimizer)
    except RuntimeError as exc:
        return str(exc)
    return "saved"


def test_a_save_failing_on_one_rank_fails_every_rank_and_leaves_no_file(tmp_path: Path) -> None:
    assert run_world(2, _save_failing_on_rank_one, str(tmp_path), timeout=60.0) == [
        f"another rank failed to write its file of the checkpoint in {tmp_path} (rank 1: see its error)",
        "cannot pickle this state",
    ]
    assert list(tmp_path.iterdir()) == []


def _load_from(directories: list[str]) -> str:
    pgc = build(ParallelLayout(num_ranks=2, ep=2, expt_tp=1))
    model = MoE(8, ep_size=2)
    attach(model, pgc)
    try:
        load_rank_files(directories[dist.get_rank()], model)
    except ValueError as exc:
        return str(exc)
    return "loaded"


def _save(directory: str) -> None:
    model = MoE(8, ep_size=2)
    attach(model, build(ParallelLayout(num_ranks=2, ep=2, expt_tp=1)))
    save_rank_files(directory, model)


def test_a_rank_that_cannot_read_the_checkpoint_fails_every_rank_without_a_hang(tmp_path: Path) -> None:
    run_world(2, _save, str(tmp_path / "saved"))
    (tmp_path / "empty").mkdir()
    assert run_world(2, _load_from, [str(tmp_path / "saved"), str(tmp_path / "empty")], timeout=60.0) == [
        f"another rank could not read the checkpoint {tmp_path / 'saved'} (rank 1: see its error)",
        f"no rank-<rank>.pt files in {tmp_path / 'empty'}",
    ]


def test_a_rank_whose_directory_is_missing_fails_every_rank_without_a_hang(tmp_path: Path) -> None:
    # A checkpoint on one node's local disk: the other node's rank finds no such directory. Its OSError used to
    # escape before the all-reduce that tells the peers, so rank 0 waited there for ever.
    run_world(2, _save, str(tmp_path / "saved"))
    assert run_world(2, _load_from, [str(tmp_path / "saved"), str(tmp_path / "absent")], timeout=30.0) == [
        f"another rank could not read the checkpoint {tmp_path / 'saved'} (rank 1: see its error)",
        f"no checkpoint directory {tmp_path / 'absent'}",
    ]


def _save_to(directories: list[str]) -> str:
    model = MoE(8, ep_size=2)
    attach(model, build(ParallelLayout(num_ranks=2, ep=2, expt_tp=1)))
    try:
        save_rank_files(directories[dist.get_rank()], model)
    except (OSError, RuntimeError) as exc:
        return type(exc).__name__
    return "saved"


def test_a_rank_that_cannot_create_the_directory_fails_every_rank_without_a_hang(tmp_path: Path) -> None:
    # Rank 1's path is a file on its node, so it cannot make the directory: its error used to escape before the
    # all-reduce that looks for an older checkpoint, where rank 0 then waited for ever.
    (tmp_path / "a-file").write_text("not a directory")
    assert run_world(2, _save_to, [str(tmp_path / "fresh"), str(tmp_path / "a-file")], timeout=30.0) == [
        "RuntimeError",
        "NotADirectoryError",  # naming what the path is (FileExistsError from mkdir before)
    ]
    assert not (tmp_path / "fresh").exists() or list((tmp_path / "fresh").iterdir()) == []


def _load_with_a_wrong_shape_on_rank_one(directory: str) -> str:
    model = filled(MoE(8, ep_size=2), -5.0)
    if dist.get_rank() == 1:  # this rank's last expert (global expert 7) is wider than the saved one
        model.experts.local_experts[3] = nn.Linear(2, 3)
    attach(model, build(ParallelLayout(num_ranks=2, ep=2, expt_tp=1)))
    before = snapshot(model)
    try:
        load_rank_files(directory, model)
    except ValueError as exc:
        message = f"ValueError: {exc}"
    else:
        message = "loaded"
    after = snapshot(model)
    changed = sorted(name for name in before if not torch.equal(before[name], after[name]))
    return f"{message}; changed {changed}"


def test_a_shape_mismatch_on_one_rank_fails_every_rank_before_anything_is_copied(tmp_path: Path) -> None:
    # The shape was checked while copying, on the rank holding the parameter only: that rank raised with the
    # parameters before it already overwritten, and the other rank loaded as if nothing were wrong.
    run_world(2, _save, str(tmp_path))
    results = run_world(2, _load_with_a_wrong_shape_on_rank_one, str(tmp_path), timeout=30.0)
    assert results[0] == (
        f"ValueError: the checkpoint {tmp_path} does not fit another rank's model (rank 1: see its error); changed []"
    )
    assert results[1] == (
        "ValueError: parameter 'experts.local_experts.7.weight' has shape (3, 2) but the checkpoint holds (2, 2) "
        "(and 1 more parameters of this rank do not fit, e.g. parameter 'experts.local_experts.7.bias' has shape "
        "(3,) but the checkpoint holds (2,)); changed []"
    )

"""A rank killed during a save or a load: every survivor fails in time with an error naming the call, the checkpoint,
the rank that did not answer and what to do, and the previous checkpoint stays intact and loads.

Before: the survivors failed in time, but with gloo's words only ("Connection closed by peer [127.0.0.1]:27528"),
naming neither the save nor the lost rank. The killed rank is SIGKILLed in the middle of writing its rank file
(pickling its optimizer state), so its partial file is on disk; the harness then reports it as failed, so each
survivor writes its error to a file for the test to read.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from checkpoint_support import MoE, filled

from pgregistry import ParallelLayout, attach, build
from pgregistry.checkpoint import (
    load_distributed,
    load_rank_files,
    save_distributed,
    save_rank_files,
)
from pgregistry.testing import RankFailure, run_world

_KILLED = 1
_EXPERTS = 6  # two per rank of EP 3, so every rank writes a file of its own


class _KillsWhilePickled:
    """Optimizer state whose pickling SIGKILLs the process: a rank lost in the middle of writing its file."""

    def __reduce__(self) -> Any:
        os.kill(os.getpid(), signal.SIGKILL)
        raise AssertionError("unreachable")


def _model(value: float) -> torch.nn.Module:
    model = filled(MoE(_EXPERTS, ep_size=3), value + dist.get_rank())
    attach(model, build(ParallelLayout(num_ranks=3, ep=3, expt_tp=1)))
    return model


def _report(out: str, call: Any) -> None:
    try:
        call()
        message = "no error"
    except (RuntimeError, ValueError) as exc:
        message = f"{type(exc).__name__}: {exc}"
    Path(out, f"rank-{dist.get_rank()}.txt").write_text(message)


def _save_then_lose_a_rank(directory: str, out: str, fmt: str) -> None:
    save = {"files": save_rank_files, "dcp": save_distributed}[fmt]
    model = _model(1.0)
    save(f"{directory}/old", model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    if dist.get_rank() == _KILLED:
        optimizer.state[model.experts.local_experts[1].bias] = {"killer": _KillsWhilePickled()}
    _report(out, lambda: save(f"{directory}/new", model, optimizer))


def _load(directory: str, fmt: str) -> list[torch.Tensor]:
    model = _model(-5.0)
    {"files": load_rank_files, "dcp": load_distributed}[fmt](directory, model)
    return [param.detach().clone() for param in model.parameters()]


def _survivors(out: Path) -> dict[int, str]:
    return {int(path.stem.split("-")[1]): path.read_text() for path in sorted(out.iterdir())}


@pytest.mark.parametrize("fmt", ["files", "dcp"])
def test_a_rank_killed_mid_save_is_named_on_every_survivor_and_the_old_checkpoint_loads(
    tmp_path: Path, fmt: str
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(RankFailure, match=rf"rank {_KILLED} failed: process exited without a result \(.*SIGKILL"):
        run_world(3, _save_then_lose_a_rank, str(tmp_path), str(out), fmt, timeout=30.0)
    survivors = _survivors(out)
    assert sorted(survivors) == [0, 2]
    operation = {"files": "save_rank_files", "dcp": "save_distributed"}[fmt]
    for rank, message in survivors.items():
        assert message.startswith(
            f"RuntimeError: {operation} of the checkpoint {tmp_path}/new over the world failed: rank(s) [{_KILLED}] "
            "did not answer within 1 s (killed, lost or stuck: see their logs); no file of this save is under a "
            "checkpoint's name and earlier checkpoints are untouched: restart from the last complete one once "
            "every rank is up (this rank's collective failed with: "
        ), (rank, message)
    if fmt == "files":
        assert not list((tmp_path / "new").glob("rank-*.pt"))  # the partial file of the killed rank only
    # The previous checkpoint is intact: every rank loads the values saved (parameter i of rank r held 1 + r + i;
    # the dense norm, parameters 0 and 1, was written by rank 0 alone, so every rank gets rank 0's).
    for rank, params in enumerate(run_world(3, _load, str(tmp_path / "old"), fmt, timeout=30.0)):
        for i, param in enumerate(params):
            assert torch.equal(param, torch.full_like(param, 1.0 + (rank if i >= 2 else 0) + i)), (rank, i)


def _lose_a_rank_during_load(directory: str, out: str) -> None:
    save_rank_files(directory, _model(1.0))
    fresh = _model(-5.0)
    if dist.get_rank() == _KILLED:
        os.kill(os.getpid(), signal.SIGKILL)
    _report(out, lambda: load_rank_files(directory, fresh))


def test_a_rank_killed_during_a_load_is_named_on_every_survivor(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(RankFailure, match=rf"rank {_KILLED} failed"):
        run_world(3, _lose_a_rank_during_load, str(tmp_path / "ckpt"), str(out), timeout=30.0)
    survivors = _survivors(out)
    assert sorted(survivors) == [0, 2]
    for rank, message in survivors.items():
        assert message.startswith(
            f"RuntimeError: load_rank_files of the checkpoint {tmp_path}/ckpt over the world failed: rank(s) "
            f"[{_KILLED}] did not answer within 1 s (killed, lost or stuck: see their logs); the checkpoint on "
            "disk is unchanged: load it again once every rank is up (this rank's collective failed with: "
        ), (rank, message)


def _job_saved_twice_rank_one_lost(directory: str, out: str) -> None:
    from torch import nn

    from pgregistry import modules as mm

    # Module b runs on rank 2 only, inside module a's span: rank 2 makes checkpoint calls the others do not.
    modules = mm.build_modules({"a": ParallelLayout(num_ranks=3), "b": ParallelLayout(num_ranks=1, rank_offset=2)})
    models = {name: filled(nn.Linear(2, 2), 1.0) for name in modules.here()}
    mm.save_checkpoint(f"{directory}/first", models, modules)
    if dist.get_rank() == _KILLED:
        os.kill(os.getpid(), signal.SIGKILL)
    _report(out, lambda: mm.save_checkpoint(f"{directory}/second", models, modules))


def test_a_rank_lost_in_a_jobs_save_is_named_though_ranks_made_different_calls_before(tmp_path: Path) -> None:
    # The records of a failure were keyed by one count of checkpoint calls per process: rank 2, which had saved
    # module b too, looked for other keys than rank 0, and each survivor named the other as lost.
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(RankFailure, match=rf"rank {_KILLED} failed"):
        run_world(3, _job_saved_twice_rank_one_lost, str(tmp_path), str(out), timeout=30.0)
    survivors = _survivors(out)
    assert sorted(survivors) == [0, 2]
    for rank, message in survivors.items():
        assert message.startswith(
            f"RuntimeError: pgregistry.modules.save_checkpoint of the checkpoint {tmp_path}/second over the world "
            f"failed: rank(s) [{_KILLED}] did not answer within 1 s"
        ), (rank, message)

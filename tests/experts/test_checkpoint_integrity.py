"""Rank-file checkpoints load nothing damaged or mixed, store no gaps in the expert numbering, and a save that the
disk fails or a ``kill -9`` stops leaves nothing behind.

Before: one flipped bit inside a stored tensor loaded silently; the rank files of two different saves (rank 1's
copied from a later one) loaded together; ``num_experts`` larger than the local experts times EP stored experts
0-3 and 8-11 of "16" without a word; a full disk surfaced as torch's ``enforce fail at inline_container.cc``
naming neither the file nor the disk; a save killed after one rank had renamed its file left that file under the
checkpoint's name, so the next save into the directory was refused as if a checkpoint were there. Multi-rank
cases run in real gloo worlds, where each fault must raise on every rank (none may hang).
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from checkpoint_support import MoE, alone, filled, flip_a_byte_of, snapshot

from pgregistry import ParallelLayout, attach
from pgregistry.checkpoint import load_rank_files, save_distributed, save_rank_files
from pgregistry.registry import build
from pgregistry.testing import run_world

REPO = Path(__file__).resolve().parents[2]


def _ep2_model(fill: float | None = None) -> MoE:
    """This rank's share of 8 experts over EP 2 (4 local experts), attached to the EP 2 collection."""
    model = MoE(8, ep_size=2)
    if fill is not None:
        filled(model, fill)
    attach(model, build(ParallelLayout(num_ranks=2, ep=2, expt_tp=1)))
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
        f"another rank found a damaged tensor in the checkpoint {tmp_path} (rank 1: see its error)",
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


# ------------------------------------------------------------------------------------------- expert numbering


def _save_with_num_experts(save: Callable[..., Any], directory: str, num_experts_by_rank: list[int]) -> str:
    """``save`` (save_rank_files, save_distributed) of this rank's experts, named as ``num_experts`` of them."""
    try:
        save(directory, _ep2_model(), num_experts=num_experts_by_rank[dist.get_rank()])
    except ValueError as exc:
        return str(exc)
    return "saved"


_GAPS = (
    "num_experts is 16, but model chunk 0 holds 4 local experts ('experts.local_experts.<i>.weight') with EP size 2, "
    "8 experts in all: the global expert indices would leave gaps; pass num_experts=8, or build 8 local experts "
    "per rank"
)


def test_num_experts_beyond_the_local_experts_times_ep_is_refused_at_save(tmp_path: Path) -> None:
    # 4 local experts on each of 2 EP ranks, saved as 16 experts: global experts 0-3 and 8-11, with 4-7 and 12-15
    # nowhere, used to be stored without a word.
    every = run_world(2, _save_with_num_experts, save_rank_files, str(tmp_path / "all"), [16, 16], timeout=30.0)
    assert every == [_GAPS, _GAPS]
    assert run_world(2, _save_with_num_experts, save_rank_files, str(tmp_path / "one"), [8, 16], timeout=30.0) == [
        "save_rank_files: another rank's model cannot be checkpointed (rank 1: see its error)",
        _GAPS,
    ]
    assert not any(path.is_file() for path in tmp_path.rglob("*"))  # nothing written


def test_num_experts_wrong_on_one_rank_fails_every_rank_of_a_dcp_save_without_a_hang(tmp_path: Path) -> None:
    assert run_world(2, _save_with_num_experts, save_distributed, str(tmp_path), [8, 16], timeout=30.0) == [
        "save_distributed: another rank's model cannot be checkpointed (rank 1: see its error)",
        _GAPS,
    ]


def test_num_experts_that_does_not_fit_the_model_is_named_at_load(tmp_path: Path) -> None:
    run_world(2, _save, str(tmp_path))
    assert run_world(2, _load, str(tmp_path), num_experts=16, timeout=30.0) == [_GAPS, _GAPS]


# ------------------------------------------------------------------------------------------- a full disk


def _save_with_a_full_disk_on(directory: str, full_rank: int) -> str:
    """Fault injection: on ``full_rank`` the disk takes 512 bytes of the file, then every write fails with ENOSPC, as
    a disk that fills up during the save does."""
    real_write, room = os.write, [512]

    def filling_disk(fd: int, data: Any) -> int:
        if room[0] <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        written = real_write(fd, memoryview(data)[: room[0]])
        room[0] -= written
        return written

    model = _ep2_model()
    if dist.get_rank() == full_rank:
        os.write = filling_disk
    try:
        save_rank_files(directory, model)
    except (OSError, RuntimeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        os.write = real_write
    return "saved"


def test_a_full_disk_names_the_file_and_the_disk_on_every_rank_and_leaves_nothing(tmp_path: Path) -> None:
    zero, one = run_world(2, _save_with_a_full_disk_on, str(tmp_path), 1, timeout=30.0)
    assert zero == (
        f"RuntimeError: another rank failed to write its file of the checkpoint in {tmp_path} (rank 1: see its error)"
    )
    # The file, then the disk: its device, where it is mounted, and its free space.
    assert one.startswith(f"OSError: [Errno 28] No space left on device: writing {tmp_path / 'rank-00001.pt'} on "), one
    assert " mounted at /" in one and one.endswith(" bytes free)"), one
    assert list(tmp_path.iterdir()) == []  # no rank file, no partial file, on either rank


_SAVE_ON_A_TINY_DISK = """
    import json, os, sys
    from torch import nn
    from checkpoint_support import MoE
    from pgregistry import ParallelLayout
    from pgregistry.checkpoint import save_rank_files
    from pgregistry import attach
    from pgregistry.registry import build
    from pgregistry.testing import run_world

    def save(directory):
        model = MoE(8, ep_size=2)
        model.dense = nn.Linear(512, 256)  # 512 KiB, written by rank 0: more than the disk holds
        attach(model, build(ParallelLayout(num_ranks=2, ep=2, expt_tp=1)))
        try:
            save_rank_files(directory, model)
        except (OSError, RuntimeError) as exc:
            return f"{type(exc).__name__}: {exc}"
        return "saved"

    results = run_world(2, save, sys.argv[1], timeout=30.0)
    print(json.dumps({"results": results, "left": os.listdir(sys.argv[1])}))
"""


def _tiny_disk_available() -> bool:
    """Whether this machine lets an unprivileged process mount a tmpfs in its own user and mount namespace."""
    if shutil.which("unshare") is None:
        return False
    done = subprocess.run(["unshare", "-rm", "true"], capture_output=True, timeout=30)
    return done.returncode == 0


@pytest.mark.skipif(not _tiny_disk_available(), reason="needs `unshare -rm` (user namespaces) to mount a tmpfs")
def test_a_really_full_disk_names_the_file_and_the_disk(tmp_path: Path) -> None:
    # A real ENOSPC from the kernel: a 256 KiB tmpfs, mounted in a private mount namespace, fills up mid-save.
    disk = tmp_path / "disk"
    disk.mkdir()
    script = tmp_path / "save.py"
    script.write_text(textwrap.dedent(_SAVE_ON_A_TINY_DISK))
    mount_and_save = f"mount -t tmpfs -o size=256k tiny {disk} && exec {sys.executable} {script} {disk}/ckpt"
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(Path(__file__).parent)])}
    done = subprocess.run(["unshare", "-rm", "sh", "-c", mount_and_save], capture_output=True, text=True,
                          timeout=90, env=environment)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    results, ckpt = report["results"], disk / "ckpt"

    def no_space(rank: int) -> str:  # the free space is what the disk had when that rank failed: racy
        file, mount = re.escape(str(ckpt / f"rank-0000{rank}.pt")), re.escape(str(disk))
        return rf"OSError: \[Errno 28\] No space left on device: writing {file} on tiny mounted at {mount} " \
            r"\(\d+ bytes free\)"

    assert re.fullmatch(no_space(0), results[0]), results  # rank 0 writes the large dense layer
    # Rank 1's small file may or may not have fitted beside rank 0's partial one.
    another = f"RuntimeError: another rank failed to write its file of the checkpoint in {ckpt} (rank 0: see its error)"
    assert results[1] == another or re.fullmatch(no_space(1), results[1]), results
    assert report["left"] == []  # no rank file, no partial file


# ------------------------------------------------------------------------------------------- kill -9


class _KillsItsRank:
    """Optimizer state whose pickling kills the rank outright, in the middle of its save."""

    def __reduce__(self) -> Any:
        os.kill(os.getpid(), signal.SIGKILL)


def _save_killed_on_rank_one(directory: str) -> None:
    model = _ep2_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    if dist.get_rank() == 1:
        optimizer.state[model.experts.local_experts[3].bias] = {"zz": _KillsItsRank()}
    save_rank_files(directory, model, optimizer)


def test_a_save_killed_half_way_leaves_nothing_the_next_save_or_load_trips_over(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError):  # rank 1 killed by SIGKILL, or rank 0 losing its peer
        run_world(2, _save_killed_on_rank_one, str(tmp_path), timeout=30.0)
    assert not list(tmp_path.glob("rank-*.pt"))  # rank 0's complete file was never renamed into place
    assert run_world(2, _load, str(tmp_path), timeout=30.0) == [f"no rank-<rank>.pt files in {tmp_path}"] * 2
    run_world(2, _save_filled, str(tmp_path))  # the next save into the directory: not refused, and it replaces
    assert sorted(path.name for path in tmp_path.iterdir()) == ["rank-00000.pt", "rank-00001.pt"]  # stale partials
    assert run_world(2, _load, str(tmp_path), timeout=30.0) == ["loaded", "loaded"]

"""The registry refuses bad input and missing ranks clearly, on every rank, within the build's own timeout.

Real gloo worlds of 4 ranks. A bad ``timeout`` (NaN, inf, a string, a bool, zero, negative), on every rank or on
one, and ``adopt`` given names, numbers or ``None`` raise the same exception on every rank, naming the argument and
what it must be; a rank that never calls a build, or is killed in one, makes the others fail within the build's
timeout of 2 s (the world's own is 30 s), with a message naming the build, the missing ranks and what to do.
"""

from __future__ import annotations

import math
import os
import signal
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from core_support import bits, errors_of, member_mask

import pgregistry.testing
from pgregistry import ParallelLayout
from pgregistry import registry as reg
from pgregistry.testing import RankFailure, run_world

FOUR = ParallelLayout(num_ranks=4, tp=2)
BAD_TIMEOUTS: dict[str, Any] = {
    "nan": math.nan, "inf": math.inf, "'abc'": "abc", "'5'": "5", "True": True, "-1": -1, "0": 0,
    "timedelta(0)": timedelta(0),
}
TYPE_ERRORS = {"'abc'", "'5'", "True"}
WORLD_TIMEOUT_S = 30.0  # each world's own timeout (run_world's): every wait must end long before it
BUILD_TIMEOUT_S = 2


def _refusals() -> dict[str, Any]:
    rank = dist.get_rank()
    calls = {f"timeout={label}": (lambda bad=bad: reg.build(FOUR, name="t", timeout=bad)) for label, bad in
             BAD_TIMEOUTS.items()}
    calls["nan_on_rank_2"] = lambda: reg.build(FOUR, name="t", timeout=math.nan if rank == 2 else 5.0)
    calls["adopt_names"] = lambda: reg.adopt(["tp"])  # type: ignore[list-item]
    calls["adopt_number"] = lambda: reg.adopt(5)  # type: ignore[arg-type]
    calls["adopt_none"] = lambda: reg.adopt([None])  # type: ignore[list-item]
    out: dict[str, Any] = errors_of(calls)
    collection = reg.build(FOUR, name="t", timeout=5.0)  # the world is usable after every refusal
    out["tp"] = member_mask(collection.tp)
    return out


def test_a_bad_timeout_or_adopt_argument_is_refused_on_every_rank() -> None:
    results = run_world(4, _refusals, timeout=30.0)
    every = "ranks [0, 1, 2, 3] were given bad input (ranks [0, 1, 2, 3]: "
    for rank, out in enumerate(results):
        for label in BAD_TIMEOUTS:
            message = out[f"timeout={label}"]
            if label in TYPE_ERRORS:
                assert message.startswith(f"TypeError: the layout to build: {every}timeout must be a number of "
                                          "seconds (an int or a float) or a datetime.timedelta, or None"), message
            else:
                assert message.startswith(f"ValueError: the layout to build: {every}timeout must be positive, finite "
                                          "and at most 1e12 seconds (or None for torch's default)"), message
            assert message.endswith(f"got {BAD_TIMEOUTS[label]!r}" + (f" ({type(BAD_TIMEOUTS[label]).__name__}))"
                                    if label in TYPE_ERRORS else ")")), message
        assert out["nan_on_rank_2"].startswith(
            "ValueError: the layout to build: ranks [2] were given bad input (rank 2: timeout must be positive"
        ), out["nan_on_rank_2"]
        assert "'timeout' differs (ranks [0, 1, 3] asked for datetime.timedelta(seconds=5); ranks [2] asked for nan)" \
            in out["nan_on_rank_2"]
        expects = f"TypeError: pgregistry.registry.adopt: {every}adopt expects an iterable of the torch.distributed "
        assert out["adopt_names"].startswith(expects) and out["adopt_names"].endswith("item 0 is 'tp' (str))")
        assert out["adopt_number"].startswith(expects) and out["adopt_number"].endswith("got 5 (int))")
        assert out["adopt_none"].startswith(expects) and out["adopt_none"].endswith("item 0 is None (NoneType))")
        assert out["tp"] == bits([rank // 2 * 2, rank // 2 * 2 + 1])


def _one_rank_never_builds() -> str:
    store = dist.distributed_c10d._get_default_store()
    if dist.get_rank() == 3:
        # Away until the others have given up on the build; then it calls the build, too late.
        store.wait(["test/others-gave-up"], timedelta(seconds=WORLD_TIMEOUT_S))
        return errors_of({"late": lambda: reg.build(FOUR, name="late", timeout=BUILD_TIMEOUT_S)})["late"]
    message = errors_of({"build": lambda: reg.build(FOUR, name="late", timeout=BUILD_TIMEOUT_S)})["build"]
    if store.add("test/gave-up", 1) == 3:
        store.set("test/others-gave-up", "")
    return message


def test_a_rank_that_never_calls_build_is_named_within_the_builds_timeout() -> None:
    results = run_world(4, _one_rank_never_builds, timeout=30.0)
    for rank, message in enumerate(results[:3]):
        assert message == (
            f"RuntimeError: pgregistry.build of layout 'late': ranks [3] did not call it within {BUILD_TIMEOUT_S} s, "
            "so nothing was done. Every rank must build the same layouts and groups, with the same names and options, "
            "in the same order: look at what ranks [3] did instead (raised or exited earlier, took another branch, or "
            "are still busy), or give the call a longer timeout"
        ), f"rank {rank}: {message}"
    assert results[3].startswith(
        "RuntimeError: pgregistry.build of layout 'late': rank 3 came after the other ranks had stopped waiting for it "
        f"(they raised after {BUILD_TIMEOUT_S} s): nothing was done."
    ), results[3]


def _killed_in_the_build(reports: Path) -> None:
    rank = dist.get_rank()
    if rank == 3:  # killed once in the build, before its agreement: the others are in it, or about to be
        reg.check_agreement = lambda *args, **kwargs: os.kill(os.getpid(), signal.SIGKILL)  # type: ignore[assignment]
    message = errors_of({"build": lambda: reg.build(FOUR, name="k", timeout=BUILD_TIMEOUT_S)})["build"]
    (reports / f"rank-{rank}.txt").write_text(message)


def test_a_rank_killed_in_a_build_is_named_on_every_other_rank(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # run_world kills the living ranks a few seconds after one dies; here they need the build's timeout and its
    # roll call to report.
    monkeypatch.setattr(pgregistry.testing, "_ERROR_GRACE_S", WORLD_TIMEOUT_S / 2)
    with pytest.raises(RankFailure, match="rank 3 failed: process exited without a result .killed by signal 9"):
        run_world(4, _killed_in_the_build, tmp_path, timeout=30.0)
    for rank in range(3):
        message = (tmp_path / f"rank-{rank}.txt").read_text()
        assert message.startswith(
            f"RuntimeError: pgregistry.build of layout 'k' failed on rank {rank} in a collective over the world: ranks "
            "[3] did not answer a roll call after it (killed, or stuck elsewhere). The process group cannot be trusted "
            "after this: restart the job (every rank) once ranks [3] are healthy. The backend said: "
        ), f"rank {rank}: {message}"
    assert not (tmp_path / "rank-3.txt").exists()


def _adopt_with_a_group_omitted() -> dict[str, Any]:
    rank = dist.get_rank()
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mine = pairs[rank // 2]
    out: dict[str, Any] = errors_of({"omitted": lambda: reg.adopt([] if rank == 1 else [mine])})
    # Nothing was recorded: adopted by every member now, the build reuses it and its all-reduce sums the pair.
    reg.adopt([mine])
    collection = reg.build(FOUR, name="adopted")
    out["reused"] = collection.tp is mine
    total = torch.tensor([float(rank)])
    dist.all_reduce(total, group=collection.tp)
    out["tp sum"] = total.item()
    reg.destroy()
    return out


def test_a_group_one_of_its_ranks_leaves_out_of_adopt_is_refused_on_every_rank() -> None:
    """Rank 1 adopted nothing while rank 0 adopted their pair: the build then raised on rank 1 alone ("must be a
    torch ProcessGroup; got int -100"), and rank 0 waited in its first all-reduce over the pair for the world's
    timeout."""
    results = run_world(4, _adopt_with_a_group_omitted, timeout=30.0)
    for rank, out in enumerate(results):
        assert out["omitted"].startswith(
            "ValueError: adopt: rank 1 did not pass its communicator of ranks [0, 1], which rank(s) [0] passed"
        ), (rank, out["omitted"])
        assert out["reused"] is True
        assert out["tp sum"] == [1.0, 1.0, 5.0, 5.0][rank]

"""run_world: results in rank order, failures re-raised with their rank, hangs caught by the deadline, no
orphan ranks."""

from __future__ import annotations

import gc
import math
import os
import re
import signal
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from pgregistry import testing
from pgregistry.testing import RankFailure, WorldTimeout, run_world


def _children_of(pid: int) -> list[int]:
    """Live (or zombie) processes whose parent is ``pid``, from /proc."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # Fields after the parenthesised command name: state, ppid, ...
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            found.append(int(entry.name))
    return found


_CHILDREN_BEFORE: set[int] = set()


@pytest.fixture(autouse=True)
def _note_children_before() -> None:
    """Children this process had before the test (an earlier test may leave the stdlib's own, such as
    multiprocessing's resource tracker, alive until the interpreter exits): not the harness's."""
    _CHILDREN_BEFORE.clear()
    _CHILDREN_BEFORE.update(_children_of(os.getpid()))


def _new_children() -> list[int]:
    """This process's children that the test started and left behind."""
    return [pid for pid in _children_of(os.getpid()) if pid not in _CHILDREN_BEFORE]


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def _identify(scale: int, *, offset: int) -> tuple[int, int, int, int]:
    rank = dist.get_rank()
    time.sleep(0.05 * (dist.get_world_size() - rank))  # later ranks finish first
    total = torch.tensor([1 << rank])
    dist.all_reduce(total)
    return rank, dist.get_world_size(), rank * scale + offset, int(total.item())


def test_results_come_back_in_rank_order_with_args_and_kwargs() -> None:
    results = run_world(4, _identify, 10, offset=3)
    assert results == [(r, 4, r * 10 + 3, 0b1111) for r in range(4)]
    assert _new_children() == []


def test_a_closure_runs_and_a_world_of_one_works() -> None:
    captured = {"value": 7}
    assert run_world(1, lambda: (dist.get_rank(), captured["value"])) == [(0, 7)]


def test_ranks_are_forked_with_the_callers_objects_frozen_and_the_caller_gets_them_back() -> None:
    """A full collection in a rank wrote to every object it inherited, copying the caller's whole heap into each
    rank: 2.2 s a rank in the middle of tests/demo/test_verify.py's worlds (pgregistry/testing/_frozen_heap.py).
    Frozen, a rank's collections leave them untouched; the caller's collector sees them again after the fork, and
    objects the caller froze itself stay frozen."""
    assert gc.get_freeze_count() == 0
    assert all(count > 0 for count in run_world(2, gc.get_freeze_count))
    assert gc.get_freeze_count() == 0
    gc.freeze()
    try:
        run_world(2, gc.get_freeze_count)
        assert gc.get_freeze_count() > 0  # not unfrozen by the world
    finally:
        gc.unfreeze()


def _fail_on_rank_two() -> int:
    if dist.get_rank() == 2:
        raise KeyError("boom on two")
    return dist.get_rank()


def test_an_exception_is_reraised_with_its_type_rank_and_traceback() -> None:
    with pytest.raises(KeyError, match="boom on two") as info:
        run_world(4, _fail_on_rank_two)
    cause = info.value.__cause__
    assert isinstance(cause, RankFailure) and cause.rank == 2
    assert "_fail_on_rank_two" in cause.detail and "KeyError: 'boom on two'" in cause.detail
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert "raised on rank 2" in notes and "_fail_on_rank_two" in notes
    assert _new_children() == []


class _Unpicklable(Exception):
    def __reduce__(self) -> tuple[object, ...]:
        raise TypeError("cannot pickle this one")


def _raise_unpicklable() -> None:
    if dist.get_rank() == 1:
        raise _Unpicklable("not picklable")


def test_an_unpicklable_exception_still_reports_its_rank_and_text() -> None:
    with pytest.raises(RankFailure, match=r"(?s)rank 1 failed: .*_Unpicklable: not picklable"):
        run_world(2, _raise_unpicklable)


def _skip_a_collective(pid_dir: str) -> int:
    rank = dist.get_rank()
    Path(pid_dir, str(rank)).write_text(str(os.getpid()))
    if rank != 1:
        # new_group is collective over the world; rank 1 never arrives, past every torch timeout.
        dist.new_group([0, 1, 2, 3])
        dist.all_reduce(torch.ones(1))
    return rank


def test_a_rank_that_skips_a_collective_times_out_and_leaves_no_orphans(tmp_path: Path) -> None:
    with pytest.raises(
        WorldTimeout,
        match=r"did not finish within 2.0 s of joining the process group; ranks still running: \[0, 2, 3\]",
    ) as info:
        run_world(4, _skip_a_collective, str(tmp_path), timeout=2.0)
    pids = [int(p.read_text()) for p in sorted(tmp_path.iterdir())]
    assert len(pids) == 4
    assert all(_gone(pid) for pid in pids)
    assert _new_children() == []
    # Where each stuck rank was: a stack dump of each, naming the collective it waits in, under the summary.
    assert info.value.stuck_ranks == [0, 2, 3]
    assert sorted(info.value.stacks) == [0, 2, 3]
    message = str(info.value)
    for rank in (0, 2, 3):
        stack = info.value.stacks[rank]
        assert "_skip_a_collective" in stack and "in new_group" in stack, stack
        assert re.search(rf"rank {rank}: _skip_a_collective \(test_testing_harness\.py:\d+\) -> new_group", message)
        assert f"--- rank {rank} ---" in message
    assert "rank 1:" not in message


def _rank() -> int:
    return dist.get_rank()


def test_a_slow_start_up_does_not_spend_the_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    # On a loaded machine forking and joining the process group can take seconds: a deadline of 2 s that counted
    # them timed out before the ranks had begun their work. Here joining is made to take 4 s (the ranks inherit
    # the patched function when forked), and the ranks have 2 s for their work once every one has joined.
    joining = dist.init_process_group

    def slow_join(*args: object, **kwargs: object) -> None:
        time.sleep(4.0)
        joining(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(dist, "init_process_group", slow_join)
    assert run_world(2, _rank, timeout=2.0) == [0, 1]


def _never_joins() -> int:
    return 0


def test_a_world_that_never_starts_names_the_ranks_that_did_not_join(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("pgregistry.testing._STARTUP_GRACE_S", 0.5)
    joining = dist.init_process_group

    def rank_one_hangs(*args: object, **kwargs: object) -> None:
        if kwargs.get("rank") == 1:
            time.sleep(300)
        joining(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(dist, "init_process_group", rank_one_hangs)
    with pytest.raises(WorldTimeout, match=r"did not start within 1\.5 s: ranks \[0, 1\] never joined") as info:
        run_world(2, _never_joins, timeout=1.0)
    assert info.value.stuck_ranks == [0, 1] and "rank_one_hangs" in info.value.stacks[1]


def _exit_abruptly(how: str) -> int:
    if dist.get_rank() == 3:
        if how == "exit":
            os._exit(7)
        os.kill(os.getpid(), signal.SIGKILL)
    return dist.get_rank()


@pytest.mark.parametrize(("how", "said"), [("exit", "exit code 7"), ("kill", r"killed by signal 9 \(SIGKILL\)")])
def test_a_rank_that_dies_is_a_rank_failure_saying_how(how: str, said: str) -> None:
    with pytest.raises(RankFailure, match=rf"rank 3 failed: process exited without a result \({said}\)") as info:
        run_world(4, _exit_abruptly, how)
    assert info.value.rank == 3
    assert _new_children() == []


class _KeywordOnly(Exception):
    """Pickles as ``(cls, args)``, which cannot call this ``__init__`` back: the parent cannot rebuild it."""

    def __init__(self, *, code: int) -> None:
        super().__init__(f"code {code}")


def _raise_keyword_only() -> int:
    if dist.get_rank() == 1:
        raise _KeywordOnly(code=3)
    return dist.get_rank()


def test_an_exception_the_parent_cannot_rebuild_reports_its_rank_and_traceback() -> None:
    with pytest.raises(RankFailure) as info:
        run_world(2, _raise_keyword_only)
    assert info.value.rank == 1
    assert "_raise_keyword_only" in info.value.detail and "_KeywordOnly: code 3" in info.value.detail
    assert "could not be rebuilt in the parent" in info.value.detail
    assert _new_children() == []


def _interrupt_rank_zero() -> int:
    if dist.get_rank() == 0:
        raise KeyboardInterrupt
    return dist.get_rank()


def test_a_ranks_keyboard_interrupt_is_that_ranks_failure_not_the_callers() -> None:
    caught: BaseException | None = None
    try:  # not pytest.raises: a KeyboardInterrupt escaping here would stop the whole session
        run_world(2, _interrupt_rank_zero)
    except BaseException as exc:  # noqa: BLE001 - the type is what is checked
        caught = exc
    assert isinstance(caught, RankFailure), repr(caught)
    assert caught.rank == 0 and "KeyboardInterrupt" in caught.detail and "_interrupt_rank_zero" in caught.detail


def test_world_size_must_be_positive() -> None:
    with pytest.raises(ValueError, match="world_size must be a positive integer, got 0"):
        run_world(0, _identify, 1, offset=0)


@pytest.mark.parametrize(("world_size", "message"), [
    (True, "world_size must be a positive integer, got True"),
    (2.0, "world_size must be a positive integer, got 2.0"),
    ("2", "world_size must be a positive integer, got '2'"),
])
def test_a_world_size_that_is_no_positive_integer_is_named_before_any_rank_starts(
    world_size: object, message: str
) -> None:
    """Found by the third hostile-input round: ``run_world(True, ...)`` ran one rank, ``2.0`` and ``'2'`` failed in
    Python's operators."""
    with pytest.raises(ValueError, match=re.escape(message)):
        run_world(world_size, _identify, 1, offset=0, timeout=10.0)  # type: ignore[arg-type]


@pytest.mark.parametrize("timeout", [-1, math.nan, math.inf, "5", True], ids=repr)
def test_a_timeout_that_is_no_positive_finite_number_is_named_before_any_rank_starts(timeout: object) -> None:
    """``timeout=0`` timed the world out, blaming a rank that "skipped or mismatched a collective"; -1 failed in gloo's
    ``timeout.count() >= 0``, inf in ``timestamp out of range``, ``'5'`` in Python's operators. The check
    (``check_deadline``) runs first in ``run_world``, as the world of 0 s shows."""
    with pytest.raises(ValueError, match=re.escape(f"timeout must be a positive, finite number of seconds, got "
                                                   f"{timeout!r}")):
        testing.check_deadline(timeout)
    with pytest.raises(ValueError, match=re.escape("timeout must be a positive, finite number of seconds, got 0")):
        run_world(1, _identify, 1, offset=0, timeout=0)

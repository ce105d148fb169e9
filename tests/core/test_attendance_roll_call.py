"""The roll call after a failed collective waits the caller's timeout, not a fixed or a doubled one (issue 41, item 11).

A 3-rank gloo world runs one attended operation (:func:`pgregistry._runtime.attendance.require_attendance`, what a
build runs
in) with a timeout of ``TIMEOUT_S``, far below the world's own (60 s) and the roll call's cap (10 s). Inside it rank 0's
"collective" fails at once, rank 1's fails ``LATE_S`` later (a survivor that learns of a fault later than its peers,
well within the timeout) and rank 2 never fails (stuck elsewhere: it never answers). Rank 0 must count rank 1 as
answering, name rank 2 alone, and raise after the roll call's wait: the timeout plus its one-second margin. The
bounds are wide for a loaded 2-core machine (the wait is polled every 50 ms) yet exclude a wait of twice the timeout
(7 s), the cap (11 s), the world's timeout, or one too short to hear rank 1.
"""

from __future__ import annotations

import time
from datetime import timedelta

import torch.distributed as dist

from pgregistry._runtime import attendance
from pgregistry._runtime.attendance import require_attendance
from pgregistry.testing import run_world

TIMEOUT_S = 3.0
LATE_S = 2.0
WAIT_S = TIMEOUT_S + attendance._MARGIN_S
SLACK_S = 1.5  # a loaded machine's polling and scheduling; twice the timeout is 3 s more


def _fail_at_different_times() -> tuple[float, str]:
    """Seconds from this rank's failure to the operation's error, and its message ("" on rank 2)."""
    rank = dist.get_rank()
    store = dist.distributed_c10d._get_default_store()
    failed = time.monotonic()
    message = ""
    try:
        with require_attendance("the test's operation", timedelta(seconds=TIMEOUT_S), "restart"):
            if rank == 1:
                time.sleep(LATE_S)
            if rank < 2:
                failed = time.monotonic()
                raise RuntimeError("a collective failed")
            store.wait(["test/reported/0", "test/reported/1"], timedelta(seconds=30))  # never answers the roll call
    except RuntimeError as error:
        message = str(error)
        store.set(f"test/reported/{rank}", "")
    return time.monotonic() - failed, message


def test_the_roll_call_waits_the_callers_timeout_and_hears_a_rank_that_answers_within_it() -> None:
    results = run_world(3, _fail_at_different_times, timeout=30.0)
    waited, message = results[0]
    assert message.startswith(
        "the test's operation failed on rank 0 in a collective over the world: ranks [2] did not answer a roll call "
        "after it (killed, or stuck elsewhere)."
    ), message
    assert WAIT_S - 0.1 <= waited <= WAIT_S + SLACK_S, f"the roll call waited {waited:.2f} s, not about {WAIT_S} s"
    assert results[1][1].startswith("the test's operation failed on rank 1 in a collective over the world: ranks [2]")
    assert results[2][1] == ""

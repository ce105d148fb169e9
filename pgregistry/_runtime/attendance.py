"""Which ranks came: a world-collective operation under its own timeout, naming ranks that did not.

A rank that never calls a world-collective operation (it raised earlier, took another branch, or
died) leaves the others in the operation's first collective until the process group's timeout (30
minutes by default), and then they fail with the backend's text, which names neither the operation
nor the missing ranks. :func:`require_attendance` runs an operation after a check-in through the
world's store, bounded by the operation's own timeout: each rank marks itself present and counts
itself in; when the count falls short at the deadline, every rank that came raises ``RuntimeError``
naming the operation, the ranks that did not come and what to do. A collective that fails inside the
operation (a rank killed in it) is followed by a roll call through the store: the message names the
ranks that did not answer it.

The check-in costs two store writes and one wait per rank, as a ``new_group`` of torch's own does;
it is for operations that are rare and must fail clearly (a build), never for a training step's
collectives.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

__all__ = ["require_attendance", "world_timeout"]

_GAVE_UP = 1 << 32
"""What a rank that stopped waiting adds to the count.

A rank arriving after it sees it, and knows to raise.
"""

_ROLL_CALL_S = 10.0
"""The longest a roll call after a failure waits for the ranks that answer, beyond
:data:`_MARGIN_S`. Every collective of an attended operation is bounded by its timeout, so a rank
that lives fails within that timeout of a peer's death and answers then; the wait is the timeout
when shorter than this."""

_MARGIN_S = 1.0

_POLL_S = 0.05

_operations = 0
"""How many attended operations this process has run: every rank runs them in one order, so the n-th
is the same operation on every rank (a rank that skips one is caught by the next check-in, or by its
agreement)."""


@contextmanager
def require_attendance(operation: str, timeout: timedelta | None, advice: str) -> Iterator[None]:
    """Run the body once every rank of the world has checked in, within ``timeout``.

    ``timeout`` ``None`` is the world's own (:func:`world_timeout`). ``RuntimeError`` on every rank
    that came when some did not, naming them and the operation, then ``advice``. A ``RuntimeError``
    inside the body, which is what torch.distributed raises when a collective fails (the body's own
    collectives must be bounded by ``timeout``, and raise no ``RuntimeError`` of their own), is
    re-raised as ``RuntimeError`` naming the operation and the ranks that did not answer a roll
    call, ``from`` the backend's error."""
    import torch.distributed as dist

    global _operations
    if (
        dist.get_backend() == "fake"
    ):  # torch's test backend: one process stands for a large world, with no peers
        yield
        return
    _operations += 1
    store = dist.distributed_c10d._get_default_store()
    prefix = f"pgregistry/attendance/{_operations}"
    bound = timeout if timeout is not None else world_timeout()
    world_size, rank = dist.get_world_size(), dist.get_rank()
    _check_in(store, prefix, world_size, rank, bound, operation, advice)
    try:
        yield
    except (
        RuntimeError
    ) as exc:  # what torch.distributed raises (gloo's errors are plain RuntimeErrors)
        silent = _roll_call(
            store, prefix, world_size, rank, min(bound.total_seconds(), _ROLL_CALL_S) + _MARGIN_S
        )
        who = (
            f"ranks {silent} did not answer a roll call after it (killed, or stuck elsewhere)"
            if silent
            else "every rank answered a roll call after it"
        )
        raise RuntimeError(
            f"{operation} failed on rank {rank} in a collective over the world: {who}. The "
            "process group cannot be trusted after this: restart the job (every rank) "
            f"once ranks {silent or 'that failed'} are healthy. The backend said: {exc}"
        ) from exc


def world_timeout() -> timedelta:
    """The world's process-group timeout (``init_process_group(timeout=...)``), else its store's."""
    import torch.distributed as dist

    from pgregistry._runtime.agreement import world_device

    try:
        backend = dist.distributed_c10d._get_default_group()._get_backend(world_device())
        found = backend.options._timeout
    except (AttributeError, RuntimeError):
        found = None
    if isinstance(found, timedelta) and found.total_seconds() > 0:
        return found
    store = dist.distributed_c10d._get_default_store()
    timeout: timedelta = store.timeout  # type: ignore[attr-defined]
    return timeout


def _check_in(
    store: Any,
    prefix: str,
    world_size: int,
    rank: int,
    bound: timedelta,
    operation: str,
    advice: str,
) -> None:
    """Count this rank in; return once every rank is, or raise naming those not in by ``bound``.

    The count is one atomic counter. The rank that brings it to ``world_size`` opens the way for
    all; one that stops waiting adds :data:`_GAVE_UP`, so a rank arriving later sees that the others
    left and raises too instead of going on alone, and the one giving up sees whether the last rank
    came just before it did."""
    store.set(f"{prefix}/rank/{rank}", "")
    count = store.add(f"{prefix}/count", 1)
    if count >= _GAVE_UP:
        raise RuntimeError(
            f"{operation}: rank {rank} came after the other ranks had stopped "
            f"waiting for it (they raised after {bound.total_seconds():g} s): "
            f"nothing was done. {advice[0].upper()}{advice[1:]}"
        )
    if count == world_size:
        store.set(f"{prefix}/all", "")
        return
    try:
        store.wait([f"{prefix}/all"], bound)
        return
    except RuntimeError:
        pass
    after = store.add(f"{prefix}/count", _GAVE_UP)
    if after // _GAVE_UP == 1 and after % _GAVE_UP == world_size:
        return  # the last rank came just before this one gave up, and went on: so does this one
    absent = [r for r in range(world_size) if not store.check([f"{prefix}/rank/{r}"])]
    who = (
        absent or "that came too late"
    )  # none absent: a late rank came between two ranks giving up
    raise RuntimeError(  # the same text on every rank that came
        f"{operation}: ranks {who} did not call it within {bound.total_seconds():g} "
        f"s, so nothing was done. {advice[0].upper()}{advice[1:]}: look at what "
        f"ranks {who} did instead (raised or exited earlier, took another branch, "
        "or are still busy), or give the call a longer timeout"
    )


def _roll_call(store: Any, prefix: str, world_size: int, rank: int, wait_s: float) -> list[int]:
    """The ranks not answering within ``wait_s`` a roll call that every failed rank joins."""
    store.set(f"{prefix}/answered/{rank}", "")
    give_up = time.monotonic() + wait_s
    answers = store.add(f"{prefix}/answers", 1)
    while answers < world_size and time.monotonic() < give_up:
        time.sleep(_POLL_S)
        answers = store.add(f"{prefix}/answers", 0)
    if answers >= world_size:
        return []
    return [r for r in range(world_size) if not store.check([f"{prefix}/answered/{r}"])]

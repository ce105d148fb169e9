"""Which ranks survive a fault: the survivors' check-in, decision and confirmation through a store.

:func:`pgregistry.recovery.recover` needs every survivor to name the same survivors, without a
collective over the broken world. Through the store it was given (see there), under the generation's
prefix:

1. *check in*: each survivor writes its record (the step it committed, the lost ranks it was told
   of) and counts itself;
2. *decide*: once every rank that may be alive has checked in, or ``wait`` seconds passed, a
   survivor proposes the ranks whose records exist; the store's ``compare_set`` keeps the first
   proposal, so every survivor reads one decision;
3. *confirm*: a rank may die after its check-in (a second failure) and still be named by the
   decision. Each rank the decision names checks in again, to a confirmation round, and that round
   is decided as the first was: over the ranks the decision named, once all of them answered or
   ``wait`` passed. A round that names every rank of the decision before it confirms it; otherwise
   the ranks that answered go to the next round, and a rank left out is lost like the first. Each
   round without a loss ends as soon as the last survivor answers; each loss costs at most ``wait``
   seconds more, and there are at most as many rounds as ranks.

A rank that checks in after a decision left it out (it was stuck longer than ``wait``, or answered a
confirmation too late) learns so and raises. Torch-free: it uses the store's methods only.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Any

__all__ = ["agree_on_survivors"]

_POLL_S = 0.01


def agree_on_survivors(
    store: Any,
    prefix: str,
    rank: int,
    world_size: int,
    step: int,
    told: list[int] | None,
    wait: float,
) -> dict[int, dict[str, Any]]:
    """Check in, decide and confirm (module docstring); the confirmed survivors' records by rank.

    ``RuntimeError`` on a rank a decision left out."""
    _check_in(store, prefix, rank, json.dumps({"step": step, "lost": told}))
    # When told who is lost, everyone else is expected (a told set that differs is the verdict's
    # error).
    expected = (
        world_size - len(set(told) & set(range(world_size))) if told is not None else world_size
    )
    survivors = _decide_survivors(store, prefix, range(world_size), expected, wait)
    generation = prefix.rsplit("/", 1)[1]
    _require_named(
        survivors, rank, generation, f"called recover after the survivors {survivors} had decided"
    )
    round_number = 0
    while True:
        confirmation = f"{prefix}/confirm/{round_number}"
        _check_in(store, confirmation, rank, "")
        confirmed = _decide_survivors(store, confirmation, survivors, len(survivors), wait)
        _require_named(
            confirmed,
            rank,
            generation,
            f"answered the survivors' confirmation after they had confirmed {confirmed}",
        )
        if confirmed == survivors:
            return {r: json.loads(store.get(f"{prefix}/record/{r}")) for r in survivors}
        survivors, round_number = confirmed, round_number + 1


def _check_in(store: Any, prefix: str, rank: int, record: str) -> None:
    store.set(f"{prefix}/record/{rank}", record)
    store.add(f"{prefix}/count", 1)


def _decide_survivors(
    store: Any, prefix: str, candidates: Sequence[int], expected: int, wait: float
) -> list[int]:
    """The ranks of ``candidates`` that checked in under ``prefix``, as the first proposal kept.

    Proposed once ``expected`` ranks have, or ``wait`` seconds passed (from this rank's own
    check-in)."""
    deadline = time.monotonic() + wait
    decision_key = f"{prefix}/decision"
    while not store.check([decision_key]):
        if store.add(f"{prefix}/count", 0) >= expected or time.monotonic() >= deadline:
            present = [r for r in candidates if store.check([f"{prefix}/record/{r}"])]
            store.compare_set(decision_key, "", json.dumps(present))
            break
        time.sleep(_POLL_S)
    decided: list[int] = json.loads(store.get(decision_key))
    return decided


def _require_named(survivors: list[int], rank: int, generation: str, when: str) -> None:
    """``RuntimeError`` on ``rank`` if ``survivors`` (decided ``when``) leave it out: it is lost."""
    if rank not in survivors:
        raise RuntimeError(
            f"rank {rank} {when} without it (generation {generation}): it is lost to "
            "them; end this process. A survivor that arrives late was stuck longer "
            "than the recovery's wait: make wait longer than the collective timeout"
        )

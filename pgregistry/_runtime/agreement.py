"""Decisions every rank of the world takes alike: one request, one verdict, raised on all or none.

A call that is collective over the world must never raise on some ranks only: the others would go on
into the next collective and wait there until the timeout. So a world-collective entry point first
checks what this rank was given, and then :func:`check_agreement` settles, in one all-reduce,
whether every rank asked for the same thing and whether any rank found a fault; every rank then
raises the same exception (quoting each faulty rank's error with the ranks that found it, then
naming the fields that differ and who asked for what), or none does. The exception is the faults'
own type when every faulty rank found the same kind (``TypeError`` for a value of the wrong type,
``RuntimeError`` for missing distributed state), else ``ValueError``.

A call that already has an all-reduce of its own carries the verdict in it instead
(:func:`verdict_of` gives its three numbers, :func:`check_verdict` reads them back), so agreeing
costs that call nothing on its happy path.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import Any

__all__ = [
    "Fault",
    "check_agreement",
    "all_reached",
    "all_reduce_within",
    "any_rank_has",
    "any_rank_has_each",
    "faulty_ranks",
    "combine_faults",
    "raise_own_or_peers_fault",
    "ranks_label",
    "require_distributed",
    "check_verdict",
    "verdict_of",
    "world_device",
]

Fault = str | Exception | None
"""What a rank found wrong with its input: ``None`` for nothing, an exception (its type and text
travel), or a text (a ``ValueError``'s)."""

_POLL_S = 0.001
"""How often a bounded all-reduce looks whether it has completed."""

_SHOWN = 4
"""How many distinct errors a message quotes in full."""

_NOT_GIVEN = "nothing (not given)"
"""How a message shows a field that a rank's call did not give at all."""

_TYPES: dict[str, type[Exception]] = {
    "ValueError": ValueError,
    "TypeError": TypeError,
    "RuntimeError": RuntimeError,
}
"""The exception types a fault keeps across ranks; any other is raised as a ``ValueError``."""


def require_distributed(what: str) -> None:
    """``RuntimeError`` unless torch.distributed is initialised."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(f"{what} needs torch.distributed initialised (init_process_group)")


def check_agreement(
    subject: str,
    fields: Mapping[str, str],
    error: Fault = None,
    *,
    failed: str = "were given bad input",
    advice: str = "every rank must make the same call with the same arguments",
    timeout: timedelta | None = None,
) -> None:
    """Raise on every rank when the ranks' ``fields`` differ or any rank's ``error`` is set.

    One all-reduce (MAX of :func:`verdict_of`) decides, so agreeing costs one small collective; only
    when it says no is more exchanged (:func:`check_verdict`). ``subject`` names the call in
    messages, ``failed`` says what happened to the faulty ranks, ``advice`` what differing ranks
    must do. With ``timeout``, ``RuntimeError`` when the all-reduce has not completed by then
    (:func:`all_reduce_within`).
    """
    import torch
    import torch.distributed as dist

    require_distributed(subject)
    verdict = torch.tensor(verdict_of(fields, error), dtype=torch.int64, device=world_device())
    all_reduce_within(verdict, dist.ReduceOp.MAX, timeout, subject)
    check_verdict(subject, fields, error, verdict.tolist(), failed=failed, advice=advice)


def verdict_of(fields: Mapping[str, str], error: Fault) -> list[int]:
    """This rank's three numbers of a verdict: a digest of ``fields``, its negation, a fault flag.

    A MAX over the world of them says whether every rank's fields are the same (the largest digest
    is minus the largest negation) and whether any rank found a fault. The digest has 52 bits, so
    the numbers are exact in a float64 all-reduce."""
    request = "|".join(f"{key}={value}" for key, value in fields.items())
    digest = int(hashlib.sha256(request.encode()).hexdigest()[:13], 16)
    return [digest, -digest, int(error is not None)]


def check_verdict(
    subject: str,
    fields: Mapping[str, str],
    error: Fault,
    reduced: Sequence[float],
    *,
    failed: str = "were given bad input",
    advice: str = "every rank must make the same call with the same arguments",
) -> None:
    """Read back the MAX over the world of every rank's :func:`verdict_of` (``reduced``).

    When the ranks differ or any found a fault, gather what each asked for and found and raise the
    same text on every rank."""
    largest, negated_smallest, faulty = (int(value) for value in reduced)
    differ = largest != -negated_smallest
    if differ or faulty:  # every rank takes this branch alike
        _raise_on_every_rank(subject, fields, error, differ, failed, advice)


def combine_faults(*errors: Fault) -> Fault:
    """The faults of several checks as one.

    ``None`` when none; the one when one; else their texts joined, as their common type
    (``ValueError`` when they differ)."""
    found = [error for error in errors if error is not None]
    if len(found) <= 1:
        return found[0] if found else None
    kinds = {_fault_type_name(error) for error in found}
    kind = _TYPES[kinds.pop()] if len(kinds) == 1 else ValueError
    return kind("; ".join(str(error) for error in found))


def all_reached(timeout: timedelta | None = None) -> None:
    """Return once every rank of the world has called this.

    One small all-reduce, bounded by ``timeout`` as :func:`all_reduce_within`."""
    import torch
    import torch.distributed as dist

    all_reduce_within(
        torch.zeros(1, device=world_device()), dist.ReduceOp.SUM, timeout, "all_reached"
    )


def all_reduce_within(tensor: Any, op: Any, timeout: timedelta | None, what: str) -> None:
    """All-reduce ``tensor`` over the world in place, within ``timeout`` when given.

    With ``timeout``, ``RuntimeError`` naming ``what`` when it has not completed by then, whatever
    the world's own timeout (a rank that never comes would otherwise hold the others for that long).
    The collective stays in flight after such an error: the world cannot be trusted any more, as
    after any timeout of torch's."""
    import torch.distributed as dist

    if timeout is None:
        dist.all_reduce(tensor, op=op)
        return
    work = dist.all_reduce(tensor, op=op, async_op=True)
    assert work is not None
    give_up = time.monotonic() + timeout.total_seconds()
    while (
        not work.is_completed()
    ):  # polled, not work.wait(timeout): NCCL's wait returns before the device is done
        if time.monotonic() > give_up:
            seconds = timeout.total_seconds()
            raise RuntimeError(
                f"{what}: an all-reduce over the world did not complete within {seconds:g} s"
            )
        time.sleep(_POLL_S)
    work.wait()


def any_rank_has(local: bool, group: Any) -> bool:
    """Whether any rank of ``group`` has ``local`` true.

    ``group`` is a ProcessGroup, or ``None``: the axis is off. One MAX all-reduce over it, none when
    it has one rank. For a verdict the ranks of one group must take alike."""
    (anywhere,) = any_rank_has_each((local,), group)
    return anywhere


def any_rank_has_each(local: Sequence[bool], group: Any) -> tuple[bool, ...]:
    """For each flag of ``local``, whether any rank of ``group`` has it true.

    One MAX all-reduce for all of them (none when the group has one rank), so several verdicts cost
    one collective."""
    import torch
    import torch.distributed as dist

    from pgregistry.collection import group_size

    if group_size(group) == 1:
        return tuple(local)
    flags = torch.tensor(
        [int(flag) for flag in local], dtype=torch.int32, device=world_device(group)
    )
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
    return tuple(bool(flag) for flag in flags.tolist())


def faulty_ranks(failed: bool, groups: Sequence[Any]) -> list[int]:
    """The world ranks that found a fault (``failed`` on them), among the ranks of ``groups``.

    ``groups`` are ProcessGroups; ``None`` and one-rank groups are skipped. A flag per world rank
    (one byte each), MAX all-reduced over each group in turn, so every rank of the groups learns the
    same list, and a refusal on the ranks without a fault can name the ranks that have it. Outside a
    distributed world, or with no group of several ranks: this rank when it failed."""
    import torch
    import torch.distributed as dist

    from pgregistry.collection import group_size

    initialised = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if initialised else 0
    reducing = (
        [group for group in groups if group is not None and group_size(group) > 1]
        if initialised
        else []
    )
    if not reducing:
        return [rank] if failed else []
    flags = torch.zeros(dist.get_world_size(), dtype=torch.uint8)
    flags[rank] = int(failed)
    for group in reducing:
        flags = flags.to(world_device(group))
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
    return [index for index, flag in enumerate(flags.tolist()) if flag]


def raise_own_or_peers_fault(
    own: BaseException | None,
    naming_peers: Callable[[list[int]], BaseException],
    groups: Sequence[Any],
) -> None:
    """Raise ``own`` where it is set, else ``naming_peers(faulty ranks)`` when another rank has one.

    A refusal that holds on every rank: a rank that raised alone would leave its peers waiting in
    the next collective. One :func:`faulty_ranks` (a flag per rank, MAX all-reduced over each group)
    tells every rank which ranks found a fault; those raise their own error, the others one naming
    them (whose log holds the cause); nothing when no rank found one. Collective: every rank of
    ``groups`` calls it, with a fault or without."""
    faulty = faulty_ranks(own is not None, groups)
    if own is not None:
        raise own
    if faulty:
        raise naming_peers(faulty)


def ranks_label(ranks: Sequence[int]) -> str:
    """``"rank 3"`` for one rank, ``"ranks [1, 3]"`` for several."""
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {list(ranks)}"


def world_device(group: Any = None) -> Any:
    """Where the collectives over ``group`` run: this rank's GPU for NCCL, else the CPU.

    ``None`` is the world's group."""
    import torch
    import torch.distributed as dist

    if "nccl" in str(dist.get_backend(group)):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _fault_type_name(error: str | Exception) -> str:
    name = type(error).__name__ if isinstance(error, Exception) else "ValueError"
    return name if name in _TYPES else "ValueError"


def _raise_on_every_rank(
    subject: str, fields: Mapping[str, str], error: Fault, differ: bool, failed: str, advice: str
) -> None:
    """Gather each rank's fields and fault (one ``all_gather_object``); raise alike on all ranks."""
    import torch.distributed as dist

    mine = None if error is None else (_fault_type_name(error), str(error))
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (dict(fields), mine))
    differences = _describe_differences([asked for asked, _ in everyone]) if differ else ""
    by_text: dict[str, list[int]] = {}
    kinds = set()
    for rank, (_, found) in enumerate(everyone):
        if found is not None:
            kinds.add(found[0])
            by_text.setdefault(found[1], []).append(rank)
    kind = _TYPES[kinds.pop()] if len(kinds) == 1 else ValueError
    then = f"{advice[0].upper()}{advice[1:]}."
    if not by_text:
        raise ValueError(
            f"ranks disagree on {subject}: {differences}; "
            f"this rank is rank {dist.get_rank()}. {then}"
        )
    faulty = sorted(rank for ranks in by_text.values() for rank in ranks)
    quoted = "; ".join(
        f"{ranks_label(ranks)}: {text}" for text, ranks in list(by_text.items())[:_SHOWN]
    )
    more = f"; and {len(by_text) - _SHOWN} more distinct error(s)" if len(by_text) > _SHOWN else ""
    message = f"{subject}: ranks {faulty} {failed} ({quoted}{more})"  # the same text on every rank
    if differences:
        message += f"; the ranks also disagree: {differences}. {then}"
    raise kind(message)


def _describe_differences(everyone: list[dict[str, str]]) -> str:
    """Each field whose value differs across ranks, with which ranks asked for which value.

    Every rank's fields are read, not only this rank's: a field that some ranks did not give at all
    (an argument given on some ranks only) is named on every rank alike, with the ranks that did not
    give it (in one order on every rank: rank 0's fields, then those only later ranks gave)."""
    differences = []
    for key in dict.fromkeys(key for asked in everyone for key in asked):
        by_value: dict[str, list[int]] = {}
        for rank, asked in enumerate(everyone):
            by_value.setdefault(asked.get(key, _NOT_GIVEN), []).append(rank)
        if len(by_value) > 1:
            askers = "; ".join(
                f"ranks {ranks} asked for {_truncate_text(value)}"
                for value, ranks in by_value.items()
            )
            differences.append(f"{key!r} differs ({askers})")
    return "; ".join(differences)


def _truncate_text(text: str, limit: int = 300) -> str:
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"

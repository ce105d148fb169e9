"""Decisions every rank of the world takes alike: one request, one verdict, raised on every rank or on none.

A call that is collective over the world must never raise on some ranks only: the others would go on into the
next collective and wait there until the timeout. So a world-collective entry point first checks what this rank
was given, and then :func:`agree` settles, in one all-reduce, whether every rank asked for the same thing and
whether any rank found a fault; every rank then raises the same ``ValueError`` (naming the fields that differ and
who asked for what, or each faulty rank's error), or none does.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

__all__ = ["agree", "all_reached", "any_rank_has", "require_distributed", "world_device"]

_SHOWN = 4
"""How many distinct errors a message quotes in full."""


def require_distributed(what: str) -> None:
    """``RuntimeError`` unless torch.distributed is initialised."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(f"{what} needs torch.distributed initialised (init_process_group)")


def agree(
    subject: str,
    fields: Mapping[str, str],
    error: str | None = None,
    *,
    failed: str = "were given bad input",
    advice: str = "every rank must make the same call with the same arguments",
) -> None:
    """Raise ``ValueError`` on every rank when the ranks' ``fields`` differ or any rank's ``error`` is set.

    One all-reduce (MAX of a digest of ``fields``, of its negation and of a fault flag) decides, so agreeing costs
    one small collective; only when it says no is more exchanged. Differing requests raise naming each field that
    differs and which ranks asked for which value, then ``advice``; faults raise quoting each distinct error with
    the ranks that found it (``failed`` says what happened to them). ``subject`` names the call in messages.
    """
    import torch
    import torch.distributed as dist

    require_distributed(subject)
    request = "|".join(f"{key}={value}" for key, value in fields.items())
    digest = int(hashlib.sha256(request.encode()).hexdigest()[:15], 16)
    verdict = torch.tensor([digest, -digest, int(error is not None)], dtype=torch.int64, device=world_device())
    dist.all_reduce(verdict, op=dist.ReduceOp.MAX)
    largest, negated_smallest, faulty = (int(value) for value in verdict.tolist())
    if largest != -negated_smallest:  # every rank takes this branch alike
        _raise_differences(subject, fields, advice)
    if faulty:
        _raise_errors(subject, error, failed)


def all_reached() -> None:
    """Return once every rank of the world has called this (one small all-reduce)."""
    import torch
    import torch.distributed as dist

    dist.all_reduce(torch.zeros(1, device=world_device()))


def any_rank_has(local: bool, group: Any) -> bool:
    """Whether any rank of ``group`` (a ProcessGroup, or ``None``: the axis is off) has ``local`` true: one MAX
    all-reduce over it, none when it has one rank. For a verdict the ranks of one group must take alike."""
    import torch
    import torch.distributed as dist

    from pgregistry.collection import group_size

    if group_size(group) == 1:
        return local
    flag = torch.tensor([int(local)], dtype=torch.int32, device=world_device(group))
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return bool(flag.item())


def world_device(group: Any = None) -> Any:
    """Where the collectives over ``group`` (the world's for ``None``) run: this rank's GPU for NCCL, else the
    CPU."""
    import torch
    import torch.distributed as dist

    if "nccl" in str(dist.get_backend(group)):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _raise_differences(subject: str, fields: Mapping[str, str], advice: str) -> None:
    import torch.distributed as dist

    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, dict(fields))
    differences = []
    for key in fields:
        by_value: dict[str, list[int]] = {}
        for rank, asked in enumerate(everyone):
            by_value.setdefault((asked or {}).get(key, "<missing>"), []).append(rank)
        if len(by_value) > 1:
            askers = "; ".join(f"ranks {ranks} asked for {_shorten(value)}" for value, ranks in by_value.items())
            differences.append(f"{key!r} differs ({askers})")
    raise ValueError(
        f"ranks disagree on {subject}: {'; '.join(differences)}; this rank is rank {dist.get_rank()}. "
        f"{advice[0].upper()}{advice[1:]}."
    )


def _raise_errors(subject: str, error: str | None, failed: str) -> None:
    import torch.distributed as dist

    errors: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    by_text: dict[str, list[int]] = {}
    for rank, text in enumerate(errors):
        if text is not None:
            by_text.setdefault(text, []).append(rank)
    faulty = sorted(rank for ranks in by_text.values() for rank in ranks)
    quoted = "; ".join(f"{_ranks_label(ranks)}: {text}" for text, ranks in list(by_text.items())[:_SHOWN])
    more = f"; and {len(by_text) - _SHOWN} more distinct error(s)" if len(by_text) > _SHOWN else ""
    raise ValueError(f"{subject}: ranks {faulty} {failed} ({quoted}{more})")  # the same text on every rank


def _ranks_label(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"


def _shorten(text: str, limit: int = 300) -> str:
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"

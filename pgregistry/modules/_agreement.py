"""What the world-collective module entry points agree on before any module's collective: one all-reduce.

A job-wide statistic, the optimizer over every module and a job's checkpoint are collective over the world, and
each runs module collectives over each module's span in between. A rank that raised alone, before its module's
collectives, would leave that module's other ranks waiting in them for ever. So every rank first checks what it
was given (the models of exactly the modules it runs, each on its module's collection) and all ranks agree, in one
all-reduce, on the request (the modules, their spans, the options) and on whether any rank found a fault; every
rank then raises the same error, naming each culprit rank and module.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from pgregistry._group_cache import require_distributed
from pgregistry.grad_stats import backend_device

__all__ = ["agree_over_the_world"]

_SHOWN = 4
"""How many ranks' errors a message quotes in full."""


def agree_over_the_world(
    subject: str, fields: Mapping[str, str], error: str | None, *, failed: str = "were given bad input"
) -> None:
    """Raise ``ValueError`` on every rank when the ranks' ``fields`` differ or any rank's ``error`` is set.

    One all-reduce (MAX of the request's digest, of its negation and of a fault flag) decides. Only when it says no
    is more exchanged: differing requests raise a message naming the fields that differ and which ranks asked for
    which value; faults are gathered and every rank raises one message quoting
    each faulty rank's error (``failed`` says what happened to those ranks). ``subject`` names the call in
    messages.
    """
    require_distributed(subject)
    request = "|".join(f"{key}={value}" for key, value in fields.items())
    digest = int(hashlib.sha256(request.encode()).hexdigest()[:15], 16)
    verdict = torch.tensor([digest, -digest, int(error is not None)], dtype=torch.int64, device=backend_device(None))
    dist.all_reduce(verdict, op=dist.ReduceOp.MAX)
    largest, negated_smallest, faulty = (int(value) for value in verdict.tolist())
    if largest != -negated_smallest:  # every rank takes this branch alike
        _raise_differences(subject, fields)
    if not faulty:
        return
    errors: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    found = [(rank, text) for rank, text in enumerate(errors) if text is not None]
    quoted = "; ".join(f"rank {rank}: {text}" for rank, text in found[:_SHOWN])
    more = f"; and {len(found) - _SHOWN} more rank(s)" if len(found) > _SHOWN else ""
    ranks = [rank for rank, _ in found]
    raise ValueError(f"{subject}: ranks {ranks} {failed} ({quoted}{more}); this rank is rank {dist.get_rank()}")


def _raise_differences(subject: str, fields: Mapping[str, str]) -> None:
    """Gather every rank's ``fields`` and raise, naming each field that differs and which ranks asked for what."""
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
        f"ranks disagree on {subject}: {'; '.join(differences)}; this rank is rank {dist.get_rank()}. Every rank "
        "must pass the same modules, in the same order, and the same options"
    )


def _shorten(text: str, limit: int = 300) -> str:
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"

"""The ranks a checkpoint call runs over, and the decisions they take alike.

So a fault on one raises on all.

A checkpoint call runs over the ranks of its model's collection: the world for a model whose layout
spans it, the module's span for one module of a job whose layout covers part of the world
(:class:`Scope`). Every collective of the call runs over those ranks only: over the world, a
module's save would wait for ranks of other modules that do not call it, or mix their files with its
own.

Saving and loading are collective: a rank that raised alone would leave its peers waiting for ever
in the next collective (the next all-reduce of a check, the all-gather of restored shards, DCP's own
exchanges). So each step that can fail on one rank (reading its files, naming its parameters,
writing its file) runs on every rank of the scope, and one all-reduce of a failure flag per rank
then tells every rank which failed: the rank that failed raises its own error, the others an error
saying another rank failed and naming it ("(rank 3: see its error)"). Nothing is copied before that
verdict. Outside a distributed world these are plain calls.

A rank that never answers (killed, its node lost, stuck) fails its peers' next collective with the
backend's words only (gloo's "Connection closed by peer", a timeout). :func:`name_lost_ranks` turns
that into a ``RuntimeError`` naming the call, its checkpoint directory, the ranks that did not
answer and what to do: each rank whose collective failed records in the world's store that it is
still there, waits up to :data:`ANSWER_WAIT_S` for the others' records, and names the ranks of the
scope whose record never came.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, TypeVar

import attrs
import torch
import torch.distributed as dist

from pgregistry._runtime.agreement import faulty_ranks, raise_own_or_peers_fault, ranks_label
from pgregistry.grad_stats import backend_device

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from pgregistry.collection import ProcessGroupCollection

__all__ = [
    "ANSWER_WAIT_S",
    "Scope",
    "run_agreed_step",
    "digest_of",
    "each_same_on_every_rank",
    "elsewhere_named",
    "name_lost_ranks",
    "max_over_ranks",
    "raise_on_every_rank",
    "refuse_another_scope",
    "same_on_every_rank",
    "scope_groups",
    "scope_of",
    "world_scope",
]

T = TypeVar("T")

ANSWER_WAIT_S: Final = 1.0
"""How long a rank whose collective failed waits for its peers to record in the store that they are
still there: the ranks that detect the failure (a peer's closed connection, a timeout) do so within
milliseconds of each other."""

_COLLECTIVES_MODULE: Final = os.path.join("torch", "distributed", "distributed_c10d.py")

_calls: dict[tuple[int, int] | None, Iterator[int]] = {}
"""Numbers the calls :func:`name_lost_ranks` watches, per scope (its span; ``None`` for the world),
so each failure's records have keys of their own: every rank of a scope makes the same calls over it
in the same order (each is collective), so the numbers agree among them, whatever calls over other
scopes some of them made in between."""


@attrs.frozen(slots=True)
class Scope:
    """The ranks one checkpoint call runs over: the world, or one module's span of it.

    ``rank`` and ``size`` are this rank's index among them and their number (rank files are numbered
    by it); ``group`` is their communicator (``None`` when they are one rank, or outside a
    distributed world: nothing to reduce); ``span`` is ``(first world rank, number of ranks)`` and
    ``name`` the module's build name, both ``None`` for the world.
    """

    rank: int
    size: int
    group: Any = None
    span: tuple[int, int] | None = None
    name: str | None = None

    @property
    def label(self) -> str:
        """How messages name the scope."""
        return "the world" if self.span is None else _module_label(self.name, self.span)

    def identity(self) -> dict[str, Any]:
        """What a rank file records of the scope saving it (none for the world, as before spans)."""
        if self.span is None:
            return {}
        return {"module": self.name, "span": list(self.span)}


def refuse_another_scope(
    directory: str | Path, saved: Mapping[str, Any], scope: Scope, *, world: str = "the whole world"
) -> None:
    """``ValueError`` naming both unless a checkpoint was saved over ``scope``, as the load is.

    ``saved`` is what the checkpoint records of the scope that saved it (:meth:`Scope.identity`:
    nothing for the world, which ``world`` names); a module's checkpoint loads into the same module
    on the same ranks."""
    if saved == scope.identity():
        return
    what = _module_label(saved.get("module"), saved["span"]) if "span" in saved else world
    raise ValueError(
        f"{directory} holds a checkpoint of {what}, and this load is of "
        f"{scope.label}: a module's checkpoint loads into the same module "
        "on the same ranks (save each module into its own directory)"
    )


def _module_label(name: str | None, span: Sequence[int]) -> str:
    """How messages name module ``name`` over ``span``, ``(first world rank, number of ranks)``."""
    first, size = span
    return f"module {name!r} (ranks {first}-{first + size - 1})"


def world_scope() -> Scope:
    """The default group; ``(0, 1)`` outside a distributed world."""
    if dist.is_available() and dist.is_initialized():
        size = dist.get_world_size()
        return Scope(dist.get_rank(), size, dist.group.WORLD if size > 1 else None)
    return Scope(0, 1)


def scope_of(collection: ProcessGroupCollection | None) -> Scope:
    """The ranks a checkpoint of a model on ``collection`` runs over.

    Its layout's span when that is part of the world, else the world (a collection assembled by
    hand, or none: the global grid).

    ``ValueError`` when this rank is outside the span: it takes no part in the module's checkpoint
    (no rank of the span waits for it, so it raises alone)."""
    world = world_scope()
    layout = collection.layout if collection is not None else None
    if collection is None or layout is None:
        return world
    first, stop = layout.rank_range()
    if (first, stop) == (0, world.size):
        return world
    if not collection.is_member:
        raise ValueError(
            f"a checkpoint of {collection.describe()} runs on its ranks "
            f"{first}-{stop - 1}; this rank ({world.rank}) is not one "
            "of them: save or load a module on the ranks that run it"
        )
    group = _span_group(collection, (first, stop))
    return Scope(world.rank - first, stop - first, group, (first, stop - first), collection.name)


def _span_group(collection: ProcessGroupCollection, span: tuple[int, int]) -> ProcessGroup | None:
    """The communicator of the span's ranks; ``None`` for a span of one rank.

    The collection's ``intra_dist_opt`` group (a build makes it hold the span), else the one the
    group cache holds for them."""
    first, stop = span
    if stop - first == 1:
        return None
    ranks = tuple(range(first, stop))
    if collection.is_set("intra_dist_opt"):
        group = collection.get("intra_dist_opt")
        if group is not None and tuple(dist.get_process_group_ranks(group)) == ranks:
            return group
    from pgregistry._runtime.group_cache import CACHE

    if CACHE.options_of(ranks) is None:
        raise ValueError(
            f"{collection.describe()} spans ranks {first}-{stop - 1}, but no communicator "
            "over them exists: build the layout with pgregistry.build, which makes one"
        )
    return CACHE.group(ranks)


def max_over_ranks(values: list[int], scope: Scope) -> list[int]:
    """The element-wise maximum of ``values`` over ``scope``'s ranks (``values`` for one rank).

    Every rank of the scope must call it with as many values; the checks built on it therefore raise
    on every rank alike.
    """
    if scope.size == 1 or scope.group is None:
        return values
    tensor = torch.tensor(values, dtype=torch.int64, device=backend_device(scope.group))
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=scope.group)
    return [int(v) for v in tensor.tolist()]


def digest_of(keys: list[str]) -> int:
    """A 60-bit digest of ``keys`` (in their order).

    Ranks all-reduce its maximum and its negation's to learn whether they all hold the same keys, in
    one collective of two integers."""
    return int(hashlib.sha256("\n".join(keys).encode()).hexdigest()[:15], 16)


def same_on_every_rank(keys: list[str], scope: Scope) -> bool:
    """Whether every rank of ``scope`` holds the same ``keys``, in the same order.

    One all-reduce of two integers: the maximum of :func:`digest_of` and of its negation."""
    return each_same_on_every_rank([keys], scope)[0]


def each_same_on_every_rank(key_lists: list[list[str]], scope: Scope) -> list[bool]:
    """For each list of ``key_lists``, whether every rank of ``scope`` holds it alike, in order.

    One all-reduce of two integers a list: :func:`same_on_every_rank`'s, for all of them at once."""
    digests = [digest_of(keys) for keys in key_lists]
    maxima = max_over_ranks([value for digest in digests for value in (digest, -digest)], scope)
    return [largest == -maxima[2 * at + 1] for at, largest in enumerate(maxima[::2])]


def raise_on_every_rank(error: BaseException | None, elsewhere: Exception, scope: Scope) -> None:
    """Return when no rank of ``scope`` has an error, else raise on every rank.

    ``error`` on the ranks that have one and ``elsewhere`` on the others, naming the ranks that have
    one (:func:`elsewhere_named`). Collective: one all-reduce of a flag per rank, so every rank must
    call it, failed or not."""
    raise_own_or_peers_fault(error, partial(elsewhere_named, elsewhere), scope_groups(scope))


def run_agreed_step(step: Callable[[], T], elsewhere: Exception, scope: Scope) -> T:
    """``step()`` on this rank, raising on every rank of ``scope`` when it raised on any.

    Its own error where it raised, ``elsewhere`` naming the ranks where it did on the others (the
    same one all-reduce as :func:`raise_on_every_rank`)."""
    try:
        result = step()
    except Exception:
        faulty_ranks(True, scope_groups(scope))  # tell the other ranks before raising here
        raise
    raise_on_every_rank(None, elsewhere, scope)
    return result


def elsewhere_named(elsewhere: Exception, faulty: list[int]) -> Exception:
    """``elsewhere`` naming the world ranks ``faulty`` that have a fault.

    ``elsewhere`` is what a rank without a fault raises ("another rank could not ..."); the names
    tell its reader whose log holds the cause."""
    its = "its error" if len(faulty) == 1 else "their errors"
    return type(elsewhere)(f"{elsewhere} ({ranks_label(faulty)}: see {its})")


def scope_groups(scope: Scope) -> list[Any]:
    """The communicators a verdict over ``scope`` all-reduces over: its group, none for one rank."""
    return [scope.group] if scope.size > 1 and scope.group is not None else []


@contextmanager
def name_lost_ranks(operation: str, directory: str | Path, scope: Scope) -> Iterator[None]:
    """Run the block, naming the ranks that did not answer when a collective in it fails.

    The block is one checkpoint call of ``operation`` on ``directory``. When a collective in it
    fails (a rank of ``scope`` lost, stuck or killed), raise ``RuntimeError`` naming the call, the
    directory, the ranks that did not answer and what to do, chained to the backend's error. Every
    other error passes as it is."""
    call = next(_calls.setdefault(scope.span, itertools.count()))
    try:
        yield
    except RuntimeError as exc:
        if not _is_collective_failure(exc) or scope.size == 1:
            raise
        missing = _ranks_not_answering(
            scope, f"pgregistry/checkpoint/{scope.span}/{call}/{operation}"
        )
        if missing is None:
            who = "the ranks that did not answer cannot be told (the store is unreachable too)"
        elif missing:
            who = (
                f"rank(s) {missing} did not answer within {ANSWER_WAIT_S:g} "
                "s (killed, lost or stuck: see their logs)"
            )
        else:
            who = (
                "every rank answered afterwards (a rank was "
                "slower than the process group's timeout allows)"
            )
        kept = (
            "no file of this save is under a checkpoint's name and earlier "
            "checkpoints are untouched: restart from the last complete one"
            if operation.startswith("save")
            else "the checkpoint on disk is unchanged: load it again"
        )
        raise RuntimeError(
            f"{operation} of the checkpoint {directory} over {scope.label} failed: {who}; "
            f"{kept} once every rank is up (this rank's collective failed with: {exc})"
        ) from exc


def _is_collective_failure(exc: RuntimeError) -> bool:
    """Whether ``exc`` is a failed collective rather than an error of the checkpoint's own.

    A failed collective is the backend's error raised from a torch.distributed collective; the
    checkpoint's own errors name their cause already."""
    if isinstance(exc, dist.DistError):
        return True
    frames = traceback.extract_tb(exc.__traceback__)
    return bool(frames) and frames[-1].filename.endswith(_COLLECTIVES_MODULE)


def _ranks_not_answering(scope: Scope, prefix: str) -> list[int] | None:
    """The world ranks of ``scope`` that have not recorded ``<prefix>/<rank>`` in time.

    In the default store, within :data:`ANSWER_WAIT_S` of this rank recording its own; ``None`` when
    the store cannot be used (it may have been hosted by the lost rank)."""
    first = scope.span[0] if scope.span is not None else 0
    ranks = range(first, first + scope.size)
    try:
        store = dist.distributed_c10d._get_default_store()  # the world's store: no public accessor
        store.set(f"{prefix}/{dist.get_rank()}", "here")
        deadline = time.monotonic() + ANSWER_WAIT_S
        while True:
            missing = [rank for rank in ranks if not store.check([f"{prefix}/{rank}"])]
            if not missing or time.monotonic() >= deadline:
                return missing
            time.sleep(0.05)
    except Exception:  # noqa: BLE001
        # A store that fails too: the message says the ranks cannot be told.
        return None

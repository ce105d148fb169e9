"""Survive a lost replica in-process: survivors agree on who is lost, rebuild their groups, go on.

After a collective failed (a peer died, or timed out), every process that is still alive calls
:func:`recover`. The survivors agree on the lost ranks through a *store no lost rank was needed
for*: a ``TCPStore`` (or any ``torch.distributed.Store``) hosted by the launcher (torchrun's agent
store) or by a process that outlives every rank it may lose. The default store of a job whose rank 0
hosts it dies with rank 0; such a job survives no loss of rank 0. The layout decides the rest
(:meth:`~pgregistry.layout.ParallelLayout.shrink`): the ranks tied to a lost one (its whole dense
and expert replicas) leave too, the others are renumbered so every group keeps its members, and the
world is re-formed over them under a fresh store prefix (a *generation*), where the registry builds
the smaller layout's collection.

The protocol, all through the store, so it needs no collective over the broken world:

1. *check in*: each survivor writes its record (the last step it committed, the lost ranks it was
   told of) under this generation's prefix, then counts itself;
2. *decide*: once every rank that may be alive has checked in (or ``wait`` seconds passed), a
   survivor proposes the ranks whose records exist; the store's ``compare_set`` keeps the first
   proposal, so every survivor reads one decision. A rank that checks in after it is lost: it learns
   so and raises;
3. *confirm*: every rank the decision names answers a confirmation round, decided the same way; a
   rank that checked in and then died (a second failure) does not answer, and is lost like the
   first: the ranks that answered confirm again among themselves
   (:mod:`pgregistry._runtime.survivors`);
4. *judge*: every survivor reads every record the confirmation names and derives, from the same
   data, the same verdict: the lost set, :meth:`~ParallelLayout.shrink`'s result or its error,
   whether the survivors committed the same step. Bad input (ranks out of range, survivors told
   different lost sets, a loss that leaves no copy) is therefore the same error on every survivor,
   and no survivor goes on alone;
5. *rebuild*: pgregistry's communicators (of every build: other collections are rebuilt by their
   owners on the new world) and the default group are destroyed, the default group is re-formed over
   the survivors under the next generation's prefix, and the layout's collection built there. A
   survivor lost after the confirmation makes the re-formation fail on the others (at the timeout at
   most): a ``RuntimeError`` naming the second failure and the phase it hit, saying to restart the
   job from the last checkpoint.

The store is the one thing every survivor must reach: when it stops answering (its host died: a
training rank that hosted it, as rank 0 hosts the store of an ``env://`` rendezvous), no survivor
can learn what the others know, and the loss is not survivable. Every survivor then raises
:class:`StoreLost`, naming the store's address and the phase, and saying to restart from the last
checkpoint with a store no training rank hosts.

A step in which the fault happened must not be half-applied: :func:`commit` is one all-reduce over
the layout's span (two where the span holds several distributed-optimizer instances: within one,
then across them) that every rank runs after its grads are synchronised and before
``optimizer.step()``; a rank whose step failed never reaches it, so no rank can pass it and step
without the others (the survivors then redo that step on the smaller grid). Should a rank die inside
the commit itself, some survivors may have stepped and others not: the verdict compares the steps
they committed and raises on every survivor, saying to reload a checkpoint.

Communicators: on this path every communicator of the smaller layout is created anew (``new_group``
under the new default group). torch binds a group to the default group it was created under (its
global ranks), and a gloo group one of whose collectives was interrupted by the fault has its
members' sequence numbers out of step, so keeping even a group whose members all survive would not
be safe here. :attr:`Recovered.communicators_keepable` counts those a backend that can keep them
(NCCL's ``shrink_group``, torch >= 2.10 with NCCL >= 2.27) would keep.

Consumers re-derive from the new collection: the data-parallel rank and size data is sharded by, the
RNG streams, grad statistics; :func:`carry_optimizer_state` moves a replicated optimizer's state
into one built on it.

Torch is imported inside functions only.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import attrs

from pgregistry._runtime.logger import get_logger
from pgregistry._runtime.survivors import agree_on_survivors

if TYPE_CHECKING:
    from torch.distributed import Store

    from pgregistry.collection import ProcessGroupCollection
    from pgregistry.layout import ParallelLayout, Shrunk
    from pgregistry.optim import ChainedOptimizer

__all__ = [
    "LeftWithReplica",
    "Recovered",
    "StoreLost",
    "carry_optimizer_state",
    "commit",
    "generation",
    "recover",
]

_log = get_logger(__name__)

_PREFIX = "pgregistry/recovery"
_generation = 0
"""This process's world generation.

0 for the world it started in, one more for each recovery it decided.
"""


class LeftWithReplica(RuntimeError):
    """This rank is alive but must leave: its replica lost a rank (``shrunk`` says who goes on).

    Raised by :func:`recover` on the live ranks of a replica that lost a rank: the smaller layout
    drops that replica whole, so these ranks have no place in the re-formed world: end the
    process, or keep it as a spare.

    Args:
        message: the text :func:`recover` gives: the lost ranks and why this rank leaves.
        shrunk: kept as the attribute of that name.

    Attributes:
        shrunk: The :class:`~pgregistry.layout.Shrunk` every rank agreed on: who was lost, who
            left with them, the smaller layout and the old -> new rank map.

    Example::

        try:
            recovered = recover(collection, store, committed_step=step)
        except LeftWithReplica as left:
            log.info("leaving", lost=left.shrunk.lost)
            sys.exit(0)
    """

    def __init__(self, message: str, shrunk: Shrunk) -> None:
        super().__init__(message)
        self.shrunk = shrunk


class StoreLost(RuntimeError):
    """The store :func:`recover` was given stopped answering: its host is lost.

    With it goes the only place the survivors meet. Not survivable: restart the job from the last
    checkpoint. Every survivor raises it, naming the store's address and the phase it was in; the
    store's own error is chained as ``__cause__``.

    Args:
        message: the store's address, this rank, the phase and what to do.

    Example::

        try:
            recovered = recover(collection, store, committed_step=step)
        except StoreLost:
            log.exception("store lost: restart from the last checkpoint")
            sys.exit(1)  # the launcher restarts the job with a store no training rank hosts
    """


@attrs.frozen(slots=True, kw_only=True)
class Recovered:
    """What :func:`recover` returns on a rank that goes on.

    Everything training needs to continue on the smaller world (the new collection, this rank's
    new number, the step to resume after) and the figures of the recovery itself. Each field is
    described below.

    Example::

        recovered = recover(collection, store, committed_step=step)
        collection, step = recovered.collection, recovered.committed_step + 1
        dp = collection.get("dp")  # shard the data over the smaller data-parallel group
        sampler = DistributedSampler(data, num_replicas=group_size(dp), rank=group_rank(dp))
    """

    collection: ProcessGroupCollection
    """The smaller layout's collection, on the re-formed world."""
    generation: int
    """The world generation it belongs to (0: the world the job started in)."""
    shrunk: Shrunk
    """Who was lost, who left with them, the smaller layout and the old -> new rank map."""
    old_rank: int
    rank: int
    """This process's rank before and after."""
    committed_step: int
    """The last step every survivor committed; training goes on from the next one."""
    communicators_created: int
    """Communicators holding this rank made on the re-formed world (its default group included)."""
    communicators_keepable: int
    """Communicators holding this rank whose members all survived: those a backend able to keep them
    would keep (this path creates them anew: see the module docstring)."""
    agree_s: float
    rebuild_s: float
    """Seconds spent agreeing on the lost set, and re-forming the world and its groups.

    Agreeing runs from check-in to verdict.
    """


def generation() -> int:
    """This process's world generation: 0 for the world it started in, one more for each recovery.

    Returns:
        The generation, whose prefix the re-formed world's store keys are under.

    Example:
        >>> generation()  # no recovery in this process yet
        0
    """
    return _generation


def commit(collection: ProcessGroupCollection) -> None:
    """Mark this rank's step as ready to apply: one all-reduce of one integer over the span.

    Over ``intra_dist_opt``, the whole span as :func:`pgregistry.build` sets it; where it is one
    instance of a partial distributed optimizer (Megatron-Core's
    ``num_distributed_optimizer_instances``), then over ``inter_dist_opt`` too (two all-reduces).

    Call it after the step's last collective (grads synchronised, statistics reduced) and before
    ``optimizer.step()``. A rank whose step failed never reaches it, so it fails on every rank and
    no rank applies a step another did not; the survivors call :func:`recover` and redo the step.

    Args:
        collection: the collection the step ran on.

    Raises:
        TypeError: ``collection`` no collection (a group).
        ValueError: a destroyed collection (the one before a recovery: commit on
            :attr:`Recovered.collection`); one whose ``intra_dist_opt`` is not set.

    Example:
        On every rank of a 2-rank world (as :func:`pgregistry.testing.run_world` starts it):

        >>> import torch
        >>> from pgregistry import ParallelLayout, build, build_optimizer, clip_grad_norm_
        >>> pg = build(ParallelLayout(num_ranks=2))
        >>> model = torch.nn.Linear(2, 1, bias=False)
        >>> optimizer = build_optimizer(model, pg)
        >>> loss = model(torch.tensor([[3.0, 4.0]])).sum()
        >>> loss.backward()
        >>> clip_grad_norm_(model, 1.0, pg)
        tensor(5.)
        >>> commit(pg)  # raises on every survivor when a rank was lost in the step
        >>> optimizer.step()
    """
    import torch
    import torch.distributed as dist

    from pgregistry._runtime.agreement import world_device
    from pgregistry._runtime.resolve import check_usable
    from pgregistry.collection import group_size
    from pgregistry.grad_stats._functional import verdict_groups

    intra, *inter = verdict_groups(check_usable(collection, "commit"), "commit")
    layout = collection.layout
    span = layout.num_ranks if layout is not None else dist.get_world_size()
    # One instance of a partial distributed optimizer (intra_dist_opt smaller than the span) is
    # followed by the group across instances: intra alone let another instance step alone.
    for group in [intra, *inter] if group_size(intra) < span else [intra]:
        if group_size(group) > 1:
            dist.all_reduce(torch.ones(1, dtype=torch.int32, device=world_device()), group=group)


def recover(
    collection: ProcessGroupCollection,
    store: Store,
    *,
    committed_step: int,
    lost: Iterable[int] | None = None,
    wait: float = 10.0,
    backend: str | None = None,
    timeout: timedelta | float | None = None,
) -> Recovered:
    """After a lost rank, re-form the world over the ranks that go on; return their collection.

    The survivors agree on the lost ranks first (see the module docstring for the protocol and the
    store it needs). A survivor that checked in and then died before the survivors confirmed who
    goes on is lost like the first (it costs one more ``wait``). A rank told that every rank is lost
    is itself among them.

    Args:
        collection: the collection the failed step ran on (its layout must span the whole world).
        store: a store every survivor reaches that no lost rank hosted, holding no keys of an
            earlier run under ``pgregistry/recovery`` (a store kept across restarts: give each run a
            ``PrefixStore`` of its own).
        committed_step: the last step this rank applied.
        lost: the ranks known to be lost (from the launcher), or ``None`` to take as lost every rank
            that has not called ``recover`` within ``wait`` seconds of this rank (more than the
            collective timeout, so a survivor stuck in a collective until it times out arrives in
            time).
        wait: seconds to wait for the others to check in, and for each confirmation round.
        backend, timeout: for the new world and its groups (``backend`` defaults to the old
            world's).

    Returns:
        :class:`Recovered`, on a rank that goes on.

    Raises:
        LeftWithReplica: on a live rank that must leave with its replica.
        RuntimeError: on a rank that is lost (named in ``lost``, or checking in after the survivors
            decided without it), when survivors committed different steps, or when a survivor is
            lost after the confirmation, while the world is re-formed (naming the phase: restart
            from the last checkpoint).
        StoreLost: on every survivor when ``store`` stops answering (its host died; not survivable).
        ValueError: on every survivor alike, for lost ranks outside the world, survivors told
            different lost sets, or a loss that leaves no copy of some state (reload a checkpoint);
            before this rank checks in, a ``wait``, ``timeout`` or ``backend`` the new world could
            not use (``TypeError`` for one of the wrong type), so the old world is kept.

    Example::

        pg = build(layout, name="job", timeout=timeout)  # a collective fails in timeout seconds
        try:
            step_once(model, optimizer, pg)  # the step's collectives, then commit(pg), then step
            step += 1
        except RuntimeError:  # a collective failed: a peer died or timed out
            # On every survivor; a wait longer than the timeout: one stuck in a collective arrives
            recovered = recover(pg, store, committed_step=step, wait=2 * timeout)
            pg = recovered.collection  # rebuild the optimizer and the data shards on it
    """
    import torch.distributed as dist

    from pgregistry import registry
    from pgregistry._runtime.agreement import require_distributed
    from pgregistry._runtime.integers import as_integer
    from pgregistry._runtime.resolve import check_usable

    global _generation
    require_distributed("pgregistry.recovery.recover")
    layout = check_usable(collection, "recover").layout
    if layout is None:
        raise ValueError(
            "recover needs a collection built by pgregistry.build (it knows its layout)"
        )
    world_size, old_rank = dist.get_world_size(), dist.get_rank()
    if layout.rank_range() != (0, world_size):
        raise ValueError(
            f"recover re-forms the whole world, so the layout must span it: {layout!r} spans ranks "
            f"{layout.rank_offset}-{layout.rank_offset + layout.num_ranks - 1} of {world_size}"
        )
    step = as_integer(committed_step)  # np.int64(5) is step 5
    if step is None:
        raise TypeError(
            f"committed_step must be an integer (the last step applied), got {committed_step!r}"
        )
    committed_step = step
    # An infinite wait (lost=None) would wait for ever for a rank that never comes.
    if not isinstance(wait, int | float) or isinstance(wait, bool) or not 0 < wait < math.inf:
        raise ValueError(f"wait must be a positive, finite number of seconds, got {wait!r}")
    # The new world is made after the old one is destroyed: options it would refuse then lose the
    # job (and were reported as a survivor lost after the decision).
    _check_new_world_options(backend, timeout)
    told = None if lost is None else _as_ranks(lost)
    if told is not None and old_rank in told:
        raise RuntimeError(
            f"rank {old_rank} called recover but is among the lost ranks {sorted(told)} "
            "it was given: a lost rank takes no part in the recovery; end this process"
        )
    started = time.perf_counter()
    prefix = f"{_PREFIX}/{_generation}"
    try:
        records = agree_on_survivors(
            store, prefix, old_rank, world_size, committed_step, told, wait
        )
    except dist.DistNetworkError as error:
        raise StoreLost(
            _store_lost(store, old_rank, "the survivors agreed on who is alive", error)
        ) from error
    _generation += 1
    shrunk, step = _survivors_verdict(layout, records, world_size, old_rank)
    agreed = time.perf_counter()
    old_backend = dist.get_backend()
    keepable = _count_keepable(layout, shrunk, old_rank)
    registry.destroy()
    dist.destroy_process_group()
    new_rank = shrunk.rank_map[old_rank]
    wanted = (
        timeout if isinstance(timeout, timedelta) or timeout is None else timedelta(seconds=timeout)
    )
    init: dict[str, Any] = {"timeout": wanted} if wanted is not None else {}
    world_store = dist.PrefixStore(f"{_PREFIX}/{_generation}/world", store)
    before = registry.communicators_created()
    phase = (
        f"the default group of generation {_generation} was "
        f"re-formed over old ranks {list(shrunk.rank_map)}"
    )
    try:
        dist.init_process_group(
            backend or old_backend,
            store=world_store,
            rank=new_rank,
            world_size=len(shrunk.rank_map),
            **init,
        )
        phase = (
            f"the groups of {shrunk.layout!r} were built on "
            f"the re-formed world of generation {_generation}"
        )
        new = registry.build(shrunk.layout, name=collection.name, backend=backend, timeout=timeout)
    except (
        RuntimeError
    ) as error:  # torch's DistError and its store and backend errors are RuntimeErrors
        if not _store_answers(store):
            raise StoreLost(_store_lost(store, old_rank, phase, error)) from error
        raise RuntimeError(
            "a second failure during recovery, after the survivors had confirmed who goes on: "
            f"rank {old_rank} (-> {new_rank}) failed while {phase}, so a rank that was to go on "
            "was lost (or stopped) after the decision. Recovery cannot go on from here: end every "
            f"process and restart the job from the last checkpoint. The backend said: {error}"
        ) from error
    created = registry.communicators_created() - before + 1
    rebuilt = time.perf_counter()
    _log.info(
        "recovered",
        generation=_generation,
        lost=list(shrunk.lost),
        leaving=list(shrunk.leaving),
        old_rank=old_rank,
        rank=new_rank,
        world_size=len(shrunk.rank_map),
        created=created,
        keepable=keepable,
    )
    return Recovered(
        collection=new,
        generation=_generation,
        shrunk=shrunk,
        old_rank=old_rank,
        rank=new_rank,
        committed_step=step,
        communicators_created=created,
        communicators_keepable=keepable,
        agree_s=agreed - started,
        rebuild_s=rebuilt - agreed,
    )


def _check_new_world_options(backend: object, timeout: object) -> None:
    """Refuse a ``backend`` or ``timeout`` the re-formed world could not be made with.

    The checks of :func:`pgregistry.registry.build` (``TypeError``, ``ValueError``), and a backend
    this torch does not have (``ValueError``), before this rank checks in."""
    import torch.distributed as dist

    from pgregistry._runtime.group_cache import GroupOptions

    GroupOptions.of(backend, timeout)  # type: ignore[arg-type]
    if isinstance(backend, str):
        # "gloo", or per device "cpu:gloo,cuda:nccl"
        names = [part.split(":")[-1].strip() for part in backend.split(",")]
        missing = [name for name in names if not dist.is_backend_available(name)]
        if missing:
            raise ValueError(
                f"backend {backend!r} names {missing}, which this torch cannot use here: give "
                "one it has ('gloo'; 'nccl' with CUDA), or None for the old world's"
            )


def _as_ranks(lost: Iterable[int]) -> list[int]:
    """The ranks of ``lost`` as ints (integers of any type); ``TypeError`` for anything else.

    Their range is the verdict's to check, so that every survivor raises it alike."""
    if isinstance(lost, str | bytes) or not isinstance(lost, Iterable):
        raise TypeError(f"lost must be an iterable of ranks or None, got {type(lost).__name__}")
    from pgregistry._runtime.integers import as_integer

    out = []
    for given in lost:
        rank = as_integer(given)  # a launcher's np.int64(3) is rank 3
        if rank is None:
            raise TypeError(f"lost rank must be an integer, got {given!r} ({type(given).__name__})")
        out.append(rank)
    return out


def _survivors_verdict(
    layout: ParallelLayout, records: dict[int, dict[str, Any]], world_size: int, rank: int
) -> tuple[Shrunk, int]:
    """The same verdict on every survivor, from the same records.

    The shrink and the committed step, or the error.
    """
    told = {r: rec["lost"] for r, rec in records.items() if rec["lost"] is not None}
    given = {tuple(sorted(set(v))) for v in told.values()}
    if len(given) > 1 or (told and len(told) != len(records)):
        said = "; ".join(f"rank {r}: {v}" for r, v in sorted(told.items()))
        raise ValueError(
            f"the survivors were told different lost ranks ({said}; "
            f"ranks {sorted(set(records) - set(told))} were told "
            "none): give every survivor the same lost ranks"
        )
    named = set(given.pop()) if given else set()
    outside = sorted(r for r in named if not 0 <= r < world_size)
    if outside:
        raise ValueError(
            f"lost rank(s) {outside} are outside the world "
            f"of {world_size} ranks (0-{world_size - 1})"
        )
    lost = (set(range(world_size)) - set(records)) | named
    shrunk = layout.shrink(sorted(lost))
    staying = {r: rec["step"] for r, rec in records.items() if r in shrunk.rank_map}
    if len(set(staying.values())) > 1:
        steps = "; ".join(f"rank {r}: {s}" for r, s in sorted(staying.items()))
        raise RuntimeError(
            f"the survivors committed different steps ({steps}): the fault hit inside "
            "the commit, so some applied a step others did not. Reload a checkpoint"
        )
    if rank not in shrunk.rank_map:
        raise LeftWithReplica(
            f"rank {rank} is alive but leaves: losing rank(s) {list(shrunk.lost)} takes ranks "
            f"{list(shrunk.leaving)} (their whole replicas); ranks {list(shrunk.rank_map)} go "
            f"on as {shrunk.layout!r}. End this process (or keep it as a spare)",
            shrunk,
        )
    return shrunk, next(iter(staying.values()))


def _store_answers(store: Store) -> bool:
    """Whether ``store`` still answers (a read of a key nobody writes)."""
    import torch.distributed as dist

    try:
        store.check([f"{_PREFIX}/probe"])
    except dist.DistNetworkError:
        return False
    return True


def _store_lost(store: Store, rank: int, phase: str, error: Exception) -> str:
    """What :class:`StoreLost` says on ``rank``.

    The store's address, the phase, why it is not survivable, and what to do."""
    import torch.distributed as dist

    underlying = store
    while isinstance(underlying, dist.PrefixStore):
        underlying = underlying.underlying_store
    host, port = getattr(underlying, "host", None), getattr(underlying, "port", None)
    where = (
        f"the {type(underlying).__name__} at {host}:{port}"
        if host is not None
        else type(underlying).__name__
    )
    return (
        f"the store recover was given ({where}) stopped answering rank {rank} while {phase}: its "
        "host is lost (when a training rank hosts it, as rank 0 hosts the store of an env:// or "
        "tcp:// rendezvous, that rank died with it). Every survivor meets the others through that "
        "store only, so this loss is not survivable: end every process and restart the job from "
        "the last checkpoint, and give recover a store no training rank hosts (torchrun's agent "
        f"store, or a TCPStore of a process outside the training ranks). The store said: {error}"
    )


def _count_keepable(layout: ParallelLayout, shrunk: Shrunk, rank: int) -> int:
    """How many of this rank's communicators the smaller layout can keep.

    Those whose members all survive and form a communicator of the smaller layout under the rank
    map."""
    from pgregistry._runtime.communicators import kinds_by_communicator

    if rank not in shrunk.rank_map:
        return 0
    new_sets = kinds_by_communicator(shrunk.layout)
    count = 0
    for ranks in kinds_by_communicator(layout):
        if rank in ranks and all(r in shrunk.rank_map for r in ranks):
            count += tuple(sorted(shrunk.rank_map[r] for r in ranks)) in new_sets
    return count


def carry_optimizer_state(old: ChainedOptimizer, new: ChainedOptimizer) -> None:
    """Move ``old``'s optimizer state into ``new``, so training goes on as if nothing happened.

    Only a replicated optimizer carries over: every data-parallel replica holds the whole state of
    its shard of the model, and a survivor keeps its shard.

    Args:
        old: the optimizer built on the collection before the recovery.
        new: the one ``build_optimizer`` built over the same model on :attr:`Recovered.collection`.

    Raises:
        TypeError: an optimizer that is no ``ChainedOptimizer`` (a torch optimizer).
        ValueError: a sharded optimizer (its state was cut over the replicas, and the lost replica's
            piece has no copy: reload a checkpoint); an optimizer whose parameters are of lower
            precision than their main grads (carrying their state is not supported: no test holds
            it; reload a checkpoint); ``new`` holding update-rule state on some rank (it has
            stepped: ``old`` and ``new`` swapped?), on every rank, before anything is carried.

    Example::

        recovered = recover(pg, store, committed_step=step, lost=lost_ranks)
        new_optimizer = build_optimizer(model, recovered.collection)
        carry_optimizer_state(optimizer, new_optimizer)
    """
    from pgregistry.optim import ChainedOptimizer, ShardedOptimizer

    for argument, optimizer in (("old", old), ("new", new)):
        if not isinstance(optimizer, ChainedOptimizer):
            raise TypeError(
                f"carry_optimizer_state takes the optimizers build_optimizer returns "
                f"(ChainedOptimizer); {argument} is a {type(optimizer).__name__}"
            )
    for child in old.chained_optimizers:
        if isinstance(child, ShardedOptimizer):
            raise ValueError(
                "a sharded optimizer's state is cut over the data-parallel replicas "
                "and the lost replica's piece has no copy: reload a checkpoint "
                "(load_optimizer_shards) instead of carrying the state over"
            )
        hooked = [p for p in child.params if getattr(p, "main_grad", p).dtype != p.dtype]
        if hooked:
            raise ValueError(
                f"{child.param_name(hooked[0])} ({hooked[0].dtype}) has main grads "
                "of another dtype: carrying the state of such parameters is not "
                "supported; reload a checkpoint"
            )
    _refuse_a_stepped_new(new)
    new.load_state_dict(old.state_dict())


def _refuse_a_stepped_new(new: ChainedOptimizer) -> None:
    """``ValueError`` on every rank of ``new``'s instance when ``new`` on any of them has stepped.

    ``new`` is the optimizer just built on the recovered collection: it holds no update-rule state
    yet. One that does is most often the old optimizer passed as ``new`` (the arguments swapped):
    its Adam moments and step counts were replaced by the fresh optimizer's empty state, without a
    word, and training went on from a cold optimizer. One flag all-reduced over
    ``new.load_groups()``, the groups of the load that follows, so no rank raises while another
    waits in it."""
    from pgregistry._runtime.agreement import raise_own_or_peers_fault, ranks_label
    from pgregistry.optim._param_state import MAIN_PARAM

    stepped = [
        child.param_name(param)
        for child in new.chained_optimizers
        for param, state in child.param_state().items()
        if any(key != MAIN_PARAM for key in state)
    ]
    raise_own_or_peers_fault(
        _refusal_of_a_stepped_new(f"(of {stepped[0]!r}, ...): it has stepped") if stepped else None,
        lambda faulty: _refusal_of_a_stepped_new(f"on {ranks_label(faulty)}"),
        new.load_groups(),
    )


def _refusal_of_a_stepped_new(where: str) -> ValueError:
    """The refusal of a ``new`` that holds update-rule state ``where`` (its parameter, or ranks)."""
    return ValueError(
        f"carry_optimizer_state: new holds update-rule state {where}, and carrying would overwrite "
        "that state with old's. new must be the optimizer build_optimizer has just built on "
        "Recovered.collection, old the one that stepped before the recovery: call "
        "carry_optimizer_state(old, new) with the arguments in that order; nothing was carried"
    )

"""One communicator per distinct rank set: the process-wide group cache and how groups are made.

* The same ranks named by two kinds (``dp`` and ``dp_cp`` when cp is 1), by two layouts (two models
  on two grids) or by a DeviceMesh flattening share one ProcessGroup.
* Every rank walks every rank set of a request, in one global order (by size, then ranks), and calls
  ``new_group`` for each distinct set once (non-members get ``NON_GROUP_MEMBER`` at no connection
  cost): one call per distinct rank set, where Megatron-Core's ``initialize_model_parallel`` calls
  ``new_group`` for every group of every kind. Not members-only creation
  (``new_group(use_local_synchronization=True)``): torch names such a group by its ranks and by how
  many groups the calling rank already holds, so two members that hold different numbers of groups
  give it two names and wait for each other until the timeout (torch 2.13, four ranks, TP 2: rank 1
  creates ``[1, 3]`` after ``[0, 1]``, rank 3 first of all), on every backend; and a group destroyed
  and created again takes its old name, and with it its members' stale addresses in the store.
* When NCCL is bound to a device at init (``init_process_group(device_id=...)``), groups are split
  from the world's communicator instead (``torch.distributed.split_group``, NCCL's
  ``ncclCommSplit``): the rank sets are dealt into families of disjoint sets (:func:`split_plan`:
  about one per group kind), and each family is one split, collective over the world, with no store
  round trip per group. An unbound world, gloo, or groups of another backend than the world's take
  ``new_group`` (:func:`split_creation` decides).
* The global order also means every member of a group reaches it after the same smaller groups, so
  group creations can never wait on each other in a cycle.
* Before creating anything, ranks exchange a digest of what they were asked for
  (``pgregistry._runtime.agreement.check_agreement``). Ranks that disagree raise on every rank,
  naming who asked for what, instead of hanging in mismatched creations.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import attrs
import torch.distributed as dist

from pgregistry._runtime.agreement import Fault, all_reached, check_agreement, require_distributed
from pgregistry.layout import RankGroup

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = [
    "CACHE",
    "GroupCache",
    "GroupOptions",
    "BUILD_ADVICE",
    "check_group_options",
    "split_chosen",
    "split_creation",
    "split_plan",
]


_LONGEST_S = 10.0**12
"""The longest timeout a build takes, in seconds (about 31,700 years: beyond it ``timedelta`` and
torch's milliseconds overflow)."""
_TIMEOUT_RANGE = "positive, finite and at most 1e12 seconds (or None for torch's default)"

BUILD_ADVICE = (
    "every rank must build the same layouts and groups, "
    "with the same names and options, in the same order"
)
"""What a disagreement about groups to create asks of the ranks."""


@attrs.frozen(slots=True)
class GroupOptions:
    """What a communicator is created with besides its ranks (``None``: ``new_group``'s pick)."""

    backend: str | None = None
    timeout: timedelta | None = None

    @classmethod
    def of(cls, backend: str | None, timeout: timedelta | float | None) -> GroupOptions:
        """Checked options, refused now where gloo would fail later, obscurely, or wait for ever.

        ``TypeError`` for a ``backend`` that is no name, or a ``timeout`` that is neither a number
        of seconds nor a ``timedelta`` (a string, a bool); ``ValueError`` for a timeout that is not
        positive and finite, or beyond 1e12 s."""
        if backend is not None and not isinstance(backend, str):
            raise TypeError(
                f"backend must be a backend's name ('gloo', 'nccl') or None, got {backend!r}"
            )
        if timeout is None:
            return cls(backend, None)
        if isinstance(timeout, timedelta):
            seconds = timeout.total_seconds()
        elif isinstance(timeout, numbers.Real) and not isinstance(timeout, bool):
            seconds = float(timeout)
        else:
            raise TypeError(
                "timeout must be a number of seconds (an int or a float) or a datetime.timedelta, "
                f"or None for torch's default; got {timeout!r} ({type(timeout).__name__})"
            )
        if not 0 < seconds <= _LONGEST_S:  # NaN fails this too
            raise ValueError(f"timeout must be {_TIMEOUT_RANGE}; got {timeout!r}")
        return cls(
            backend, timeout if isinstance(timeout, timedelta) else timedelta(seconds=seconds)
        )

    def describe(self) -> dict[str, str]:
        """Option -> text, for messages and the agreement check."""
        return {"backend": repr(self.backend), "timeout": repr(self.timeout)}


def check_group_options(
    backend: object, timeout: object
) -> tuple[GroupOptions, dict[str, str], Fault]:
    """The options of ``backend`` and ``timeout``, their text for the agreement, and a refusal.

    The options :meth:`GroupOptions.of` makes, their text, and ``None``; or, when it refuses them,
    torch's defaults, the text of what was given and the refusal, which the caller's agreement
    raises on every rank (a rank raising alone would leave the others waiting in it)."""
    try:
        options = GroupOptions.of(backend, timeout)  # type: ignore[arg-type]
    except (TypeError, ValueError) as exc:
        return GroupOptions(), {"backend": repr(backend), "timeout": repr(timeout)}, exc
    return options, options.describe(), None


class GroupCache:
    """Every communicator this process created or adopted, keyed by its sorted rank set."""

    def __init__(self) -> None:
        self._groups: dict[RankGroup, tuple[ProcessGroup, GroupOptions]] = {}
        self._adopted: set[RankGroup] = set()
        self._twins: list[ProcessGroup] = []
        self.created = 0
        """How many communicators holding this rank this process created, by ``new_group`` or
        ``split_group`` (a non-member's ``new_group`` call creates none; for benchmarks and
        tests)."""
        self.splits = 0
        """How many ``split_group`` calls this process joined (each collective over the world)."""

    def group(self, ranks: RankGroup) -> ProcessGroup:
        """The communicator of ``ranks`` (sorted), which must exist."""
        return self._groups[ranks][0]

    def options_of(self, ranks: RankGroup) -> GroupOptions | None:
        """The options ``ranks``' communicator was created with; ``None`` when it has none yet."""
        existing = self._groups.get(ranks)
        return existing[1] if existing is not None else None

    def create(self, rank_sets: Iterable[RankGroup], options: GroupOptions) -> None:
        """Create the communicators of ``rank_sets`` that do not exist yet, in the one global order.

        ``rank_sets`` are the same on every rank. Collective over the world: split where
        :func:`split_creation` holds, else one ``new_group`` per missing set on every rank."""
        ordered = sorted(set(rank_sets), key=lambda r: (len(r), r))
        missing = [ranks for ranks in ordered if not self._has_communicator(ranks, options)]
        if split_creation(options):
            self._split_world_communicator(missing, options)
            return
        for ranks in missing:
            self._groups[ranks] = (self._new_group(ranks, options), options)
        if missing:
            all_reached(options.timeout)  # see _new_group

    def _has_communicator(self, ranks: RankGroup, options: GroupOptions) -> bool:
        """Whether ``ranks`` has its communicator (``ValueError`` when created with other options).

        The world's own ranks with default options are the world's group, which needs no
        creating."""
        existing = self._groups.get(ranks)
        if existing is not None:
            if existing[1] != options:
                raise ValueError(
                    f"ranks {list(ranks)} already have a communicator created "
                    f"with {existing[1].describe()}; refusing a second one "
                    f"with {options.describe()} (one communicator per rank set)"
                )
            return True
        if (
            len(ranks) == dist.get_world_size() and options == GroupOptions()
        ):  # sorted and distinct: the world
            world = dist.group.WORLD
            assert world is not None  # callers checked that torch.distributed is initialised
            self._groups[ranks] = (world, options)
            return True
        return False

    def _new_group(self, ranks: RankGroup, options: GroupOptions) -> ProcessGroup:
        """``new_group`` of ``ranks``, called by every rank of the world.

        Only then do torch's own names for it agree across ranks.

        Callers wait for every rank after their last creation
        (:func:`~pgregistry._runtime.agreement.all_reached`): gloo finishes connecting a pair on one
        side before the other, so a rank that went on and destroyed its new communicators
        (``registry.destroy()`` right after a build) closed pairs a peer was still connecting, and
        the peer failed ("connectFullMesh failed ... Connection closed by peer", 3 runs in 36 of an
        8-rank test)."""
        try:
            group = dist.new_group(list(ranks), backend=options.backend, timeout=options.timeout)
        except RuntimeError as exc:  # the backend's own text names neither the group nor the rank
            raise RuntimeError(
                f"rank {dist.get_rank()} could not create the communicator of ranks {list(ranks)} "
                f"({self.created} created before it): {exc}"
            ) from exc
        if dist.get_rank() in ranks:
            self.created += 1
        return group

    def _split_world_communicator(
        self, rank_sets: Iterable[RankGroup], options: GroupOptions
    ) -> None:
        """Split the world's communicator into ``rank_sets``, one ``split_group`` per family.

        ``rank_sets`` are the same on every rank, none existing yet; the families are
        :func:`split_plan`'s. Every rank records every set, those it is not in as torch's
        ``NON_GROUP_MEMBER`` (as :meth:`adopt` does), so later decisions agree across ranks."""
        rank = dist.get_rank()
        non_member: Any = dist.GroupMember.NON_GROUP_MEMBER
        for family in split_plan(rank_sets):
            group = dist.split_group(
                split_ranks=[list(ranks) for ranks in family], timeout=options.timeout
            )
            self.splits += 1
            for ranks in family:
                if rank not in ranks:
                    self._groups[ranks] = (non_member, options)
                    continue
                if group is None:
                    raise RuntimeError(
                        f"split_group gave rank {rank} no communicator for its ranks {list(ranks)}"
                    )
                self._groups[ranks] = (group, options)
                self.created += 1

    def partition_group(
        self, rank_sets: Iterable[Iterable[int]], options: GroupOptions
    ) -> ProcessGroup | None:
        """Get or create a communicator for each of ``rank_sets``; return the one holding this rank.

        ``None`` if none does.

        For groups no layout kind describes (a DeviceMesh dimension, a flattened set of dimensions,
        HSDP's split). Collective over the world: every rank passes the same disjoint rank sets,
        typically every group of one partition (``ValueError`` on every rank when they overlap),
        after the same agreement check as a build. A 1-rank set gets a communicator too: the caller
        asked for it explicitly.
        """
        sets, rank = _agree_on_rank_sets(rank_sets, options, "the rank sets to create")
        # Checked on the whole list, not on this rank's sets only, so that every rank raises alike
        # (none hangs).
        seen: set[int] = set()
        for ranks in sets:
            if seen.intersection(ranks):
                raise ValueError(
                    "rank sets overlap at ranks "
                    f"{sorted(seen.intersection(ranks))}; pass disjoint sets"
                )
            seen.update(ranks)
        mine = [ranks for ranks in sets if rank in ranks]
        self.create(sets, options)
        return self.group(mine[0]) if mine else None

    def twin_partition_group(
        self, rank_sets: Iterable[Iterable[int]], options: GroupOptions
    ) -> ProcessGroup | None:
        """Like :meth:`partition_group`, but a new communicator per rank set, beside any cached.

        For a library that needs two communicators over the same ranks: FSDP2 (torch 2.13) shards
        one ``fully_shard`` call's parameters by communicator and needs one mesh per communicator,
        so torchtitan's dense and expert FSDP meshes must be two communicators where their ranks
        coincide (EP = TP). The twins are counted in :attr:`created` and destroyed with the cache's
        own, never handed out for a rank set again.
        """
        sets, rank = _agree_on_rank_sets(rank_sets, options, "the twin rank sets to create")
        mine: ProcessGroup | None = None
        for ranks in sorted(sets, key=lambda r: (len(r), r)):
            group = self._new_group(ranks, options)
            if rank in ranks:
                mine = group
                self._twins.append(group)
        all_reached(options.timeout)  # see _new_group
        return mine

    def adopt(self, groups: Iterable[ProcessGroup]) -> None:
        """Learn communicators created elsewhere (Megatron-Core's ``initialize_model_parallel``).

        A later build whose rank sets they cover then reuses them instead of creating a second set.

        Collective over the world: every rank passes the groups it is a member of. The rank sets are
        gathered so every rank records every adopted set (non-members as torch's
        ``NON_GROUP_MEMBER``), which keeps the gloo path, where every rank walks every rank set, in
        step. Adopted groups count as created with default options. Where several given groups share
        a rank set (Megatron-Core creates one communicator per kind), the first is kept. A rank set
        the cache already has keeps its communicator. Adopted groups belong to their creator:
        :meth:`destroy` forgets them without destroying them.
        """
        require_distributed("adopting process groups")
        mine: dict[RankGroup, ProcessGroup] = {}
        for group in groups:
            mine.setdefault(tuple(sorted(dist.get_process_group_ranks(group))), group)
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, sorted(mine))
        _refuse_omitted_groups([{tuple(ranks) for ranks in sets} for sets in everyone])
        non_member: Any = dist.GroupMember.NON_GROUP_MEMBER
        for ranks in sorted({tuple(r) for sets in everyone for r in sets}):
            if ranks not in self._groups:
                self._groups[ranks] = (mine.get(ranks, non_member), GroupOptions())
                self._adopted.add(ranks)

    def destroy(self) -> None:
        """Destroy every communicator this cache created (not adopted ones) and forget them all."""
        owned = [
            group for ranks, (group, _) in self._groups.items() if ranks not in self._adopted
        ] + self._twins
        for group in owned:
            if (
                group is not dist.group.WORLD
                and dist.is_initialized()
                and not isinstance(group, int)
            ):
                dist.destroy_process_group(group)
        self._groups.clear()
        self._adopted.clear()
        self._twins.clear()


def _refuse_omitted_groups(passed: list[set[RankGroup]]) -> None:
    """``ValueError`` when a rank did not pass a group it belongs to that another rank passed.

    ``passed[r]`` is the rank sets rank ``r`` passed to :meth:`GroupCache.adopt`, gathered, so every
    rank finds the same and raises alike. Recorded as it was, the omitting rank held that rank set
    as torch's ``NON_GROUP_MEMBER``: a later build raised there, naming no cause, while its peers
    went on with the adopted communicator and waited for it in their first collective."""
    omitted = {
        (rank, ranks)
        for sets in passed
        for ranks in sets
        for rank in ranks
        if rank < len(passed) and ranks not in passed[rank]
    }
    if not omitted:
        return
    rank, ranks = min(omitted)
    givers = [other for other, sets in enumerate(passed) if ranks in sets]
    raise ValueError(
        f"adopt: rank {rank} did not pass its communicator of ranks {list(ranks)}, which rank(s) "
        f"{givers} passed ({len(omitted)} such omission(s)): every rank passes every group it "
        "belongs to, else a later build reuses the communicator on some of its ranks and waits "
        "for the others"
    )


CACHE = GroupCache()
"""The process-wide cache every build, adoption and mesh flattening goes through."""


def split_creation(options: GroupOptions) -> bool:
    """Whether this world creates groups of ``options`` by splitting its communicator.

    See the module docstring: :func:`split_chosen` of the world's backend, its bound device and the
    backend asked for."""
    world = dist.distributed_c10d._get_default_group()
    bound = getattr(world, "bound_device_id", None) is not None
    return split_chosen(
        str(dist.get_backend()), bound, options.backend, hasattr(dist, "split_group")
    )


def split_chosen(
    world_backend: str, bound: bool, requested: str | None, torch_splits: bool = True
) -> bool:
    """The rule choosing between ``split_group`` and ``new_group``.

    Split when the world's backend is NCCL, bound to a device at init (NCCL splits only a
    communicator that exists: the bound world's is created eagerly), the groups ask for no other
    backend, and torch has ``split_group``; else ``new_group``."""
    nccl = world_backend.lower() == "nccl"
    same_backend = requested is None or requested.lower() == "nccl"
    return nccl and bound and same_backend and torch_splits


def split_plan(rank_sets: Iterable[RankGroup]) -> list[list[RankGroup]]:
    """``rank_sets`` dealt into families of disjoint sets, one ``split_group`` each.

    In the global order (by size, then ranks), each set joins the first family it does not overlap.
    The groups of one kind are disjoint and of one size, so a kind takes one family (kinds over the
    same rank sets share it; the embedding groups, which cover the pipeline's edge stages only, may
    join another kind's). Deterministic: every rank deals alike."""
    families: list[list[RankGroup]] = []
    covered: list[set[int]] = []
    for ranks in sorted(set(rank_sets), key=lambda r: (len(r), r)):
        for family, taken in zip(families, covered, strict=True):
            if taken.isdisjoint(ranks):
                family.append(ranks)
                taken.update(ranks)
                break
        else:
            families.append([ranks])
            covered.append(set(ranks))
    return families


def _agree_on_rank_sets(
    rank_sets: Iterable[Iterable[int]], options: GroupOptions, what: str
) -> tuple[list[RankGroup], int]:
    """``rank_sets`` sorted, each checked (:func:`_rank_set`), and this rank.

    Collective: every rank must pass the same sets and options (``what`` names them in the error),
    agreed before any communicator is created."""
    require_distributed("creating process groups")
    world_size, rank = dist.get_world_size(), dist.get_rank()
    sets = sorted({_rank_set(ranks, world_size) for ranks in rank_sets})
    fields = {"rank sets": repr(sets), **options.describe()}
    check_agreement(what, fields, advice=BUILD_ADVICE)
    return sets, rank


def _rank_set(ranks: Iterable[int], world_size: int) -> RankGroup:
    """``ranks`` as a sorted tuple (a group's ranks are in ascending order in torch too).

    ``ValueError`` when empty, repeated or outside the world."""
    listed = [int(r) for r in ranks]
    out = tuple(sorted(set(listed)))
    if not out or len(out) != len(listed) or out[0] < 0 or out[-1] >= world_size:
        raise ValueError(
            f"rank set {listed} must list distinct ranks of the {world_size}-rank world"
        )
    return out

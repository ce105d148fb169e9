"""The process-wide service that creates and owns process groups, and maps models to their collections.

:func:`build` turns a :class:`~pgregistry.layout.ParallelLayout` into a
:class:`~pgregistry.collection.ProcessGroupCollection`:

* one communicator per distinct rank set: the same ranks named by two kinds (``dp`` and ``dp_cp`` when cp is 1)
  or by two layouts (two models on two grids) share one ProcessGroup;
* each rank creates only the groups it belongs to (``new_group(use_local_synchronization=True)``): a few dozen
  calls per rank at any scale, where Megatron-Core's ``initialize_model_parallel`` calls ``new_group`` for every
  group of every kind on every rank (35,993 calls per rank at 8,192 ranks);
* creation follows one global order (by size, then ranks). Every member of a group reaches it after the same
  smaller groups, so group creations can never wait on each other in a cycle;
* gloo is the exception: its eager connection set-up deadlocks when member-only groups overlap (seen with
  torch 2.13: ranks 0 and 2 never connect in ``[0, 2]`` after ``[0, 1]`` was created by ranks 0 and 1). For gloo
  every rank therefore walks every distinct rank set of the layout in the same global order (non-members get
  ``NON_GROUP_MEMBER`` at no connection cost); that is still one call per distinct rank set, not per kind;
* before creating anything, ranks exchange a fingerprint of what they were asked to build. Ranks that disagree
  raise on every rank, naming who declared what, instead of hanging in mismatched group creations;
* size-1 axes are ``None`` (axis off) unless ``explicit_singletons=True``.

The global grid (:func:`initialize_global_grid`, :func:`global_collection`) is the deprecated path: only the
fallback resolvers of :mod:`pgregistry.fallback` should read it.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Mapping, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypedDict, TypeVar, overload

import attrs
import torch
import torch.distributed as dist

from pgregistry._logging import get_logger
from pgregistry.collection import ProcessGroupCollection
from pgregistry.layout import GROUP_KINDS, ParallelLayout, RankGroup

if TYPE_CHECKING:
    from torch import nn
    from torch.distributed import ProcessGroup
    from typing_extensions import Unpack

__all__ = [
    "GroupRegistry",
    "adopt",
    "attach",
    "build",
    "collection_of",
    "default_registry",
    "destroy",
    "global_collection",
    "global_collection_or_none",
    "initialize_global_grid",
]

_log = get_logger(__name__)

# Collection fields that alias a layout kind when there is one distributed-optimizer instance.
_ALIASES: dict[str, str] = {"intra_dp_cp": "dp_cp", "intra_expt_dp": "expt_dp"}


class BuildOptions(TypedDict, total=False):
    """The keywords of :meth:`GroupRegistry.build` besides ``name``, which :func:`build` and
    :func:`initialize_global_grid` pass on: the groups' ``backend`` and ``timeout`` (``None``: those
    ``torch.distributed.new_group`` picks), and ``explicit_singletons`` (size-1 axes get groups too, not ``None``)."""

    backend: str | None
    timeout: timedelta | float | None
    explicit_singletons: bool


@attrs.frozen(slots=True)
class _GroupOptions:
    backend: str | None
    timeout: timedelta | None

    def described(self) -> dict[str, str]:
        """Field -> text, for the agreement check's message."""
        return {"backend": repr(self.backend), "timeout": repr(self.timeout)}


@attrs.frozen(slots=True)
class _Built:
    layout: ParallelLayout
    options: _GroupOptions
    explicit_singletons: bool
    collection: ProcessGroupCollection


_RAISE: Any = object()
D = TypeVar("D")


class GroupRegistry:
    """Owns every process group it creates, keyed by rank set; see the module docstring."""

    def __init__(self) -> None:
        self._groups: dict[RankGroup, tuple[ProcessGroup, _GroupOptions]] = {}
        self._adopted: set[RankGroup] = set()
        self._built: dict[str, _Built] = {}
        self._global: ProcessGroupCollection | None = None
        self._attached: weakref.WeakKeyDictionary[nn.Module, ProcessGroupCollection] = (
            weakref.WeakKeyDictionary()
        )
        self.groups_created = 0
        """How many ``new_group`` calls this process issued (for benchmarks and tests)."""

    # ------------------------------------------------------------------------------------------- build

    def build(
        self,
        layout: ParallelLayout,
        *,
        name: str | None = None,
        backend: str | None = None,
        timeout: timedelta | float | None = None,
        explicit_singletons: bool = False,
    ) -> ProcessGroupCollection:
        """Create (or reuse) the groups of ``layout`` that this rank belongs to; return its collection.

        Collective over the default process group: every rank must call it with the same arguments. ``name``
        identifies the layout (default: derived from the layout); building the same name again returns the same
        collection, and a different layout under a used name raises ``ValueError``.
        """
        _require_distributed("pgregistry.build")
        options = _GroupOptions(backend, _as_timedelta(timeout))
        name = name if name is not None else f"layout-{layout.fingerprint()}"
        _agree_on_request(
            "the layout to build",
            {"name": repr(name), "layout": repr(layout), **options.described(),
             "explicit_singletons": repr(explicit_singletons)},
        )
        world_size, rank = dist.get_world_size(), dist.get_rank()
        if layout.world_size != world_size:
            raise ValueError(
                f"layout {name!r} declares world_size {layout.world_size} but the process group world has "
                f"{world_size} ranks"
            )
        previous = self._built.get(name)
        if previous is not None:
            if (previous.layout, previous.options, previous.explicit_singletons) != (
                layout, options, explicit_singletons,
            ):
                raise ValueError(f"layout name {name!r} is already built with a different layout or options")
            return previous.collection

        wanted = layout.groups_of(rank)
        needed = {ranks for ranks in wanted.values() if ranks is not None}
        needed.add(tuple(range(world_size)))  # intra_dist_opt: the one distributed-optimizer instance
        members_only = _members_only_creation(options.backend)
        to_create = needed if members_only else _all_rank_sets(layout)
        if not explicit_singletons:
            needed = {ranks for ranks in needed if len(ranks) > 1}
            to_create = {ranks for ranks in to_create if len(ranks) > 1}
        self._create_in_order(to_create, options, members_only)

        def group_for(ranks: RankGroup | None) -> ProcessGroup | None:
            if ranks is None or ranks not in needed:
                return None
            return self._groups[ranks][0]

        fields: dict[str, Any] = {kind: group_for(wanted[kind]) for kind in GROUP_KINDS}
        fields.update({alias: fields[kind] for alias, kind in _ALIASES.items()})
        fields["intra_dist_opt"] = group_for(tuple(range(world_size)))
        # Not built, as Megatron-Core's initialize_model_parallel does not build them either (docs/layout.md).
        fields.update(inter_dist_opt=None, hcp=None, dp_cp_ag=None, expt_dp_ag=None)
        collection = ProcessGroupCollection(**fields)
        self._built[name] = _Built(layout, options, explicit_singletons, collection)
        _log.debug("built layout", name=name, layout=repr(layout), groups_created=self.groups_created)
        return collection

    def group_of_partition(
        self,
        rank_sets: Iterable[Iterable[int]],
        *,
        backend: str | None = None,
        timeout: timedelta | float | None = None,
    ) -> ProcessGroup | None:
        """Get or create a group for each of ``rank_sets``; return the one holding this rank (None if none does).

        For groups no layout kind describes (a DeviceMesh dimension, a flattened set of dimensions). Collective
        over the default process group: every rank passes the same disjoint rank sets, typically every group of
        one partition of the world (``ValueError`` on every rank when they overlap). Rank sets the registry already has
        (from :meth:`build` or an earlier call, with the same options) are reused, so identical sets share one
        ProcessGroup; creation follows the same global order and backend rules as :meth:`build`, after the same
        agreement check. A 1-rank set gets a group too: the caller asked for it explicitly.
        """
        _require_distributed("group_of_partition")
        world_size, rank = dist.get_world_size(), dist.get_rank()
        sets = sorted({_rank_set(ranks, world_size) for ranks in rank_sets})
        options = _GroupOptions(backend, _as_timedelta(timeout))
        _agree_on_request("the rank sets to create", {"rank sets": repr(sets), **options.described()})
        # Checked on the whole list, not on this rank's sets only, so that every rank raises alike (none hangs).
        seen: set[int] = set()
        for ranks in sets:
            if seen.intersection(ranks):
                raise ValueError(f"rank sets overlap at ranks {sorted(seen.intersection(ranks))}; pass disjoint sets")
            seen.update(ranks)
        mine = [ranks for ranks in sets if rank in ranks]
        members_only = _members_only_creation(options.backend)
        self._create_in_order(set(mine) if members_only else set(sets), options, members_only)
        return self._groups[mine[0]][0] if mine else None

    def adopt(self, groups: Iterable[ProcessGroup]) -> None:
        """Learn communicators created elsewhere (Megatron-Core's ``initialize_model_parallel``), so that a later
        :meth:`build` whose rank sets they cover reuses them instead of creating a second set.

        Collective over the default process group: every rank passes the groups it is a member of. The rank sets
        are gathered so every rank records every adopted set (non-members as torch's ``NON_GROUP_MEMBER``), which
        keeps the gloo path, where every rank walks every rank set, in step. Adopted groups count as created with
        default options. Where several given groups share a rank set (Megatron-Core creates one communicator per
        kind), the first is kept. A rank set the registry already has keeps its communicator.
        Adopted groups belong to their creator: :meth:`destroy` forgets them without destroying them.
        """
        _require_distributed("GroupRegistry.adopt")
        mine: dict[RankGroup, ProcessGroup] = {}
        for group in groups:
            mine.setdefault(tuple(sorted(dist.get_process_group_ranks(group))), group)
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, sorted(mine))
        default = _GroupOptions(None, None)
        non_member: Any = dist.GroupMember.NON_GROUP_MEMBER
        for ranks in sorted({tuple(r) for sets in everyone for r in sets}):
            if ranks not in self._groups:
                self._groups[ranks] = (mine.get(ranks, non_member), default)
                self._adopted.add(ranks)

    def _create_in_order(self, rank_sets: set[RankGroup], options: _GroupOptions, members_only: bool) -> None:
        # One global order (by size, then ranks) on every rank, so group creations never wait on each other.
        for ranks in sorted(rank_sets, key=lambda r: (len(r), r)):
            self._ensure_group(ranks, options, members_only)

    def _ensure_group(self, ranks: RankGroup, options: _GroupOptions, members_only: bool) -> None:
        existing = self._groups.get(ranks)
        if existing is not None:
            if existing[1] != options:
                raise ValueError(
                    f"ranks {list(ranks)} already have a group created with {existing[1]}; refusing to create "
                    f"a second one with {options}"
                )
            return
        group: ProcessGroup
        if ranks == tuple(range(dist.get_world_size())) and options == _GroupOptions(None, None):
            world = dist.group.WORLD
            assert world is not None  # build() checked that torch.distributed is initialised
            group = world
        else:
            group = dist.new_group(
                list(ranks),
                backend=options.backend,
                timeout=options.timeout,
                use_local_synchronization=members_only,
            )
            self.groups_created += 1
        self._groups[ranks] = (group, options)

    # ------------------------------------------------------------------------------------------- models

    def attach(self, module: nn.Module, collection: ProcessGroupCollection) -> None:
        """Record that ``module`` (a model or model chunk) runs on ``collection``."""
        if not isinstance(collection, ProcessGroupCollection):
            raise TypeError(f"attach expects a ProcessGroupCollection, got {type(collection).__name__}")
        self._attached[module] = collection

    @overload
    def collection_of(self, module: nn.Module) -> ProcessGroupCollection: ...

    @overload
    def collection_of(self, module: nn.Module, default: D) -> ProcessGroupCollection | D: ...

    def collection_of(self, module: nn.Module, default: object = _RAISE) -> object:
        """The collection attached to ``module``; ``LookupError`` naming it unless ``default`` is given."""
        collection = self._attached.get(module)
        if collection is None:
            if default is _RAISE:
                raise LookupError(
                    f"no ProcessGroupCollection is attached to this {type(module).__name__}; call "
                    "pgregistry.registry.attach(model, collection)"
                )
            return default
        return collection

    # ------------------------------------------------------------------------------------------- global grid

    def initialize_global_grid(
        self, layout: ParallelLayout, **build_options: Unpack[BuildOptions]
    ) -> ProcessGroupCollection:
        """Build ``layout`` and make it the global grid that fallbacks read (the deprecated path)."""
        if self._global is not None:
            raise RuntimeError("the global grid is already initialised; call destroy() first")
        self._global = self.build(layout, name="global", **build_options)
        return self._global

    def global_collection(self) -> ProcessGroupCollection:
        """The global grid; ``RuntimeError`` when it is not initialised."""
        if self._global is None:
            raise RuntimeError("the global grid is not initialised (pgregistry.registry.initialize_global_grid)")
        return self._global

    def global_collection_or_none(self) -> ProcessGroupCollection | None:
        """The global grid, or ``None`` when it is not initialised."""
        return self._global

    def destroy(self) -> None:
        """Destroy every group this registry created and forget layouts, attachments and the global grid."""
        for ranks, (group, _) in self._groups.items():
            if group is not dist.group.WORLD and ranks not in self._adopted and dist.is_initialized():
                dist.destroy_process_group(group)
        self._groups.clear()
        self._adopted.clear()
        self._built.clear()
        self._attached.clear()
        self._global = None


def _require_distributed(caller: str) -> None:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(f"{caller} needs torch.distributed initialised (init_process_group)")


def _members_only_creation(backend: str | None) -> bool:
    """Whether groups may be created by their members alone (every backend but gloo; see module docstring)."""
    effective = backend if backend is not None else str(dist.get_backend())
    return "gloo" not in effective or "nccl" in effective


def _all_rank_sets(layout: ParallelLayout) -> set[RankGroup]:
    sets: set[RankGroup] = {tuple(range(layout.world_size))}
    for kind in GROUP_KINDS:
        sets.update(layout.groups(kind))
    return sets


def _rank_set(ranks: Iterable[int], world_size: int) -> RankGroup:
    """``ranks`` as a sorted tuple (a group's ranks are in ascending order in torch too); ``ValueError`` when
    empty, repeated or outside the world."""
    listed = [int(r) for r in ranks]
    out = tuple(sorted(set(listed)))
    if not out or len(out) != len(listed) or out[0] < 0 or out[-1] >= world_size:
        raise ValueError(f"rank set {listed} must list distinct ranks of the {world_size}-rank world")
    return out


def _as_timedelta(timeout: timedelta | float | None) -> timedelta | None:
    if timeout is None or isinstance(timeout, timedelta):
        return timeout
    return timedelta(seconds=float(timeout))


def _agree_on_request(subject: str, fields: Mapping[str, str]) -> None:
    """Compare a digest of ``fields`` across ranks; raise on every rank when ranks asked for different things.

    One all-reduce (MAX of the digest and of its negation) decides; only when ranks disagree is every rank's
    request gathered, to name the fields that differ and who asked for which value (two ranks that differ only in
    a build's name or timeout print the same layout, so naming the field is the whole diagnosis). A world-sized
    all-gather on every build cost 0.1 s per rank at 8,192 ranks, most of ``build``. ``subject`` names what is
    agreed on in the message; ``fields`` maps each part of the request to its text.
    """
    import hashlib

    request = "|".join(f"{key}={value}" for key, value in fields.items())
    digest = int(hashlib.sha256(request.encode()).hexdigest()[:15], 16)
    device = torch.device("cpu")
    if "nccl" in str(dist.get_backend()):
        device = torch.device("cuda", torch.cuda.current_device())
    bounds = torch.tensor([digest, -digest], dtype=torch.int64, device=device)
    dist.all_reduce(bounds, op=dist.ReduceOp.MAX)
    if int(bounds[0]) == -int(bounds[1]):  # the largest digest is the smallest: all equal
        return
    everyone: list[dict[str, str] | None] = [None] * dist.get_world_size()
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
        "must build the same layouts and groups, with the same names and options, in the same order."
    )


def _shorten(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


default_registry = GroupRegistry()
"""The process-wide registry the module-level functions use."""


def build(
    layout: ParallelLayout, *, name: str | None = None, **options: Unpack[BuildOptions]
) -> ProcessGroupCollection:
    """:meth:`GroupRegistry.build` on the process-wide registry."""
    return default_registry.build(layout, name=name, **options)


def adopt(groups: Iterable[ProcessGroup]) -> None:
    """:meth:`GroupRegistry.adopt` on the process-wide registry."""
    default_registry.adopt(groups)


def attach(module: nn.Module | Sequence[nn.Module], collection: ProcessGroupCollection) -> None:
    """Attach ``collection`` to a model, or to each chunk of a list of model chunks."""
    modules = [module] if not isinstance(module, Sequence) else list(module)
    for chunk in modules:
        default_registry.attach(chunk, collection)


@overload
def collection_of(module: nn.Module) -> ProcessGroupCollection: ...


@overload
def collection_of(module: nn.Module, default: D) -> ProcessGroupCollection | D: ...


def collection_of(module: nn.Module, default: object = _RAISE) -> object:
    """The collection attached to ``module`` (see :meth:`GroupRegistry.collection_of`)."""
    return default_registry.collection_of(module, default)


def initialize_global_grid(layout: ParallelLayout, **build_options: Unpack[BuildOptions]) -> ProcessGroupCollection:
    """Build ``layout`` as the global grid (deprecated path, read only by fallbacks)."""
    return default_registry.initialize_global_grid(layout, **build_options)


def global_collection() -> ProcessGroupCollection:
    """The global grid; ``RuntimeError`` when not initialised."""
    return default_registry.global_collection()


def global_collection_or_none() -> ProcessGroupCollection | None:
    """The global grid, or ``None``."""
    return default_registry.global_collection_or_none()


def destroy() -> None:
    """Destroy the process-wide registry's groups and global grid."""
    default_registry.destroy()

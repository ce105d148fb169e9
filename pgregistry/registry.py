"""Build a layout into a collection: each group kind's groups, one communicator per rank set.

:func:`build` turns a :class:`~pgregistry.layout.ParallelLayout` into a
:class:`~pgregistry.collection.ProcessGroupCollection` that knows its layout. Its communicators come
from one process-wide cache (one per distinct rank set, created in one deadlock-free global order,
after the ranks agree on the request: :mod:`pgregistry._runtime.group_cache`), so two layouts that
share rank sets share communicators.

A layout may cover part of the world (``rank_offset`` and ``num_ranks``: one module of a job on
ranks of its own). The build stays collective over the world, so every rank agrees on every module's
layout; a rank outside the span gets a collection that knows it is no member and refuses to be used.

An axis of size 1 is ``None`` (off) in the collection. Each build also makes a group of this rank
alone, which the collection carries
(:attr:`~pgregistry.collection.ProcessGroupCollection.one_rank_group`) for the adapters to libraries
that have no "axis off" value (Megatron-Core, DeviceMesh): one extra communicator per rank, never
used for a collective by pgregistry itself, so with NCCL (which sets a communicator up at its first
collective) it costs memory only where an adapter hands it to a library that uses it.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypedDict

import attrs
import torch.distributed as dist

from pgregistry._runtime.agreement import check_agreement, combine_faults, require_distributed
from pgregistry._runtime.attendance import require_attendance
from pgregistry._runtime.group_cache import BUILD_ADVICE, CACHE, GroupOptions, check_group_options
from pgregistry._runtime.logger import get_logger
from pgregistry.collection import NOT_MEMBER, ProcessGroupCollection, _Lifetime
from pgregistry.layout import GROUP_KINDS, ParallelLayout, RankGroup

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["BuildOptions", "adopt", "build", "communicators_created", "destroy"]

_log = get_logger(__name__)

_ALIASES: dict[str, str] = {"intra_dp_cp": "dp_cp", "intra_expt_dp": "expt_dp"}
"""Collection fields that alias a layout kind when there is one distributed-optimizer instance."""


class BuildOptions(TypedDict, total=False):
    """The keywords of :func:`build` besides ``name``: the groups' ``backend`` and ``timeout``.

    For a caller that passes the options on as one mapping (``build(layout, **options)``), typed.
    A key left out means what ``None`` means.

    Attributes:
        backend: The groups' backend; ``None``: the one ``torch.distributed.new_group`` picks.
        timeout: A positive, finite number of seconds up to 1e12 or a ``timedelta``; the groups'
            timeout and the bound of the build itself (``None``: torch's). :func:`build` raises
            ``ValueError`` or ``TypeError`` for another value.

    Example:
        On every rank of a 2-rank world (as :func:`pgregistry.testing.run_world` starts it):

        >>> from pgregistry import ParallelLayout, build
        >>> from pgregistry.collection import group_size
        >>> options: BuildOptions = {"backend": "gloo", "timeout": 60.0}
        >>> collection = build(ParallelLayout(num_ranks=2), name="train", **options)
        >>> group_size(collection.dp)
        2
    """

    backend: str | None
    timeout: timedelta | float | None


@attrs.frozen(slots=True)
class _Built:
    layout: ParallelLayout
    options: GroupOptions
    collection: ProcessGroupCollection


_builds: dict[str, _Built] = {}
_lifetime = _Lifetime()


def build(
    layout: ParallelLayout,
    *,
    name: str | None = None,
    backend: str | None = None,
    timeout: timedelta | float | None = None,
) -> ProcessGroupCollection:
    """Create (or reuse) the groups of ``layout`` that this rank belongs to; return its collection.

    Collective over the world: every rank calls it with the same arguments (ranks that do not raise
    ``ValueError`` on every rank, naming who asked for what).

    Args:
        layout: the layout to build; it may span part of the world (``rank_offset``, ``num_ranks``).
        name: identifies the build in messages; building the same name (or, unnamed, the same
            layout) again returns the same collection.
        backend: the groups' backend (``None``: the world's).
        timeout: seconds or a ``timedelta`` (``None``: torch's); the groups' timeout, and the bound
            of the build itself: every rank checks in through the world's store first
            (:mod:`pgregistry._runtime.attendance`), and the build's all-reduces wait no longer.

    Returns:
        The collection. On a rank outside the span it knows it is no member (``is_member`` false)
        and raises, naming the layout and the rank, when anything reads a group from it or computes
        with it.

    Raises:
        ValueError: ranks that asked differently; the same name asked for another layout or other
            options (naming what differs); a span past the world's end; a timeout not positive and
            finite.
        TypeError: a layout that is none, a name that is no string, a timeout that is no number
            (``'5'``, ``True``).
        RuntimeError: a rank that has not checked in within ``timeout`` (named on every rank that
            did), or a collective failing in the build (a rank killed), naming the ranks that did
            not answer a roll call.

    All of these are raised on every rank alike.

    Example:
        On every rank of a 4-rank world (as :func:`pgregistry.testing.run_world` starts it):

        >>> from pgregistry import ParallelLayout, build
        >>> from pgregistry.collection import group_size
        >>> layout = ParallelLayout(num_ranks=4, tp=2, ep=4, expt_tp=1)
        >>> pg = build(layout, name="policy")
        >>> group_size(pg.tp), group_size(pg.dp), group_size(pg.ep)
        (2, 2, 4)
        >>> build(layout, name="policy") is pg  # built once: the same collection again
        True
    """
    require_distributed("pgregistry.build")
    options, described, fault = check_group_options(backend, timeout)
    if isinstance(layout, ParallelLayout):
        declared = {
            f.name: repr(getattr(layout, f.name)) for f in attrs.fields(ParallelLayout) if f.init
        }
    else:
        declared = {"layout": repr(layout)}
        fault = combine_faults(
            fault, TypeError(f"build expects a ParallelLayout, got {type(layout).__name__}")
        )
    if name is not None and (not isinstance(name, str) or not name):
        fault = combine_faults(
            fault, TypeError(f"name must be a non-empty string or None, got {name!r}")
        )
    with require_attendance(
        f"pgregistry.build of {_layout_label(name, layout)}", options.timeout, BUILD_ADVICE
    ):
        check_agreement(
            "the layout to build",
            {"name": repr(name), **declared, **described},
            fault,
            advice=BUILD_ADVICE,
            timeout=options.timeout,
        )
        return _build_agreed(layout, name, options)


def _build_agreed(
    layout: ParallelLayout, name: str | None, options: GroupOptions
) -> ProcessGroupCollection:
    """:func:`build` once every rank has agreed on the request."""
    key = name if name is not None else f"unnamed {layout!r}"
    world_size, rank = dist.get_world_size(), dist.get_rank()
    first, stop = layout.rank_range()
    if stop > world_size:
        # Every rank agreed on the layout above, so every rank raises here alike.
        raise ValueError(
            f"{_layout_label(name, layout)} spans ranks {first}-{stop - 1} "
            f"(rank_offset {first} + num_ranks {layout.num_ranks}), past the end "
            f"of the {world_size}-rank world; shrink num_ranks or rank_offset"
        )
    previous = _builds.get(key)
    if previous is not None:
        _check_same_build(name, previous, layout, options)
        return previous.collection

    member = first <= rank < stop
    span = tuple(range(first, stop))
    wanted = layout.groups_of(rank) if member else {}
    every_set = _all_rank_sets(layout)
    _refuse_other_options(every_set, options, name, layout)
    CACHE.create(every_set, options)
    if not member:
        outside = ProcessGroupCollection._for_non_member(layout, name, _lifetime)
        _builds[key] = _Built(layout, options, outside)
        _log.debug("built layout elsewhere", name=name, layout=repr(layout), rank=rank)
        return outside

    def group_for(ranks: RankGroup | None) -> ProcessGroup | None | Any:
        if ranks is None:
            return NOT_MEMBER
        return CACHE.group(ranks) if len(ranks) > 1 else None

    fields: dict[str, Any] = {kind: group_for(wanted[kind]) for kind in GROUP_KINDS}
    fields.update({alias: fields[kind] for alias, kind in _ALIASES.items()})
    fields["intra_dist_opt"] = group_for(span)
    # Not built, as Megatron-Core's initialize_model_parallel does not build them either
    # (docs/layout.md).
    fields.update(inter_dist_opt=None, hcp=None, dp_cp_ag=None, expt_dp_ag=None)
    collection = ProcessGroupCollection(
        layout=layout, name=name, one_rank_group=CACHE.group((rank,)), **fields
    )
    collection._lifetime = _lifetime
    _builds[key] = _Built(layout, options, collection)
    _log.debug("built layout", name=name, layout=repr(layout), groups_created=CACHE.created)
    return collection


def _layout_label(name: object, layout: object) -> str:
    return f"layout {name!r}" if name is not None else repr(layout)


def _check_same_build(
    name: str | None, previous: _Built, layout: ParallelLayout, options: GroupOptions
) -> None:
    """``ValueError`` naming what differs from an earlier build of the same name or layout."""
    differences = []
    if previous.layout != layout:
        differences.append(f"layout {previous.layout!r} then {layout!r}")
    for option, before in previous.options.describe().items():
        now = options.describe()[option]
        if before != now:
            differences.append(f"{option}={before} then {option}={now}")
    if differences:
        subject = f"name {name!r}" if name is not None else repr(layout)
        raise ValueError(
            f"{subject} is already built with other settings: "
            f"{'; '.join(differences)}. Build it again with the same ones (it is "
            "returned as built), give the new build its own name, or destroy() first"
        )


def _refuse_other_options(
    rank_sets: Iterable[RankGroup], options: GroupOptions, name: str | None, layout: ParallelLayout
) -> None:
    """``ValueError`` on every rank when a needed rank set has a communicator with other options.

    A rank set this build needs may already have a communicator with other options (one communicator
    per rank set). Agreed over the world, so that no rank goes on into the creation alone."""
    conflict = None
    for ranks in sorted(rank_sets):
        existing = CACHE.options_of(ranks)
        if existing is not None and existing != options:
            conflict = (
                f"{_layout_label(name, layout)} needs a communicator over ranks "
                f"{list(ranks)}, which already exists with {existing.describe()}, and "
                f"this build asks {options.describe()}: one communicator per rank "
                "set, so build with the same backend and timeout, or destroy() first"
            )
            break
    check_agreement(
        "pgregistry.build",
        {},
        conflict,
        failed="found a communicator with other options",
        timeout=options.timeout,
    )


def _all_rank_sets(layout: ParallelLayout) -> set[RankGroup]:
    """Every rank set of ``layout``: what every rank walks when creating its groups.

    See ``pgregistry._runtime.group_cache``."""
    first, stop = layout.rank_range()
    sets: set[RankGroup] = {tuple(range(first, stop))}
    sets.update((rank,) for rank in range(first, stop))
    for kind in GROUP_KINDS:
        sets.update(ranks for ranks in layout.groups(kind) if len(ranks) > 1)
    return sets


def adopt(groups: Iterable[ProcessGroup]) -> None:
    """Learn communicators created elsewhere (Megatron-Core's ``initialize_model_parallel``).

    A later :func:`build` whose rank sets they cover reuses them. Collective over the world: every
    rank passes the groups it belongs to. Adopted groups belong to their creator: :func:`destroy`
    does not destroy them.

    Args:
        groups: the process groups this rank belongs to.

    Raises:
        TypeError: on every rank, before anything is adopted, a rank passing no iterable of process
            groups (a name such as ``'tp'``, a number, ``None``, which torch.distributed reads as
            the world), naming the rank and what it passed.
        ValueError: on every rank, before anything is adopted, a group some of its ranks passed and
            another of its ranks did not, naming that rank and the group's ranks.

    Example:
        On every rank of a 2-rank world (as :func:`pgregistry.testing.run_world` starts it), with
        Megatron-Core's groups:

        >>> from megatron.core import parallel_state
        >>> from pgregistry import ParallelLayout
        >>> parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
        >>> adopt([parallel_state.get_tensor_model_parallel_group()])
        >>> pg = build(ParallelLayout(num_ranks=2, tp=2))  # reuses Megatron-Core's TP communicator
        >>> pg.get("tp") is parallel_state.get_tensor_model_parallel_group()
        True
    """
    require_distributed("pgregistry.registry.adopt")
    given, fault = _process_groups(groups)
    check_agreement("pgregistry.registry.adopt", {}, fault)
    CACHE.adopt(given)


def _process_groups(groups: object) -> tuple[list[ProcessGroup], TypeError | None]:
    """``groups`` as a list, and ``None``; or the ``TypeError`` saying what adopt expects."""
    expects = (
        "adopt expects an iterable of the torch.distributed ProcessGroup "
        "objects this rank belongs to (e.g. Megatron-Core's "
        "parallel_state.get_tensor_model_parallel_group()), not their names"
    )
    if isinstance(groups, (str, bytes, dist.ProcessGroup)) or not isinstance(groups, Iterable):
        return [], TypeError(f"{expects}; got {groups!r} ({type(groups).__name__})")
    given = list(groups)
    for index, group in enumerate(given):
        if not isinstance(group, dist.ProcessGroup):
            return [], TypeError(f"{expects}; item {index} is {group!r} ({type(group).__name__})")
    return given, None


def communicators_created() -> int:
    """How many communicators holding this rank pgregistry created here (for benchmarks and tests).

    Returns:
        The count of those made by ``new_group`` or ``split_group`` (adopted ones left out).

    Example:
        On every rank of a 4-rank world:

        >>> from pgregistry import ParallelLayout, build
        >>> from pgregistry.registry import communicators_created
        >>> layout = ParallelLayout(num_ranks=4, tp=2)
        >>> before = communicators_created()
        >>> _ = build(layout)
        >>> made = communicators_created()
        >>> made > before
        True
        >>> _ = build(layout, name="again")  # the same rank sets: their communicators are reused
        >>> communicators_created() == made
        True
    """
    return CACHE.created


def destroy() -> None:
    """Destroy every communicator pgregistry created and forget every build.

    Collections built so far (and the global grid) are marked destroyed, so using one raises instead
    of running a collective on a dead group. Adopted communicators stay (their creator owns them).
    Call it before ``torch.distributed.destroy_process_group()`` at the end of a run, or between
    tests that build again; a later :func:`build` creates new groups. With ``torch.distributed`` not
    initialised it only forgets.

    Example:
        On every rank of a 2-rank world:

        >>> from pgregistry import ParallelLayout, build, grad_norm
        >>> from pgregistry.registry import destroy
        >>> collection = build(ParallelLayout(num_ranks=2), name="job")
        >>> destroy()
        >>> collection.is_destroyed
        True
        >>> grad_norm([], collection)  # an entry point given it raises, naming destroy()
        Traceback (most recent call last):
        ValueError: grad_norm was given layout 'job' ...destroy() destroyed; build the layout again
    """
    global _lifetime
    CACHE.destroy()
    _builds.clear()
    _lifetime.alive = False
    _lifetime = _Lifetime()

"""Megatron-Core's multi-module objects.

``HyperCommGrid`` in, ``MultiModuleProcessGroupCollection`` both ways.

Megatron-Core's MIMO models give each module a ``HyperCommGrid`` (a grid over a span of ranks:
``shape`` and ``dim_names`` fastest first, ``rank_offset``), whose dense groups are created over the
base dims ``tp cp dp pp`` and whose expert groups over a registered view named ``"expert"`` with
dims ``expt_tp ep expt_dp pp`` (what its MIMO optimizer reads,
``megatron/core/models/mimo/optimizer.py``). Its per-rank ``MultiModuleProcessGroupCollection``
holds the collections of the modules that rank runs.

Reading them in, pgregistry recovers each module's :class:`~pgregistry.layout.ParallelLayout` from
the groups themselves: the axis sizes and the span come from the groups, and the order is the first
order string (the default one first) under which every given group holds the layout's ranks; none
fitting raises, naming the module. The collection then holds the very communicators Megatron-Core
created (a grid lacking a one-axis group statistics read gets it through its own ``create_pg``;
nothing else is created) and is checked against that layout like any other. Both readers are
collective over the world: they adopt the communicators (so a later :func:`pgregistry.build` of the
same rank sets reuses them) and learn the modules this rank does not run.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping
from typing import Any, Final

from pgregistry.collection import NOT_MEMBER, GroupName, ProcessGroupCollection, group_size
from pgregistry.layout import (
    DEFAULT_ORDER,
    EXPERT_GROUP_KINDS,
    GROUP_KINDS,
    OrderToken,
    ParallelLayout,
    RankGroup,
)

__all__ = [
    "EXPERT_VIEW",
    "modules_from_reports",
    "describe_groups",
    "expert_fields_off",
    "from_hyper_comm_grid",
]

EXPERT_VIEW: Final = "expert"
"""The view of a ``HyperCommGrid`` whose dims hold the expert groups.

As Megatron-Core's MIMO optimizer names it.
"""

_BASE_DIMS: Final[Mapping[str, str]] = {"tp": "tp", "cp": "cp", "dp": "dp", "pp": "pp"}
"""Base-view dim -> layout axis."""
_EXPERT_DIMS: Final[Mapping[str, str]] = {
    "expt_tp": "expt_tp",
    "ep": "ep",
    "expt_dp": "expt_dp",
    "pp": "pp",
}
"""Expert-view dim -> layout axis."""

_BASE_FIELDS: Final[Mapping[GroupName, tuple[str, ...]]] = {
    "tp": ("tp",),
    "cp": ("cp",),
    "dp": ("dp",),
    "pp": ("pp",),
    "dp_cp": ("dp", "cp"),
    "tp_cp": ("tp", "cp"),
    "mp": ("tp", "pp"),
    "tp_dp_cp": ("tp", "cp", "dp"),
    "intra_dist_opt": ("tp", "cp", "dp", "pp"),
}
"""Collection field -> the base-view dims of the grid group holding it.

Megatron-Core's MIMO choice.
"""
_EXPERT_FIELDS: Final[Mapping[GroupName, tuple[str, ...]]] = {
    "ep": ("ep",),
    "expt_tp": ("expt_tp",),
    "expt_dp": ("expt_dp",),
    "tp_ep": ("expt_tp", "ep"),
    "tp_ep_pp": ("expt_tp", "ep", "pp"),
}
"""Collection field -> the expert-view dims of the grid group that holds it."""
_ALIASES: Final[Mapping[str, GroupName]] = {"intra_dp_cp": "dp_cp", "intra_expt_dp": "expt_dp"}
"""Fields that hold the same group as another when there is one distributed-optimizer instance."""

_EMBEDDING_KINDS: Final = ("embd", "pos_embd")
"""Kinds a grid says nothing about.

Which ranks hold the embeddings is the model's choice, not the grid's.
"""

_SIZE_FIELDS: Final[tuple[str, ...]] = (
    "tp",
    "cp",
    "pp",
    "ep",
    "expt_tp",
    "gtp_remat",
    "expt_gtp_remat",
)
"""The layout sizes read off a collection's groups (``dp`` and ``expt_dp`` follow from the span)."""


# ------------------------------------------------------------------------------------ HyperCommGrid


def from_hyper_comm_grid(grid: Any, *, name: str | None = None) -> ProcessGroupCollection:
    """The collection of the communicators a Megatron-Core ``HyperCommGrid``'s ``create_pg`` made.

    The layout is the grid's: its span (``rank_offset``, the grid's size), the sizes of its base
    dims (``tp cp dp pp``) and of its ``"expert"`` view (``expt_tp ep expt_dp pp``; without the
    view, expert TP and EP are off), in an order that gives every created group its ranks. Each
    field whose dims the grid has created holds that group (``intra_dist_opt`` is the group over all
    four base dims). A field the grid did not create is ``None`` where this rank's group has one
    rank (an axis the grid does not have is off: GTP remat always, a dense grid's expert axes), else
    the grid's communicator of another field over the same ranks (so a MIMO job builds nothing
    twice); the others (the embedding groups, a group of several ranks the grid did not create) stay
    UNSET. A rank outside the grid's span gets the collection that refuses every use.

    Collective over the world (as the grid's ``create_pg``): the communicators are adopted, so a
    later :func:`pgregistry.build` whose rank sets they cover reuses them. The one-axis groups grad
    statistics read (``tp``, ``ep``, ``expt_tp``) are created through the grid's ``create_pg`` when
    the grid lacks them and no group it made holds their ranks (a MIMO job's grids hold what
    Megatron-Core's MIMO optimizer reads: ``tp_ep_pp``, not ``ep``), and pgregistry's one-rank
    groups of the span when the grid made none (the collection's stand-in for an off axis, as every
    build makes it); nothing else is created.

    Args:
        grid: a ``megatron.core.hyper_comm_grid.HyperCommGrid``.
        name: the collection's name in messages.

    Returns:
        The :class:`ProcessGroupCollection` of the grid, with its layout.

    Raises:
        TypeError: ``grid`` is not a ``HyperCommGrid``.
        ValueError: a dim pgregistry has no axis for (named).

    Example:
        On every rank of a 4-rank world (as :func:`pgregistry.testing.run_world` starts it):

        >>> from megatron.core.hyper_comm_grid import HyperCommGrid
        >>> grid = HyperCommGrid([2, 1, 2, 1], ["tp", "cp", "dp", "pp"], rank_offset=0)
        >>> for dims in (["tp"], ["dp"]):
        ...     _ = grid.create_pg(dims)
        >>> pg = from_hyper_comm_grid(grid, name="encoder")
        >>> pg.layout.tp, pg.layout.dp, pg.layout.num_ranks
        (2, 2, 4)
    """
    from megatron.core.hyper_comm_grid import HyperCommGrid

    from pgregistry import registry

    if not isinstance(grid, HyperCommGrid):
        raise TypeError(
            "from_hyper_comm_grid expects "
            f"megatron.core.hyper_comm_grid.HyperCommGrid, got {type(grid).__name__}"
        )
    sizes = _grid_sizes(grid)
    fields, enums = _grid_groups(grid)
    first, stop = int(grid.rank_offset), int(grid.rank_offset) + int(grid.size)
    described = (
        f"HyperCommGrid(shape={grid.shape}, dim_names={grid.dim_names}, rank_offset={first})"
    )
    layout = _layout_fitting(sizes, (first, stop), enums, described)
    _create_per_axis_groups(grid, layout, fields, enums)
    registry.adopt(group for group in fields.values() if group is not NOT_MEMBER)
    own = _one_rank_group(enums, (first, stop))
    if not grid.is_current_rank_in_grid():
        return ProcessGroupCollection._for_non_member(layout, name, None)
    own = own or next((g for g in fields.values() if group_size(g) == 1), None)
    fields.update(_not_created(layout, fields))
    fields.update({alias: fields[field] for alias, field in _ALIASES.items() if field in fields})
    return ProcessGroupCollection(layout=layout, name=name, one_rank_group=own, **fields)


_PER_AXIS: Final[Mapping[GroupName, tuple[tuple[str, ...], str | None]]] = {
    "tp": (("tp",), None),
    "ep": (("ep",), EXPERT_VIEW),
    "expt_tp": (("expt_tp",), EXPERT_VIEW),
}
"""The one-axis groups grad statistics decide duplicates with (field -> the grid's dims and view). A
MIMO job's grids hold only what Megatron-Core's MIMO optimizer reads (``tp_ep_pp`` but neither
``ep`` nor ``expt_tp``)."""


def _create_per_axis_groups(
    grid: Any, layout: ParallelLayout, fields: dict[str, Any], enums: dict[str, set[RankGroup]]
) -> None:
    """Create the per-axis groups the grid lacks, through the grid's own ``create_pg``.

    Megatron-Core then finds them there too. Created: each group of :data:`_PER_AXIS` that the grid
    lacks, has several ranks, and no group the grid made holds the ranks of.

    Without one, statistics would read that axis off the global grid: another grid's group, or none.
    Every rank decides alike (the grid's state and its rank enumerations are the same on every rank)
    and creates them in one order, as ``create_pg`` requires of a collective."""
    for field, (dims, view) in _PER_AXIS.items():
        if field in fields or _rank_enum(grid, dims, view) is None:
            continue
        partition = {tuple(sorted(ranks)) for ranks in layout.groups(field)}
        if all(len(ranks) == 1 for ranks in partition):
            continue  # off: None
        if any(sets == partition for other, sets in enums.items() if other in GROUP_KINDS):
            continue  # the grid's communicator of that field serves
        group = grid.create_pg(list(dims), view=view)
        fields[field] = group if _is_member_group(group) else NOT_MEMBER
        enums[field] = partition


def _one_rank_group(enums: Mapping[str, set[RankGroup]], span: tuple[int, int]) -> Any:
    """This rank's one-rank group when the grid made none.

    ``None`` when it did, and on ranks outside ``span``.

    A collection's off axes go to Megatron-Core and DeviceMesh as that group (they have no "axis
    off"), so a grid whose groups all have several ranks gets pgregistry's, as every build makes it:
    one communicator per rank of the span, created once (a later build reuses them). Every rank
    decides alike, from the grid's enumerations."""
    if any(all(len(ranks) == 1 for ranks in sets) for sets in enums.values()):
        return None
    from pgregistry._runtime.group_cache import CACHE, GroupOptions

    return CACHE.partition_group([[rank] for rank in range(*span)], GroupOptions.of(None, None))


def _not_created(layout: ParallelLayout, created: Mapping[str, Any]) -> dict[str, Any]:
    """The layout kinds the grid did not create that need no new communicator.

    ``None`` where this rank's group has one rank (an axis the grid does not have, GTP remat and a
    dense grid's expert axes, is off), else the grid's communicator of another field over the same
    ranks (``tp_ep_pp`` is ``pp`` when expert TP and EP are off; ``intra_dist_opt``, the whole span,
    is among them). Every member of a group finds the same field first, so they all hold the same
    communicator."""
    import torch.distributed as dist

    ranks_of = {
        field: tuple(sorted(dist.get_process_group_ranks(group)))
        for field, group in created.items()
        if (field in GROUP_KINDS or field == "intra_dist_opt")
        and group is not NOT_MEMBER
        and group is not None
    }
    out: dict[str, Any] = {}
    for kind, ranks in layout.groups_of(dist.get_rank()).items():
        if kind in created or kind in _EMBEDDING_KINDS or ranks is None:
            continue
        if len(ranks) == 1:
            out[kind] = None
            continue
        same = next(
            (field for field, held in ranks_of.items() if held == tuple(sorted(ranks))), None
        )
        if same is not None:
            out[kind] = created[same]
    return out


def _grid_sizes(grid: Any) -> dict[str, int]:
    """Layout axis -> size, from base dims and expert view; ``ValueError`` for an unknown dim."""
    sizes: dict[str, int] = {}
    for dim, size in zip(grid.dim_names, grid.shape, strict=True):
        if dim not in _BASE_DIMS:
            raise ValueError(
                f"HyperCommGrid dim {dim!r} is none of the base dims "
                f"pgregistry reads ({', '.join(_BASE_DIMS)}); expert dims "
                "belong in a view named 'expert' (expt_tp, ep, expt_dp, pp)"
            )
        sizes[_BASE_DIMS[dim]] = int(size)
    expert_view = False
    for dim, axis in _EXPERT_DIMS.items():
        enum = _rank_enum(grid, (dim,), EXPERT_VIEW)
        if enum is not None and axis != "pp":
            sizes[axis] = len(enum[0])
            expert_view = True
    if (
        not expert_view
    ):  # a dense grid: its expert axes are off (expert TP would otherwise default to TP)
        sizes.update(expt_tp=1, ep=1)
    return sizes


def _grid_groups(grid: Any) -> tuple[dict[str, Any], dict[str, set[RankGroup]]]:
    """The pair (field -> this rank's group, field -> all its rank sets).

    For every field whose dims the grid created.
    """
    fields: dict[str, Any] = {}
    enums: dict[str, set[RankGroup]] = {}
    for table, view in ((_BASE_FIELDS, None), (_EXPERT_FIELDS, EXPERT_VIEW)):
        for field, dims in table.items():
            group = _grid_group(grid, dims, view)
            if group is _NOT_CREATED:
                continue
            fields[field] = group if _is_member_group(group) else NOT_MEMBER
            enum = _rank_enum(grid, dims, view)
            assert enum is not None  # the grid created the group, so it knows its dims
            enums[field] = {tuple(sorted(ranks)) for ranks in enum}
    return fields, enums


_NOT_CREATED: Final = object()


def _grid_group(grid: Any, dims: tuple[str, ...], view: str | None) -> Any:
    """The grid's group over ``dims``.

    ``_NOT_CREATED`` when the grid lacks the dims, the view, or the group.
    """
    try:
        return grid.get_pg(list(dims), view=view)
    except (KeyError, ValueError):
        return _NOT_CREATED


def _rank_enum(grid: Any, dims: tuple[str, ...], view: str | None) -> list[list[int]] | None:
    try:
        return grid.get_rank_enum(list(dims), view=view)
    except (KeyError, ValueError):
        return None


def _is_member_group(group: Any) -> bool:
    import torch.distributed as dist

    return group is not None and group is not dist.GroupMember.NON_GROUP_MEMBER


# ---------------------------------------------------------------- MultiModuleProcessGroupCollection


_OFF: Final[RankGroup] = ()
"""How :func:`describe_groups` reports a ``None`` field (off, or Megatron-Core's "not needed")."""


def describe_groups(fields: Mapping[str, Any]) -> dict[str, RankGroup | None]:
    """Field -> the sorted ranks of this rank's group, for the others to recover a module's layout.

    ``()`` for ``None``, ``None`` for NOT_MEMBER or a list; the other ranks recover a module's
    layout with :func:`modules_from_reports`."""
    import torch.distributed as dist

    out: dict[str, RankGroup | None] = {}
    for field, value in fields.items():
        if value is None:
            out[field] = _OFF
        elif value is NOT_MEMBER or isinstance(value, list):
            out[field] = None
        else:
            out[field] = tuple(sorted(dist.get_process_group_ranks(value)))
    return out


def modules_from_reports(everyone: list[Any]) -> tuple[dict[str, ParallelLayout], str | None]:
    """Every module's layout, from the groups its ranks reported, and the language model's name.

    ``everyone[rank]`` is ``(module name -> described_groups(...), language model name or None)`` of
    that rank; ``ValueError`` naming the module when its ranks are not one span or no layout gives
    its groups, and when ranks name different language models."""
    observed: dict[str, dict[str, set[RankGroup]]] = {}
    off: dict[str, set[str]] = {}
    ranks_of: dict[str, set[int]] = {}
    language_models: set[str] = set()
    for rank, (modules, language_model) in enumerate(everyone):
        if language_model is not None:
            language_models.add(language_model)
        for name, fields in modules.items():
            ranks_of.setdefault(name, set()).add(rank)
            seen = observed.setdefault(name, {})
            for field, ranks in fields.items():
                if ranks == _OFF:
                    off.setdefault(name, set()).add(field)
                elif ranks is not None:
                    seen.setdefault(field, set()).add(ranks)
    if len(language_models) > 1:
        raise ValueError(f"ranks name different language models: {sorted(language_models)}")
    layouts = {}
    for name in sorted(observed):
        members = sorted(ranks_of[name])
        first, stop = members[0], members[-1] + 1
        if members != list(range(first, stop)):
            raise ValueError(
                f"module {name!r} runs on ranks {members}, "
                "which are not one span of consecutive ranks"
            )
        _require_sizing_groups(name, observed[name])
        sizes = {
            axis: size
            for axis in _SIZE_FIELDS
            if (size := _size_of(observed[name], axis)) is not None
        }
        if (
            off.get(name, set()) & EXPERT_GROUP_KINDS.keys()
            and not set(observed[name]) & EXPERT_GROUP_KINDS.keys()
        ):
            sizes.update(
                expt_tp=1, ep=1
            )  # expert groups "not needed" and none given: the expert axes are off
        layouts[name] = _layout_fitting(sizes, (first, stop), observed[name], f"module {name!r}")
    return layouts, next(iter(language_models), None)


def expert_fields_off(
    layout: ParallelLayout, fields: Mapping[str, Any], names: Iterable[str]
) -> dict[str, Any]:
    """``fields`` with each ``None`` of ``names`` holding what ``layout`` gives that field.

    ``fields`` are those of this rank's module collection; ``None`` is Megatron-Core's "not needed"
    in ``expt_dp`` and ``tp_ep_pp``: the expert axes are off, as ``layout`` has them. Each such
    field holds ``None`` where this rank's group has one rank, else the communicator of another
    field over the same ranks (``expt_dp`` is ``intra_dist_opt`` at PP 1), else is left out (UNSET),
    so the collection never holds a ``None`` that its layout contradicts."""
    dropped = {field for field in names if field in fields and fields[field] is None}
    kept = {field: value for field, value in fields.items() if field not in dropped}
    return {
        **kept,
        **{field: value for field, value in _not_created(layout, kept).items() if field in dropped},
    }


def _require_sizing_groups(name: str, observed: Mapping[str, set[RankGroup]]) -> None:
    """``ValueError`` naming the groups a module lacks to fix its layout.

    ``tp cp pp dp`` always, and ``ep expt_tp expt_dp`` when it has any expert group (the
    data-parallel sizes fix the GTP-remat ones, which are 1 when their groups are absent). Without
    them several layouts fit, and a guess would be a silent wrong answer."""
    needed = ["tp", "cp", "pp", "dp"]
    if any(field in EXPERT_GROUP_KINDS for field in observed):
        needed += ["ep", "expt_tp", "expt_dp"]
    missing = [field for field in needed if field not in observed]
    if missing:
        raise ValueError(
            f"module {name!r} lacks the groups {missing}, so its layout is not "
            "determined by its groups (several layouts would fit); give every "
            "module's collection its tp, cp, pp and dp groups (and ep, expt_tp "
            "and expt_dp with experts), a size-1 axis as a one-rank group"
        )


def _size_of(observed: Mapping[str, set[RankGroup]], axis: str) -> int | None:
    sets = observed.get(axis)
    if not sets:
        return None
    sizes = {len(ranks) for ranks in sets}
    if len(sizes) > 1:
        raise ValueError(f"the {axis!r} groups have different sizes {sorted(sizes)}")
    return sizes.pop()


# --------------------------------------------------------------------------------------- the layout


def _layout_fitting(
    sizes: Mapping[str, int],
    span: tuple[int, int],
    observed: Mapping[str, Iterable[RankGroup]],
    what: str,
) -> ParallelLayout:
    """The layout over ``span`` with ``sizes`` whose groups include every observed rank set.

    The first in order (the default first) whose groups include every rank set of ``observed``
    (field -> sorted rank sets); ``ValueError`` naming ``what`` when none does."""
    first, stop = span
    keywords = {axis: size for axis, size in sizes.items() if axis not in ("dp", "expt_dp")}
    wanted = {
        field: {tuple(sorted(ranks)) for ranks in sets}
        for field, sets in observed.items()
        if field in GROUP_KINDS or field in _ALIASES or field == "intra_dist_opt"
    }
    for order in _candidate_orders():
        try:
            layout = ParallelLayout(
                num_ranks=stop - first, rank_offset=first, order=order, **keywords
            )
        except ValueError:
            continue
        if _layout_fits(layout, sizes, wanted):
            return layout
    raise ValueError(
        f"no ParallelLayout over ranks {first}-{stop - 1} with sizes {dict(sizes)} "
        f"gives the groups of {what}: its groups are not those of one grid "
        "(Megatron-Core's rank order); build the module with pgregistry.build"
    )


def _candidate_orders() -> Iterable[str]:
    tokens = tuple(token.value for token in OrderToken)
    yield DEFAULT_ORDER
    for permutation in itertools.permutations(tokens):
        order = "-".join(permutation)
        if order != DEFAULT_ORDER:
            yield order


def _layout_fits(
    layout: ParallelLayout, sizes: Mapping[str, int], wanted: Mapping[str, set[RankGroup]]
) -> bool:
    if any(layout.axis_sizes()[axis] != size for axis, size in sizes.items()):
        return False
    span = tuple(range(*layout.rank_range()))
    for field, sets in wanted.items():
        if field == "intra_dist_opt":
            groups = {span}
        elif field in _ALIASES:
            groups = {tuple(sorted(g)) for g in layout.groups(_ALIASES[field])}
        else:
            groups = {tuple(sorted(g)) for g in layout.groups(field)}
        if not sets <= groups:
            return False
    return True

"""``ProcessGroupCollection``: the typed, frozen set of process groups one model runs on.

Each field has three states that are never conflated:

* a ``ProcessGroup``: use it;
* ``None``: the axis is off (size 1) for this model; code must treat it as rank 0 of 1, never as WORLD;
* :data:`UNSET`: nobody said. Reading it with :meth:`ProcessGroupCollection.get` raises; the fallback resolvers
  (:mod:`pgregistry.fallback`) read the global grid for it and warn.

 Mixing "unset" and "off" is what made Megatron-Core's filters read the global rank for a model whose own grid

turned an axis off (Megatron-LM pull request 8042; ``docs/known_bugs.md``). ``None`` passed to a

``torch.distributed`` call means WORLD, so library code goes
through :func:`group_size` and :func:`group_rank`, which read ``None`` as size 1 / rank 0.
"""

from __future__ import annotations

import difflib
import enum
import math
import sys
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Final, Literal, TypeAlias, TypeVar, Union, cast, get_args, overload

import attrs

from pgregistry.layout import DENSE_GROUP_KINDS, EXPERT_GROUP_KINDS

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = [
    "COMPOSITE_AXES",
    "FIELD_NAMES",
    "UNSET",
    "FieldName",
    "FieldValue",
    "GroupField",
    "GroupName",
    "ProcessGroupCollection",
    "Unset",
    "check_field_names",
    "group_rank",
    "group_size",
]


class Unset(enum.Enum):
    """Type of the :data:`UNSET` sentinel (an enum so type checkers can narrow on it)."""

    UNSET = "UNSET"

    def __repr__(self) -> str:
        return "UNSET"

    def __bool__(self) -> Literal[False]:
        return False


UNSET: Final = Unset.UNSET
"""A collection field nobody provided; distinct from ``None`` (the axis is off)."""

GroupName: TypeAlias = Literal[
    "tp", "cp", "dp", "pp", "dp_cp", "tp_cp", "mp", "tp_dp_cp", "ep", "expt_tp", "expt_dp", "tp_ep", "tp_ep_pp",
    "tp_ep_pp_with_egtp_remat", "gtp_remat", "expt_gtp_remat", "dp_cp_gtp_remat", "expt_dp_gtp_remat", "dp_cp_ag",
    "expt_dp_ag", "embd", "pos_embd", "intra_dp_cp", "intra_expt_dp", "inter_dist_opt", "intra_dist_opt",
]
"""The name of every field that holds one process group (every field but ``hcp``)."""

FieldName: TypeAlias = Literal[GroupName, "hcp"]
"""The name of every field of :class:`ProcessGroupCollection`."""

GroupField: TypeAlias = Union["ProcessGroup", None, Unset]
"""What a one-group field holds."""

FieldValue: TypeAlias = Union["ProcessGroup", "list[ProcessGroup]", None, Unset]
"""What any field holds (``hcp`` holds a list of groups)."""

D = TypeVar("D")


def _group_field() -> GroupField:
    return cast(GroupField, attrs.field(default=UNSET, kw_only=True))


@attrs.frozen(slots=True, repr=False, eq=False, init=False)
class ProcessGroupCollection:
    """One process group (or ``None`` = axis off, or ``UNSET``) per group kind.

    Field names are Megatron-Core's ``ProcessGroupCollection`` names, and a field holds the ranks Megatron-Core
    gives it (docs/layout.md). ``mp`` is TP x GTP-remat x PP (the dense grad-norm group),
    ``tp_ep_pp_with_egtp_remat`` is expert TP x EP x expert GTP-remat x PP (the expert one; ``tp_ep_pp`` leaves the
    expert GTP axis out), ``intra_dist_opt`` is the group one distributed-optimizer instance spans. ``hcp`` is a
    list of hierarchical context-parallel groups. ``dp_cp_ag`` and ``expt_dp_ag`` are optional second
    communicators for parameter all-gathers; ``None`` there means "use ``dp_cp`` / ``expt_dp``", as in
    Megatron-Core.

    Checked when built (:func:`_check_fields`): every field must be a ``ProcessGroup``, ``None`` or ``UNSET``
    (``TypeError`` naming the field), and a group that spans several axes must be as large as those axes
    together (``ValueError`` naming it and them; see :data:`COMPOSITE_AXES`).
    """

    tp: GroupField = _group_field()
    cp: GroupField = _group_field()
    dp: GroupField = _group_field()
    pp: GroupField = _group_field()
    dp_cp: GroupField = _group_field()
    tp_cp: GroupField = _group_field()
    mp: GroupField = _group_field()
    tp_dp_cp: GroupField = _group_field()
    ep: GroupField = _group_field()
    expt_tp: GroupField = _group_field()
    expt_dp: GroupField = _group_field()
    tp_ep: GroupField = _group_field()
    tp_ep_pp: GroupField = _group_field()
    tp_ep_pp_with_egtp_remat: GroupField = _group_field()
    gtp_remat: GroupField = _group_field()
    expt_gtp_remat: GroupField = _group_field()
    dp_cp_gtp_remat: GroupField = _group_field()
    expt_dp_gtp_remat: GroupField = _group_field()
    dp_cp_ag: GroupField = _group_field()
    expt_dp_ag: GroupField = _group_field()
    embd: GroupField = _group_field()
    pos_embd: GroupField = _group_field()
    intra_dp_cp: GroupField = _group_field()
    intra_expt_dp: GroupField = _group_field()
    inter_dist_opt: GroupField = _group_field()
    intra_dist_opt: GroupField = _group_field()
    hcp: list[ProcessGroup] | None | Unset = attrs.field(default=UNSET, kw_only=True)

    def __init__(self, **groups: FieldValue) -> None:
        check_field_names(groups)
        _check_fields(groups)
        self.__attrs_init__(**groups)  # type: ignore[arg-type]  # names and types checked just above

    # ------------------------------------------------------------------------------------------- access

    def is_set(self, name: FieldName) -> bool:
        """True when ``name`` holds a group or ``None`` (axis off); False when it is :data:`UNSET`."""
        return self._raw(name) is not UNSET

    @overload
    def get(self, name: GroupName) -> ProcessGroup | None: ...

    @overload
    def get(self, name: Literal["hcp"]) -> list[ProcessGroup] | None: ...

    def get(self, name: FieldName) -> ProcessGroup | list[ProcessGroup] | None:
        """The group (or ``None`` = axis off) of ``name``; raises ``AttributeError`` naming it when UNSET."""
        value = self._raw(name)
        if isinstance(value, Unset):
            raise AttributeError(
                f"process group {name!r} is not set in this ProcessGroupCollection; pass it when building the "
                f"collection (None means the axis is off)"
            )
        return value

    def get_or(self, name: GroupName, default: D) -> ProcessGroup | None | D:
        """The group (or ``None`` = axis off) of ``name`` when it is set, else ``default``."""
        value = self._raw(name)
        if isinstance(value, Unset):
            return default
        return cast("ProcessGroup | None", value)

    def evolve(self, **changes: FieldValue) -> ProcessGroupCollection:
        """A copy with ``changes`` applied (unknown names raise ``ValueError``, from the constructor)."""
        fields: dict[str, FieldValue] = dict(self.items())
        fields.update(changes)
        return ProcessGroupCollection(**fields)

    def items(self) -> Iterator[tuple[FieldName, FieldValue]]:
        """``(name, value)`` for every field, UNSET ones included, in declaration order."""
        for name in FIELD_NAMES:
            yield name, getattr(self, name)  # our own names: no check needed

    def _raw(self, name: str) -> FieldValue:
        check_field_names((name,))
        return cast(FieldValue, getattr(self, name))

    # ------------------------------------------------------------------------------------------- dunder

    def __eq__(self, other: object) -> bool:
        # Groups compare by identity: two collections are equal when they hold the same communicators.
        if not isinstance(other, ProcessGroupCollection):
            return NotImplemented
        return all(_same(a, b) for (_, a), (_, b) in zip(self.items(), other.items(), strict=True))

    def __hash__(self) -> int:
        return hash(tuple((name, _identity(value)) for name, value in self.items()))

    def __repr__(self) -> str:
        parts = [f"{name}({_describe(value)})" for name, value in self.items() if value is not UNSET]
        return f"ProcessGroupCollection({', '.join(parts)})"


FIELD_NAMES: Final[tuple[FieldName, ...]] = (*get_args(GroupName), "hcp")
"""Every field of :class:`ProcessGroupCollection`, in declaration order."""

assert FIELD_NAMES == tuple(a.name for a in attrs.fields(ProcessGroupCollection)), "GroupName lists every field"


def _composite_axes() -> dict[GroupName, tuple[GroupName, ...]]:
    """Composite field -> the one-axis fields it spans, from the layout's group kinds."""
    spans: dict[str, tuple[str, ...]] = {}
    no_shared_axis: dict[str, str] = {}
    grids: tuple[tuple[Mapping[str, str], dict[str, str]], ...] = (
        (DENSE_GROUP_KINDS, no_shared_axis),
        (EXPERT_GROUP_KINDS, {"pp": "pp"}),  # the expert grid's pipeline axis is the dense one
    )
    for kinds, shared in grids:
        axis_field = {**shared, **{axes: field for field, axes in kinds.items() if "-" not in axes}}
        for field, axes in kinds.items():
            if "-" in axes:
                spans[field] = tuple(axis_field[axis] for axis in axes.split("-"))
    return cast("dict[GroupName, tuple[GroupName, ...]]", spans)


COMPOSITE_AXES: Final[Mapping[GroupName, tuple[GroupName, ...]]] = _composite_axes()
"""Each field whose group spans several axes -> the fields of those axes, as the layout defines the kinds
(``mp`` spans ``tp``, ``gtp_remat``, ``pp``; ``tp_ep_pp_with_egtp_remat`` spans ``expt_tp``, ``expt_gtp_remat``,
``ep``, ``pp``; ...). A collection is refused when such a group's size is not the product of its axes' sizes
(``None`` counts 1): a group set to ``None`` on an axis the composite spans is how a norm reads ranks twice."""


def _check_fields(groups: Mapping[str, object]) -> None:
    """``TypeError`` for a field that is not a group, ``None`` or UNSET; ``ValueError`` for a composite group
    whose size disagrees with its axes. Imports nothing: a group exists only when torch is already loaded."""
    for name, value in groups.items():
        if name != "hcp":
            _check_group_type(name, value, allow_none=True)
        elif isinstance(value, list):
            for index, item in enumerate(value):
                _check_group_type(f"hcp[{index}]", item, allow_none=False)
        elif value is not None and value is not UNSET:
            raise TypeError(f"field 'hcp' must be a list of torch ProcessGroups, None or UNSET; got {value!r}")
    for composite, axes in COMPOSITE_AXES.items():
        group = groups.get(composite, UNSET)
        if group is UNSET:
            continue
        size = group_size(cast("ProcessGroup | None", group))
        given = [axis for axis in axes if groups.get(axis, UNSET) is not UNSET]
        product = math.prod(group_size(cast("ProcessGroup | None", groups[axis])) for axis in given)
        complete = len(given) == len(axes)
        if (size != product) if complete else (size % product != 0):
            described = ", ".join(
                f"{axis} ({_describe(cast(FieldValue, groups.get(axis, UNSET)))})"
                for axis in axes
            )
            relation = "" if complete else "a multiple of "
            raise ValueError(
                f"process group {composite!r} spans {size} rank(s), but it spans the axes {described}, so its size "
                f"must be {relation}{product}: a group set to None (off) on an axis {composite!r} spans, or a group "
                f"of another layout, would make a reduction over {composite!r} count ranks twice or miss them"
            )


def _check_group_type(name: str, value: object, *, allow_none: bool) -> None:
    if value is UNSET or (value is None and allow_none):
        return
    distributed = sys.modules.get("torch.distributed")
    process_group = getattr(distributed, "ProcessGroup", None)
    if process_group is not None and isinstance(value, process_group):
        return
    expected = "a torch ProcessGroup" + (", None (axis off) or UNSET" if allow_none else "")
    hint = " (torch's NON_GROUP_MEMBER: this process is not a member of that group)" if isinstance(value, int) else ""
    raise TypeError(f"process group field {name!r} must be {expected}; got {type(value).__name__} {value!r}{hint}")


def group_size(group: ProcessGroup | None) -> int:
    """Size of ``group``; ``None`` (axis off) is 1. Never WORLD."""
    if group is None:
        return 1
    _check_group(group)
    return int(group.size())


def group_rank(group: ProcessGroup | None) -> int:
    """This process's rank in ``group``; ``None`` (axis off) is 0. Never the WORLD rank."""
    if group is None:
        return 0
    _check_group(group)
    rank = int(group.rank())
    if rank < 0:
        raise ValueError(_NOT_A_MEMBER)
    return rank


_NOT_A_MEMBER: Final = "this process is not a member of the group it asked about"


def _check_group(group: object) -> None:
    if group is UNSET:
        raise ValueError("UNSET is not a process group; resolve it first (pgregistry.fallback)")
    # A non-member's handle from new_group is torch's NON_GROUP_MEMBER sentinel, an int with no size or rank.
    if isinstance(group, int):
        raise ValueError(f"{_NOT_A_MEMBER} (its handle is torch's NON_GROUP_MEMBER, {group!r})")


def check_field_names(names: Iterable[str]) -> tuple[FieldName, ...]:
    """``names`` as a tuple; ``ValueError`` with a close-match suggestion for the first unknown one."""
    names = tuple(names)
    for name in names:
        if name not in FIELD_NAMES:
            close = difflib.get_close_matches(name, FIELD_NAMES, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ValueError(f"Unknown attribute: {name!r}{hint} (known: {', '.join(FIELD_NAMES)})")
    return cast("tuple[FieldName, ...]", names)


def _identity(value: FieldValue) -> object:
    if isinstance(value, list):
        return tuple(id(v) for v in value)
    if value is None or value is UNSET:
        return value
    return id(value)


def _same(a: FieldValue, b: FieldValue) -> bool:
    return _identity(a) == _identity(b)


def _describe(value: FieldValue) -> str:
    if value is None:
        return "off"
    if isinstance(value, Unset):
        return "unset"
    if isinstance(value, list):
        return "[" + ", ".join(str(g.size()) for g in value) + "]"
    return str(value.size())

"""``ProcessGroupCollection``: the typed, frozen process groups one model runs on, and their layout.

Each field holds exactly one of four things, and each means one thing only:

* a ``ProcessGroup``: use it;
* ``None``: the axis is off (size 1) for this model. Code treats it as rank 0 of 1, never as WORLD
  (which is what ``None`` means to a ``torch.distributed`` call), so library code reads sizes and
  ranks through :func:`group_size` and :func:`group_rank`. In ``dp_cp_ag`` / ``expt_dp_ag`` "off"
  means "no second communicator for parameter all-gathers": Megatron-Core's rule is that the
  all-gathers then run on ``dp_cp`` / ``expt_dp``;
* :data:`UNSET`: nobody said. :meth:`ProcessGroupCollection.get` raises; only an entry point's
  resolution (:mod:`pgregistry._runtime.resolve`) may read the global grid for it, with a warning.
  Mixing "unset" and "off" is what made Megatron-Core's filters read the global rank for a model
  whose own grid turned an axis off (Megatron-LM pull request 8042; ``docs/known_bugs.md``);
* :data:`NOT_MEMBER`: this rank belongs to no group of that kind: the embedding groups of a middle
  pipeline stage, or every field of a collection given to a rank outside its layout's span. Never
  "rank 0 of 1".

``UNSET`` and ``NOT_MEMBER`` have no truth value: ``if pg.tp:`` raises for them instead of reading
"nobody said" as "off".

A collection built by :func:`pgregistry.registry.build` knows its
:attr:`~ProcessGroupCollection.layout`, its :attr:`~ProcessGroupCollection.name` and whether this
rank is a member, and its groups are checked against the layout when it is made, so consumers take
the collection alone: no second argument can disagree with it. Every field of a collection held by a
rank outside the layout's ranks raises when read, naming the layout and the rank.
"""

from __future__ import annotations

import difflib
import enum
import math
import sys
from collections.abc import Iterable, Iterator, Mapping
from typing import (
    TYPE_CHECKING,
    Final,
    Generic,
    Literal,
    NoReturn,
    TypeAlias,
    TypeVar,
    Union,
    cast,
    get_args,
    overload,
)

from pgregistry.layout import DENSE_GROUP_KINDS, EXPERT_GROUP_KINDS, GROUP_KINDS

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from pgregistry.layout import ParallelLayout

__all__ = [
    "FIELD_NAMES",
    "NOT_MEMBER",
    "UNSET",
    "FieldName",
    "GroupName",
    "NotMember",
    "ProcessGroupCollection",
    "Unset",
    "group_rank",
    "group_size",
    "implied_size",
]


class Unset(enum.Enum):
    """Type of the :data:`UNSET` sentinel (an enum so type checkers can narrow on it).

    Its one member is a field nobody gave. It has no truth value: ``if pg.tp:`` would take an unset
    field for an axis that is off, so test it with :meth:`ProcessGroupCollection.is_set`.

    Raises:
        TypeError: on ``bool(UNSET)`` (an ``if``, ``and``, ``not``), saying what to ask instead.

    Example:
        >>> collection = ProcessGroupCollection(tp=None)
        >>> collection.dp, collection.is_set("dp"), collection.is_set("tp")
        (UNSET, False, True)
        >>> isinstance(collection.dp, Unset)
        True
        >>> bool(collection.dp)
        Traceback (most recent call last):
        TypeError: UNSET (nobody gave this field) has no truth value: ...
    """

    UNSET = "UNSET"

    def __repr__(self) -> str:
        return "UNSET"

    def __bool__(self) -> NoReturn:
        raise TypeError(
            "UNSET (nobody gave this field) has no truth value: `if pg.tp:` would read it "
            "as 'off'. Ask pg.is_set(name), or pg.get(name), which raises for an unset field"
        )


UNSET: Final = Unset.UNSET
"""A collection field nobody provided; distinct from ``None`` (the axis is off)."""


class NotMember(enum.Enum):
    """Type of the :data:`NOT_MEMBER` sentinel: this rank is in no group of the field's kind.

    A middle pipeline stage has no embedding group; its ``embd`` is ``NOT_MEMBER``, set (not
    ``UNSET``) but no group. Test it with :meth:`ProcessGroupCollection.is_member_of`.

    Raises:
        TypeError: on ``bool(NOT_MEMBER)``, saying what to ask instead.

    Example:
        >>> collection = ProcessGroupCollection(embd=NOT_MEMBER)
        >>> collection.is_set("embd"), collection.is_member_of("embd")
        (True, False)
        >>> collection.get("embd")
        Traceback (most recent call last):
        ValueError: rank ... belongs to no 'embd' group of ... ask pg.is_member_of('embd') first
    """

    NOT_MEMBER = "NOT_MEMBER"

    def __repr__(self) -> str:
        return "NOT_MEMBER"

    def __bool__(self) -> NoReturn:
        raise TypeError(
            "NOT_MEMBER (this rank belongs to no group of that kind) has no truth value; "
            "ask pg.is_member_of(name)"
        )


NOT_MEMBER: Final = NotMember.NOT_MEMBER
"""A field of a kind this rank is in no group of (an embedding group on a middle pipeline stage)."""

GroupName: TypeAlias = Literal[
    "tp",
    "cp",
    "dp",
    "pp",
    "dp_cp",
    "tp_cp",
    "mp",
    "tp_dp_cp",
    "ep",
    "expt_tp",
    "expt_dp",
    "tp_ep",
    "tp_ep_pp",
    "tp_ep_pp_with_egtp_remat",
    "gtp_remat",
    "expt_gtp_remat",
    "dp_cp_gtp_remat",
    "expt_dp_gtp_remat",
    "dp_cp_ag",
    "expt_dp_ag",
    "embd",
    "pos_embd",
    "intra_dp_cp",
    "intra_expt_dp",
    "inter_dist_opt",
    "intra_dist_opt",
]
"""The name of every field that holds one process group (every field but ``hcp``)."""

FieldName: TypeAlias = Literal[GroupName, "hcp"]
"""The name of every field of :class:`ProcessGroupCollection`."""

GroupField: TypeAlias = Union["ProcessGroup", None, Unset, NotMember]
"""What a one-group field holds."""

GroupsField: TypeAlias = Union["list[ProcessGroup]", None, Unset, NotMember]
"""What ``hcp`` holds: a list of hierarchical context-parallel groups."""

FieldValue: TypeAlias = Union["ProcessGroup", "list[ProcessGroup]", None, Unset, NotMember]
"""What any field holds."""

FIELD_NAMES: Final[tuple[FieldName, ...]] = (*get_args(GroupName), "hcp")
"""Every field of :class:`ProcessGroupCollection`, in declaration order."""

_LAYOUT_KINDS: Final = frozenset(GROUP_KINDS)

D = TypeVar("D")
V = TypeVar("V")


class _Field(Generic[V]):
    """One field: reads the stored value, refusing each read on a rank outside the layout."""

    __slots__ = ("name",)

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, instance: None, owner: type) -> _Field[V]: ...

    @overload
    def __get__(self, instance: ProcessGroupCollection, owner: type) -> V: ...

    def __get__(self, instance: ProcessGroupCollection | None, owner: type) -> V | _Field[V]:
        if instance is None:
            return self
        return cast(V, instance._raw_field(self.name))

    def __set__(self, instance: ProcessGroupCollection, value: object) -> NoReturn:
        raise AttributeError(
            f"ProcessGroupCollection is frozen; use evolve({self.name}=...) for a changed copy"
        )


class ProcessGroupCollection:
    """One process group per group kind, plus the layout.

    A field may instead be ``None`` (axis off), ``UNSET`` or ``NOT_MEMBER``.

    What a model and its optimizer are handed instead of reading a global ``parallel_state``: each
    field is one communicator, so a function's groups are visible in its arguments. Field names
    are Megatron-Core's ``ProcessGroupCollection`` names, and a field holds the ranks
    Megatron-Core gives it (docs/layout.md). ``mp`` is TP x GTP-remat x PP (the dense grad-norm
    group), ``tp_ep_pp_with_egtp_remat`` is expert TP x EP x expert GTP-remat x PP (the expert one;
    ``tp_ep_pp`` leaves the expert GTP axis out), ``intra_dist_opt`` is the group one
    distributed-optimizer instance spans. ``hcp`` is a list of hierarchical context-parallel
    groups.
    The collection is frozen: :meth:`evolve` gives a changed copy.

    Args:
        layout: What the groups were built from; each group is then checked to hold the layout's
            ranks for this rank. ``None``: no such check.
        name: The build's name, for messages.
        one_rank_group: A group of this rank alone: adapters to libraries without an "axis off"
            value (Megatron-Core, DeviceMesh) pass it where a field is ``None``.
        **groups: The fields, by name; a field not given is ``UNSET``.

    Raises:
        TypeError: A field is not a ``ProcessGroup``, ``None``, ``UNSET`` or ``NOT_MEMBER`` (named).
        ValueError: An unknown field name (the nearest one suggested); a group that spans several
            axes is not as large as those axes together (named with them; see
            :data:`COMPOSITE_AXES`); with a layout, a group does not hold the layout's ranks (the
            field, its ranks and the layout's named).

    Example:
        >>> collection = ProcessGroupCollection(tp=None, name="toy")
        >>> collection.tp is None, collection.dp
        (True, UNSET)
        >>> collection.evolve(dp=None).dp is None
        True
        >>> ProcessGroupCollection(tp=3)
        Traceback (most recent call last):
        TypeError: process group field 'tp' must be a torch ProcessGroup, None (axis off), ...
    """

    __slots__ = ("_values", "_layout", "_name", "_one_rank_group", "_member", "_lifetime")

    tp = _Field[GroupField]()
    cp = _Field[GroupField]()
    dp = _Field[GroupField]()
    pp = _Field[GroupField]()
    dp_cp = _Field[GroupField]()
    tp_cp = _Field[GroupField]()
    mp = _Field[GroupField]()
    tp_dp_cp = _Field[GroupField]()
    ep = _Field[GroupField]()
    expt_tp = _Field[GroupField]()
    expt_dp = _Field[GroupField]()
    tp_ep = _Field[GroupField]()
    tp_ep_pp = _Field[GroupField]()
    tp_ep_pp_with_egtp_remat = _Field[GroupField]()
    gtp_remat = _Field[GroupField]()
    expt_gtp_remat = _Field[GroupField]()
    dp_cp_gtp_remat = _Field[GroupField]()
    expt_dp_gtp_remat = _Field[GroupField]()
    dp_cp_ag = _Field[GroupField]()
    expt_dp_ag = _Field[GroupField]()
    embd = _Field[GroupField]()
    pos_embd = _Field[GroupField]()
    intra_dp_cp = _Field[GroupField]()
    intra_expt_dp = _Field[GroupField]()
    inter_dist_opt = _Field[GroupField]()
    intra_dist_opt = _Field[GroupField]()
    hcp = _Field[GroupsField]()

    def __init__(
        self,
        *,
        layout: ParallelLayout | None = None,
        name: str | None = None,
        one_rank_group: ProcessGroup | None = None,
        **groups: FieldValue,
    ) -> None:
        check_field_names(groups)
        _check_fields(groups)
        if one_rank_group is not None:
            _check_group_type("one_rank_group", one_rank_group, allow_none=False)
        values: dict[str, FieldValue] = {name_: groups.get(name_, UNSET) for name_ in FIELD_NAMES}
        if layout is not None:
            _check_against_layout(values, layout, one_rank_group)
        self._values = values
        self._layout = layout
        self._name = name
        self._one_rank_group = one_rank_group
        self._member = True
        self._lifetime: _Lifetime | None = None

    @classmethod
    def _for_non_member(
        cls, layout: ParallelLayout, name: str | None, lifetime: _Lifetime | None
    ) -> ProcessGroupCollection:
        """The collection of a rank outside ``layout``'s ranks.

        It knows it is no member, and every read raises.
        """
        collection = cls.__new__(cls)
        collection._values = dict.fromkeys(FIELD_NAMES, NOT_MEMBER)
        collection._layout = layout
        collection._name = name
        collection._one_rank_group = None
        collection._member = False
        collection._lifetime = lifetime
        return collection

    # ------------------------------------------------------------------------------------- identity

    @property
    def layout(self) -> ParallelLayout | None:
        """The layout this collection was built from (``None`` for one assembled by hand)."""
        return self._layout

    @property
    def name(self) -> str | None:
        """The name it was built under (``None`` for a collection assembled by hand)."""
        return self._name

    @property
    def is_member(self) -> bool:
        """Whether this rank is one of the layout's ranks (always true without a layout)."""
        return self._member

    @property
    def one_rank_group(self) -> ProcessGroup | None:
        """This rank's own group, for adapters where a field is ``None``; ``None`` if not given."""
        self._check_member()
        return self._one_rank_group

    @property
    def is_destroyed(self) -> bool:
        """Whether :func:`pgregistry.registry.destroy` destroyed this built collection's groups."""
        return self._lifetime is not None and not self._lifetime.alive

    def describe(self) -> str:
        """How messages name it: build name and layout, or "a collection assembled by hand".

        Returns:
            ``"layout 'name' ParallelLayout(...)"`` for a built collection, ``"collection 'name'"``
            for a named one assembled by hand, else ``"a collection assembled by hand"``.

        Example:
            >>> ProcessGroupCollection(tp=None, name="toy").describe()
            "collection 'toy'"
        """
        if self._layout is None:
            return f"collection {self._name!r}" if self._name else "a collection assembled by hand"
        label = f"{self._name!r} " if self._name else ""
        return f"layout {label}{self._layout!r}"

    # --------------------------------------------------------------------------------------- access

    def is_set(self, name: FieldName) -> bool:
        """Whether ``name`` holds a group, ``None`` (axis off) or ``NOT_MEMBER``; not ``UNSET``.

        Args:
            name: a field name (:data:`FIELD_NAMES`).

        Returns:
            ``False`` for a field nobody gave, ``True`` otherwise.

        Raises:
            ValueError: an unknown ``name`` (suggesting a close one); this rank is not a member of
                the collection's layout (:attr:`is_member`).

        Example:
            >>> collection = ProcessGroupCollection(tp=None)
            >>> collection.is_set("tp"), collection.is_set("dp")
            (True, False)
        """
        return self._raw_field(name) is not UNSET

    def is_member_of(self, name: FieldName) -> bool:
        """Whether this rank belongs to a group of kind ``name`` (``None``, axis off: rank 0 of 1).

        Args:
            name: a field name (:data:`FIELD_NAMES`).

        Returns:
            ``False`` where the field is ``NOT_MEMBER`` (an embedding group on a middle pipeline
            stage), ``True`` for a group or ``None``.

        Raises:
            AttributeError: ``name`` is UNSET, as :meth:`get`.
            ValueError: an unknown ``name``; this rank is not a member of the collection's layout.

        Example:
            >>> collection = ProcessGroupCollection(tp=None, embd=NOT_MEMBER)
            >>> collection.is_member_of("tp"), collection.is_member_of("embd")
            (True, False)
        """
        value = self._raw_field(name)
        if isinstance(value, Unset):
            raise self._unset_error(name)
        return not isinstance(value, NotMember)

    @overload
    def get(self, name: GroupName) -> ProcessGroup | None: ...

    @overload
    def get(self, name: Literal["hcp"]) -> list[ProcessGroup] | None: ...

    def get(self, name: FieldName) -> ProcessGroup | list[ProcessGroup] | None:
        """The group (or ``None`` = axis off) of ``name``.

        Attribute access (``collection.tp``) answers ``UNSET`` or ``NOT_MEMBER`` where ``get``
        raises.

        Args:
            name: a field name (:data:`FIELD_NAMES`).

        Returns:
            This rank's group of that kind; ``None`` where the axis is off; for ``hcp``, a list of
            groups.

        Raises:
            AttributeError: the field is UNSET, naming it.
            ValueError: this rank belongs to no group of that kind (``NOT_MEMBER``), naming it; an
                unknown ``name``; this rank is not a member of the collection's layout.

        Example:
            >>> collection = ProcessGroupCollection(tp=None)
            >>> collection.get("tp") is None
            True
            >>> collection.get("dp")
            Traceback (most recent call last):
            AttributeError: process group 'dp' is not set in this ProcessGroupCollection; ...
        """
        value = self._raw_field(name)
        if isinstance(value, Unset):
            raise self._unset_error(name)
        if isinstance(value, NotMember):
            raise ValueError(
                f"rank {_this_rank()} belongs to no {name!r} group of "
                f"{self.describe()} (embedding groups hold the first and last "
                f"pipeline stages only); ask pg.is_member_of({name!r}) first"
            )
        return value

    def get_or(self, name: GroupName, default: D) -> ProcessGroup | None | D:
        """The group (or ``None`` = axis off) of ``name`` when it is set, else ``default``.

        Args:
            name: a field name (:data:`FIELD_NAMES`).
            default: returned when the field is UNSET.

        Returns:
            What :meth:`get` returns, or ``default``.

        Raises:
            ValueError: as :meth:`get`: this rank belongs to no group of that kind, an unknown
                ``name``, or this rank is not a member of the collection's layout.

        Example:
            >>> ProcessGroupCollection(tp=None).get_or("dp", "no dp group given")
            'no dp group given'
        """
        if not self.is_set(name):
            return default
        return self.get(name)

    def evolve(self, **changes: FieldValue) -> ProcessGroupCollection:
        """A copy with ``changes`` applied, checked like a new collection (against the layout too).

        The copy keeps the layout, name and one-rank group, and dies with the original's groups
        (:func:`pgregistry.registry.destroy`). The original is unchanged.

        Args:
            **changes: field name -> new value: a group, ``None`` (axis off), ``UNSET`` or
                ``NOT_MEMBER``.

        Returns:
            The new collection.

        Raises:
            ValueError: an unknown field name (suggesting a close one); a value the layout refuses,
                as :class:`ProcessGroupCollection` does; this rank is not a member of the layout.
            TypeError: a value that is no group, ``None`` or sentinel.

        Example:
            >>> collection = ProcessGroupCollection(tp=None)
            >>> collection.evolve(dp=None).is_set("dp"), collection.is_set("dp")
            (True, False)
        """
        fields: dict[str, FieldValue] = dict(self.items())
        fields.update(changes)
        copy = ProcessGroupCollection(
            layout=self._layout, name=self._name, one_rank_group=self._one_rank_group, **fields
        )
        copy._lifetime = self._lifetime
        return copy

    def items(self) -> Iterator[tuple[FieldName, FieldValue]]:
        """``(name, value)`` for every field, UNSET ones included, in declaration order.

        Yields:
            Each field's name (:data:`FIELD_NAMES` order) and value: a group, ``None``, ``UNSET``
            or ``NOT_MEMBER``.

        Raises:
            ValueError: this rank is not a member of the collection's layout.

        Example:
            >>> [name for name, value in ProcessGroupCollection(tp=None).items() if value is None]
            ['tp']
        """
        self._check_member()
        for name in FIELD_NAMES:
            yield name, self._values[name]

    def _raw_field(self, name: str) -> FieldValue:
        value = self._values.get(name, _MISSING)
        if value is _MISSING:
            check_field_names((name,))
        self._check_member()
        return cast(FieldValue, value)

    def _check_member(self) -> None:
        if not self._member:
            layout = cast("ParallelLayout", self._layout)
            first, last = layout.rank_range()
            raise ValueError(
                f"rank {_this_rank()} is not a member of {self.describe()}, "
                f"which spans ranks {first}-{last - 1}: this rank holds no group "
                "of it and must not compute with it (check pg.is_member first)"
            )

    def _unset_error(self, name: str) -> AttributeError:
        return AttributeError(
            f"process group {name!r} is not set in this ProcessGroupCollection; "
            "pass it when building the collection (None means the axis is off)"
        )

    # --------------------------------------------------------------------------------------- dunder

    def __eq__(self, other: object) -> bool:
        # Groups compare by identity: two collections are equal when they hold the same
        # communicators.
        if not isinstance(other, ProcessGroupCollection):
            return NotImplemented
        return self._identity_key() == other._identity_key()

    def __hash__(self) -> int:
        return hash(self._identity_key())

    def _identity_key(self) -> tuple[object, ...]:
        return (
            self._layout,
            self._member,
            tuple(_field_identity(value) for value in self._values.values()),
        )

    def __repr__(self) -> str:
        if not self._member:
            return f"ProcessGroupCollection(not a member of {self.describe()})"
        parts = [
            f"{name}({_describe_field(value)})"
            for name, value in self._values.items()
            if value is not UNSET
        ]
        return f"ProcessGroupCollection({', '.join(parts)})"


_MISSING: Final = object()


class _Lifetime:
    """Shared by the collections of one build: :func:`pgregistry.registry.destroy` marks it dead."""

    __slots__ = ("alive",)

    def __init__(self) -> None:
        self.alive = True


assert FIELD_NAMES == tuple(
    name for name, value in vars(ProcessGroupCollection).items() if isinstance(value, _Field)
), "GroupName lists every field, in declaration order"


def _composite_axes() -> dict[GroupName, tuple[GroupName, ...]]:
    """Composite field -> the one-axis fields it spans, from the layout's group kinds."""
    kinds = {**DENSE_GROUP_KINDS, **EXPERT_GROUP_KINDS}  # every axis is named by its one-axis field
    return cast(
        "dict[GroupName, tuple[GroupName, ...]]",
        {f: axes for f, axes in kinds.items() if len(axes) > 1},
    )


COMPOSITE_AXES: Final[Mapping[GroupName, tuple[GroupName, ...]]] = _composite_axes()
"""Each field whose group spans several axes -> the fields of those axes, as the layout defines the
kinds (``mp`` spans ``tp``, ``gtp_remat``, ``pp``; ``tp_ep_pp_with_egtp_remat`` spans ``expt_tp``,
``expt_gtp_remat``, ``ep``, ``pp``; ...). A collection is refused when such a group's size is not
the product of its axes' sizes (``None`` counts 1): a group set to ``None`` on an axis the composite
spans is how a norm reads ranks twice."""


def _check_fields(groups: Mapping[str, object]) -> None:
    """Refuse a field that is not a group, or a composite group whose size disagrees with its axes.

    ``TypeError`` for a field that is not a group, ``None``, UNSET or NOT_MEMBER; ``ValueError`` for
    a composite group whose size disagrees with its axes, or that lacks a rank of an axis's group.
    Imports nothing: a group exists only when torch is already loaded."""
    for name, value in groups.items():
        if name != "hcp":
            _check_group_type(name, value, allow_none=True)
        elif isinstance(value, list):
            for index, item in enumerate(value):
                _check_group_type(f"hcp[{index}]", item, allow_none=False)
        elif value is not None and not isinstance(value, (Unset, NotMember)):
            raise TypeError(
                f"field 'hcp' must be a list of torch ProcessGroups, None or UNSET; got {value!r}"
            )
    for composite, axes in COMPOSITE_AXES.items():
        group = groups.get(composite, UNSET)
        if isinstance(group, (Unset, NotMember)):
            continue
        size = group_size(cast("ProcessGroup | None", group))
        given = [
            axis for axis in axes if not isinstance(groups.get(axis, UNSET), (Unset, NotMember))
        ]
        product = math.prod(group_size(cast("ProcessGroup | None", groups[axis])) for axis in given)
        complete = len(given) == len(axes)
        if (size != product) if complete else (size % product != 0):
            described = ", ".join(
                f"{axis} ({_describe_field(cast(FieldValue, groups.get(axis, UNSET)))})"
                for axis in axes
            )
            relation = "" if complete else "a multiple of "
            raise ValueError(
                f"process group {composite!r} spans {size} rank(s), but it spans the axes "
                f"{described}, so its size must be {relation}{product}: a group set to "
                f"None (off) on an axis {composite!r} spans, or a group of another layout, "
                f"would make a reduction over {composite!r} count ranks twice or miss them"
            )
        if group is not None:
            _check_axes_inside(
                composite, cast("ProcessGroup", group), {axis: groups[axis] for axis in given}
            )


def _check_axes_inside(
    composite: GroupName, group: ProcessGroup, axes: Mapping[str, object]
) -> None:
    """``ValueError`` when a group of one of ``composite``'s axes holds a rank ``group`` lacks.

    Sizes alone pass a group of another kind that has the right size (the ``dp`` group given as
    ``mp`` at TP 2): a reduction over it then sums other ranks' grads and misses the axis's peers, a
    norm off on every rank (7.07 and 16.97 for 13)."""
    known = _global_ranks_or_none(group)
    if known is None:
        return
    held = set(known)
    for axis, value in axes.items():
        ranks = None if value is None else _global_ranks_or_none(cast("ProcessGroup", value))
        outside = sorted(set(ranks or ()) - held)
        if ranks is not None and outside:
            raise ValueError(
                f"process group {composite!r} holds ranks {sorted(held)}, but it spans the axis "
                f"{axis!r}, whose group holds ranks {list(ranks)} (rank(s) {outside} not in "
                f"{composite!r}): is it another kind's group of the same size? A reduction over "
                f"{composite!r} would sum other ranks' grads and miss {axis!r}'s; give the group "
                f"of {' x '.join(COMPOSITE_AXES[composite])} (pgregistry.build makes them)"
            )


def implied_size(
    collection: ProcessGroupCollection, axis: GroupName
) -> tuple[int, GroupName] | None:
    """The size the collection's own composite groups fix for ``axis``, and the composite fixing it.

    A composite group that is set (a group, or ``None``: one rank) fixes its axes' sizes together:
    when its size is the product of its set axes', each unset axis has one rank (``tp_ep_pp=None``
    leaves ``expt_tp`` and ``ep`` off); when ``axis`` is its only unset axis, ``axis`` has the
    quotient. Whatever fills an unset field (the global grid) must agree with it: a collection never
    holds a filled field that contradicts one that was set.

    Args:
        collection: the collection.
        axis: a one-axis field (``"ep"``, ``"tp"``, ...).

    Returns:
        ``(size, composite field)``, or ``None`` when no composite fixes ``axis``.

    Example:
        >>> implied_size(ProcessGroupCollection(tp_ep_pp=None), "ep")
        (1, 'tp_ep_pp')
        >>> implied_size(ProcessGroupCollection(), "ep") is None
        True
    """
    for composite, axes in COMPOSITE_AXES.items():
        if (
            axis not in axes
            or not collection.is_set(composite)
            or not collection.is_member_of(composite)
        ):
            continue
        size = group_size(collection.get(composite))
        unset = [other for other in axes if not collection.is_set(other)]
        product = math.prod(
            group_size(collection.get(other)) for other in axes if other not in unset
        )
        if size == product:
            return 1, composite
        if unset == [axis] and size % product == 0:
            return size // product, composite
    return None


def _check_group_type(name: str, value: object, *, allow_none: bool) -> None:
    if isinstance(value, (Unset, NotMember)) or (value is None and allow_none):
        return
    distributed = sys.modules.get("torch.distributed")
    process_group = getattr(distributed, "ProcessGroup", None)
    if process_group is not None and isinstance(value, process_group):
        return
    expected = "a torch ProcessGroup" + (
        ", None (axis off), UNSET or NOT_MEMBER" if allow_none else ""
    )
    hint = (
        " (torch's NON_GROUP_MEMBER: this process is not a member of that group; pass NOT_MEMBER)"
        if isinstance(value, int)
        else ""
    )
    raise TypeError(
        f"process group field {name!r} must be {expected}; "
        f"got {type(value).__name__} {value!r}{hint}"
    )


_INSIDE: Final[Mapping[str, str]] = {
    "intra_dp_cp": "dp_cp",
    "intra_expt_dp": "expt_dp",
    "inter_dist_opt": "dp_cp",
}
"""Fields a layout does not enumerate, and the layout kind whose group holds them (HSDP split)."""

_SAME_AS: Final[Mapping[str, str]] = {"dp_cp_ag": "dp_cp", "expt_dp_ag": "expt_dp"}
"""Second communicators over the same ranks as a layout kind."""


def _check_against_layout(
    values: Mapping[str, FieldValue], layout: ParallelLayout, one_rank_group: ProcessGroup | None
) -> None:
    """Check every given group holds the ranks ``layout`` gives this rank.

    Or lies inside them, for the HSDP fields; ``None`` only where the layout's group has one rank;
    ``NOT_MEMBER`` only where this rank is in none."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "a ProcessGroupCollection with a layout needs torch.distributed initialised"
        )
    rank = dist.get_rank()
    expected = layout.groups_of(rank)
    first, last = layout.rank_range()
    span = tuple(range(first, last))
    if one_rank_group is not None and tuple(dist.get_process_group_ranks(one_rank_group)) != (
        rank,
    ):
        raise ValueError(
            f"one_rank_group holds ranks {_ranks_of(one_rank_group)}, not rank {rank} alone"
        )
    for name, value in values.items():
        if isinstance(value, Unset):
            continue
        if name in _LAYOUT_KINDS:
            want = expected[name]
            _check_kind(name, value, want, layout, rank)
        elif name in _INSIDE or name in _SAME_AS or name == "intra_dist_opt":
            kind = _INSIDE.get(name) or _SAME_AS.get(name)
            outer = expected[kind] if kind is not None else span
            assert outer is not None  # every layout kind but the embedding ones holds every rank
            _check_inside(name, value, outer, layout, rank, same=name in _SAME_AS)
        elif isinstance(value, list):  # hcp: inside the context-parallel group
            cp = expected["cp"]
            assert cp is not None
            for index, group in enumerate(value):
                _check_inside(f"hcp[{index}]", group, cp, layout, rank, same=False)


def _check_kind(
    name: str, value: FieldValue, want: tuple[int, ...] | None, layout: ParallelLayout, rank: int
) -> None:
    if want is None:
        if not isinstance(value, NotMember):
            raise ValueError(
                f"field {name!r} is {_describe_field(value)}, "
                f"but rank {rank} belongs to no {name!r} group of {layout!r}; "
                "give NOT_MEMBER"
            )
        return
    if isinstance(value, NotMember):
        raise ValueError(
            f"field {name!r} is NOT_MEMBER, but rank {rank}'s "
            f"{name!r} group in {layout!r} is {list(want)}"
        )
    if value is None:
        if len(want) != 1:
            raise ValueError(
                f"field {name!r} is None (axis off), but rank {rank}'s {name!r} group "
                f"in {layout!r} spans {list(want)}: a reduction over it would miss ranks"
            )
        return
    actual = _ranks_of(cast("ProcessGroup", value))
    if actual != want:
        raise ValueError(
            f"field {name!r} holds ranks {list(actual)}, but rank {rank}'s {name!r} "
            f"group in {layout!r} is {list(want)}: the group belongs to another layout"
        )


def _check_inside(
    name: str,
    value: FieldValue,
    outer: tuple[int, ...],
    layout: ParallelLayout,
    rank: int,
    *,
    same: bool,
) -> None:
    if value is None or isinstance(value, NotMember):
        return
    actual = _ranks_of(cast("ProcessGroup", value))
    inside = set(actual) == set(outer) if same else rank in actual and set(actual) <= set(outer)
    if not inside:
        relation = "the same ranks as" if same else "a group inside"
        raise ValueError(
            f"field {name!r} holds ranks {list(actual)}, but in {layout!r} "
            f"it must be {relation} rank {rank}'s ranks {list(outer)}"
        )


def _ranks_of(group: ProcessGroup) -> tuple[int, ...]:
    import torch.distributed as dist

    return tuple(dist.get_process_group_ranks(group))


def _global_ranks_or_none(group: ProcessGroup) -> tuple[int, ...] | None:
    """The global ranks of ``group``; ``None`` for a group torch.distributed never registered.

    A ``ProcessGroup`` made directly (a test's stand-in, a library's own) has no ranks there."""
    try:
        return _ranks_of(group)
    except (KeyError, ValueError, RuntimeError):
        return None


def _this_rank() -> int | str:
    distributed = sys.modules.get("torch.distributed")
    if distributed is not None and distributed.is_available() and distributed.is_initialized():
        return int(distributed.get_rank())
    return "?"


def group_size(group: ProcessGroup | None) -> int:
    """Size of ``group``; ``None`` (axis off) is 1. Never WORLD.

    Args:
        group: a process group, or ``None`` for an axis that is off.

    Returns:
        The number of ranks in ``group``.

    Raises:
        ValueError: ``UNSET`` (resolve the field first), ``NOT_MEMBER`` or torch's
            ``NON_GROUP_MEMBER`` (this rank is not in the group).

    Example:
        >>> group_size(None)
        1
    """
    if group is None:
        return 1
    _check_group(group)
    return int(group.size())


def group_rank(group: ProcessGroup | None) -> int:
    """This process's rank in ``group``; ``None`` (axis off) is 0.

    Never the WORLD rank, and never "rank 0" for a rank outside the group.

    Args:
        group: a process group, or ``None`` for an axis that is off.

    Returns:
        This process's index among the group's ranks.

    Raises:
        ValueError: ``UNSET`` (resolve the field first), ``NOT_MEMBER``, torch's
            ``NON_GROUP_MEMBER`` or any group this rank is not in.

    Example:
        >>> group_rank(None)
        0
    """
    if group is None:
        return 0
    _check_group(group)
    rank = int(group.rank())
    if rank < 0:
        raise ValueError(_NOT_A_MEMBER)
    return rank


_NOT_A_MEMBER: Final = "this process is not a member of the group it asked about"


def _check_group(group: object) -> None:
    if isinstance(group, Unset):
        raise ValueError(
            "UNSET is not a process group: the field was never given (resolve it first)"
        )
    if isinstance(group, NotMember):
        raise ValueError(f"{_NOT_A_MEMBER} (the field is NOT_MEMBER)")
    # A non-member's handle from new_group is torch's NON_GROUP_MEMBER sentinel, an int with no size
    # or rank.
    if isinstance(group, int):
        raise ValueError(f"{_NOT_A_MEMBER} (its handle is torch's NON_GROUP_MEMBER, {group!r})")


def check_field_names(names: Iterable[str]) -> tuple[FieldName, ...]:
    """``names`` as a tuple; ``ValueError`` suggesting a close match for the first unknown one.

    For the code that takes field names (a collection's keywords, a mesh's dims, a door's field),
    before it reads them.

    Args:
        names: collection field names (:data:`FIELD_NAMES`).

    Returns:
        ``names`` as a tuple, in their order.

    Raises:
        TypeError: a name that is no str (``None``, a pair), which difflib cannot compare.
        ValueError: the first unknown name, with a close known one where there is one.

    Example:
        >>> check_field_names(["tp", "dp"])
        ('tp', 'dp')
        >>> check_field_names(["tpp"])
        Traceback (most recent call last):
        ValueError: Unknown attribute: 'tpp'; did you mean 'tp'? (known: ...)
    """
    names = tuple(names)
    for name in names:
        if not isinstance(name, str):
            raise TypeError(
                f"a field name must be a str (one of {', '.join(FIELD_NAMES)}), got {name!r} "
                f"({type(name).__name__})"
            )
        if name not in FIELD_NAMES:
            close = difflib.get_close_matches(name, FIELD_NAMES, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ValueError(f"Unknown attribute: {name!r}{hint} (known: {', '.join(FIELD_NAMES)})")
    return cast("tuple[FieldName, ...]", names)


def _field_identity(value: FieldValue) -> object:
    if isinstance(value, list):
        return tuple(id(v) for v in value)
    if value is None or isinstance(value, (Unset, NotMember)):
        return value
    return id(value)


def _describe_field(value: FieldValue) -> str:
    if value is None:
        return "off"
    if isinstance(value, Unset):
        return "unset"
    if isinstance(value, NotMember):
        return "not a member"
    if isinstance(value, list):
        return "[" + ", ".join(str(g.size()) for g in value) + "]"
    return str(value.size())

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
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any, Final, Literal, TypeAlias, Union

import attrs

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = [
    "FIELD_NAMES",
    "UNSET",
    "GroupField",
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

GroupField: TypeAlias = Union["ProcessGroup", None, Unset]


def _group_field() -> Any:
    return attrs.field(default=UNSET, kw_only=True)


@attrs.frozen(slots=True, repr=False, eq=False)
class ProcessGroupCollection:
    """One process group (or ``None`` = axis off, or ``UNSET``) per group kind.

    Field names follow Megatron-Core's ``ProcessGroupCollection``. ``mp`` is TP x GTP-remat x PP (the dense
    grad-norm group), ``tp_ep_pp`` is expert TP x EP x expert GTP-remat x PP (the expert one), ``intra_dist_opt`` is the
    group one distributed-optimizer instance spans. ``hcp`` is a list of hierarchical context-parallel groups.
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
    gtp_remat: GroupField = _group_field()
    expt_gtp_remat: GroupField = _group_field()
    embd: GroupField = _group_field()
    pos_embd: GroupField = _group_field()
    intra_dp_cp: GroupField = _group_field()
    intra_expt_dp: GroupField = _group_field()
    inter_dist_opt: GroupField = _group_field()
    intra_dist_opt: GroupField = _group_field()
    hcp: list[ProcessGroup] | None | Unset = _group_field()

    def __init__(self, **groups: Any) -> None:
        check_field_names(groups)
        self.__attrs_init__(**groups)  # type: ignore[attr-defined]

    # ------------------------------------------------------------------------------------------- access

    def is_set(self, name: str) -> bool:
        """True when ``name`` holds a group or ``None`` (axis off); False when it is :data:`UNSET`."""
        return self._raw(name) is not UNSET

    def get(self, name: str) -> Any:
        """The group (or ``None`` = axis off) of ``name``; raises ``AttributeError`` naming it when UNSET."""
        value = self._raw(name)
        if value is UNSET:
            raise AttributeError(
                f"process group {name!r} is not set in this ProcessGroupCollection; pass it when building the "
                f"collection (None means the axis is off)"
            )
        return value

    def evolve(self, **changes: Any) -> ProcessGroupCollection:
        """A copy with ``changes`` applied (unknown names raise ``ValueError``, from the constructor)."""
        return ProcessGroupCollection(**{**dict(self.items()), **changes})

    def items(self) -> Iterator[tuple[str, Any]]:
        """``(name, value)`` for every field, UNSET ones included, in declaration order."""
        for name in FIELD_NAMES:
            yield name, getattr(self, name)  # our own names: no check needed

    def _raw(self, name: str) -> Any:
        check_field_names((name,))
        return getattr(self, name)

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


FIELD_NAMES: Final[tuple[str, ...]] = tuple(a.name for a in attrs.fields(ProcessGroupCollection))
"""Every field of :class:`ProcessGroupCollection`, in declaration order."""


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


def check_field_names(names: Iterable[str]) -> tuple[str, ...]:
    """``names`` as a tuple; ``ValueError`` with a close-match suggestion for the first unknown one."""
    names = tuple(names)
    for name in names:
        if name not in FIELD_NAMES:
            close = difflib.get_close_matches(name, FIELD_NAMES, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ValueError(f"Unknown attribute: {name!r}{hint} (known: {', '.join(FIELD_NAMES)})")
    return names


def _identity(value: Any) -> Any:
    if isinstance(value, list):
        return tuple(id(v) for v in value)
    if value is None or value is UNSET:
        return value
    return id(value)


def _same(a: Any, b: Any) -> bool:
    return _identity(a) == _identity(b)


def _describe(value: Any) -> str:
    if value is None:
        return "off"
    if isinstance(value, list):
        return "[" + ", ".join(str(g.size()) for g in value) + "]"
    return str(value.size())

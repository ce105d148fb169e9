"""Rank layout: pure arithmetic that maps ranks to parallelism coordinates and groups.

No process group is created here. A :class:`ParallelLayout` declares the sizes of the parallelism
axes, the order in which they vary over ranks and the span of ranks it covers (``num_ranks`` ranks
from ``rank_offset``: the whole world, or the part of it one module runs on), and answers which
ranks form each group kind. The rules are exactly those of Megatron-Core's ``RankGenerator`` (and of
its ``HyperCommGrid`` for a span), so that users migrating get the same communicators:

* The order string lists axes fastest-varying first: with the default ``"tp-cp-ep-dp-pp"`` the dense
  grid puts ``rank = rank_offset + tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank))``.
* There are two grids over the same ranks. The dense grid has the axes ``tp, gtp_remat, cp, dp, pp``
  (``ep`` is 1 there); the expert grid has ``expt_tp, ep, expt_gtp_remat, expt_dp, pp`` (``cp`` is 1
  there). Both follow the same order string, whose tokens name the slot of each: ``tp`` is TP in the
  dense grid and expert TP in the expert grid, ``dp`` data and expert data parallelism. Every other
  name is the collection field of that axis's group.
* The GTP-remat axis is placed right after ``tp`` in the dense grid and right after ``ep`` in the
  expert grid (after ``tp``, or first, when the order does not name that axis).
* A group kind such as ``("dp", "cp")`` is the set of ranks that differ only in those coordinates;
  its ranks are listed in grid order (the order string's axis order, fastest first), whatever order
  the kind names them in.

Every query is vectorised: a whole kind is one reshape/permute of ``arange(num_ranks)``, so
enumerating every group of a 131,072-rank layout takes a fraction of a second.
"""

from __future__ import annotations

import enum
import hashlib
import math
import operator
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Final

import attrs

from pgregistry._runtime.flags import require_flag
from pgregistry._runtime.integers import non_negative_int, plain_int, positive_int

if TYPE_CHECKING:
    import torch

__all__ = [
    "DEFAULT_ORDER",
    "DENSE_GROUP_KINDS",
    "EXPERT_GROUP_KINDS",
    "GROUP_KINDS",
    "OrderToken",
    "ParallelLayout",
    "RankGroup",
    "Shrunk",
]

RankGroup = tuple[int, ...]
"""One group: its ranks in grid order."""


class OrderToken(str, enum.Enum):
    """The tokens of an order string, one per slot of both grids (Megatron-Core's ``order``).

    A token names a slot, not one axis: ``tp`` is TP in the dense grid and expert TP in the expert
    grid, ``dp`` data parallelism and expert data parallelism. An *axis* is a dimension of the rank
    grid; a *dim* is a dimension of a tensor. A token is a ``str``: it compares equal to its text.

    Raises:
        ValueError: ``OrderToken(text)`` with a text that names no slot.

    Example:
        >>> [token.value for token in OrderToken]
        ['tp', 'cp', 'ep', 'dp', 'pp']
        >>> OrderToken("dp") is OrderToken.DP, OrderToken.DP == "dp"
        (True, True)
    """

    TP = "tp"
    CP = "cp"
    EP = "ep"
    DP = "dp"
    PP = "pp"


DEFAULT_ORDER: Final = "tp-cp-ep-dp-pp"
_TOKENS: Final = tuple(token.value for token in OrderToken)

_DENSE_AXES: Final[Mapping[str, str]] = {"tp": "tp", "cp": "cp", "ep": "ep", "dp": "dp", "pp": "pp"}
"""Order token -> the dense grid's axis in that slot (``ep`` has size 1 there)."""
_EXPERT_AXES: Final[Mapping[str, str]] = {
    "tp": "expt_tp",
    "cp": "cp",
    "ep": "ep",
    "dp": "expt_dp",
    "pp": "pp",
}
"""Order token -> the expert grid's axis in that slot (``cp`` has size 1 there)."""

DENSE_GROUP_KINDS: Final[Mapping[str, tuple[str, ...]]] = {
    "tp": ("tp",),
    "gtp_remat": ("gtp_remat",),
    "cp": ("cp",),
    "dp": ("dp",),
    "pp": ("pp",),
    "dp_cp": ("dp", "cp"),
    "tp_cp": ("tp", "cp"),
    # The model-parallel group spans every axis that shards the dense model (GTP remat included),
    # which is the group dense grad norms reduce over. With gtp_remat == 1 it is Megatron-Core's
    # "tp-pp".
    "mp": ("tp", "gtp_remat", "pp"),
    # Spans the GTP axis like Megatron-Core's: GTP peers hold distinct data, and the router's
    # expert-bias and the FP8 amax reductions run over every rank of one TP x data domain.
    "tp_dp_cp": ("tp", "gtp_remat", "dp", "cp"),
    # The full data-distribution group (every rank holding a distinct micro-batch); ``dp_cp`` when
    # GTP is off.
    "dp_cp_gtp_remat": ("gtp_remat", "dp", "cp"),
}
"""Dense-grid group kinds: collection field -> the dense-grid axes its groups span."""

EXPERT_GROUP_KINDS: Final[Mapping[str, tuple[str, ...]]] = {
    "ep": ("ep",),
    "expt_tp": ("expt_tp",),
    "expt_gtp_remat": ("expt_gtp_remat",),
    "expt_dp": ("expt_dp",),
    "tp_ep": ("expt_tp", "ep"),
    "tp_ep_pp": ("expt_tp", "ep", "pp"),
    # The expert model-parallel group: every axis that shards expert weights (expert TP x EP x
    # expert GTP-remat x PP), which is the group expert grad norms reduce over. ``tp_ep_pp`` when
    # expert GTP is off.
    "tp_ep_pp_with_egtp_remat": ("expt_tp", "expt_gtp_remat", "ep", "pp"),
    # The full expert data-distribution group; ``expt_dp`` when expert GTP is off.
    "expt_dp_gtp_remat": ("expt_gtp_remat", "expt_dp"),
}
"""Expert-grid group kinds: collection field -> the expert-grid axes its groups span."""

_PIPELINE_EDGE_KINDS: Final = ("embd", "pos_embd")

GROUP_KINDS: Final[tuple[str, ...]] = (
    *DENSE_GROUP_KINDS,
    *EXPERT_GROUP_KINDS,
    *_PIPELINE_EDGE_KINDS,
)
"""Every group kind a layout enumerates, in the deterministic order groups are created."""


def require_layout(layout: object) -> None:
    """``TypeError`` for a ``layout`` that is no :class:`ParallelLayout` (``None``, keywords).

    For the functions that take a layout (the seed plan, placement), before they read it.

    Args:
        layout: what the caller was given as a layout.

    Raises:
        TypeError: ``layout`` is no :class:`ParallelLayout`; the message shows how to make one.

    Example:
        >>> require_layout(ParallelLayout(num_ranks=8, tp=2))
        >>> require_layout({"num_ranks": 8, "tp": 2})
        Traceback (most recent call last):
        TypeError: layout must be a pgregistry.layout.ParallelLayout (such as ...), got dict
    """
    if not isinstance(layout, ParallelLayout):
        raise TypeError(
            "layout must be a pgregistry.layout.ParallelLayout (such as "
            f"ParallelLayout(num_ranks=8, tp=2)), got {type(layout).__name__}"
        )


def _check_positive(instance: object, attribute: attrs.Attribute[int], value: int) -> None:
    positive_int(value, attribute.name)


def _non_negative(instance: object, attribute: attrs.Attribute[int], value: int) -> None:
    non_negative_int(value, attribute.name)


def _order_text(order: object) -> str:
    """``order`` lower-cased; ``TypeError`` unless it is a str (an :class:`OrderToken` is one).

    Stringifying anything else read ``None`` as the axis ``'none'`` and a list as one odd axis."""
    if not isinstance(order, str):
        raise TypeError(
            f"order must be a str of axes joined by '-' (such as {DEFAULT_ORDER!r}), "
            f"got {order!r} ({type(order).__name__})"
        )
    return str.lower(order)


MAX_WORLD_SIZE: Final = 2**31 - 1
"""The most ranks a world may have: torch.distributed keeps ranks and world sizes in a C ``int``."""


@attrs.frozen(slots=True, kw_only=True)
class _Grid:
    """One grid (dense or expert): axis names and sizes in order, fastest first.

    It spans ``offset + arange(size)``.
    """

    axes: tuple[str, ...]
    sizes: tuple[int, ...]
    offset: int

    def strides(self) -> tuple[int, ...]:
        return tuple(math.prod(self.sizes[:axis]) for axis in range(len(self.sizes)))

    def mask(self, kind_axes: tuple[str, ...]) -> tuple[bool, ...]:
        unknown = [a for a in kind_axes if a not in self.axes]
        if unknown:
            raise ValueError(
                f"unknown axes {unknown} in group kind {kind_axes}; grid axes are {self.axes}"
            )
        return tuple(axis in kind_axes for axis in self.axes)

    def all_groups(self, kind_axes: tuple[str, ...]) -> torch.Tensor:
        """Each group of ``kind_axes``, as a ``[num_groups, group_size]`` int64 tensor of ranks.

        The ranks are global.
        """
        import torch

        mask = self.mask(kind_axes)
        count = math.prod(self.sizes)
        # C-order reshape puts the last dim fastest, so reverse the axes (ours are fastest first).
        grid = torch.arange(self.offset, self.offset + count, dtype=torch.int64).reshape(
            tuple(reversed(self.sizes))
        )
        n = len(self.axes)
        dim_of = {i: n - 1 - i for i in range(n)}
        outer = [dim_of[i] for i in reversed(range(n)) if not mask[i]]
        inner = [dim_of[i] for i in reversed(range(n)) if mask[i]]
        group_size = math.prod(s for s, m in zip(self.sizes, mask, strict=True) if m)
        return grid.permute(*outer, *inner).reshape(count // group_size, group_size)

    def coords(self, rank: int) -> dict[str, int]:
        local = rank - self.offset
        axes = zip(self.axes, self.sizes, self.strides(), strict=True)
        return {axis: (local // stride) % size for axis, size, stride in axes}

    def group_of(self, rank: int, kind_axes: tuple[str, ...]) -> RankGroup:
        """The group of ``kind_axes`` holding ``rank``, without enumerating the others."""
        local = rank - self.offset
        masked_axes = [
            (size, stride)
            for size, stride, masked in zip(
                self.sizes, self.strides(), self.mask(kind_axes), strict=True
            )
            if masked
        ]
        members = [local - sum((local // stride) % size * stride for size, stride in masked_axes)]
        # Adding each slower axis as the outer loop keeps the faster ones varying fastest: grid
        # order.
        for size, stride in masked_axes:
            members = [m + i * stride for i in range(size) for m in members]
        return tuple(self.offset + m for m in members)


@attrs.frozen(slots=True, kw_only=True)
class ParallelLayout:
    """The declared parallelism of one model: axis sizes and their order over a span of ranks.

    Pure arithmetic, no process group: the same rank sets Megatron-Core's ``RankGenerator`` makes,
    so a layout can be checked, drawn or compared on a laptop before any job starts.

    Args:
        num_ranks: the ranks of the span (the world, or the part one module runs on).
        tp, cp, pp, ep, gtp_remat, expt_gtp_remat: axis sizes (1: off); ``expt_tp`` defaults to
            ``tp``.
        order: the axes, fastest-varying first (:data:`DEFAULT_ORDER`).
        rank_offset: the span's first rank (Megatron-Core's ``HyperCommGrid`` name; 0: the world's
            first).

    ``dp = num_ranks / (tp * gtp_remat * cp * pp)`` and ``expt_dp = num_ranks / (expt_tp * ep *
    expt_gtp_remat * pp)`` are derived.

    Raises:
        ValueError: a size that does not divide ``num_ranks``, an unknown or repeated axis in
            ``order``, or more ranks than torch.distributed addresses; the message names the
            offending size, so an invalid layout cannot exist.
        TypeError: ``order`` not a str.

    Example:
        >>> layout = ParallelLayout(num_ranks=8, tp=2, pp=2)
        >>> layout.dp, layout.groups("tp")
        (2, ((0, 1), (2, 3), (4, 5), (6, 7)))
        >>> ParallelLayout(num_ranks=6, tp=4)
        Traceback (most recent call last):
        ValueError: num_ranks 6 is not divisible by tp*gtp_remat*cp*pp = 4*1*1*1 = 4
    """

    num_ranks: int = attrs.field(converter=plain_int, validator=_check_positive)
    tp: int = attrs.field(default=1, converter=plain_int, validator=_check_positive)
    cp: int = attrs.field(default=1, converter=plain_int, validator=_check_positive)
    pp: int = attrs.field(default=1, converter=plain_int, validator=_check_positive)
    ep: int = attrs.field(default=1, converter=plain_int, validator=_check_positive)
    expt_tp: int = attrs.field(
        default=attrs.Factory(lambda self: self.tp, takes_self=True),
        converter=plain_int,
        validator=_check_positive,
    )
    gtp_remat: int = attrs.field(default=1, converter=plain_int, validator=_check_positive)
    expt_gtp_remat: int = attrs.field(default=1, converter=plain_int, validator=_check_positive)
    order: str = attrs.field(default=DEFAULT_ORDER, converter=_order_text)
    rank_offset: int = attrs.field(default=0, converter=plain_int, validator=_non_negative)
    dp: int = attrs.field(init=False)
    expt_dp: int = attrs.field(init=False)
    _dense: _Grid = attrs.field(init=False, repr=False, eq=False)
    _expert: _Grid = attrs.field(init=False, repr=False, eq=False)

    def __attrs_post_init__(self) -> None:
        if self.rank_offset + self.num_ranks > MAX_WORLD_SIZE:
            span = f"num_ranks {self.num_ranks}"
            if self.rank_offset:
                span = (
                    f"rank_offset {self.rank_offset} + {span} = {self.rank_offset + self.num_ranks}"
                )
            raise ValueError(
                f"{span} is more ranks than torch.distributed can address "
                f"(at most {MAX_WORLD_SIZE} = 2**31 - 1: ranks are C ints)"
            )
        tokens = self._validate_order_tokens()
        dense_product = self.tp * self.gtp_remat * self.cp * self.pp
        if self.num_ranks % dense_product:
            raise ValueError(
                f"num_ranks {self.num_ranks} is not divisible by tp*gtp_remat*cp*pp = "
                f"{self.tp}*{self.gtp_remat}*{self.cp}*{self.pp} = {dense_product}"
            )
        expert_product = self.expt_tp * self.ep * self.expt_gtp_remat * self.pp
        if self.num_ranks % expert_product:
            raise ValueError(
                "expt_tp*ep*expt_gtp_remat*pp = "
                f"{self.expt_tp}*{self.ep}*{self.expt_gtp_remat}*{self.pp} = "
                f"{expert_product} does not divide num_ranks {self.num_ranks}"
            )
        dp = self.num_ranks // dense_product
        expt_dp = self.num_ranks // expert_product
        if "dp" not in self.order.split("-") and (dp, expt_dp) != (1, 1):
            raise ValueError(
                f"order {self.order!r} lacks axis 'dp' whose size "
                f"is {dp} (expert data-parallel size {expt_dp})"
            )
        # Megatron-Core tests the order string as declared: axes appended because they are missing
        # have size 1.
        if not self.order.endswith(OrderToken.PP.value) and self.pp > 1 and expt_dp != dp:
            raise ValueError(
                f"pp must be last in order {self.order!r} when pp={self.pp} > 1 and "
                f"the expert data-parallel size ({expt_dp}) differs from the dense "
                f"one ({dp}): dense and expert grids would not share pipeline stages"
            )
        object.__setattr__(self, "dp", dp)
        object.__setattr__(self, "expt_dp", expt_dp)
        dense_sizes = {
            "tp": self.tp,
            "gtp_remat": self.gtp_remat,
            "cp": self.cp,
            "ep": 1,
            "dp": dp,
            "pp": self.pp,
        }
        expert_sizes = {
            "expt_tp": self.expt_tp,
            "expt_gtp_remat": self.expt_gtp_remat,
            "cp": 1,
            "ep": self.ep,
            "expt_dp": expt_dp,
            "pp": self.pp,
        }
        declared = tuple(self.order.split("-"))
        dense = self._build_grid(
            declared, tokens, _DENSE_AXES, "gtp_remat", dense_sizes, after=OrderToken.TP.value
        )
        expert = self._build_grid(
            declared,
            tokens,
            _EXPERT_AXES,
            "expt_gtp_remat",
            expert_sizes,
            after=OrderToken.EP.value,
        )
        object.__setattr__(self, "_dense", dense)
        object.__setattr__(self, "_expert", expert)
        if self.pp > 1 and not dense.all_groups(("pp",)).equal(expert.all_groups(("pp",))):
            raise ValueError(
                f"order {self.order!r} gives the dense and expert "
                "grids different pipeline stages; put pp last"
            )

    def _validate_order_tokens(self) -> tuple[str, ...]:
        tokens = tuple(self.order.split("-"))
        unknown = [t for t in tokens if t not in _TOKENS]
        if unknown:
            raise ValueError(
                f"unknown axis {unknown[0]!r} in order "
                f"{self.order!r}; known axes: {sorted(_TOKENS)}"
            )
        repeated = sorted({t for t in tokens if tokens.count(t) > 1})
        if repeated:
            raise ValueError(f"axis {repeated[0]!r} repeated in order {self.order!r}")
        # Like Megatron-Core, an axis missing from the order is appended (outermost) when its size
        # is 1. The data parallel sizes are derived later, and checked in __attrs_post_init__.
        sizes = {"tp": self.tp, "cp": self.cp, "ep": self.ep, "pp": self.pp, "dp": 1}
        missing = [t for t in _TOKENS if t not in tokens]
        for token in missing:
            if sizes[token] != 1:
                raise ValueError(
                    f"order {self.order!r} lacks axis {token!r} whose size is {sizes[token]}"
                )
            if token == OrderToken.TP.value and self.expt_tp != 1:
                raise ValueError(
                    f"order {self.order!r} lacks axis 'tp' whose "
                    f"expert size (expt_tp) is {self.expt_tp}"
                )
        return tokens + tuple(missing)

    def _build_grid(
        self,
        declared: tuple[str, ...],
        tokens: tuple[str, ...],
        axis_of: Mapping[str, str],
        gtp_axis: str,
        sizes: Mapping[str, int],
        *,
        after: str,
    ) -> _Grid:
        """The grid of ``tokens`` with the GTP axis placed as Megatron-Core places it.

        ``tokens`` is the declared order, then the appended size-1 axes; ``axis_of`` names each
        slot's axis in this grid. The GTP axis goes right after ``after`` when the declared order
        names it, else right after ``tp`` when named, else first. The appended axes have size 1, so
        only the declared ones decide the ranks."""
        preceding = after if after in declared else OrderToken.TP.value
        position = declared.index(preceding) + 1 if preceding in declared else 0
        slots = [axis_of[token] for token in tokens]
        axes = (*slots[:position], gtp_axis, *slots[position:])
        return _Grid(axes=axes, sizes=tuple(sizes[a] for a in axes), offset=self.rank_offset)

    # -------------------------------------------------------------------------------------- queries

    def groups_tensor(self, kind: str) -> torch.Tensor:
        """Every group of ``kind`` as a ``[num_groups, group_size]`` int64 tensor (fast path).

        What :meth:`groups` enumerates, without building a tuple per group.

        Args:
            kind: a :data:`GROUP_KINDS` name.

        Returns:
            One row per group, its ranks in grid order, on the CPU.

        Raises:
            ValueError: an unknown ``kind``, listing the known ones (with a close match).
            TypeError: a ``kind`` that is no str.

        Example:
            >>> ParallelLayout(num_ranks=8, tp=2, pp=2).groups_tensor("tp").tolist()
            [[0, 1], [2, 3], [4, 5], [6, 7]]
        """
        _check_kind_is_a_name(kind)
        if kind in DENSE_GROUP_KINDS:
            return self._dense.all_groups(DENSE_GROUP_KINDS[kind])
        if kind in EXPERT_GROUP_KINDS:
            return self._expert.all_groups(EXPERT_GROUP_KINDS[kind])
        if kind in _PIPELINE_EDGE_KINDS:
            return self._dense.all_groups(("pp",))[:, list(self._pipeline_edges(kind))]
        raise ValueError(self._unknown_kind_message(kind))

    def group_shape(self, kind: str) -> tuple[int, int]:
        """``(number of groups, ranks per group)`` of ``kind``: the shape of :meth:`groups_tensor`.

        By arithmetic alone, so a caller can size what enumerating a huge layout would take before
        doing it.

        Args:
            kind: a :data:`GROUP_KINDS` name.

        Returns:
            ``(number of groups, ranks per group)``.

        Raises:
            ValueError: an unknown ``kind``, listing the known ones (with a close match).
            TypeError: a ``kind`` that is no str.

        Example:
            >>> ParallelLayout(num_ranks=131072, tp=8, pp=16).group_shape("dp")
            (128, 1024)
        """
        _check_kind_is_a_name(kind)
        if kind in _PIPELINE_EDGE_KINDS:
            return self.num_ranks // self.pp, len(self._pipeline_edges(kind))
        if kind in DENSE_GROUP_KINDS:
            grid, axes = self._dense, DENSE_GROUP_KINDS[kind]
        elif kind in EXPERT_GROUP_KINDS:
            grid, axes = self._expert, EXPERT_GROUP_KINDS[kind]
        else:
            raise ValueError(self._unknown_kind_message(kind))
        size = math.prod(s for s, masked in zip(grid.sizes, grid.mask(axes), strict=True) if masked)
        return self.num_ranks // size, size

    def groups(self, kind: str) -> tuple[RankGroup, ...]:
        """Every group of ``kind`` (a :data:`GROUP_KINDS` name) as a tuple of ranks in grid order.

        ``embd`` and ``pos_embd`` hold the first and last pipeline stage (``[first]`` when pp is 1)
        and the first stage of each pipeline group, as Megatron-Core builds them; ranks outside them
        belong to no such group.

        Args:
            kind: a :data:`GROUP_KINDS` name.

        Returns:
            Every group of the kind, each a tuple of global ranks; the groups of a kind other than
            the embedding ones partition the layout's ranks.

        Raises:
            ValueError: an unknown ``kind``, listing the known ones (with a close match).
            TypeError: a ``kind`` that is no str.

        Example:
            >>> ParallelLayout(num_ranks=8, tp=2, pp=2).groups("dp")
            ((0, 2), (1, 3), (4, 6), (5, 7))
        """
        # Zipping the columns builds the row tuples in C: about 3x faster than a tuple() per row at
        # 131k ranks.
        return tuple(zip(*self.groups_tensor(kind).T.tolist(), strict=True))

    def groups_of(self, rank: int) -> dict[str, RankGroup | None]:
        """Group kind -> the group holding ``rank`` (``None`` for embedding kinds it is not in).

        Computed for ``rank`` alone (no kind is enumerated).

        Args:
            rank: a global rank of the layout.

        Returns:
            Every :data:`GROUP_KINDS` name -> the group (a tuple of global ranks) holding ``rank``,
            or ``None`` for an embedding kind it is not in.

        Raises:
            ValueError: a rank outside the layout's ranks.
            TypeError: a rank that is no integer (a bool too: ``True`` is not rank 1).

        Example:
            >>> groups = ParallelLayout(num_ranks=8, tp=2, pp=2).groups_of(5)
            >>> groups["tp"], groups["dp"], groups["embd"]
            ((4, 5), (5, 7), (1, 5))
        """
        rank = self._check_rank(rank)
        out: dict[str, RankGroup | None] = {}
        for kind, axes in DENSE_GROUP_KINDS.items():
            out[kind] = self._dense.group_of(rank, axes)
        for kind, axes in EXPERT_GROUP_KINDS.items():
            out[kind] = self._expert.group_of(rank, axes)
        pp_group = out["pp"]
        assert pp_group is not None  # every dense kind holds every rank
        for kind in _PIPELINE_EDGE_KINDS:
            edges = tuple(pp_group[i] for i in self._pipeline_edges(kind))
            out[kind] = edges if rank in edges else None
        return out

    def coords(self, rank: int) -> dict[str, int]:
        """Axis -> coordinate of ``rank``, over the axes of both grids.

        The dense axes are ``tp, gtp_remat, cp, dp, pp``, the expert ones ``expt_tp, ep,
        expt_gtp_remat, expt_dp``.

        Args:
            rank: a global rank of the layout.

        Returns:
            Axis -> ``rank``'s coordinate along it (0 for an axis of size 1), the axes of
            :meth:`axis_sizes`.

        Raises:
            ValueError: a rank outside the layout's ranks.
            TypeError: a rank that is no integer (a bool too).

        Example:
            >>> coords = ParallelLayout(num_ranks=8, tp=2, pp=2).coords(5)
            >>> coords["tp"], coords["dp"], coords["pp"]
            (1, 0, 1)
        """
        rank = self._check_rank(rank)
        dense = self._dense.coords(rank)
        expert = self._expert.coords(rank)
        return {axis: dense[axis] for axis in _AXIS_SIZES if axis in dense and axis != "ep"} | {
            axis: expert[axis] for axis in ("expt_tp", "ep", "expt_gtp_remat", "expt_dp")
        }

    def axis_sizes(self) -> dict[str, int]:
        """Axis -> size, with the same names as :meth:`coords`.

        Returns:
            Each axis of both grids (dense, then expert) -> its size, the derived ``dp`` and
            ``expt_dp`` included.

        Example:
            >>> ParallelLayout(num_ranks=8, tp=2, pp=2).axis_sizes()["dp"]
            2
        """
        return {axis: int(getattr(self, axis)) for axis in _AXIS_SIZES}

    def rank_range(self) -> tuple[int, int]:
        """``(first, stop)``: the layout's ranks are ``range(first, stop)``.

        Returns:
            ``(rank_offset, rank_offset + num_ranks)``.

        Example:
            >>> ParallelLayout(num_ranks=4, tp=2, rank_offset=4).rank_range()
            (4, 8)
        """
        return self.rank_offset, self.rank_offset + self.num_ranks

    def fingerprint(self) -> str:
        """A stable digest of the declared layout, equal on all ranks declaring the same one.

        The digest covers every size, the offset and the order, and no process's state, so it is
        the same across processes and runs.

        Returns:
            16 hex digits.

        Example:
            >>> a = ParallelLayout(num_ranks=8, tp=2, pp=2)
            >>> a.fingerprint() == ParallelLayout(num_ranks=8, pp=2, tp=2).fingerprint()
            True
            >>> a.fingerprint() == ParallelLayout(num_ranks=8, tp=2).fingerprint()
            False
        """
        text = (
            f"v2|ranks={self.num_ranks}|offset={self.rank_offset}|"
            f"tp={self.tp}|cp={self.cp}|pp={self.pp}|ep={self.ep}|expt_tp={self.expt_tp}|"
            f"gtp={self.gtp_remat}|egtp={self.expt_gtp_remat}|order={self.order}"
        )
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def shrink(self, lost: Iterable[int], *, sharded_optimizer: bool = False) -> Shrunk:
        """What losing the ranks ``lost`` does to this layout (:class:`Shrunk`).

        That is: the ranks that must leave with them, the smaller layout the survivors go on with,
        and each survivor's new rank.

        A lost rank takes its whole dense replica (its ``dp`` coordinate: every rank its TP,
        GTP-remat, CP and pipeline peers are) and its whole expert replica (its ``expt_dp``
        coordinate: expert TP x EP x expert GTP-remat x PP), and so on until no leaving rank has a
        peer that stays. The survivors keep every size but ``dp`` and ``expt_dp``, are renumbered
        from ``rank_offset`` in their old order, and every group of the survivors keeps its members
        (only the data-parallel kinds lose some). ``sharded_optimizer``: the optimizer state is
        sharded over the data-parallel replicas, so losing any replica loses a shard.

        Args:
            lost: the lost global ranks (any order; repeats are one).
            sharded_optimizer: whether the optimizer state is sharded over the data-parallel
                replicas.

        Returns:
            The :class:`Shrunk` record: the lost and leaving ranks, the smaller layout and the
            old -> new rank map.

        Raises:
            ValueError: naming the ranks, for a rank outside the layout, a loss that leaves no copy
                of some state (every replica touched; any loss with ``sharded_optimizer``), or
                survivors that no layout with the same sizes and order fits; each message says to
                reload a checkpoint.
            TypeError: a non-integer rank, or a ``sharded_optimizer`` that is no bool.

        Example:
            >>> shrunk = ParallelLayout(num_ranks=8, tp=2, pp=2).shrink([3])
            >>> shrunk.leaving, shrunk.layout.dp, shrunk.rank_map
            ((2, 3, 6, 7), 1, {0: 0, 1: 1, 4: 2, 5: 3})
        """
        return _shrink_layout(self, lost, sharded_optimizer=sharded_optimizer)

    def _pipeline_edges(self, kind: str) -> tuple[int, ...]:
        """Positions in a pipeline group of the stages an embedding kind spans: first (and last)."""
        if kind == "pos_embd" or self.pp == 1:
            return (0,)
        return (0, self.pp - 1)

    def _check_rank(self, rank: int, what: str = "rank") -> int:
        """``rank`` as an int, refused when it is not a rank of the layout.

        ``TypeError`` for a bool (``True`` is not rank 1) or a non-integer, ``ValueError`` outside
        the layout's ranks. ``what`` names it in the message (``lost rank`` for :meth:`shrink`)."""
        if isinstance(rank, bool):
            raise TypeError(f"{what} must be an integer, got the bool {rank!r}")
        try:
            rank = operator.index(rank)
        except TypeError:
            raise TypeError(
                f"{what} must be an integer, got {rank!r} ({type(rank).__name__})"
            ) from None
        first, stop = self.rank_range()
        if not first <= rank < stop:
            span = f"the {self.num_ranks} ranks" if first == 0 else f"ranks {first}..{stop - 1}"
            raise ValueError(f"{what} {rank} is outside {span} of this layout")
        return rank

    @staticmethod
    def _unknown_kind_message(kind: str) -> str:
        import difflib

        close = difflib.get_close_matches(kind, GROUP_KINDS, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        return f"unknown group kind {kind!r}{hint} Known kinds: {', '.join(GROUP_KINDS)}"


def _check_kind_is_a_name(kind: object) -> None:
    """``TypeError`` for a kind that is no str (``None``, a list of kinds), listing the names.

    Else the lookups fail inside ``dict`` or difflib with a message that names neither."""
    if not isinstance(kind, str):
        raise TypeError(
            f"group kind must be a str (one of {', '.join(GROUP_KINDS)}), "
            f"got {kind!r} ({type(kind).__name__})"
        )


_AXIS_SIZES: Final = (
    "tp",
    "gtp_remat",
    "cp",
    "dp",
    "pp",
    "expt_tp",
    "ep",
    "expt_gtp_remat",
    "expt_dp",
)
"""Every axis of the two grids, by the name of the collection field that holds its group."""


@attrs.frozen(slots=True, kw_only=True)
class Shrunk:
    """What losing ``lost`` does to a layout: who leaves, the smaller layout, and the new ranks.

    Example:
        >>> shrunk = ParallelLayout(num_ranks=8, tp=2).shrink([3])
        >>> shrunk.leaving  # rank 3 takes its TP peer along: their whole data-parallel replica
        (2, 3)
        >>> shrunk.layout.dp, dict(shrunk.rank_map)
        (3, {0: 0, 1: 1, 4: 2, 5: 3, 6: 4, 7: 5})
    """

    lost: tuple[int, ...]
    """The lost ranks, sorted."""
    leaving: tuple[int, ...]
    """The lost ranks and every rank that must leave with them (their whole replicas), sorted."""
    layout: ParallelLayout
    """The layout over the survivors: ``dp`` and ``expt_dp`` smaller, every other size, the order
    and the ``rank_offset`` the same."""
    rank_map: Mapping[int, int]
    """Old rank -> new rank, for every survivor.

    In old order: the survivors renumbered from ``rank_offset``.
    """
    dense_replicas_left: tuple[int, ...]
    """The data-parallel coordinates (``dp``) of the dense replicas that leave."""
    expert_replicas_left: tuple[int, ...]
    """The expert data-parallel coordinates (``expt_dp``) of the expert replicas that leave."""

    @property
    def survivors(self) -> tuple[int, ...]:
        """The old ranks that go on, in order."""
        return tuple(self.rank_map)


def _shrink_layout(
    layout: ParallelLayout, lost: Iterable[int], *, sharded_optimizer: bool = False
) -> Shrunk:
    """:meth:`ParallelLayout.shrink`: the ranks that leave with ``lost`` and the smaller layout.

    The smaller layout is over the survivors (pure rank arithmetic over the layout's coordinates).

    A rank holds state that differs from its peers along every axis but data parallelism: its TP,
    CP, GTP-remat and pipeline peers hold other shards of the dense model or other parts of the
    sequence, its expert TP, EP and expert GTP-remat peers other experts or other shards of them. A
    lost rank therefore takes with it every rank of its *dense replica* (the ranks of its
    data-parallel coordinate ``dp``: TP x GTP-remat x CP x PP) and of its *expert replica* (its
    ``expt_dp`` coordinate: expert TP x EP x expert GTP-remat x PP). An expert replica usually spans
    several dense replicas (EP runs across data-parallel ranks), and a dense replica may reach into
    several expert replicas, so the ranks that leave are the closure of both relations. What is left
    is whole dense and whole expert replicas: the same layout with fewer data-parallel replicas
    (``dp`` and ``expt_dp`` smaller, every other size the same), over the survivors renumbered in
    their old order. A mixed-radix rank keeps its order when whole values of one digit are removed,
    so renumbering in order maps each surviving group onto a group of the smaller layout, with the
    same members: their communicators can be kept. Only groups that reach across replicas (the
    data-parallel kinds) lose members.
    """
    # "no" would be true, and refuse a survivable loss
    require_flag(sharded_optimizer, "sharded_optimizer")
    lost_ranks = _check_lost_ranks(layout, lost)
    first, stop = layout.rank_range()
    ranks = range(first, stop)
    coords = {rank: layout.coords(rank) for rank in ranks}
    dense_gone = {coords[rank]["dp"] for rank in lost_ranks}
    expert_gone = {coords[rank]["expt_dp"] for rank in lost_ranks}
    # Closure: a rank leaves with its dense replica or its expert replica; each leaving rank takes
    # both of its own.
    while True:
        leaving = [
            r for r in ranks if coords[r]["dp"] in dense_gone or coords[r]["expt_dp"] in expert_gone
        ]
        dense_now = {coords[r]["dp"] for r in leaving}
        expert_now = {coords[r]["expt_dp"] for r in leaving}
        if dense_now == dense_gone and expert_now == expert_gone:
            break
        dense_gone, expert_gone = dense_now, expert_now
    survivors = [r for r in ranks if coords[r]["dp"] not in dense_gone]
    if lost_ranks and sharded_optimizer:
        raise ValueError(
            f"losing rank(s) {_ranks_text(lost_ranks)} loses the sharded optimizer's "
            f"shards on rank(s) {_ranks_text(leaving)}: each data-parallel replica "
            "holds its own shard, kept nowhere else. Reload a checkpoint (or train "
            "with a replicated optimizer to survive the loss of a replica)"
        )
    if not survivors:
        raise ValueError(
            f"losing rank(s) {_ranks_text(lost_ranks)} leaves no copy of the model: their replicas "
            f"({_replicas_text(layout, sorted(dense_gone), sorted(expert_gone))}) cover every rank "
            f"{first}-{stop - 1}, so some shard is held by no survivor. Reload a checkpoint"
        )
    smaller = _smaller_layout(layout, lost_ranks, len(survivors))
    rank_map = {old: first + i for i, old in enumerate(survivors)}
    _check_groups_kept(layout, smaller, coords, rank_map, sorted(dense_gone), sorted(expert_gone))
    return Shrunk(
        lost=lost_ranks,
        leaving=tuple(leaving),
        layout=smaller,
        rank_map=rank_map,
        dense_replicas_left=tuple(sorted(dense_gone)),
        expert_replicas_left=tuple(sorted(expert_gone)),
    )


def _check_lost_ranks(layout: ParallelLayout, lost: Iterable[int]) -> tuple[int, ...]:
    """The lost ranks, sorted and deduplicated, refused when not ranks of the layout's span.

    ``TypeError`` for a non-integer (a bool too), ``ValueError`` for a rank outside the layout's
    span."""
    if isinstance(lost, str | bytes) or not isinstance(lost, Iterable):
        raise TypeError(f"lost must be an iterable of ranks, got {type(lost).__name__}")
    out = {layout._check_rank(rank, "lost rank") for rank in lost}
    return tuple(sorted(out))


def _smaller_layout(
    layout: ParallelLayout, lost: tuple[int, ...], num_ranks: int
) -> ParallelLayout:
    """The layout over ``num_ranks`` ranks with every size but the data-parallel ones unchanged.

    A ``ValueError`` naming the lost ranks when no such layout is valid (an order rule the smaller
    data-parallel sizes break)."""
    if num_ranks == layout.num_ranks:
        return layout
    try:
        return attrs.evolve(layout, num_ranks=num_ranks)
    except ValueError as error:
        raise ValueError(
            f"losing rank(s) {_ranks_text(lost)} leaves {num_ranks} ranks, on "
            f"which no layout with the same sizes and order fits: {error}. "
            "Reload a checkpoint on a layout that fits the survivors"
        ) from error


def _check_groups_kept(
    old: ParallelLayout,
    new: ParallelLayout,
    coords: Mapping[int, Mapping[str, int]],
    rank_map: Mapping[int, int],
    dense_gone: list[int],
    expert_gone: list[int],
) -> None:
    """Check each survivor keeps its coordinates on the smaller layout, so groups keep members.

    The data-parallel coordinates are renumbered in order; then every group keeps its members. Holds
    whenever whole replicas leave (see the module docstring); checked rather than assumed, because
    the dense and expert grids interleave their axes in ways the order string chooses."""
    # Coordinate -> its place among the kept ones, by lookup: a list's index() per rank made this
    # quadratic in the data-parallel size (25 s at 65536 ranks of dp 32768, days at 2**20).
    dense_kept = _positions_after_removing(old.dp, dense_gone)
    expert_kept = _positions_after_removing(old.expt_dp, expert_gone)
    for rank, new_rank in rank_map.items():
        want = dict(coords[rank])
        want["dp"] = dense_kept[want["dp"]]
        want["expt_dp"] = expert_kept[want["expt_dp"]]
        got = new.coords(new_rank)
        if got != want:
            raise ValueError(
                f"no layout over the survivors keeps rank {rank}'s groups: "
                f"renumbered {new_rank} on {new!r} it would sit at {got}, not "
                f"{want}. Reload a checkpoint on a layout that fits the survivors"
            )


def _positions_after_removing(size: int, gone: Iterable[int]) -> dict[int, int]:
    """Each coordinate in ``range(size)`` but ``gone`` -> its place among those kept, in order."""
    left = set(gone)
    return {
        coordinate: place
        for place, coordinate in enumerate(c for c in range(size) if c not in left)
    }


def _ranks_text(ranks: Iterable[int]) -> str:
    ranks = list(ranks)
    shown = ", ".join(str(r) for r in ranks[:16])
    return shown + (f", ... ({len(ranks)} ranks)" if len(ranks) > 16 else "")


def _replicas_text(layout: ParallelLayout, dense: list[int], expert: list[int]) -> str:
    parts = [f"dense replica(s) dp={_ranks_text(dense)} of {layout.dp}"]
    if layout.ep > 1 or layout.expt_dp != layout.dp:
        parts.append(f"expert replica(s) expt_dp={_ranks_text(expert)} of {layout.expt_dp}")
    return "; ".join(parts)

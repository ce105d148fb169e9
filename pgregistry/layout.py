"""Rank layout: pure arithmetic that maps ranks to parallelism coordinates and groups.

No process group is created here. A :class:`ParallelLayout` declares the sizes of the parallelism axes and the
order in which they vary over ranks, and answers which ranks form each group kind. The rules are exactly those of
Megatron-Core's ``RankGenerator`` so that users migrating get the same communicators:

* The order string lists axes fastest-varying first: with the default ``"tp-cp-ep-dp-pp"`` the dense grid puts
  ``rank = tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank))``.
* There are two grids over the same ranks. The dense grid has sizes ``tp, cp, dp, pp`` (ep is 1 there); the
  expert grid has ``tp=etp, ep, dp=expt_dp, pp`` and ``cp=1``. Both use the same order string.
* The GTP-remat axis (``gtp``) is placed right after ``tp`` in the dense grid and right after ``ep`` in the
  expert grid (after ``tp``, or first, when the order does not name that axis).
* A group kind such as ``"tp-dp"`` is the set of ranks that differ only in those coordinates; its ranks are
  listed in grid order (the order string's axis order, fastest first), whatever order the kind names them in.

Every query is vectorised: a whole kind is one reshape/permute of ``arange(world_size)``, so enumerating every
group of a 131,072-rank layout takes a fraction of a second.
"""

from __future__ import annotations

import enum
import hashlib
import math
import operator
from collections.abc import Mapping
from typing import TYPE_CHECKING, Final

import attrs

if TYPE_CHECKING:
    import torch

__all__ = [
    "DENSE_GROUP_KINDS",
    "DEFAULT_ORDER",
    "EXPERT_GROUP_KINDS",
    "GROUP_KINDS",
    "Axis",
    "ParallelLayout",
    "RankGroup",
]

RankGroup = tuple[int, ...]
"""One group: its ranks in grid order."""


class Axis(str, enum.Enum):
    """Parallelism axes of the rank grid.

    Vocabulary used across pgregistry: an *axis* is a dimension of the rank grid (tensor, context, data,
    pipeline, expert parallelism, ...); a *dim* is a dimension of a tensor. The dense grid uses ``tp, gtp, cp,
    dp, pp``; the expert grid uses ``tp`` (= expert TP), ``ep``, ``gtp`` (= expert GTP remat), ``dp`` (= expert
    DP), ``pp``. The order string is written with these tokens.
    """

    TP = "tp"
    CP = "cp"
    EP = "ep"
    DP = "dp"
    PP = "pp"
    GTP = "gtp"


DEFAULT_ORDER: Final = "tp-cp-ep-dp-pp"
_ORDER_TOKENS: Final = frozenset({Axis.TP.value, Axis.CP.value, Axis.EP.value, Axis.DP.value, Axis.PP.value})

DENSE_GROUP_KINDS: Final[Mapping[str, str]] = {
    "tp": "tp",
    "gtp_remat": "gtp",
    "cp": "cp",
    "dp": "dp",
    "pp": "pp",
    "dp_cp": "dp-cp",
    "tp_cp": "tp-cp",
    # The model-parallel group spans every axis that shards the dense model (GTP remat included), which is the
    # group dense grad norms reduce over. With gtp_remat == 1 it is Megatron-Core's "tp-pp".
    "mp": "tp-gtp-pp",
    # Spans the GTP axis like Megatron-Core's: GTP peers hold distinct data, and the router's expert-bias and the
    # FP8 amax reductions run over every rank of one TP x data domain.
    "tp_dp_cp": "tp-gtp-dp-cp",
    # The full data-distribution group (every rank holding a distinct micro-batch); ``dp_cp`` when GTP is off.
    "dp_cp_gtp_remat": "gtp-dp-cp",
}
"""Dense-grid group kinds: collection field -> axes of the dense grid."""

EXPERT_GROUP_KINDS: Final[Mapping[str, str]] = {
    "ep": "ep",
    "expt_tp": "tp",
    "expt_gtp_remat": "gtp",
    "expt_dp": "dp",
    "tp_ep": "tp-ep",
    "tp_ep_pp": "tp-ep-pp",
    # The expert model-parallel group: every axis that shards expert weights (expert TP x EP x expert GTP-remat x
    # PP), which is the group expert grad norms reduce over. ``tp_ep_pp`` when expert GTP is off.
    "tp_ep_pp_with_egtp_remat": "tp-gtp-ep-pp",
    # The full expert data-distribution group; ``expt_dp`` when expert GTP is off.
    "expt_dp_gtp_remat": "gtp-dp",
}
"""Expert-grid group kinds: collection field -> axes of the expert grid."""

_PIPELINE_EDGE_KINDS: Final = ("embd", "pos_embd")

GROUP_KINDS: Final[tuple[str, ...]] = (*DENSE_GROUP_KINDS, *EXPERT_GROUP_KINDS, *_PIPELINE_EDGE_KINDS)
"""Every group kind a layout enumerates, in the deterministic order groups are created."""


def _positive(instance: object, attribute: attrs.Attribute[int], value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{attribute.name} must be a positive integer, got {value!r}")


MAX_WORLD_SIZE: Final = 2**31 - 1
"""The most ranks a layout may have: torch.distributed keeps ranks and world sizes in a C ``int``."""


def _addressable(instance: object, attribute: attrs.Attribute[int], value: int) -> None:
    if value > MAX_WORLD_SIZE:
        raise ValueError(
            f"{attribute.name} {value} is more ranks than torch.distributed can address (at most "
            f"{MAX_WORLD_SIZE} = 2**31 - 1: ranks are C ints)"
        )


@attrs.frozen(slots=True, kw_only=True)
class _Grid:
    """One grid (dense or expert): axis sizes in order, fastest first."""

    axes: tuple[str, ...]
    sizes: tuple[int, ...]

    def strides(self) -> tuple[int, ...]:
        out, acc = [], 1
        for size in self.sizes:
            out.append(acc)
            acc *= size
        return tuple(out)

    def mask(self, kind_axes: str) -> tuple[bool, ...]:
        wanted = kind_axes.split("-")
        unknown = [a for a in wanted if a not in self.axes]
        if unknown:
            raise ValueError(f"unknown axes {unknown} in group kind {kind_axes!r}; grid axes are {self.axes}")
        return tuple(axis in wanted for axis in self.axes)

    def all_groups(self, kind_axes: str) -> torch.Tensor:
        """Every group of ``kind_axes`` as a ``[num_groups, group_size]`` int64 tensor."""
        import torch

        mask = self.mask(kind_axes)
        world = math.prod(self.sizes)
        # C-order reshape puts the last dim fastest, so reverse the axes (ours are fastest first).
        grid = torch.arange(world, dtype=torch.int64).reshape(tuple(reversed(self.sizes)))
        n = len(self.axes)
        dim_of = {i: n - 1 - i for i in range(n)}
        outer = [dim_of[i] for i in reversed(range(n)) if not mask[i]]
        inner = [dim_of[i] for i in reversed(range(n)) if mask[i]]
        group_size = math.prod(s for s, m in zip(self.sizes, mask, strict=True) if m)
        return grid.permute(*outer, *inner).reshape(world // group_size, group_size)

    def coords(self, rank: int) -> dict[str, int]:
        axes = zip(self.axes, self.sizes, self.strides(), strict=True)
        return {axis: (rank // stride) % size for axis, size, stride in axes}

    def group_of(self, rank: int, kind_axes: str) -> RankGroup:
        """The group of ``kind_axes`` holding ``rank``, without enumerating the others."""
        masked_axes = [
            (size, stride)
            for size, stride, masked in zip(self.sizes, self.strides(), self.mask(kind_axes), strict=True)
            if masked
        ]
        members = [rank - sum((rank // stride) % size * stride for size, stride in masked_axes)]
        # Adding each slower axis as the outer loop keeps the faster ones varying fastest: grid order.
        for size, stride in masked_axes:
            members = [m + i * stride for i in range(size) for m in members]
        return tuple(members)


@attrs.frozen(slots=True, kw_only=True)
class ParallelLayout:
    """The declared parallelism of one model: axis sizes and their order over ``world_size`` ranks.

    ``dp`` and ``expt_dp`` are derived: ``dp = world / (tp * gtp_remat * cp * pp)`` and
    ``expt_dp = world / (etp * ep * expt_gtp_remat * pp)``. ``etp`` defaults to ``tp``. Invalid combinations
    raise ``ValueError`` naming the offending size, so an invalid layout cannot exist.
    """

    world_size: int = attrs.field(validator=[_positive, _addressable])
    tp: int = attrs.field(default=1, validator=_positive)
    cp: int = attrs.field(default=1, validator=_positive)
    pp: int = attrs.field(default=1, validator=_positive)
    ep: int = attrs.field(default=1, validator=_positive)
    etp: int = attrs.field(
        default=attrs.Factory(lambda self: self.tp, takes_self=True), validator=_positive
    )
    gtp_remat: int = attrs.field(default=1, validator=_positive)
    expt_gtp_remat: int = attrs.field(default=1, validator=_positive)
    order: str = attrs.field(default=DEFAULT_ORDER, converter=lambda s: str(s).lower())
    dp: int = attrs.field(init=False)
    expt_dp: int = attrs.field(init=False)
    _dense: _Grid = attrs.field(init=False, repr=False, eq=False)
    _expert: _Grid = attrs.field(init=False, repr=False, eq=False)

    def __attrs_post_init__(self) -> None:
        tokens = self._validated_order_tokens()
        dense_product = self.tp * self.gtp_remat * self.cp * self.pp
        if self.world_size % dense_product:
            raise ValueError(
                f"world_size {self.world_size} is not divisible by tp*gtp_remat*cp*pp = "
                f"{self.tp}*{self.gtp_remat}*{self.cp}*{self.pp} = {dense_product}"
            )
        expert_product = self.etp * self.ep * self.expt_gtp_remat * self.pp
        if self.world_size % expert_product:
            raise ValueError(
                f"etp*ep*expt_gtp_remat*pp = {self.etp}*{self.ep}*{self.expt_gtp_remat}*{self.pp} = "
                f"{expert_product} does not divide world_size {self.world_size}"
            )
        dp = self.world_size // dense_product
        expt_dp = self.world_size // expert_product
        if "dp" not in self.order.split("-") and (dp, expt_dp) != (1, 1):
            raise ValueError(
                f"order {self.order!r} lacks axis 'dp' whose size is {dp} (expert data-parallel size {expt_dp})"
            )
        # Megatron-Core tests the order string as declared: axes appended because they are missing have size 1.
        if not self.order.endswith(Axis.PP.value) and self.pp > 1 and expt_dp != dp:
            raise ValueError(
                f"pp must be last in order {self.order!r} when pp={self.pp} > 1 and the expert data-parallel "
                f"size ({expt_dp}) differs from the dense one ({dp}): dense and expert grids would not share "
                "pipeline stages"
            )
        object.__setattr__(self, "dp", dp)
        object.__setattr__(self, "expt_dp", expt_dp)
        dense_sizes = {"tp": self.tp, "gtp": self.gtp_remat, "cp": self.cp, "ep": 1, "dp": dp, "pp": self.pp}
        expert_sizes = {
            "tp": self.etp, "gtp": self.expt_gtp_remat, "cp": 1, "ep": self.ep, "dp": expt_dp, "pp": self.pp,
        }
        declared = tuple(self.order.split("-"))
        object.__setattr__(self, "_dense", self._grid(declared, tokens, dense_sizes, after=Axis.TP.value))
        object.__setattr__(self, "_expert", self._grid(declared, tokens, expert_sizes, after=Axis.EP.value))
        if self.pp > 1 and not self._dense.all_groups("pp").equal(self._expert.all_groups("pp")):
            raise ValueError(
                f"order {self.order!r} gives the dense and expert grids different pipeline stages; put pp last"
            )

    def _validated_order_tokens(self) -> tuple[str, ...]:
        tokens = tuple(self.order.split("-"))
        unknown = [t for t in tokens if t not in _ORDER_TOKENS]
        if unknown:
            raise ValueError(
                f"unknown axis {unknown[0]!r} in order {self.order!r}; known axes: {sorted(_ORDER_TOKENS)}"
            )
        repeated = sorted({t for t in tokens if tokens.count(t) > 1})
        if repeated:
            raise ValueError(f"axis {repeated[0]!r} repeated in order {self.order!r}")
        # Like Megatron-Core, an axis missing from the order is appended (outermost) when its size is 1. The data
        # parallel sizes are derived later, and checked in __attrs_post_init__.
        sizes = {"tp": self.tp, "cp": self.cp, "ep": self.ep, "pp": self.pp, "dp": 1}
        missing = [t for t in ("tp", "cp", "ep", "dp", "pp") if t not in tokens]
        for token in missing:
            if sizes[token] != 1:
                raise ValueError(f"order {self.order!r} lacks axis {token!r} whose size is {sizes[token]}")
            if token == Axis.TP.value and self.etp != 1:
                raise ValueError(f"order {self.order!r} lacks axis 'tp' whose expert size (etp) is {self.etp}")
        return tokens + tuple(missing)

    @staticmethod
    def _grid(
        declared: tuple[str, ...], tokens: tuple[str, ...], sizes: Mapping[str, int], *, after: str
    ) -> _Grid:
        """The grid of ``tokens`` (the declared order, then the appended size-1 axes) with the GTP axis placed as
        Megatron-Core places it: right after ``after`` when the declared order names it, else right after ``tp``
        when named, else first. The appended axes have size 1, so only the declared ones decide the ranks."""
        preceding = after if after in declared else Axis.TP.value
        position = declared.index(preceding) + 1 if preceding in declared else 0
        axes = (*tokens[:position], Axis.GTP.value, *tokens[position:])
        return _Grid(axes=axes, sizes=tuple(sizes[a] for a in axes))

    # ----------------------------------------------------------------------------------------------- queries

    def groups_tensor(self, kind: str) -> torch.Tensor:
        """Every group of ``kind`` as a ``[num_groups, group_size]`` int64 tensor (the fast path)."""
        if kind in DENSE_GROUP_KINDS:
            return self._dense.all_groups(DENSE_GROUP_KINDS[kind])
        if kind in EXPERT_GROUP_KINDS:
            return self._expert.all_groups(EXPERT_GROUP_KINDS[kind])
        if kind in _PIPELINE_EDGE_KINDS:
            return self._dense.all_groups("pp")[:, list(self._pipeline_edges(kind))]
        raise ValueError(self._unknown_kind_message(kind))

    def group_shape(self, kind: str) -> tuple[int, int]:
        """``(number of groups, ranks per group)`` of ``kind``: the shape of :meth:`groups_tensor`, by arithmetic
        alone, so a caller can size what enumerating a huge layout would take before doing it."""
        if kind in _PIPELINE_EDGE_KINDS:
            return self.world_size // self.pp, len(self._pipeline_edges(kind))
        if kind in DENSE_GROUP_KINDS:
            grid, axes = self._dense, DENSE_GROUP_KINDS[kind]
        elif kind in EXPERT_GROUP_KINDS:
            grid, axes = self._expert, EXPERT_GROUP_KINDS[kind]
        else:
            raise ValueError(self._unknown_kind_message(kind))
        size = math.prod(s for s, masked in zip(grid.sizes, grid.mask(axes), strict=True) if masked)
        return self.world_size // size, size

    def groups(self, kind: str) -> tuple[RankGroup, ...]:
        """Every group of ``kind``, each a tuple of ranks in grid order.

        ``embd`` and ``pos_embd`` hold the first and last pipeline stage (``[first]`` when pp is 1) and the first
        stage of each pipeline group, as Megatron-Core builds them; ranks outside them belong to no such group.
        """
        # Zipping the columns builds the row tuples in C: about 3x faster than a tuple() per row at 131k ranks.
        return tuple(zip(*self.groups_tensor(kind).T.tolist(), strict=True))

    def groups_of(self, rank: int) -> dict[str, RankGroup | None]:
        """Group kind -> the group holding ``rank`` (``None`` for embedding kinds it is not part of)."""
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
        """Axis -> coordinate of ``rank``: dense ``tp, gtp_remat, cp, dp, pp`` and expert ``etp, ep,
        expt_gtp_remat, expt_dp``."""
        rank = self._check_rank(rank)
        dense = self._dense.coords(rank)
        expert = self._expert.coords(rank)
        return {
            "tp": dense["tp"],
            "gtp_remat": dense["gtp"],
            "cp": dense["cp"],
            "dp": dense["dp"],
            "pp": dense["pp"],
            "etp": expert["tp"],
            "ep": expert["ep"],
            "expt_gtp_remat": expert["gtp"],
            "expt_dp": expert["dp"],
        }

    def axis_sizes(self) -> dict[str, int]:
        """Axis -> size, with the same names as :meth:`coords`."""
        return {
            "tp": self.tp, "gtp_remat": self.gtp_remat, "cp": self.cp, "dp": self.dp, "pp": self.pp,
            "etp": self.etp, "ep": self.ep, "expt_gtp_remat": self.expt_gtp_remat, "expt_dp": self.expt_dp,
        }

    def rank_range(self) -> tuple[int, int]:
        """``(first, stop)``: the layout's ranks are ``range(first, stop)``."""
        return 0, self.world_size

    def fingerprint(self) -> str:
        """A stable digest of the declared layout; equal on every rank that declared the same layout."""
        text = (
            f"v1|world={self.world_size}|tp={self.tp}|cp={self.cp}|pp={self.pp}|ep={self.ep}|etp={self.etp}|"
            f"gtp={self.gtp_remat}|egtp={self.expt_gtp_remat}|order={self.order}"
        )
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def _pipeline_edges(self, kind: str) -> tuple[int, ...]:
        """Positions in a pipeline group of the stages an embedding kind spans: first (and last)."""
        if kind == "pos_embd" or self.pp == 1:
            return (0,)
        return (0, self.pp - 1)

    def _check_rank(self, rank: int) -> int:
        """``rank`` as an int; ``TypeError`` for a bool (``True`` is not rank 1) or a non-integer, ``ValueError``
        outside the world."""
        if isinstance(rank, bool):
            raise TypeError(f"rank must be an integer, got the bool {rank!r}")
        try:
            rank = operator.index(rank)
        except TypeError:
            raise TypeError(f"rank must be an integer, got {rank!r} ({type(rank).__name__})") from None
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside the world of {self.world_size} ranks")
        return rank

    @staticmethod
    def _unknown_kind_message(kind: str) -> str:
        import difflib

        close = difflib.get_close_matches(kind, GROUP_KINDS, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        return f"unknown group kind {kind!r}{hint} Known kinds: {', '.join(GROUP_KINDS)}"

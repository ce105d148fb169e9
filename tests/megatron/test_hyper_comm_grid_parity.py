"""A layout over a span of the world has Megatron-Core's ``HyperCommGrid`` rank lists: the oracle is Megatron-Core.

``HyperCommGrid(shape, dim_names, rank_offset)`` is how Megatron-Core lays out a model on part of the world (MIMO
modules, heterogeneous inference shards): shape fastest-varying first, ranks from ``rank_offset``, and
``get_rank_enum(dims)`` gives every group over ``dims`` without creating one. Each grid of a :class:`ParallelLayout`
is built here as its own ``HyperCommGrid``, mirroring two pieces of Megatron-Core 0.19.2:

* ``megatron/core/inference/shards.py`` (``build_inference_pg_collection``): the only place it builds a model's
  groups from ``HyperCommGrid``: a decoder grid (``tp, cp, dp, pp``) and an expert grid (``tp, ep, dp, pp``, with
  expert TP and expert DP in the ``tp`` and ``dp`` slots) over one ``rank_offset``, the embedding groups taken from
  the decoder grid's ``pp`` enumeration (first and last stage; first stage);
* ``megatron/core/parallel_state.py`` (``initialize_model_parallel``) for what that file hard-codes: the dims in
  the order string's order (the size-1 axes it leaves out appended, as ``RankGenerator`` does), the GTP axes put in
  by Megatron-Core's own ``_inject_gtp_remat_axis`` (after ``tp`` in the dense grid, after ``ep`` in the expert
  one), and the dims of each group (``get_ranks('tp-gtp_remat-pp')`` for ``mp``, ...), written out below.

The MIMO way (``megatron/core/models/mimo/optimizer.py``: one grid, its expert groups over a registered view named
``"expert"``) must give the same expert groups as the expert grid of its own; ``register_view`` with ``pp`` shared
also checks, in Megatron-Core's code, that both put the same ranks in each pipeline stage.

Every group kind of the layout must equal ``get_rank_enum`` of its dims exactly: the same groups, in the same order,
each listing its ranks in the same order. Two layers: a sweep of sizes, orders and offsets (0, and non-zero inside a
larger world) read from ``WORLD_SIZE``, which ``HyperCommGrid`` takes as the world without a process group, and a
real gloo world of 8 ranks, where ``pgregistry.build`` builds spans and a real all-reduce over each group tells its
members, against ``HyperCommGrid`` built on that world.
"""

from __future__ import annotations

import itertools
from collections import Counter
from typing import Any

import pytest
import torch
import torch.distributed as dist
from megatron_support import require_megatron

require_megatron()

from megatron.core.hyper_comm_grid import HyperCommGrid  # noqa: E402
from megatron.core.parallel_state import _inject_gtp_remat_axis  # noqa: E402

from pgregistry import registry  # noqa: E402
from pgregistry.layout import GROUP_KINDS, ParallelLayout  # noqa: E402
from pgregistry.testing import run_world  # noqa: E402

# The dims of each group kind, with Megatron-Core's names in each grid (parallel_state.py's get_ranks tokens).
DENSE_DIMS: dict[str, list[str]] = {
    "tp": ["tp"], "gtp_remat": ["gtp_remat"], "cp": ["cp"], "dp": ["dp"], "pp": ["pp"],
    "dp_cp": ["dp", "cp"], "tp_cp": ["tp", "cp"], "mp": ["tp", "gtp_remat", "pp"],
    "tp_dp_cp": ["tp", "gtp_remat", "dp", "cp"], "dp_cp_gtp_remat": ["gtp_remat", "dp", "cp"],
}
EXPERT_DIMS: dict[str, list[str]] = {
    "ep": ["ep"], "expt_tp": ["tp"], "expt_gtp_remat": ["gtp_remat"], "expt_dp": ["dp"], "tp_ep": ["tp", "ep"],
    "tp_ep_pp": ["tp", "ep", "pp"], "tp_ep_pp_with_egtp_remat": ["tp", "ep", "gtp_remat", "pp"],
    "expt_dp_gtp_remat": ["gtp_remat", "dp"],
}
EDGE_KINDS = ("embd", "pos_embd")
_TOKENS = ("tp", "cp", "ep", "dp", "pp", "gtp_remat")


def _grid(order: str, sizes: dict[str, int], *, gtp_after: str, absent: str, rank_offset: int) -> HyperCommGrid:
    """One grid as Megatron-Core lays it out: the order's dims (fastest first) with the GTP axis injected by
    Megatron-Core itself, the left-out axes appended; ``absent`` (``ep`` in the dense grid, ``cp`` in the expert
    grid, size 1 there) left out as shards.py leaves it out."""
    dims = _inject_gtp_remat_axis(order, after=gtp_after).split("-")
    dims += [token for token in _TOKENS if token not in dims]
    dims = [dim for dim in dims if dim != absent]
    return HyperCommGrid([sizes[dim] for dim in dims], dims, rank_offset=rank_offset)


def megatron_enums(layout: ParallelLayout) -> dict[str, list[list[int]]]:
    """Group kind -> ``HyperCommGrid.get_rank_enum`` of its dims, on a dense and an expert grid of the layout's
    sizes, order and offset (the world: ``WORLD_SIZE`` or the initialised process group, as HyperCommGrid reads it)."""
    dense = _grid(layout.order, {"tp": layout.tp, "gtp_remat": layout.gtp_remat, "cp": layout.cp, "ep": 1,
                                 "dp": layout.dp, "pp": layout.pp},
                  gtp_after="tp", absent="ep", rank_offset=layout.rank_offset)
    expert = _grid(layout.order, {"tp": layout.expt_tp, "gtp_remat": layout.expt_gtp_remat, "cp": 1, "ep": layout.ep,
                                  "dp": layout.expt_dp, "pp": layout.pp},
                   gtp_after="ep", absent="cp", rank_offset=layout.rank_offset)
    enums = {kind: dense.get_rank_enum(dims) for kind, dims in DENSE_DIMS.items()}
    enums.update({kind: expert.get_rank_enum(dims) for kind, dims in EXPERT_DIMS.items()})
    dense.register_view("expert", expert.shape, expert.dim_names, shared_dims=["pp"])
    for kind, dims in EXPERT_DIMS.items():
        assert dense.get_rank_enum(dims, view="expert") == enums[kind], (kind, layout)
    pipelines = dense.get_rank_enum("pp")
    enums["embd"] = [[ranks[0]] if len(ranks) == 1 else [ranks[0], ranks[-1]] for ranks in pipelines]
    enums["pos_embd"] = [[ranks[0]] for ranks in pipelines]
    enums["intra_dist_opt"] = dense.get_rank_enum(dense.dim_names)  # the whole span
    return enums


def test_every_group_kind_is_checked() -> None:
    assert [*DENSE_DIMS, *EXPERT_DIMS, *EDGE_KINDS] == list(GROUP_KINDS)


# ------------------------------------------------------------------------------------------------ the sweep

ORDERS = ("tp-cp-ep-dp-pp", "tp-pp-dp", "tp-cp-ep-pp-dp", "dp-tp-cp-ep-pp", "ep-tp-dp-cp-pp", "pp-dp-ep-cp-tp")
"""The default; one leaving out cp and ep; pp before dp; tp not fastest; ep first (the expert GTP axis then lands
second); everything reversed."""
EXTRA_RANKS = 3
"""Ranks of the world past a span with a non-zero offset: the span lies strictly inside the world."""
MIN_COMPARED = 2400
"""Of the cases drawn below, those ParallelLayout and Megatron-Core both accept (2,706 of 6,912)."""


def _sweep() -> list[tuple[dict[str, Any], int]]:
    """(layout keywords, world size): every combination of small sizes, each order, offset 0 (world = span) and a
    non-zero offset (the span inside a larger world)."""
    cases = []
    for tp, cp, pp, gtp, dp, ep, etp, egtp in itertools.product(
        (1, 2), (1, 2), (1, 2), (1, 2), (1, 3), (1, 2, 4), (1, 2), (1, 2),
    ):
        num_ranks = tp * gtp * cp * pp * dp
        for order, offset in itertools.product(ORDERS, (0, 5, num_ranks)):
            sizes = {"num_ranks": num_ranks, "tp": tp, "cp": cp, "pp": pp, "ep": ep, "expt_tp": etp,
                     "gtp_remat": gtp, "expt_gtp_remat": egtp, "order": order, "rank_offset": offset}
            cases.append((sizes, num_ranks + offset + (EXTRA_RANKS if offset else 0)))
    return cases


def test_sweep_of_sizes_orders_and_offsets_matches_hyper_comm_grid(monkeypatch: pytest.MonkeyPatch) -> None:
    compared: Counter[str] = Counter()
    for sizes, world in _sweep():
        try:
            layout = ParallelLayout(**sizes)
        except ValueError:
            continue  # sizes that do not divide, pp not last where it must be (tests/megatron/test_megatron_parity)
        monkeypatch.setenv("WORLD_SIZE", str(world))
        enums = megatron_enums(layout)
        for kind in GROUP_KINDS:
            assert [list(group) for group in layout.groups(kind)] == enums[kind], (kind, layout, world)
        assert enums["intra_dist_opt"] == [list(range(*layout.rank_range()))]
        compared["cases"] += 1
        compared["offset"] += layout.rank_offset > 0
        compared["gtp"] += layout.gtp_remat > 1 and layout.expt_gtp_remat > 1
        compared["expert sharded otherwise"] += layout.ep > 1 and layout.expt_tp != layout.tp
    assert compared["cases"] >= MIN_COMPARED, compared
    # Each property the sweep is for is present in a good share of the cases.
    assert min(compared.values()) >= compared["cases"] // 8, compared


def test_every_order_at_an_offset_matches_hyper_comm_grid(monkeypatch: pytest.MonkeyPatch) -> None:
    # The 120 orders of the five tokens, each axis of size 2 (expert TP 1), at offset 7 of a 40-rank world.
    monkeypatch.setenv("WORLD_SIZE", "40")
    compared = 0
    for tokens in itertools.permutations(("tp", "cp", "ep", "dp", "pp")):
        sizes = {"num_ranks": 32, "tp": 2, "cp": 2, "pp": 2, "ep": 2, "expt_tp": 1, "gtp_remat": 2,
                 "expt_gtp_remat": 2, "order": "-".join(tokens), "rank_offset": 7}
        try:
            layout = ParallelLayout(**sizes)  # type: ignore[arg-type]
        except ValueError:
            continue  # pp not last while expert and dense data parallel differ: Megatron-Core refuses it too
        enums = megatron_enums(layout)
        for kind in GROUP_KINDS:
            assert [list(group) for group in layout.groups(kind)] == enums[kind], (kind, layout)
        compared += 1
    assert compared >= 24  # at least the orders with pp last


def test_bad_spans_are_refused_like_hyper_comm_grid(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "8")
    with pytest.raises(ValueError, match="rank_offset must be non-negative"):
        HyperCommGrid([2, 2], ["tp", "dp"], rank_offset=-1)
    with pytest.raises(ValueError, match="rank_offset must be a non-negative integer, got -1"):
        ParallelLayout(num_ranks=4, tp=2, rank_offset=-1)
    # Past the end of the world: HyperCommGrid knows the world, the layout does not (pgregistry.build refuses it on
    # every rank, tests/core/test_registry.py); both accept the last span that fits.
    with pytest.raises(RuntimeError, match="over sized with world size 8 and rank offset 6"):
        HyperCommGrid([2, 2], ["tp", "dp"], rank_offset=6)
    assert megatron_enums(ParallelLayout(num_ranks=4, tp=2, rank_offset=4))["tp"] == [[4, 5], [6, 7]]


# ------------------------------------------------------------------------------------------------ a real world

WORLD = 8
SPANS: dict[str, ParallelLayout] = {
    "upper half (the issue's example)": ParallelLayout(num_ranks=4, tp=2, pp=2, rank_offset=4),
    "middle, experts over the span": ParallelLayout(num_ranks=4, tp=2, ep=2, expt_tp=1, rank_offset=2),
    "six ranks from 2, ep 3": ParallelLayout(num_ranks=6, tp=2, ep=3, expt_tp=1, rank_offset=2),
    "gtp and expert gtp": ParallelLayout(num_ranks=4, gtp_remat=2, ep=2, expt_tp=1, expt_gtp_remat=2, rank_offset=4),
    "pp before dp": ParallelLayout(num_ranks=4, pp=2, order="tp-pp-dp", rank_offset=3),
    "three ranks at the end": ParallelLayout(num_ranks=3, rank_offset=5),
}


def _members(group: Any) -> list[int]:
    """The ranks of ``group``, learned by a real all-reduce: each member adds a one at its own rank."""
    mine = torch.zeros(WORLD, dtype=torch.int64)
    mine[dist.get_rank()] = 1
    dist.all_reduce(mine, group=group)
    return [rank for rank, count in enumerate(mine.tolist()) if count]


def _built_spans_on_rank() -> dict[str, Any]:
    """Per span: whether this rank is a member, each field's members (by all-reduce; ``"off"`` for None, ``"not a
    member"`` for NOT_MEMBER), and HyperCommGrid's enumeration on this real world."""
    out: dict[str, Any] = {}
    for name, layout in SPANS.items():
        collection = registry.build(layout, name=name)
        fields: dict[str, Any] = {}
        if collection.is_member:
            for kind in (*GROUP_KINDS, "intra_dist_opt"):
                if not collection.is_member_of(kind):  # type: ignore[arg-type]
                    fields[kind] = "not a member"
                    continue
                group = collection.get(kind)  # type: ignore[call-overload]
                fields[kind] = "off" if group is None else _members(group)
        out[name] = {"member": collection.is_member, "fields": fields, "enums": megatron_enums(layout)}
    return out


def test_spans_built_in_a_gloo_world_hold_hyper_comm_grids_ranks() -> None:
    for rank, built in enumerate(run_world(WORLD, _built_spans_on_rank, timeout=60)):
        for name, layout in SPANS.items():
            first, stop = layout.rank_range()
            result = built[name]
            assert result["member"] == (first <= rank < stop), (name, rank)
            if not result["member"]:
                assert result["fields"] == {}
                continue
            for kind, members in result["fields"].items():
                holding = [group for group in result["enums"][kind] if rank in group]
                if members == "not a member":
                    assert holding == [] and kind in EDGE_KINDS, (name, rank, kind)
                elif members == "off":
                    assert holding == [[rank]], (name, rank, kind)
                else:
                    assert [sorted(group) for group in holding] == [members], (name, rank, kind)

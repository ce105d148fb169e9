"""ParallelLayout's own consistency: its three queries (enumeration, tensor, per rank) and coordinates agree.

Whether the groups are Megatron-Core's is tested against Megatron-Core itself, its ``initialize_model_parallel``
run for every rank of a world (tests/megatron/test_megatron_parity.py); no port of it lives here.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from pgregistry.layout import GROUP_KINDS, ParallelLayout


def _as_lists(groups: tuple[tuple[int, ...], ...]) -> list[list[int]]:
    return [list(g) for g in groups]


# ------------------------------------------------------------------------------------------------ examples


def test_hand_worked_example() -> None:
    layout = ParallelLayout(num_ranks=8, tp=2, pp=2, order="tp-pp-dp")
    assert layout.dp == 2
    assert _as_lists(layout.groups("dp")) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert _as_lists(layout.groups("tp")) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert _as_lists(layout.groups("pp")) == [[0, 2], [1, 3], [4, 6], [5, 7]]


# ------------------------------------------------------------------------------------------------ property


@st.composite
def layout_args(draw: st.DrawFn) -> dict[str, object]:
    small = st.sampled_from([1, 1, 2, 2, 3, 4])
    tp, cp, pp, gtp = draw(small), draw(small), draw(small), draw(small)
    dp = draw(st.sampled_from([1, 2, 3, 4, 6]))
    world = tp * gtp * cp * pp * dp
    assume(world <= 384)
    # Expert sizes: draw divisors of what the pipeline leaves, so most draws are valid.
    per_stage = world // pp
    divisors = [d for d in range(1, per_stage + 1) if per_stage % d == 0]
    ep, etp, egtp = draw(st.sampled_from(divisors)), draw(st.sampled_from(divisors)), draw(small)
    tokens = list(draw(st.permutations(["tp", "cp", "ep", "dp", "pp"])))
    # Sometimes leave out tokens (Megatron appends those of size 1; others are an error on both sides).
    dropped = draw(st.sets(st.sampled_from(tokens), max_size=2))
    order = "-".join(t for t in tokens if t not in dropped)
    return {
        "num_ranks": world, "tp": tp, "cp": cp, "pp": pp, "ep": ep, "expt_tp": etp, "gtp_remat": gtp,
        "expt_gtp_remat": egtp, "order": order,
    }


# Single-axis kinds: a rank's index in its group of the kind is its coordinate on the axis.
_AXIS_OF_KIND = {
    "tp": "tp", "dp": "dp", "pp": "pp", "cp": "cp", "gtp_remat": "gtp_remat", "ep": "ep", "expt_tp": "expt_tp",
    "expt_dp": "expt_dp", "expt_gtp_remat": "expt_gtp_remat",
}


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(layout_args())
def test_queries_and_coordinates_agree(args: dict[str, object]) -> None:
    try:
        layout = ParallelLayout(**args)  # type: ignore[arg-type]
    except ValueError:
        assume(False)
        return
    world = layout.num_ranks
    enumerated = {kind: layout.groups(kind) for kind in GROUP_KINDS}
    for kind in GROUP_KINDS:
        assert layout.groups_tensor(kind).tolist() == _as_lists(enumerated[kind]), kind
    index = {kind: {r: g for g in groups for r in g} for kind, groups in enumerated.items()}
    sizes = layout.axis_sizes()
    for rank in range(world):
        mine = layout.groups_of(rank)
        assert set(mine) == set(GROUP_KINDS)
        for kind in GROUP_KINDS:
            assert mine[kind] == index[kind].get(rank), (kind, rank)
        coords = layout.coords(rank)
        assert all(0 <= coords[axis] < sizes[axis] for axis in sizes)
        for kind, axis in _AXIS_OF_KIND.items():
            group = mine[kind]
            assert group is not None and group.index(rank) == coords[axis], (kind, rank)


# ------------------------------------------------------------------------------------------------ structure


_SAMPLE_LAYOUTS = [
    {"num_ranks": 8, "tp": 2, "pp": 2, "order": "tp-pp-dp"},
    {"num_ranks": 16, "tp": 2, "cp": 2, "pp": 2, "ep": 2, "expt_tp": 1},
    {"num_ranks": 24, "tp": 2, "gtp_remat": 2, "pp": 3, "ep": 4, "expt_tp": 1, "expt_gtp_remat": 2},
    {"num_ranks": 64, "tp": 4, "cp": 2, "pp": 2, "ep": 4, "expt_tp": 2, "order": "tp-cp-ep-pp-dp"},
    {"num_ranks": 1},
]


@pytest.mark.parametrize("kw", _SAMPLE_LAYOUTS, ids=lambda kw: "-".join(f"{k}{v}" for k, v in kw.items()))
def test_every_kind_partitions_the_world(kw: dict[str, object]) -> None:
    layout = ParallelLayout(**kw)  # type: ignore[arg-type]
    world = layout.num_ranks
    for kind in GROUP_KINDS:
        groups = layout.groups(kind)
        members = [r for g in groups for r in g]
        assert len(members) == len(set(members)), kind
        assert all(list(g) == sorted(g) for g in groups), kind
        if kind in ("embd", "pos_embd"):
            continue  # only the pipeline edges belong to these
        assert sorted(members) == list(range(world)), kind
        assert len({len(g) for g in groups}) == 1, kind
        assert layout.groups_tensor(kind).shape == (len(groups), len(groups[0]))


def test_group_sizes_follow_the_axis_sizes() -> None:
    layout = ParallelLayout(num_ranks=48, tp=2, gtp_remat=2, cp=2, pp=2, ep=3, expt_tp=2, expt_gtp_remat=2)
    assert (layout.dp, layout.expt_dp) == (3, 2)
    expected_size = {
        "tp": 2, "gtp_remat": 2, "cp": 2, "dp": 3, "pp": 2, "dp_cp": 6, "tp_cp": 4, "mp": 8, "tp_dp_cp": 24,
        "dp_cp_gtp_remat": 12, "ep": 3, "expt_tp": 2, "expt_gtp_remat": 2, "expt_dp": 2, "tp_ep": 6,
        "tp_ep_pp": 12, "tp_ep_pp_with_egtp_remat": 24, "expt_dp_gtp_remat": 4, "embd": 2, "pos_embd": 1,
    }
    for kind, size in expected_size.items():
        groups = layout.groups(kind)
        assert {len(g) for g in groups} == {size}, kind


def test_default_etp_is_tp_and_default_order() -> None:
    layout = ParallelLayout(num_ranks=8, tp=4)
    assert layout.expt_tp == 4
    assert layout.order == "tp-cp-ep-dp-pp"
    assert layout.groups("expt_tp") == layout.groups("tp")


def test_order_is_case_insensitive() -> None:
    assert ParallelLayout(num_ranks=8, tp=2, order="TP-CP-EP-DP-PP") == ParallelLayout(num_ranks=8, tp=2)


def test_coords_example() -> None:
    # Default order tp-cp-ep-dp-pp: rank = tp + tp*(cp + cp*(dp + dp*pp)).
    layout = ParallelLayout(num_ranks=32, tp=2, cp=2, pp=2, ep=2, expt_tp=1)
    rank = 1 + 2 * (1 + 2 * (3 + 4 * 1))  # tp 1, cp 1, dp 3 (dp = 4), pp 1
    coords = layout.coords(rank)
    assert {k: coords[k] for k in ("tp", "cp", "dp", "pp")} == {"tp": 1, "cp": 1, "dp": 3, "pp": 1}
    # Expert grid: expt_tp 1, ep 2, expt_dp 8; rank = expt_tp + 1*(ep + 2*(expt_dp + 8*pp)).
    expert = {"expt_tp": 0, "ep": rank % 2, "expt_dp": rank // 2 % 8}
    assert {k: coords[k] for k in ("expt_tp", "ep", "expt_dp")} == expert


def test_embedding_groups_only_hold_pipeline_edges() -> None:
    layout = ParallelLayout(num_ranks=8, pp=4)
    assert _as_lists(layout.groups("embd")) == [[0, 6], [1, 7]]
    assert _as_lists(layout.groups("pos_embd")) == [[0], [1]]
    assert layout.groups_of(2)["embd"] is None
    assert layout.groups_of(6)["embd"] == (0, 6)
    assert layout.groups_of(6)["pos_embd"] is None
    assert layout.groups_of(1)["pos_embd"] == (1,)


def test_fingerprint_is_stable_and_distinguishes_layouts() -> None:
    a = ParallelLayout(num_ranks=8, tp=2)
    assert a.fingerprint() == ParallelLayout(num_ranks=8, tp=2, expt_tp=2).fingerprint()
    assert a.fingerprint() != ParallelLayout(num_ranks=8, tp=2, expt_tp=1).fingerprint()
    assert a.fingerprint() != ParallelLayout(num_ranks=8, tp=2, order="tp-cp-ep-pp-dp").fingerprint()


def test_layout_is_frozen_and_hashable() -> None:
    layout = ParallelLayout(num_ranks=8, tp=2)
    with pytest.raises(AttributeError):
        layout.tp = 4  # type: ignore[misc]
    assert hash(layout) == hash(ParallelLayout(num_ranks=8, tp=2))


def test_groups_of_matches_groups_on_a_large_layout() -> None:
    layout = ParallelLayout(num_ranks=1024, tp=8, pp=4, cp=2, ep=8, expt_tp=1, gtp_remat=2, expt_gtp_remat=2)
    enumerated = {kind: set(layout.groups(kind)) for kind in GROUP_KINDS}
    for rank in (0, 1, 7, 8, 255, 511, 512, 1023):
        for kind, group in layout.groups_of(rank).items():
            if group is None:
                assert all(rank not in g for g in enumerated[kind]), kind
            else:
                assert rank in group and group in enumerated[kind], kind


# ------------------------------------------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    ("kw", "pattern"),
    [
        ({"num_ranks": 12, "tp": 8}, r"num_ranks 12 .*tp\*gtp_remat\*cp\*pp .*= 8"),
        ({"num_ranks": 8, "tp": 2, "cp": 3}, r"num_ranks 8 .*2\*1\*3\*1 = 6"),
        ({"num_ranks": 12, "tp": 2, "ep": 8, "expt_tp": 1}, r"expt_tp\*ep\*expt_gtp_remat\*pp = 1\*8\*1\*1 = 8 .*12"),
        ({"num_ranks": 16, "pp": 2, "ep": 3}, r"= 6 does not divide num_ranks 16"),
        ({"num_ranks": 0}, r"num_ranks must be a positive integer, got 0"),
        ({"num_ranks": 8, "tp": 0}, r"tp must be a positive integer, got 0"),
        ({"num_ranks": 8, "cp": -2}, r"cp must be a positive integer, got -2"),
        ({"num_ranks": 8, "pp": 1.5}, r"pp must be a positive integer, got 1.5"),
        ({"num_ranks": 8, "ep": True}, r"ep must be a positive integer, got True"),
        ({"num_ranks": 8, "expt_tp": 0}, r"expt_tp must be a positive integer"),
        ({"num_ranks": 8, "gtp_remat": 0}, r"gtp_remat must be a positive integer"),
        ({"num_ranks": 8, "expt_gtp_remat": -1}, r"expt_gtp_remat must be a positive integer"),
        ({"num_ranks": 8, "order": "tp-xp-dp-pp"}, r"unknown axis 'xp' in order 'tp-xp-dp-pp'"),
        ({"num_ranks": 8, "order": "tp-cp-tp-dp-pp"}, r"axis 'tp' repeated in order"),
        ({"num_ranks": 8, "tp": 2, "order": "cp-ep-dp-pp"}, r"lacks axis 'tp' whose size is 2"),
        ({"num_ranks": 8, "expt_tp": 2, "order": "cp-ep-dp-pp"}, r"lacks axis 'tp' whose expert size \(expt_tp\) is 2"),
        ({"num_ranks": 8, "tp": 2, "order": "tp-cp-ep-pp"}, r"lacks axis 'dp' whose size is 4"),
        ({"num_ranks": 8, "tp": 8, "expt_tp": 1, "ep": 2, "order": "tp-ep-pp"}, r"lacks axis 'dp' .*expert .* 4"),
    ],
)
def test_bad_sizes_raise_naming_the_culprit(kw: dict[str, object], pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        ParallelLayout(**kw)  # type: ignore[arg-type]


def test_axes_of_size_one_may_be_left_out_of_the_order() -> None:
    # Megatron-Core appends a missing axis of size 1; dp too, when both grids have one data-parallel rank.
    layout = ParallelLayout(num_ranks=8, tp=4, pp=2, order="tp-pp")
    assert (layout.dp, layout.expt_dp) == (1, 1)
    assert layout.groups("pp") == ((0, 4), (1, 5), (2, 6), (3, 7))
    assert ParallelLayout(num_ranks=8, tp=2, order="tp-dp").groups("dp") == ((0, 2, 4, 6), (1, 3, 5, 7))


def test_pp_not_last_refused_when_expert_dp_differs() -> None:
    # dense dp = 16/(2*2) = 4, expert dp = 16/(1*2*2) = 4 with ep 2 -> allowed; ep 4 -> expert dp 2 -> refused.
    with pytest.raises(ValueError, match=r"pp must be last in order 'tp-cp-ep-pp-dp' when pp=2 .*\(2\).*\(4\)"):
        ParallelLayout(num_ranks=16, tp=2, pp=2, ep=4, expt_tp=1, order="tp-cp-ep-pp-dp")


@pytest.mark.parametrize(
    "kw",
    [
        {"num_ranks": 16, "tp": 2, "pp": 2, "ep": 2, "expt_tp": 1, "order": "tp-cp-ep-pp-dp"},  # expert dp == dp
        {"num_ranks": 16, "tp": 2, "pp": 1, "ep": 4, "expt_tp": 1, "order": "tp-cp-ep-pp-dp"},  # pp == 1
        {"num_ranks": 8, "tp": 2, "pp": 2, "order": "tp-pp-dp"},  # no experts
    ],
)
def test_pp_not_last_allowed_as_in_megatron(kw: dict[str, object]) -> None:
    # Accepted, with one pipeline partition shared by both grids; that the groups are Megatron-Core's is checked
    # against Megatron-Core in tests/megatron.
    layout = ParallelLayout(**kw)  # type: ignore[arg-type]
    stages = {rank: group for group in layout.groups("pp") for rank in group}
    assert sorted(stages) == list(range(layout.num_ranks))


def test_unknown_kind_and_rank_out_of_range() -> None:
    layout = ParallelLayout(num_ranks=8, tp=2)
    with pytest.raises(ValueError, match=re.escape("unknown group kind 'dp_pc'; did you mean 'dp_cp'?")):
        layout.groups("dp_pc")
    with pytest.raises(ValueError, match="rank 8 is outside the 8 ranks of this layout"):
        layout.groups_of(8)
    with pytest.raises(ValueError, match="rank -1 is outside"):
        layout.coords(-1)


def test_a_bool_or_a_non_integer_is_not_a_rank() -> None:
    layout = ParallelLayout(num_ranks=8, tp=2)
    for query in (layout.groups_of, layout.coords):
        with pytest.raises(TypeError, match="rank must be an integer, got the bool True"):
            query(True)  # would read as rank 1
        with pytest.raises(TypeError, match=r"rank must be an integer, got 1.0 \(float\)"):
            query(1.0)  # type: ignore[arg-type]
    assert layout.groups_of(np.int64(3)) == layout.groups_of(3)  # type: ignore[arg-type]  # any __index__


def test_num_ranks_is_bounded_by_what_torch_distributed_can_address() -> None:
    assert ParallelLayout(num_ranks=2**31 - 1).num_ranks == 2**31 - 1  # construction is arithmetic only
    for world in (2**31, 2**62):
        with pytest.raises(ValueError, match=rf"num_ranks {world} is more ranks than torch.distributed can "
                           r"address \(at most 2147483647 = 2\*\*31 - 1: ranks are C ints\)"):
            ParallelLayout(num_ranks=world)


@pytest.mark.parametrize("kw", _SAMPLE_LAYOUTS, ids=lambda kw: "-".join(f"{k}{v}" for k, v in kw.items()))
def test_group_shape_is_the_enumerated_shape(kw: dict[str, object]) -> None:
    layout = ParallelLayout(**kw)  # type: ignore[arg-type]
    for kind in GROUP_KINDS:
        groups = layout.groups(kind)
        assert layout.group_shape(kind) == (len(groups), len(groups[0])), kind
    with pytest.raises(ValueError, match="unknown group kind 'dp_pc'"):
        layout.group_shape("dp_pc")


def test_a_group_kind_that_is_no_string_is_named_as_such() -> None:
    """``groups(None)`` raised ``TypeError: 'NoneType' object is not iterable`` from difflib, ``groups(['tp'])``
    ``unhashable type: 'list'``: neither said that a kind is a name."""
    layout = ParallelLayout(num_ranks=4, tp=2)
    for query in (layout.groups, layout.groups_tensor, layout.group_shape):
        for kind in (None, 3, ["tp"], ("tp",)):
            with pytest.raises(TypeError, match=rf"group kind must be a str \(one of tp, gtp_remat, .*\), got "
                                                rf"{re.escape(repr(kind))} \({type(kind).__name__}\)"):
                query(kind)  # type: ignore[arg-type]


def test_an_order_that_is_no_string_is_refused_naming_order() -> None:
    """``order=None`` was read as the axis ``'none'``, ``order=['tp', 'dp']`` as the axis ``"['tp', 'dp']"``, and
    ``order=OrderToken.TP`` as ``'ordertoken.tp'``: the order was stringified before it was checked."""
    for order in (None, ["tp", "dp"], ("tp", "dp"), 1):
        with pytest.raises(TypeError, match=rf"order must be a str of axes joined by '-' \(such as 'tp-cp-ep-dp-pp'\), "
                                            rf"got {re.escape(repr(order))} \({type(order).__name__}\)"):
            ParallelLayout(num_ranks=4, order=order)  # type: ignore[arg-type]
    from pgregistry.layout import OrderToken

    assert ParallelLayout(num_ranks=4, tp=4, order=OrderToken.TP).order == "tp"
    assert ParallelLayout(num_ranks=4, tp=2, order="TP-DP") == ParallelLayout(num_ranks=4, tp=2, order="tp-dp")


def test_a_size_of_any_integer_type_is_taken_as_its_int() -> None:
    """``ParallelLayout(num_ranks=np.int64(8))`` was refused as "num_ranks must be a positive integer, got
    np.int64(8)", which it is; ranks of any integer type were taken already (``groups_of(np.int64(3))``)."""
    layout = ParallelLayout(num_ranks=np.int64(8), tp=np.int32(2), pp=np.uint8(2), rank_offset=np.int64(8))  # type: ignore[arg-type]
    assert layout == ParallelLayout(num_ranks=8, tp=2, pp=2, rank_offset=8)
    assert type(layout.num_ranks) is int and type(layout.tp) is int and type(layout.rank_offset) is int
    assert layout.fingerprint() == ParallelLayout(num_ranks=8, tp=2, pp=2, rank_offset=8).fingerprint()
    with pytest.raises(ValueError, match=r"tp must be a positive integer, got 0"):
        ParallelLayout(num_ranks=8, tp=np.int64(0))  # type: ignore[arg-type]


def test_a_size_given_as_a_float_tensor_is_named() -> None:
    """``ParallelLayout(num_ranks=torch.tensor(8.0))`` raised torch's "only integer tensors of a single element can
    be converted to an index", naming no size (found by the third hostile-input round); an integer tensor is its
    value."""
    import torch

    with pytest.raises(ValueError, match=re.escape("num_ranks must be a positive integer, got tensor(8.)")):
        ParallelLayout(num_ranks=torch.tensor(8.0))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=re.escape("tp must be a positive integer, got tensor(2.5000)")):
        ParallelLayout(num_ranks=8, tp=torch.tensor(2.5))  # type: ignore[arg-type]
    assert ParallelLayout(num_ranks=torch.tensor(8), tp=torch.tensor(2)) == ParallelLayout(num_ranks=8, tp=2)  # type: ignore[arg-type]

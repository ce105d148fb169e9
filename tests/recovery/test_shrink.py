"""``ParallelLayout.shrink`` against an independent enumeration: the ranks tied to a lost one found by walking the
groups whose members hold different state (a union-find over ``groups(kind)``), and every group of the survivors
checked to be a group of the smaller layout, with the same members, under the returned rank map."""

from __future__ import annotations

import re

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from pgregistry.layout import GROUP_KINDS, ParallelLayout

# Kinds whose members hold different state (other shards, other experts, other sequence parts): a lost member
# takes the others with it. The data-parallel kinds (replicas of one another) are the only ones left out.
_TIED_KINDS = ("tp", "gtp_remat", "cp", "pp", "ep", "expt_tp", "expt_gtp_remat")


def _tied_closure(layout: ParallelLayout, lost: set[int]) -> set[int]:
    first, stop = layout.rank_range()
    parent = {r: r for r in range(first, stop)}

    def root(r: int) -> int:
        while parent[r] != r:
            parent[r] = parent[parent[r]]
            r = parent[r]
        return r

    for kind in _TIED_KINDS:
        for group in layout.groups(kind):
            for other in group[1:]:
                parent[root(other)] = root(group[0])
    roots = {root(r) for r in lost}
    return {r for r in range(first, stop) if root(r) in roots}


@st.composite
def shrink_cases(draw: st.DrawFn) -> tuple[dict[str, object], list[int]]:
    small = st.sampled_from([1, 1, 2, 2, 3])
    tp, cp, pp, gtp = draw(small), draw(small), draw(small), draw(small)
    dp = draw(st.sampled_from([1, 2, 3, 4, 6]))
    world = tp * gtp * cp * pp * dp
    assume(world <= 96)
    per_stage = world // pp
    divisors = [d for d in range(1, per_stage + 1) if per_stage % d == 0]
    ep, etp, egtp = draw(st.sampled_from(divisors)), draw(st.sampled_from(divisors)), draw(small)
    order = "-".join(draw(st.permutations(["tp", "cp", "ep", "dp", "pp"])))
    offset = draw(st.sampled_from([0, 0, 3]))
    kw = {
        "num_ranks": world, "tp": tp, "cp": cp, "pp": pp, "ep": ep, "expt_tp": etp, "gtp_remat": gtp,
        "expt_gtp_remat": egtp, "order": order, "rank_offset": offset,
    }
    lost = draw(st.lists(st.integers(offset, offset + world - 1), min_size=1, max_size=3))
    return kw, lost


def _fits(kw: dict[str, object], num_ranks: int) -> bool:
    try:
        ParallelLayout(**{**kw, "num_ranks": num_ranks})  # type: ignore[arg-type]
    except ValueError:
        return False
    return True


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(shrink_cases())
def test_shrink_matches_an_independent_enumeration(case: tuple[dict[str, object], list[int]]) -> None:
    kw, lost = case
    try:
        layout = ParallelLayout(**kw)  # type: ignore[arg-type]
    except ValueError:
        assume(False)
        return
    leaving = _tied_closure(layout, set(lost))
    first, stop = layout.rank_range()
    survivors = [r for r in range(first, stop) if r not in leaving]
    if not survivors or not _fits(kw, len(survivors)):
        with pytest.raises(ValueError, match=r"losing rank\(s\) .*Reload a checkpoint"):
            layout.shrink(lost)
        return
    shrunk = layout.shrink(lost)
    assert shrunk.lost == tuple(sorted(set(lost)))
    assert set(shrunk.leaving) == leaving
    assert list(shrunk.rank_map) == survivors
    assert sorted(shrunk.rank_map.values()) == list(range(first, first + len(survivors)))
    new = shrunk.layout
    for axis in ("tp", "cp", "pp", "ep", "expt_tp", "gtp_remat", "expt_gtp_remat"):
        assert getattr(new, axis) == getattr(layout, axis), axis
    assert (new.order, new.rank_offset, new.num_ranks) == (layout.order, layout.rank_offset, len(survivors))
    # Every group of the survivors is a group of the smaller layout, same members in the same order; the new
    # layout has no other group. A group losing members (a data-parallel one) keeps the rest.
    for kind in GROUP_KINDS:
        mapped = {
            tuple(shrunk.rank_map[r] for r in group if r in shrunk.rank_map) for group in layout.groups(kind)
        } - {()}
        assert mapped == set(new.groups(kind)), kind


def test_a_lost_rank_takes_its_replica_and_the_rest_renumber_in_order() -> None:
    layout = ParallelLayout(num_ranks=8, tp=2)
    shrunk = layout.shrink([5])
    assert shrunk.leaving == (4, 5)
    assert dict(shrunk.rank_map) == {0: 0, 1: 1, 2: 2, 3: 3, 6: 4, 7: 5}
    assert (shrunk.layout.dp, shrunk.layout.tp) == (3, 2)


def test_expert_parallelism_across_replicas_takes_every_replica_it_spans() -> None:
    # EP 4 x expert TP 2 on 16 ranks: two expert replicas of 8 ranks, each spanning four dense replicas.
    layout = ParallelLayout(num_ranks=16, tp=2, ep=4)
    shrunk = layout.shrink([3])
    assert shrunk.leaving == tuple(range(8))
    assert (shrunk.layout.dp, shrunk.layout.expt_dp, shrunk.layout.ep) == (4, 1, 4)


def test_the_moe_layout_with_expert_tp_1_loses_one_expert_replica_and_the_dense_replicas_it_spans() -> None:
    # TP 2 x EP 4, expert TP 1 on 8 ranks: expert replicas {0-3} and {4-7}, each spanning two dense replicas.
    shrunk = ParallelLayout(num_ranks=8, tp=2, ep=4, expt_tp=1).shrink([7])
    assert shrunk.leaving == (4, 5, 6, 7)
    assert (shrunk.dense_replicas_left, shrunk.expert_replicas_left) == ((2, 3), (1,))
    assert dict(shrunk.rank_map) == {0: 0, 1: 1, 2: 2, 3: 3}
    new = shrunk.layout
    assert (new.tp, new.dp, new.ep, new.expt_tp, new.expt_dp) == (2, 2, 4, 1, 1)
    # One expert replica is left: the next loss leaves no copy of some expert.
    with pytest.raises(ValueError, match=r"losing rank\(s\) 0 leaves no copy of the model: .*expt_dp=0 of 1"):
        new.shrink([0])


@pytest.mark.parametrize(
    ("kw", "lost", "pattern"),
    [
        ({"num_ranks": 8, "tp": 2, "ep": 4}, [3], r"losing rank\(s\) 3 leaves no copy of the model: .*expt_dp=0 of 1"),
        ({"num_ranks": 4, "tp": 2}, [0, 3], r"losing rank\(s\) 0, 3 leaves no copy of the model"),
        ({"num_ranks": 4, "tp": 2}, [4], r"lost rank 4 is outside the 4 ranks of this layout"),
        ({"num_ranks": 4, "tp": 2, "rank_offset": 4}, [2], r"lost rank 2 is outside ranks 4\.\.7 of this layout"),
        ({"num_ranks": 4, "tp": 2}, [-1], r"lost rank -1 is outside"),
    ],
)
def test_bad_losses_name_the_ranks(kw: dict[str, object], lost: list[int], pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        ParallelLayout(**kw).shrink(lost)  # type: ignore[arg-type]


def test_a_sharded_optimizer_loses_a_shard_with_any_replica() -> None:
    with pytest.raises(ValueError, match=re.escape("loses the sharded optimizer's shards on rank(s) 2, 3")):
        ParallelLayout(num_ranks=8, tp=2).shrink([2], sharded_optimizer=True)
    assert ParallelLayout(num_ranks=8, tp=2).shrink([], sharded_optimizer=True).layout.dp == 4


@pytest.mark.parametrize("flag", ["no", "False", 0, None, 1])
def test_a_sharded_optimizer_flag_that_is_no_bool_is_refused_naming_it(flag: object) -> None:
    # `sharded_optimizer="no"` was read as true (a non-empty string), and a loss it should survive was refused.
    layout = ParallelLayout(num_ranks=8, tp=2)
    for lost in ([2], []):
        with pytest.raises(TypeError, match=re.escape(f"sharded_optimizer must be True or False, got {flag!r} (")):
            layout.shrink(lost, sharded_optimizer=flag)  # type: ignore[arg-type]


def test_lost_ranks_must_be_integers() -> None:
    layout = ParallelLayout(num_ranks=4, tp=2)
    with pytest.raises(TypeError, match="got the bool True"):
        layout.shrink([True])
    with pytest.raises(TypeError, match=r"got 1.0 \(float\)"):
        layout.shrink([1.0])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="lost must be an iterable of ranks, got int"):
        layout.shrink(3)  # type: ignore[arg-type]


@pytest.mark.timeout(12)
def test_shrinking_a_large_layout_takes_time_linear_in_its_ranks() -> None:
    """Found by a hostile-input audit: ``shrink`` placed each survivor's data-parallel coordinate by a list's
    ``index()``, quadratic in the data-parallel size: 25 s at 65536 ranks of dp 32768, days at 2**20 ranks. Over
    65536 ranks of dp 65536 it now takes about a second (the timeout is a hang detector, not a measurement)."""
    layout = ParallelLayout(num_ranks=2**16)
    shrunk = layout.shrink([5])
    assert shrunk.leaving == (5,)
    assert shrunk.layout.dp == 2**16 - 1
    assert shrunk.rank_map[2**16 - 1] == 2**16 - 2 and shrunk.rank_map[4] == 4 and shrunk.rank_map[6] == 5

"""Every collection field named like Megatron-Core's holds Megatron-Core's ranks: the oracle is Megatron-Core itself.

Megatron-Core's ``initialize_model_parallel`` then ``ProcessGroupCollection.use_mpu_process_groups()`` give, on each
rank, the groups Megatron-Core would use; ``pgregistry.build`` of the same sizes must give the same rank sets field by
field. Megatron-Core builds real one-rank groups where pgregistry says ``None`` (axis off), and says ``None`` where
pgregistry says ``NOT_MEMBER`` (a rank outside the embedding groups): each is compared as exactly that.

Two layers: real gloo worlds of 8 ranks (the layouts the issue names, both orders Megatron-Core documents), and a
property-based sweep on torch's fake backend, where one process plays any rank of any world, so hundreds of sizes and
orders (axes left out included) run in seconds. Refusals must agree both ways: a layout Megatron-Core refuses is a
``ValueError`` here, and one it accepts is accepted here with its ranks. Each run must compare a minimum of
layouts field by field (a sweep whose draws Megatron-Core all refused would otherwise pass comparing nothing).
"""

from __future__ import annotations

import itertools
from collections import Counter
from typing import Any

import pytest
import torch.distributed as dist
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from megatron_support import (
    describe_groups,
    fake_world,
    megatron_fields,
    megatron_initialize,
    require_megatron,
)

require_megatron()

from pgregistry import registry  # noqa: E402
from pgregistry.collection import FIELD_NAMES, ProcessGroupCollection  # noqa: E402
from pgregistry.layout import ParallelLayout  # noqa: E402
from pgregistry.testing import run_world  # noqa: E402

WORLD = 8

BOTH_REFUSE = "both refuse"

GLOO_LAYOUTS: dict[str, dict[str, Any]] = {
    "tp2-gtp2-ep2-egtp2": {"tp": 2, "gtp_remat": 2, "ep": 2, "expt_gtp_remat": 2},
    "tp2-pp2-cp2": {"tp": 2, "pp": 2, "cp": 2},
    "tp2-ep4-etp1-pp2": {"tp": 2, "ep": 4, "expt_tp": 1, "pp": 2},
    "tp2-pp2-order-tp-pp-dp": {"tp": 2, "pp": 2, "order": "tp-pp-dp"},
    "cp2-gtp2-ep4-etp1-order-pp-before-dp": {"cp": 2, "gtp_remat": 2, "ep": 4, "expt_tp": 1, "order": "tp-cp-ep-pp-dp"},
    "gtp2-pp2-ep2-etp2-egtp2": {"gtp_remat": 2, "pp": 2, "ep": 2, "expt_tp": 2},
    "tp4-ep2-etp1-egtp2": {"tp": 4, "ep": 2, "expt_tp": 1, "expt_gtp_remat": 2},
    "ep8-etp1": {"ep": 8, "expt_tp": 1},
}


_NOT_USED = frozenset({"hcp", "inter_dist_opt", "dp_cp_ag", "expt_dp_ag"})
"""Fields whose ``None`` means "not used" in both libraries."""


def _ours(collection: ProcessGroupCollection, names: tuple[str, ...]) -> dict[str, Any]:
    """Field -> the ranks of pgregistry's group, ``"off"`` (None) or ``"not a member"`` (NOT_MEMBER)."""
    out: dict[str, Any] = {}
    for name in names:
        if not collection.is_member_of(name):  # type: ignore[arg-type]  # a Megatron-Core field name
            out[name] = "not a member"
            continue
        value = collection.get(name)  # type: ignore[call-overload]
        out[name] = "off" if value is None else describe_groups(collection, (name,))[name]
    return out


def _compare(theirs: dict[str, Any], ours: dict[str, Any]) -> list[str]:
    """Fields where pgregistry differs from Megatron-Core: the same ranks; None (off) exactly where Megatron-Core
    has this rank alone (or "not used"); NOT_MEMBER exactly where it has no embedding group."""
    rank = dist.get_rank()
    wrong = []
    for name, ranks in theirs.items():
        mine = ours[name]
        if mine == "off":
            agrees = ranks == (rank,) or (ranks is None and name in _NOT_USED)
        elif mine == "not a member":
            agrees = ranks is None and name in ("embd", "pos_embd")
        else:
            agrees = mine == ranks
        if not agrees:
            wrong.append(f"{name}: megatron {ranks}, pgregistry {mine}")
    return wrong


def _both_on_this_rank(sizes: dict[str, Any], tag: str) -> list[str]:
    """Build ``sizes`` with Megatron-Core and with pgregistry on this rank; the fields that differ."""
    names = megatron_fields()
    with megatron_initialize(sizes) as theirs:
        megatron_ranks = describe_groups(theirs, names)
    layout = ParallelLayout(num_ranks=dist.get_world_size(), **sizes)
    # Destroyed right after (a build followed at once by destroy() is what found ranks leaving a build before
    # their peers had connected; pgregistry/_runtime/group_cache.py), and because the fake-backend sweep runs in the
    # test process, whose state forked worlds of other tests inherit.
    try:
        ours = _ours(registry.build(layout, name=tag), names)
    finally:
        registry.destroy()
    return _compare(megatron_ranks, ours)


def _gloo_parity_on_rank() -> dict[str, list[str]]:
    return {name: _both_on_this_rank(sizes, name) for name, sizes in GLOO_LAYOUTS.items()}


def test_pgregistry_has_every_megatron_field() -> None:
    assert set(megatron_fields()) <= set(FIELD_NAMES)


def test_every_field_holds_megatrons_ranks_on_gloo_worlds() -> None:
    # One world for every layout: each rank imports nothing new, and the groups of both libraries are real.
    for rank, wrong_by_layout in enumerate(run_world(WORLD, _gloo_parity_on_rank, timeout=60)):
        for layout_name, wrong in wrong_by_layout.items():
            assert wrong == [], f"{layout_name} rank {rank}: {wrong}"


# ------------------------------------------------------------------------------------------------ fake-backend sweep


def _outcome_on_fake_rank(sizes: dict[str, Any], world: int, rank: int) -> str | list[str]:
    """:data:`BOTH_REFUSE` when Megatron-Core and pgregistry both reject ``sizes``; otherwise what differs: the
    fields whose ranks differ (``[]``: parity), or that one of them refuses what the other accepts."""
    with fake_world(rank, world):
        try:
            with megatron_initialize(sizes):
                pass
            theirs: Exception | None = None
        except (RuntimeError, AssertionError, ValueError) as exc:  # its refusals: sizes that do not divide, ...
            theirs = exc
        try:
            ParallelLayout(num_ranks=world, **sizes)
        except ValueError as ours:
            return BOTH_REFUSE if theirs is not None else [f"pgregistry refuses what Megatron-Core accepts: {ours}"]
        if theirs is not None:
            return [f"Megatron-Core refuses what pgregistry accepts: {type(theirs).__name__}: {theirs}"]
        return _both_on_this_rank(sizes, "sweep")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@st.composite
def sweep_case(draw: st.DrawFn) -> tuple[dict[str, Any], int, list[int]]:
    small = st.sampled_from([1, 1, 2, 2, 3, 4])
    tp, cp, pp, gtp = draw(small), draw(small), draw(small), draw(small)
    world = tp * gtp * cp * pp * draw(st.sampled_from([1, 2, 3, 4]))
    # Expert sizes drawn among those that divide what a pipeline stage holds, so most draws are layouts.
    per_stage = world // pp
    ep = draw(st.sampled_from(_divisors(per_stage)))
    etp = draw(st.sampled_from(_divisors(per_stage // ep)))
    egtp = draw(st.sampled_from([d for d in _divisors(per_stage // (ep * etp)) if d <= 3]))
    sizes: dict[str, Any] = {
        "tp": tp, "cp": cp, "pp": pp, "gtp_remat": gtp, "ep": ep, "expt_tp": etp, "expt_gtp_remat": egtp,
    }
    tokens = draw(st.permutations(["tp", "cp", "ep", "dp", "pp"]))
    # Megatron-Core appends size-1 axes left out of the order (all but "tp", whose omission it crashes on).
    dropped = draw(st.sets(st.sampled_from([t for t in tokens if t != "tp"]), max_size=2))
    sizes["order"] = "-".join(t for t in tokens if t not in dropped)
    ranks = draw(st.lists(st.integers(0, world - 1), min_size=1, max_size=3, unique=True))
    return sizes, world, ranks


SWEEP_EXAMPLES = 200
# Of SWEEP_EXAMPLES drawn layouts, those compared field by field (the others: both refuse); about half are.
MIN_SWEEP_COMPARED = 60


def test_sweep_matches_megatron_initialize_model_parallel() -> None:
    counted: Counter[str] = Counter()

    @settings(max_examples=SWEEP_EXAMPLES, deadline=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
    @given(sweep_case())
    def one_layout(case: tuple[dict[str, Any], int, list[int]]) -> None:
        sizes, world, ranks = case
        assume(world <= 96)  # keeps each example to milliseconds; larger worlds add nothing the smaller ones do not
        outcomes = {rank: _outcome_on_fake_rank(sizes, world, rank) for rank in ranks}
        assert all(outcome in (BOTH_REFUSE, []) for outcome in outcomes.values()), (sizes, world, outcomes)
        counted[BOTH_REFUSE if BOTH_REFUSE in outcomes.values() else "compared"] += 1

    one_layout()
    assert counted["compared"] >= MIN_SWEEP_COMPARED, counted


# Two layouts of 16 ranks with every axis of size 2 but expert TP: with expert TP 1 Megatron-Core accepts only the
# 24 orders that put pp last (the expert and dense data-parallel sizes differ), with expert TP 2 another 80.
ORDER_LAYOUTS = ({"tp": 2, "cp": 2, "pp": 2, "ep": 2, "expt_tp": 1}, {"tp": 2, "cp": 2, "pp": 2, "ep": 2, "expt_tp": 2})
MIN_ORDERS_COMPARED = 100  # of the 2 x 120 (layout, order) pairs


def test_every_order_matches_megatron() -> None:
    # Exhaustive over the 120 orders at each layout (one rank each, a different one per order); the sweep samples.
    compared = 0
    for sizes in ORDER_LAYOUTS:
        for index, tokens in enumerate(itertools.permutations(["tp", "cp", "ep", "dp", "pp"])):
            case = {**sizes, "order": "-".join(tokens)}
            outcome = _outcome_on_fake_rank(case, 16, index % 16)
            assert outcome in (BOTH_REFUSE, []), (case, outcome)
            compared += outcome == []
    assert compared >= MIN_ORDERS_COMPARED, compared


@pytest.mark.parametrize(
    "sizes",
    [{"tp": 3}, {"ep": 3}, {"tp": 2, "order": "tp-cp-ep-pp"}, {"pp": 2, "ep": 4, "order": "tp-cp-ep-pp-dp"}],
)
def test_megatron_refusals_are_value_errors_here(sizes: dict[str, Any]) -> None:
    assert _outcome_on_fake_rank(sizes, 8, 0) == BOTH_REFUSE
    with pytest.raises(ValueError):
        ParallelLayout(num_ranks=8, **sizes)


@pytest.mark.parametrize(
    "sizes",
    [
        # The order leaves out "ep": Megatron-Core then places the expert GTP axis after "tp", not at the end.
        {"tp": 2, "expt_gtp_remat": 2, "order": "tp-cp-dp-pp"},
        {"gtp_remat": 2, "expt_gtp_remat": 2, "order": "dp-tp-pp"},
    ],
)
def test_gtp_axis_placed_as_megatron_places_it_when_the_order_omits_its_anchor(sizes: dict[str, Any]) -> None:
    for rank in range(8):
        assert _outcome_on_fake_rank(sizes, 8, rank) == [], rank

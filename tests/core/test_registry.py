"""The group registry in real gloo worlds: every group's membership checked with an all-reduce against the layout
arithmetic, sharing of identical rank sets, singletons, the agreement check, names, attachments, the global grid."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
import torch.distributed as dist
from core_support import bits, errors_of, member_mask
from torch import nn

from pgregistry import ParallelLayout, ProcessGroupCollection
from pgregistry import registry as reg
from pgregistry.collection import FIELD_NAMES, group_rank, group_size
from pgregistry.layout import GROUP_KINDS
from pgregistry.testing import run_world

# Collection fields that are not layout kinds, and the rank set each stands for.
_ALIAS_OF = {"intra_dp_cp": "dp_cp", "intra_expt_dp": "expt_dp"}


def _expected_sets(layout: ParallelLayout, rank: int) -> dict[str, tuple[int, ...] | None]:
    """Field -> the ranks its group must hold on ``rank``, from the layout arithmetic (None: no group)."""
    mine: dict[str, tuple[int, ...] | None] = dict(layout.groups_of(rank))
    mine.update({alias: mine[kind] for alias, kind in _ALIAS_OF.items()})
    mine["intra_dist_opt"] = tuple(range(layout.world_size))
    return mine


def _membership(collection: ProcessGroupCollection) -> dict[str, Any]:
    """Field -> (bit mask of the members by a real all-reduce, size, this rank's index) or None/'UNSET'.

    Every rank walks the fields in the same order, and every member of a group reaches it at the same step.
    """
    out: dict[str, Any] = {}
    for name in FIELD_NAMES:
        if not collection.is_set(name):
            out[name] = "UNSET"
            continue
        group = collection.get(name)
        if group is None or name == "hcp":
            out[name] = group
            continue
        out[name] = (member_mask(group), group_size(group), group_rank(group))
    return out


def _check_membership(
    layout: ParallelLayout, rank: int, seen: dict[str, Any], *, singletons: bool = False
) -> None:
    expected = _expected_sets(layout, rank)
    assert seen["inter_dist_opt"] is None and seen["hcp"] is None
    for name, ranks in expected.items():
        if ranks is None or (len(ranks) == 1 and not singletons):
            assert seen[name] is None, (name, rank)
            continue
        assert seen[name] == (bits(ranks), len(ranks), ranks.index(rank)), (name, rank)


def _sharing(collections: list[ProcessGroupCollection], layouts: list[ParallelLayout]) -> list[str]:
    """Violations of "one ProcessGroup per distinct rank set" across every field of ``collections``."""
    by_object: dict[int, set[tuple[int, ...]]] = {}
    by_ranks: dict[tuple[int, ...], set[int]] = {}
    for collection, layout in zip(collections, layouts, strict=True):
        expected = _expected_sets(layout, dist.get_rank())
        for name, ranks in expected.items():
            group = collection.get(name)
            if group is None:
                continue
            by_object.setdefault(id(group), set()).add(ranks)  # type: ignore[arg-type]
            by_ranks.setdefault(ranks, set()).add(id(group))  # type: ignore[arg-type]
    problems = [f"one object for several rank sets: {sorted(s)}" for s in by_object.values() if len(s) > 1]
    problems += [f"{len(ids)} objects for ranks {r}" for r, ids in by_ranks.items() if len(ids) > 1]
    return problems


def _distinct_sets(layout: ParallelLayout, *, singletons: bool) -> set[tuple[int, ...]]:
    sets = {group for kind in GROUP_KINDS for group in layout.groups(kind)}
    return {s for s in sets if len(s) < layout.world_size and (singletons or len(s) > 1)}


# ------------------------------------------------------------------------------------------------ 8 ranks

_MOE = ParallelLayout(world_size=8, tp=2, pp=2, ep=2, etp=1)  # dp 2, cp off, expt_dp 4
_DENSE = ParallelLayout(world_size=8, tp=2, cp=2, pp=2)  # shares tp and pp rank sets with _MOE
_GTP = ParallelLayout(world_size=8, tp=2, gtp_remat=2, ep=4, etp=1, expt_gtp_remat=2, order="tp-cp-ep-pp-dp")


def _build_two_layouts() -> dict[str, Any]:
    registry = reg.default_registry
    moe = reg.build(_MOE, name="moe")
    created_by_moe = registry.groups_created
    dense = reg.build(_DENSE, name="dense")
    created_by_dense = registry.groups_created - created_by_moe
    gtp = reg.build(_GTP, name="gtp")
    again = reg.build(_MOE, name="moe")
    unnamed = reg.build(_MOE)
    return {
        "moe": _membership(moe),
        "dense": _membership(dense),
        "gtp": _membership(gtp),
        "sharing": _sharing([moe, dense, gtp], [_MOE, _DENSE, _GTP]),
        "same_again": again is moe,
        "unnamed_shares_groups": all(
            unnamed.get(name) is moe.get(name) for name in FIELD_NAMES if name != "hcp"
        ),
        "created": (created_by_moe, created_by_dense),
        "repr": repr(moe),
    }


def test_build_in_an_8_rank_world_matches_the_layout() -> None:
    results = run_world(8, _build_two_layouts)
    moe_sets = _distinct_sets(_MOE, singletons=False)
    for rank, out in enumerate(results):
        _check_membership(_MOE, rank, out["moe"])
        _check_membership(_DENSE, rank, out["dense"])
        _check_membership(_GTP, rank, out["gtp"])
        assert out["sharing"] == []
        assert out["same_again"] and out["unnamed_shares_groups"]
        # gloo: every rank creates every distinct rank set once (not once per kind); the world is WORLD.
        assert out["created"] == (len(moe_sets), len(_distinct_sets(_DENSE, singletons=False) - moe_sets))
        assert out["repr"].startswith("ProcessGroupCollection(tp(2), cp(off), dp(2), pp(2), dp_cp(2), tp_cp(2),")


def _singletons() -> dict[str, Any]:
    collection = reg.build(_MOE, explicit_singletons=True)
    return {"seen": _membership(collection), "created": reg.default_registry.groups_created}


def test_explicit_singletons_give_every_axis_a_group() -> None:
    results = run_world(8, _singletons)
    for rank, out in enumerate(results):
        _check_membership(_MOE, rank, out["seen"], singletons=True)
        assert out["seen"]["cp"] == (1 << rank, 1, 0)
        assert out["created"] == len(_distinct_sets(_MOE, singletons=True))


# ------------------------------------------------------------------------------------------------ 4 ranks


def _misuse() -> dict[str, str]:
    rank = dist.get_rank()
    four = ParallelLayout(world_size=4, tp=2)
    reg.build(four, name="m")
    return errors_of({
        # Rank 0 asks for another layout than its peers: every rank raises instead of hanging.
        "disagree": lambda: reg.build(ParallelLayout(world_size=4, tp=4 if rank == 0 else 2), name="x"),
        # The same layout, a different name or timeout on one rank: the message names the field.
        "disagree_name": lambda: reg.build(four, name="n0" if rank == 0 else "n1"),
        "disagree_timeout": lambda: reg.build(four, name="t", timeout=30.0 if rank == 3 else 60.0),
        "disagree_partition": lambda: reg.default_registry.group_of_partition(
            [[0, 1], [2, 3]] if rank else [[0, 2], [1, 3]]
        ),
        "world": lambda: reg.build(ParallelLayout(world_size=8, tp=2)),
        "renamed": lambda: reg.build(ParallelLayout(world_size=4, pp=2), name="m"),
        "options": lambda: reg.build(four, name="m", timeout=30.0),
        "conflict": lambda: reg.build(
            ParallelLayout(world_size=4, tp=2, pp=2), name="y", timeout=timedelta(seconds=60)
        ),
        "partition_overlap": lambda: reg.default_registry.group_of_partition([[0, 1, 2], [2, 3]]),
        "partition_bad": lambda: reg.default_registry.group_of_partition([[0, 4]]),
    })


def test_misuse_raises_a_clear_error_on_every_rank() -> None:
    results = run_world(4, _misuse, timeout=30.0)
    for rank, out in enumerate(results):
        assert out["disagree"].startswith("ValueError: ranks disagree on the layout to build: 'layout' differs (")
        assert "ranks [0] asked for ParallelLayout(world_size=4, tp=4," in out["disagree"]
        assert "ranks [1, 2, 3] asked for ParallelLayout(world_size=4, tp=2," in out["disagree"]
        assert "'name'" not in out["disagree"] and "'timeout'" not in out["disagree"]
        assert f"this rank is rank {rank}." in out["disagree"]
        assert out["disagree_name"].startswith(
            "ValueError: ranks disagree on the layout to build: 'name' differs (ranks [0] asked for 'n0'; "
            "ranks [1, 2, 3] asked for 'n1'); this rank"
        )
        assert out["disagree_timeout"].startswith(
            "ValueError: ranks disagree on the layout to build: 'timeout' differs (ranks [0, 1, 2] asked for "
            "datetime.timedelta(seconds=60); ranks [3] asked for datetime.timedelta(seconds=30)); this rank"
        )
        assert out["disagree_partition"].startswith(
            "ValueError: ranks disagree on the rank sets to create: 'rank sets' differs (ranks [0] asked for "
            "[(0, 2), (1, 3)]; ranks [1, 2, 3] asked for [(0, 1), (2, 3)]); this rank"
        )
        assert out["world"] == (
            "ValueError: layout 'layout-" + ParallelLayout(world_size=8, tp=2).fingerprint()
            + "' declares world_size 8 but the process group world has 4 ranks"
        )
        assert out["renamed"] == "ValueError: layout name 'm' is already built with a different layout or options"
        assert out["options"] == out["renamed"]
        assert "already have a group created with" in out["conflict"] and "refusing" in out["conflict"]
        assert out["partition_overlap"] == "ValueError: rank sets overlap at ranks [2]; pass disjoint sets"
        assert out["partition_bad"].startswith("ValueError: rank set [0, 4] must list distinct ranks of the 4-rank")


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(2, 2)


def _attachments_and_global_grid() -> dict[str, Any]:
    first = reg.build(ParallelLayout(world_size=4, tp=2), name="first")
    second = reg.build(ParallelLayout(world_size=4, tp=4, ep=2, etp=1), name="second")
    model_a, model_b, stray = _Model(), _Model(), _Model()
    chunks = [_Model(), _Model()]
    reg.attach(model_a, first)
    reg.attach(model_b, second)
    reg.attach(chunks, second)
    out: dict[str, Any] = {
        "attached": [
            reg.collection_of(model_a) is first, reg.collection_of(model_b) is second,
            all(reg.collection_of(c) is second for c in chunks), reg.collection_of(stray, None) is None,
        ],
        "tp_sizes": [group_size(reg.collection_of(m).get("tp")) for m in (model_a, model_b)],
        "errors": errors_of({
            "stray": lambda: reg.collection_of(stray),
            "not_a_collection": lambda: reg.attach(stray, {"tp": None}),  # type: ignore[arg-type]
            "no_grid": reg.global_collection,
        }),
    }
    grid = reg.initialize_global_grid(ParallelLayout(world_size=4, pp=2))
    out["grid"] = [reg.global_collection() is grid, reg.global_collection_or_none() is grid]
    out["grid_pp"] = _membership(grid)["pp"]
    out["errors"].update(errors_of({"twice": lambda: reg.initialize_global_grid(ParallelLayout(world_size=4))}))
    created = reg.default_registry.groups_created
    reg.destroy()
    out["after_destroy"] = [
        reg.global_collection_or_none() is None, reg.collection_of(model_a, "gone"),
    ]
    rebuilt = reg.build(ParallelLayout(world_size=4, tp=2), name="first")
    out["rebuilt"] = [rebuilt is not first, reg.default_registry.groups_created - created]
    out["rebuilt_tp"] = _membership(rebuilt)["tp"]
    return out


def test_attachments_global_grid_and_destroy() -> None:
    results = run_world(4, _attachments_and_global_grid)
    for rank, out in enumerate(results):
        assert out["attached"] == [True, True, True, True]
        assert out["tp_sizes"] == [2, 4]
        assert out["errors"]["stray"].startswith("LookupError: no ProcessGroupCollection is attached to this _Model")
        assert out["errors"]["not_a_collection"] == "TypeError: attach expects a ProcessGroupCollection, got dict"
        assert out["errors"]["no_grid"].startswith("RuntimeError: the global grid is not initialised")
        assert out["errors"]["twice"].startswith("RuntimeError: the global grid is already initialised")
        assert out["grid"] == [True, True]
        pp = [rank % 2, rank % 2 + 2]
        assert out["grid_pp"] == (bits(pp), 2, pp.index(rank))
        assert out["after_destroy"] == [True, "gone"]
        assert out["rebuilt"] == [True, 4]  # the tp and dp pairs are created anew
        tp = [rank // 2 * 2, rank // 2 * 2 + 1]
        assert out["rebuilt_tp"] == (bits(tp), 2, rank % 2)


def _partition() -> dict[str, Any]:
    collection = reg.build(ParallelLayout(world_size=4, tp=2), name="tp2")
    created = reg.default_registry.groups_created
    pairs = reg.default_registry.group_of_partition([[3, 2], [1, 0]])
    strided = reg.default_registry.group_of_partition(iter([(0, 2), (1, 3)]))
    solo = reg.default_registry.group_of_partition([[0], [1], [2], [3]])
    partial = reg.default_registry.group_of_partition([[0, 1]])
    return {
        "reused": [pairs is collection.get("tp"), strided is collection.get("dp")],
        "created": reg.default_registry.groups_created - created,
        "strided": _membership(ProcessGroupCollection(dp=strided))["dp"],
        "solo": (group_size(solo), group_rank(solo)),
        "partial": partial is pairs if dist.get_rank() < 2 else partial,
    }


def test_group_of_partition_reuses_and_creates_groups() -> None:
    results = run_world(4, _partition)
    for rank, out in enumerate(results):
        assert out["reused"] == [True, True]  # the layout's tp and dp pairs
        assert out["created"] == 4  # the singletons only
        strided = [rank % 2, rank % 2 + 2]
        assert out["strided"] == (bits(strided), 2, rank // 2)
        assert out["solo"] == (1, 0)
        assert out["partial"] is (True if rank < 2 else None)


def _members_only_on_the_fake_backend(rank: int, world_size: int) -> dict[str, Any]:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.destroy_process_group()  # run_world's gloo world; the fake one stands for a large job
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    layout = ParallelLayout(world_size=world_size, tp=4, pp=4, cp=2, ep=4, etp=1)
    collection = reg.build(layout)
    ranks = {
        name: None if group is None else dist.get_process_group_ranks(group)
        for name, group in collection.items() if name != "hcp" and group is not None
    }
    return {"created": reg.default_registry.groups_created, "ranks": ranks}


def test_members_only_creation_on_the_fake_backend() -> None:
    layout = ParallelLayout(world_size=256, tp=4, pp=4, cp=2, ep=4, etp=1)
    for rank in (0, 77):
        (out,) = run_world(1, _members_only_on_the_fake_backend, rank, 256)
        expected = _expected_sets(layout, rank)
        wanted = {ranks for ranks in expected.values() if ranks is not None and 1 < len(ranks) < 256}
        assert out["created"] == len(wanted)  # only this rank's own groups, each once
        for name, ranks in out["ranks"].items():
            assert tuple(ranks) == expected[name], name


def test_build_needs_torch_distributed() -> None:
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="needs torch.distributed initialised"):
        reg.build(ParallelLayout(world_size=1))
    with pytest.raises(RuntimeError, match="needs torch.distributed initialised"):
        reg.default_registry.group_of_partition([[0]])


def test_a_misspelt_build_option_is_refused() -> None:
    # build and initialize_global_grid pass their options on as **kwargs (BuildOptions): a misspelt one must
    # raise, never be ignored.
    layout = ParallelLayout(world_size=1)
    with pytest.raises(TypeError, match="unexpected keyword argument 'explicit_singleton'"):
        reg.build(layout, explicit_singleton=True)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="unexpected keyword argument 'backnd'"):
        reg.initialize_global_grid(layout, backnd="gloo")  # type: ignore[call-arg]
    assert reg.global_collection_or_none() is None

"""The group registry in real gloo worlds: every group's membership checked with an all-reduce against the layout
arithmetic, sharing of identical rank sets, the one-rank group, the agreement check, names, attachments, the global
grid."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from core_support import bits, errors_of, member_mask
from torch import nn

import pgregistry
from pgregistry import ParallelLayout, ProcessGroupCollection
from pgregistry import registry as reg
from pgregistry._runtime.group_cache import CACHE, GroupOptions
from pgregistry.collection import FIELD_NAMES, group_rank, group_size
from pgregistry.global_grid import global_collection, initialize_global_grid
from pgregistry.layout import GROUP_KINDS
from pgregistry.testing import run_world

# Collection fields that are not layout kinds, and the rank set each stands for.
_ALIAS_OF = {"intra_dp_cp": "dp_cp", "intra_expt_dp": "expt_dp"}


def _expected_sets(layout: ParallelLayout, rank: int) -> dict[str, tuple[int, ...] | None]:
    """Field -> the ranks its group must hold on ``rank``, from the layout arithmetic (None: no group)."""
    mine: dict[str, tuple[int, ...] | None] = dict(layout.groups_of(rank))
    mine.update({alias: mine[kind] for alias, kind in _ALIAS_OF.items()})
    mine["intra_dist_opt"] = tuple(range(*layout.rank_range()))
    return mine


def _membership(collection: ProcessGroupCollection) -> dict[str, Any]:
    """Field -> (bit mask of the members by a real all-reduce, size, this rank's index) or None/'UNSET'/
    'NOT_MEMBER'; and the one-rank group under 'one_rank_group'.

    Every rank walks the fields in the same order, and every member of a group reaches it at the same step.
    """
    out: dict[str, Any] = {}
    for name in FIELD_NAMES:
        if not collection.is_set(name):
            out[name] = "UNSET"
            continue
        if not collection.is_member_of(name):
            out[name] = "NOT_MEMBER"
            continue
        group = collection.get(name)
        if group is None or name == "hcp":
            out[name] = group
            continue
        out[name] = (member_mask(group), group_size(group), group_rank(group))
    own = collection.one_rank_group
    out["one_rank_group"] = None if own is None else (member_mask(own), group_size(own), group_rank(own))
    return out


def _check_membership(layout: ParallelLayout, rank: int, seen: dict[str, Any]) -> None:
    expected = _expected_sets(layout, rank)
    assert seen["inter_dist_opt"] is None and seen["hcp"] is None
    assert seen["one_rank_group"] == (1 << rank, 1, 0)
    for name, ranks in expected.items():
        if ranks is None:
            assert seen[name] == "NOT_MEMBER", (name, rank)  # never "rank 0 of 1"
        elif len(ranks) == 1:
            assert seen[name] is None, (name, rank)  # a size-1 axis is off
        else:
            assert seen[name] == (bits(ranks), len(ranks), ranks.index(rank)), (name, rank)


def _sharing(collections: list[ProcessGroupCollection], layouts: list[ParallelLayout]) -> list[str]:
    """Violations of "one ProcessGroup per distinct rank set" across every field of ``collections``."""
    by_object: dict[int, set[tuple[int, ...]]] = {}
    by_ranks: dict[tuple[int, ...], set[int]] = {}
    for collection, layout in zip(collections, layouts, strict=True):
        expected = _expected_sets(layout, dist.get_rank())
        for name, ranks in expected.items():
            if not collection.is_member_of(name) or collection.get(name) is None:
                continue
            group = collection.get(name)
            by_object.setdefault(id(group), set()).add(ranks)  # type: ignore[arg-type]
            by_ranks.setdefault(ranks, set()).add(id(group))  # type: ignore[arg-type]
    problems = [f"one object for several rank sets: {sorted(s)}" for s in by_object.values() if len(s) > 1]
    problems += [f"{len(ids)} objects for ranks {r}" for r, ids in by_ranks.items() if len(ids) > 1]
    return problems


def _holding(sets: set[tuple[int, ...]], rank: int) -> set[tuple[int, ...]]:
    return {ranks for ranks in sets if rank in ranks}


def _distinct_sets(layout: ParallelLayout, world_size: int | None = None) -> set[tuple[int, ...]]:
    """The rank sets a build creates communicators for: every multi-rank set of every kind and the layout's span,
    but the world (WORLD itself), and every rank of the span alone (the one-rank groups)."""
    span = tuple(range(*layout.rank_range()))
    sets = {group for kind in GROUP_KINDS for group in layout.groups(kind)} | {span}
    singles = {(rank,) for rank in span}
    world = world_size if world_size is not None else layout.num_ranks
    return {s for s in sets if 1 < len(s) < world} | singles


# ------------------------------------------------------------------------------------------------ 8 ranks

_MOE = ParallelLayout(num_ranks=8, tp=2, pp=2, ep=2, expt_tp=1)  # dp 2, cp off, expt_dp 4
_DENSE = ParallelLayout(num_ranks=8, tp=2, cp=2, pp=2)  # shares tp and pp rank sets with _MOE
_GTP = ParallelLayout(num_ranks=8, tp=2, gtp_remat=2, ep=4, expt_tp=1, expt_gtp_remat=2, order="tp-cp-ep-pp-dp")


def _build_two_layouts() -> dict[str, Any]:
    moe = reg.build(_MOE, name="moe")
    created_by_moe = reg.communicators_created()
    dense = reg.build(_DENSE, name="dense")
    created_by_dense = reg.communicators_created() - created_by_moe
    gtp = reg.build(_GTP, name="gtp")
    again = reg.build(_MOE, name="moe")
    unnamed = reg.build(_MOE)
    return {
        "moe": _membership(moe),
        "dense": _membership(dense),
        "gtp": _membership(gtp),
        "sharing": _sharing([moe, dense, gtp], [_MOE, _DENSE, _GTP]),
        "same_again": again is moe,
        "unnamed_shares_groups": unnamed == moe and unnamed.name is None and moe.name == "moe",
        "layouts": [moe.layout == _MOE, dense.layout == _DENSE, gtp.layout is _GTP],
        "created": (created_by_moe, created_by_dense),
        "repr": repr(moe),
    }


def test_build_in_an_8_rank_world_matches_the_layout() -> None:
    results = run_world(8, _build_two_layouts)
    moe_sets = _distinct_sets(_MOE)
    for rank, out in enumerate(results):
        _check_membership(_MOE, rank, out["moe"])
        _check_membership(_DENSE, rank, out["dense"])
        _check_membership(_GTP, rank, out["gtp"])
        assert out["sharing"] == []
        assert out["same_again"] and out["unnamed_shares_groups"] and out["layouts"] == [True, True, True]
        # A communicator for each distinct rank set of this rank's (not once per kind); the world is WORLD.
        dense_only = _distinct_sets(_DENSE) - moe_sets
        assert out["created"] == (len(_holding(moe_sets, rank)), len(_holding(dense_only, rank)))
        assert out["repr"].startswith("ProcessGroupCollection(tp(2), cp(off), dp(2), pp(2), dp_cp(2), tp_cp(2),")


def _embedding_groups() -> dict[str, Any]:
    collection = reg.build(ParallelLayout(num_ranks=8, pp=4))
    errors = errors_of({"embd": lambda: collection.get("embd"), "rank": lambda: group_rank(collection.embd)})
    return {
        "embd": collection.is_member_of("embd"),
        "pos_embd": collection.is_member_of("pos_embd"),
        "value": repr(collection.embd),
        "errors": errors,
    }


def test_a_rank_outside_the_embedding_groups_is_not_a_member_never_rank_0_of_1() -> None:
    for rank, out in enumerate(run_world(8, _embedding_groups)):
        stage = rank // 2  # pp 4 over 8 ranks, dp 2: the pipeline axis is the slowest
        assert out["embd"] is (stage in (0, 3)) and out["pos_embd"] is (stage == 0)
        if stage in (1, 2):
            assert out["value"] == "NOT_MEMBER"
            assert out["errors"]["embd"].startswith(f"ValueError: rank {rank} belongs to no 'embd' group of layout ")
            assert out["errors"]["rank"].startswith("ValueError: this process is not a member of the group")


# ------------------------------------------------------------------------------------------------ 4 ranks


def _misuse() -> dict[str, str]:
    rank = dist.get_rank()
    four = ParallelLayout(num_ranks=4, tp=2)
    reg.build(four, name="m")
    return errors_of({
        # Rank 0 asks for another layout than its peers: every rank raises instead of hanging.
        "disagree": lambda: reg.build(ParallelLayout(num_ranks=4, tp=4 if rank == 0 else 2), name="x"),
        # The same layout, a different name or timeout on one rank: the message names the field.
        "disagree_name": lambda: reg.build(four, name="n0" if rank == 0 else "n1"),
        "disagree_timeout": lambda: reg.build(four, name="t", timeout=30.0 if rank == 3 else 60.0),
        "disagree_partition": lambda: CACHE.partition_group(
            [[0, 1], [2, 3]] if rank else [[0, 2], [1, 3]], GroupOptions()
        ),
        "world": lambda: reg.build(ParallelLayout(num_ranks=8, tp=2)),
        "past_the_end": lambda: reg.build(ParallelLayout(num_ranks=2, rank_offset=3), name="late"),
        "disagree_span": lambda: reg.build(ParallelLayout(num_ranks=2, rank_offset=2 if rank == 1 else 0)),
        "renamed": lambda: reg.build(ParallelLayout(num_ranks=4, pp=2), name="m"),
        "options": lambda: reg.build(four, name="m", timeout=30.0),
        "conflict": lambda: reg.build(
            ParallelLayout(num_ranks=4, tp=2, pp=2), name="y", timeout=timedelta(seconds=60)
        ),
        "partition_overlap": lambda: CACHE.partition_group([[0, 1, 2], [2, 3]], GroupOptions()),
        "partition_bad": lambda: CACHE.partition_group([[0, 4]], GroupOptions()),
        "timeout_zero": lambda: reg.build(four, name="z", timeout=0),
        "timeout_negative": lambda: reg.build(four, name="z", timeout=timedelta(seconds=-5)),
        "unnamed_other_options": lambda: reg.build(ParallelLayout(num_ranks=4, pp=4)) and reg.build(
            ParallelLayout(num_ranks=4, pp=4), timeout=20.0
        ),
    })


def test_misuse_raises_a_clear_error_on_every_rank() -> None:
    results = run_world(4, _misuse, timeout=30.0)
    for rank, out in enumerate(results):
        assert out["disagree"].startswith(
            "ValueError: ranks disagree on the layout to build: 'tp' differs (ranks [0] asked for 4; ranks [1, 2, 3] "
            "asked for 2); 'expt_tp' differs (ranks [0] asked for 4; ranks [1, 2, 3] asked for 2); this rank"
        )
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
            f"ValueError: {ParallelLayout(num_ranks=8, tp=2)!r} spans ranks 0-7 (rank_offset 0 + num_ranks 8), past "
            "the end of the 4-rank world; shrink num_ranks or rank_offset"
        )
        assert out["past_the_end"] == (
            "ValueError: layout 'late' spans ranks 3-4 (rank_offset 3 + num_ranks 2), past the end of the 4-rank "
            "world; shrink num_ranks or rank_offset"
        )
        assert out["disagree_span"].startswith(
            "ValueError: ranks disagree on the layout to build: 'rank_offset' differs (ranks [0, 2, 3] asked for 0; "
            "ranks [1] asked for 2); this rank"
        )
        assert out["renamed"].startswith(
            "ValueError: name 'm' is already built with other settings: layout ParallelLayout(num_ranks=4, tp=2,"
        )
        assert "then ParallelLayout(num_ranks=4, tp=1, cp=1, pp=2," in out["renamed"]
        assert out["options"].startswith(
            "ValueError: name 'm' is already built with other settings: timeout=None then "
            "timeout=datetime.timedelta(seconds=30)."
        )
        assert out["unnamed_other_options"].startswith(
            f"ValueError: {ParallelLayout(num_ranks=4, pp=4)!r} is already built with other settings: timeout=None "
        )
        assert out["conflict"].startswith(
            "ValueError: pgregistry.build: ranks [0, 1, 2, 3] found a communicator with other options (ranks [0, 1, 2, "
            "3]: layout 'y' needs a communicator over ranks ["
        )
        assert "one communicator per rank set" in out["conflict"]
        every = "ranks [0, 1, 2, 3] were given bad input (ranks [0, 1, 2, 3]: timeout must be positive, finite"
        assert out["timeout_zero"].startswith(f"ValueError: the layout to build: {every}"), out["timeout_zero"]
        assert out["timeout_zero"].endswith("; got 0)")
        assert out["timeout_negative"].endswith("; got datetime.timedelta(days=-1, seconds=86395))")
        assert out["partition_overlap"] == "ValueError: rank sets overlap at ranks [2]; pass disjoint sets"
        assert out["partition_bad"].startswith("ValueError: rank set [0, 4] must list distinct ranks of the 4-rank")


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(2, 2)


def _attachments_and_global_grid() -> dict[str, Any]:
    first = reg.build(ParallelLayout(num_ranks=4, tp=2), name="first")
    second = reg.build(ParallelLayout(num_ranks=4, tp=4, ep=2, expt_tp=1), name="second")
    model_a, model_b, stray = _Model(), _Model(), _Model()
    chunks = [_Model(), _Model()]
    pgregistry.attach(model_a, first)
    pgregistry.attach(model_b, second)
    pgregistry.attach(chunks, second)
    out: dict[str, Any] = {
        "attached": [
            pgregistry.collection_of(model_a) is first, pgregistry.collection_of(model_b) is second,
            all(pgregistry.collection_of(c) is second for c in chunks), pgregistry.collection_of(stray, None) is None,
        ],
        "tp_sizes": [group_size(pgregistry.collection_of(m).get("tp")) for m in (model_a, model_b)],
        "errors": errors_of({
            "stray": lambda: pgregistry.collection_of(stray),
            "not_a_collection": lambda: pgregistry.attach(stray, {"tp": None}),  # type: ignore[arg-type]
            "no_grid": global_collection,
        }),
    }
    grid = initialize_global_grid(ParallelLayout(num_ranks=4, pp=2))
    out["grid"] = [global_collection() is grid, global_collection(None) is grid]
    out["grid_pp"] = _membership(grid)["pp"]
    out["errors"].update(errors_of({"twice": lambda: initialize_global_grid(ParallelLayout(num_ranks=4))}))
    created = reg.communicators_created()
    reg.destroy()
    out["after_destroy"] = [global_collection(None) is None, pgregistry.collection_of(model_a).is_destroyed]
    out["errors"].update(errors_of({"destroyed_grid": global_collection}))
    rebuilt = reg.build(ParallelLayout(num_ranks=4, tp=2), name="first")
    out["rebuilt"] = [rebuilt is not first, reg.communicators_created() - created]
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
        # Destroyed, it is named as destroyed (it said "not initialised", of a grid the job had initialised).
        assert out["errors"]["destroyed_grid"] == (
            "RuntimeError: the global grid is destroyed (pgregistry.registry.destroy): initialise it with "
            "pgregistry.global_grid.initialize_global_grid(layout)"
        )
        assert out["grid"] == [True, True]
        pp = [rank % 2, rank % 2 + 2]
        assert out["grid_pp"] == (bits(pp), 2, pp.index(rank))
        assert out["after_destroy"] == [True, True]
        assert out["rebuilt"] == [True, 3]  # this rank's tp and dp pairs and its one-rank group, created anew
        tp = [rank // 2 * 2, rank // 2 * 2 + 1]
        assert out["rebuilt_tp"] == (bits(tp), 2, rank % 2)


def _partition() -> dict[str, Any]:
    collection = reg.build(ParallelLayout(num_ranks=4, tp=2), name="tp2")
    created = reg.communicators_created()
    pairs = CACHE.partition_group([[3, 2], [1, 0]], GroupOptions())
    strided = CACHE.partition_group(iter([(0, 2), (1, 3)]), GroupOptions())
    solo = CACHE.partition_group([[0], [1], [2], [3]], GroupOptions())
    partial = CACHE.partition_group([[0, 1]], GroupOptions())
    return {
        "reused": [pairs is collection.get("tp"), strided is collection.get("dp"), solo is collection.one_rank_group],
        "created": reg.communicators_created() - created,
        "strided": _membership(ProcessGroupCollection(dp=strided))["dp"],
        "solo": (group_size(solo), group_rank(solo)),
        "partial": partial is pairs if dist.get_rank() < 2 else partial,
    }


def test_group_of_partition_reuses_and_creates_groups() -> None:
    results = run_world(4, _partition)
    for rank, out in enumerate(results):
        assert out["reused"] == [True, True, True]  # the layout's tp and dp pairs, the build's one-rank groups
        assert out["created"] == 0
        strided = [rank % 2, rank % 2 + 2]
        assert out["strided"] == (bits(strided), 2, rank // 2)
        assert out["solo"] == (1, 0)
        assert out["partial"] is (True if rank < 2 else None)


def _build_on_the_fake_backend(rank: int, world_size: int) -> dict[str, Any]:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.destroy_process_group()  # run_world's gloo world; the fake one stands for a large job
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    layout = ParallelLayout(num_ranks=world_size, tp=4, pp=4, cp=2, ep=4, expt_tp=1)
    collection = reg.build(layout)
    ranks = {
        name: dist.get_process_group_ranks(group)
        for name, group in collection.items() if isinstance(group, dist.ProcessGroup)
    }
    return {"created": reg.communicators_created(), "ranks": ranks}


def test_a_rank_of_a_large_world_creates_only_its_own_groups_each_once() -> None:
    layout = ParallelLayout(num_ranks=256, tp=4, pp=4, cp=2, ep=4, expt_tp=1)
    for rank in (0, 77):
        (out,) = run_world(1, _build_on_the_fake_backend, rank, 256)
        expected = _expected_sets(layout, rank)
        wanted = {ranks for ranks in expected.values() if ranks is not None and 1 < len(ranks) < 256}
        assert out["created"] == len(wanted) + 1  # only this rank's own groups, each once, and its one-rank group
        for name, ranks in out["ranks"].items():
            assert tuple(ranks) == expected[name], name


def test_build_needs_torch_distributed() -> None:
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="needs torch.distributed initialised"):
        reg.build(ParallelLayout(num_ranks=1))
    with pytest.raises(RuntimeError, match="needs torch.distributed initialised"):
        CACHE.partition_group([[0]], GroupOptions())


def test_a_misspelt_build_option_is_refused() -> None:
    # build and initialize_global_grid pass their options on as **kwargs (BuildOptions): a misspelt one must
    # raise, never be ignored.
    layout = ParallelLayout(num_ranks=1)
    with pytest.raises(TypeError, match="unexpected keyword argument 'explicit_singleton'"):
        reg.build(layout, explicit_singleton=True)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="unexpected keyword argument 'backnd'"):
        initialize_global_grid(layout, backnd="gloo")  # type: ignore[call-arg]
    assert global_collection(None) is None


# ------------------------------------------------------------------------------------------------ spans

_ENCODER = ParallelLayout(num_ranks=4)  # ranks 0-3, dp 4
_LANGUAGE = ParallelLayout(num_ranks=4, tp=2, pp=2, ep=2, expt_tp=1, rank_offset=4)  # ranks 4-7
_MIDDLE = ParallelLayout(num_ranks=4, tp=2, rank_offset=2)  # ranks 2-5: overlaps both
_COLOCATED = ParallelLayout(num_ranks=8, tp=4)  # the whole world, at another parallelism
_SPANS = {"encoder": _ENCODER, "language": _LANGUAGE, "middle": _MIDDLE, "colocated": _COLOCATED}


def _build_spans() -> dict[str, Any]:
    collections = {name: reg.build(layout, name=name) for name, layout in _SPANS.items()}
    members = {name: c for name, c in collections.items() if c.is_member}
    outside = {name: c for name, c in collections.items() if not c.is_member}
    model = nn.Linear(2, 2)
    model.weight.grad = torch.ones_like(model.weight)
    refusals = {}

    def attached_then_used(collection: ProcessGroupCollection) -> object:
        carrier = nn.Linear(1, 1)
        pgregistry.attach(carrier, collection)
        return pgregistry.grad_norm(carrier)

    for name, collection in outside.items():
        refusals.update(errors_of({
            f"{name}.tp": lambda c=collection: c.tp,
            f"{name}.get": lambda c=collection: c.get("dp"),
            f"{name}.items": lambda c=collection: list(c.items()),
            f"{name}.grad_norm": lambda c=collection: pgregistry.grad_norm(model, pg_collection=c),
            f"{name}.attach": lambda c=collection: attached_then_used(c),
        }))
    return {
        "members": sorted(members),
        "membership": {name: _membership(c) for name, c in members.items()},
        "outside": {name: (repr(c), c.layout == _SPANS[name], c.name) for name, c in outside.items()},
        "refusals": refusals,
        "sharing": _sharing(list(members.values()), [_SPANS[name] for name in members]),
        "created": reg.communicators_created(),
        "again": all(reg.build(layout, name=name) is collections[name] for name, layout in _SPANS.items()),
    }


def test_layouts_over_spans_of_the_world_build_disjoint_overlapping_and_colocated() -> None:
    results = run_world(8, _build_spans)
    union = set().union(*(_distinct_sets(layout, world_size=8) for layout in _SPANS.values()))
    for rank, out in enumerate(results):
        expected_members = sorted(n for n, layout in _SPANS.items() if rank in range(*layout.rank_range()))
        assert out["members"] == expected_members
        for name in expected_members:
            _check_membership(_SPANS[name], rank, out["membership"][name])
        assert out["sharing"] == []
        # One communicator for each distinct rank set of the four layouts holding this rank, members of a span or not.
        assert out["created"] == len(_holding(union, rank))
        assert out["again"]
        for name, (text, same_layout, built_name) in out["outside"].items():
            first, stop = _SPANS[name].rank_range()
            assert same_layout and built_name == name
            assert text == f"ProcessGroupCollection(not a member of layout {name!r} {_SPANS[name]!r})"
            not_member = (
                f"ValueError: rank {rank} is not a member of layout {name!r} {_SPANS[name]!r}, which spans ranks "
                f"{first}-{stop - 1}: this rank holds no group of it and must not compute with it"
            )
            for read in ("tp", "get", "items"):
                assert out["refusals"][f"{name}.{read}"].startswith(not_member), (rank, name, read)
            refused = (
                f"ValueError: grad_norm was given layout {name!r} {_SPANS[name]!r}, which spans "
                f"ranks {first}-{stop - 1}; this rank ({rank}) is not one of them and must not compute with it"
            )
            assert out["refusals"][f"{name}.grad_norm"].startswith(refused), out["refusals"][f"{name}.grad_norm"]
            assert out["refusals"][f"{name}.attach"].startswith(refused)

"""ProcessGroupCollection: the three field states, access, evolution, equality, repr and the size/rank helpers."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
import torch.distributed as dist
from fixtures.groups import SizeRankGroup

from pgregistry import NOT_MEMBER, UNSET, ProcessGroupCollection
from pgregistry.collection import FIELD_NAMES, Unset, check_field_names, group_rank, group_size
from pgregistry.testing import run_world


def test_every_field_starts_unset() -> None:
    collection = ProcessGroupCollection()
    for name, value in collection.items():
        assert value is UNSET
        assert not collection.is_set(name)
    assert [name for name, _ in collection.items()] == list(FIELD_NAMES)
    assert repr(collection) == "ProcessGroupCollection()"


def test_three_states_are_kept_apart() -> None:
    tp = SizeRankGroup(4)
    collection = ProcessGroupCollection(tp=tp, cp=None)
    assert collection.is_set("tp") and collection.get("tp") is tp
    assert collection.is_set("cp") and collection.get("cp") is None
    assert not collection.is_set("dp")
    with pytest.raises(AttributeError, match=r"process group 'dp' is not set"):
        collection.get("dp")
    # UNSET is not None and has no truth value, so `if pg.tp:` can never read "nobody said" as "off".
    assert UNSET is not None and repr(UNSET) == "UNSET" and isinstance(UNSET, Unset)
    with pytest.raises(TypeError, match="UNSET .* has no truth value"):
        bool(collection.dp)
    with pytest.raises(TypeError, match="NOT_MEMBER .* has no truth value"):
        bool(NOT_MEMBER)


def test_unknown_names_suggest_a_close_match() -> None:
    message = re.escape("Unknown attribute: 'exp_dp'; did you mean 'expt_dp'?")
    with pytest.raises(ValueError, match=message):
        ProcessGroupCollection(exp_dp=None)
    collection = ProcessGroupCollection(tp=None)
    for call in (collection.is_set, collection.get, lambda n: collection.evolve(**{n: None})):
        with pytest.raises(ValueError, match=message):
            call("exp_dp")
    with pytest.raises(ValueError, match=r"Unknown attribute: 'zzz' \(known: tp, cp,"):
        check_field_names(["tp", "zzz"])
    assert check_field_names(iter(["tp", "hcp"])) == ("tp", "hcp")


def test_evolve_returns_a_changed_copy() -> None:
    tp, ep = SizeRankGroup(2), SizeRankGroup(4)
    base = ProcessGroupCollection(tp=tp, cp=None)
    changed = base.evolve(ep=ep, cp=UNSET, tp=None)
    assert changed.get("ep") is ep and changed.get("tp") is None and not changed.is_set("cp")
    assert base.get("tp") is tp and base.get("cp") is None and not base.is_set("ep")
    assert base.evolve() == base and base.evolve() is not base


def test_equality_compares_groups_by_identity() -> None:
    a, b = SizeRankGroup(2), SizeRankGroup(2)
    assert ProcessGroupCollection(tp=a, cp=None) == ProcessGroupCollection(tp=a, cp=None)
    assert hash(ProcessGroupCollection(tp=a, cp=None)) == hash(ProcessGroupCollection(tp=a, cp=None))
    assert ProcessGroupCollection(tp=a) != ProcessGroupCollection(tp=b)  # same size, different communicator
    assert ProcessGroupCollection(cp=None) != ProcessGroupCollection()  # off is not unset
    assert ProcessGroupCollection(hcp=[a, b]) == ProcessGroupCollection(hcp=[a, b])
    assert ProcessGroupCollection(hcp=[a, b]) != ProcessGroupCollection(hcp=[b, a])
    assert ProcessGroupCollection() != "not a collection"


def test_repr_names_set_fields_with_their_sizes() -> None:
    collection = ProcessGroupCollection(
        tp=SizeRankGroup(4), ep=SizeRankGroup(2), cp=None, hcp=[SizeRankGroup(2), SizeRankGroup(4)]
    )
    assert repr(collection) == "ProcessGroupCollection(tp(4), cp(off), ep(2), hcp([2, 4]))"


def test_collection_is_frozen() -> None:
    collection = ProcessGroupCollection(tp=None)
    with pytest.raises(AttributeError, match=r"ProcessGroupCollection is frozen; use evolve\(tp=...\)"):
        collection.tp = SizeRankGroup(2)  # type: ignore[assignment]
    with pytest.raises(AttributeError):
        collection.not_a_field = None  # type: ignore[attr-defined]
    assert collection.get("tp") is None


def test_group_size_and_rank_read_none_as_axis_off() -> None:
    assert group_size(None) == 1 and group_rank(None) == 0
    group: Any = SizeRankGroup(8, rank=3)
    assert group_size(group) == 8 and group_rank(group) == 3
    for helper in (group_size, group_rank):
        with pytest.raises(ValueError, match="UNSET is not a process group: the field was never given"):
            helper(UNSET)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="not a member of the group it asked about"):
            helper(NOT_MEMBER)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="not a member of the group it asked about"):
        group_rank(SizeRankGroup(2, rank=-1))  # type: ignore[arg-type]


def _real_groups() -> tuple[str, list[int], list[int], list[bool]]:
    rank = dist.get_rank()
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    pair = pairs[rank // 2]
    collection = ProcessGroupCollection(tp=dist.group.WORLD, ep=pair, cp=None)
    outsider = pairs[1 - rank // 2]
    refused = []  # a non-member's handle (torch's NON_GROUP_MEMBER) has no size or rank: a clear ValueError
    for helper in (group_rank, group_size):
        try:
            helper(outsider)
        except ValueError as exc:
            refused.append("NON_GROUP_MEMBER" in str(exc))
    # A real all-reduce over the collection's ep group reaches exactly the pair.
    total = torch.tensor([1 << rank])
    dist.all_reduce(total, group=collection.get("ep"))
    sizes = [group_size(collection.get(n)) for n in ("tp", "ep", "cp")]
    ranks = [group_rank(collection.get(n)) for n in ("tp", "ep", "cp")] + [int(total.item())]
    return repr(collection), sizes, ranks, refused


def test_collection_of_real_gloo_groups() -> None:
    results = run_world(4, _real_groups)
    for rank, (text, sizes, ranks, refused) in enumerate(results):
        assert text == "ProcessGroupCollection(tp(4), cp(off), ep(2))"
        assert sizes == [4, 2, 1]
        pair = (rank // 2) * 2
        assert ranks == [rank, rank % 2, 0, (1 << pair) | (1 << (pair + 1))]
        assert refused == [True, True]

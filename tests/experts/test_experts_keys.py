"""Expert key renaming between local and global indices: REFERENCE examples, errors, properties (hypothesis)."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Callable

import attrs
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pgregistry
from pgregistry.experts import (
    expert_owner,
    global_expert_index,
    globalize_expert_keys,
    is_expert_key,
    localize_expert_keys,
)


def test_reference_examples() -> None:
    # 8 experts over 4 EP ranks: 2 per rank (one key of them each: partial state dicts, renamed on purpose).
    def renamed(key: str, ep_rank: int) -> list[str]:
        return list(globalize_expert_keys({key: 1}, 8, ep_rank, 4, strict=False))

    assert renamed("decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight", 1) == [
        "decoder.layers.0.mlp.experts.local_experts.2.linear_fc1.weight"
    ]
    assert renamed("decoder.layers.0.mlp.experts.linear_fc1.weight1_w", 1) == [
        "decoder.layers.0.mlp.experts.linear_fc1.weight3_w"
    ]
    assert renamed("decoder.layers.0.mlp.experts.linear_fc2.weight0", 3) == [
        "decoder.layers.0.mlp.experts.linear_fc2.weight6"
    ]
    keys = {"a.mlp.experts.local_experts.1.w": 0, "a.mlp.experts.linear_fc1.weight1_v": 1}
    assert globalize_expert_keys(keys, 8, 0, 4, strict=False) == keys  # rank 0 unchanged


def test_grouped_bias_is_renamed_and_order_is_kept() -> None:
    state = {
        "embedding.weight": 0,
        "layers.1.mlp.experts.linear_fc1.bias1": 1,
        "layers.1.mlp.router.weight": 2,
        "layers.1.mlp.experts.local_experts.0.linear_fc2.bias": 3,
        "layers.1.mlp.experts.linear_fc1._extra_state": 4,
        "final_norm.weight": 5,
    }
    out = globalize_expert_keys(state, 6, 2, 3, strict=False)
    assert list(out) == [
        "embedding.weight",
        "layers.1.mlp.experts.linear_fc1.bias5",
        "layers.1.mlp.router.weight",
        "layers.1.mlp.experts.local_experts.4.linear_fc2.bias",
        "layers.1.mlp.experts.linear_fc1._extra_state",
        "final_norm.weight",
    ]
    assert list(out.values()) == list(range(6))
    assert localize_expert_keys(out, 6, 2, 3, strict=False) == state


@pytest.mark.parametrize(
    "key",
    [
        "layers.0.mlp.router.weight",
        "layers.0.mlp.shared_experts.linear_fc1.weight",
        "layers.0.norm.weight1",  # numbered, but not under an "experts" module
        "layers.0.mlp.experts.linear_fc1.weight",
        "layers.0.mlp.experts.linear_fc1.weight1_x",
        "local_experts_count",
    ],
)
def test_non_expert_keys_never_change(key: str) -> None:
    assert not is_expert_key(key)
    assert list(globalize_expert_keys({key: 0}, 8, 3, 4)) == [key]
    assert list(globalize_expert_keys({key: 0}, None, 3, 4)) == [key]  # no experts: num_experts not needed


def test_missing_num_experts_raises_instead_of_dropping_keys() -> None:
    with pytest.raises(ValueError, match="names an expert but num_experts is not given"):
        globalize_expert_keys({"x.local_experts.0.w": 1}, None, 0, 1)
    with pytest.raises(ValueError, match="names an expert but num_experts is not given"):
        localize_expert_keys({"x.experts.fc.weight0": 1}, None, 0, 1)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: globalize_expert_keys({"x.local_experts.2.w": 1}, 8, 0, 4), "local expert index 2 is out of range"),
        (lambda: globalize_expert_keys({"x.local_experts.0.w": 1}, 8, 0, 3), "ep_size 3 does not divide"),
        (lambda: globalize_expert_keys({"x.local_experts.0.w": 1}, 8, 4, 4), "ep_rank 4 is not a rank"),
        (lambda: globalize_expert_keys({"x.local_experts.0.w": 1}, 0, 0, 1), "num_experts must be a positive"),
        (lambda: localize_expert_keys({"x.experts.fc.bias8": 1}, 8, 0, 4), "global expert index 8 is out of range"),
        (lambda: localize_expert_keys({"x.experts.fc.bias3": 1}, 8, 0, 4), "held by EP rank 1, not 0"),
        (lambda: globalize_expert_keys({"x.local_experts.01.w": 1}, 8, 0, 4), "not in canonical form"),
        (lambda: localize_expert_keys({}, 8, 0, 4, foreign="drop"), "foreign must be"),  # type: ignore[arg-type]
        (lambda: global_expert_index(0, 8, 0, 0), "ep_rank 0 is not a rank"),
        (lambda: expert_owner(-1, 8, 2), "out of range"),
    ],
)
def test_inconsistent_input_raises(call: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call()  # type: ignore[operator]


def test_foreign_keys_can_be_skipped_to_pick_this_ranks_experts() -> None:
    whole = {f"m.experts.fc.weight{e}": e for e in range(8)} | {"m.router.weight": -1}
    mine = localize_expert_keys(whole, 8, 2, 4, foreign="skip")
    assert mine == {"m.experts.fc.weight0": 4, "m.experts.fc.weight1": 5, "m.router.weight": -1}


def test_a_num_experts_other_than_the_state_dicts_is_refused_naming_the_keys() -> None:
    # 8 experts over EP 2: rank 1 holds local experts 0-3, global 4-7. Given 16, its experts used to be renamed
    # 8-11 (and a whole-model dict of 8 split as if rank 1 held none) without a word.
    local = {f"layers.0.mlp.experts.local_experts.{i}.linear_fc1.weight": i for i in range(4)} | {"norm.weight": -1}
    assert list(globalize_expert_keys(local, 8, 1, 2))[:4] == [
        f"layers.0.mlp.experts.local_experts.{i}.linear_fc1.weight" for i in range(4, 8)
    ]
    with pytest.raises(ValueError, match=r"expert keys 'layers\.0\.mlp\.experts\.local_experts\.<i>\.linear_fc1\."
                       r"weight' hold experts 0-3, but 16 experts over 2 EP ranks leave 8 local ones per rank \(0-7\): "
                       r"is num_experts the model's\? Pass strict=False"):
        globalize_expert_keys(local, 16, 1, 2)
    whole = {f"m.experts.fc.weight{e}": e for e in range(8)}
    with pytest.raises(ValueError, match=r"'m\.experts\.fc\.weight<i>' hold experts 0-7, but a whole-model state dict "
                       r"of 16 experts \(0-15\)"):
        localize_expert_keys(whole, 16, 0, 2, foreign="skip")
    mine = {f"m.experts.fc.weight{e}": e for e in range(4)}  # rank 0's experts of 8
    with pytest.raises(ValueError, match=r"hold experts 0-3, but EP rank 0 of 2 holds experts 0-7 of 16 \(0-7\)"):
        localize_expert_keys(mine, 16, 0, 2)
    assert localize_expert_keys(mine, 16, 0, 2, strict=False) == mine  # a partial dict, on purpose


def test_package_root_exports_stay_torch_free() -> None:
    assert pgregistry.globalize_expert_keys is globalize_expert_keys
    assert pgregistry.localize_expert_keys is localize_expert_keys
    code = (
        "import sys, pgregistry; pgregistry.globalize_expert_keys; pgregistry.localize_expert_keys; "
        "pgregistry.get_ep_rank_and_size; assert 'torch' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# --------------------------------------------------------------------------------------------------- properties

_PREFIX = st.sampled_from(["", "decoder.", "module.decoder."])


@attrs.frozen
class _Layout:
    """An EP layout and one rank's local state dict (the same on every rank): keys from ``templates`` over two
    layers and ``num_experts // ep_size`` local experts, each valued by its position."""

    ep_size: int
    num_experts: int
    templates: list[str]
    local: dict[str, int]


@st.composite
def _layouts(draw: st.DrawFn) -> _Layout:
    ep_size = draw(st.integers(1, 16))
    num_local = draw(st.integers(1, 8))
    templates = draw(
        st.lists(
            st.sampled_from(
                [
                    "layers.{L}.mlp.experts.local_experts.{i}.linear_fc1.weight",
                    "layers.{L}.mlp.experts.local_experts.{i}.linear_fc2.bias",
                    "layers.{L}.mlp.experts.linear_fc1.weight{i}",
                    "layers.{L}.mlp.experts.linear_fc1.weight{i}_w",
                    "layers.{L}.mlp.experts.linear_fc1.weight{i}_v",
                    "layers.{L}.mlp.experts.linear_fc2.bias{i}",
                    "layers.{L}.mlp.router.weight",
                    "layers.{L}.norm.weight",
                ]
            ),
            min_size=1,
            max_size=5,
            unique=True,
        )
    )
    prefix = draw(_PREFIX)
    templates = [prefix + t for t in templates]
    return _Layout(ep_size, ep_size * num_local, templates, _local_state(templates, num_local))


def _local_state(templates: list[str], num_local: int) -> dict[str, int]:
    state: dict[str, int] = {}
    for layer in range(2):
        for template in templates:
            for i in range(num_local if "{i}" in template else 1):
                state[template.format(L=layer, i=i)] = len(state)
    return state


@settings(max_examples=150, deadline=None)
@given(_layouts())
def test_local_global_local_is_the_identity(case: _Layout) -> None:
    ep_size, num_experts, local = case.ep_size, case.num_experts, case.local
    for ep_rank in range(ep_size):
        global_state = globalize_expert_keys(local, num_experts, ep_rank, ep_size)
        assert list(global_state.values()) == list(local.values())  # order and values kept
        back = localize_expert_keys(global_state, num_experts, ep_rank, ep_size)
        assert list(back.items()) == list(local.items())


@settings(max_examples=150, deadline=None)
@given(_layouts())
def test_global_indices_of_all_ranks_are_exactly_every_expert(case: _Layout) -> None:
    ep_size, num_experts, local = case.ep_size, case.num_experts, case.local
    expert_templates = [t for t in case.templates if "{i}" in t]
    seen: list[str] = []
    for ep_rank in range(ep_size):
        seen.extend(k for k in globalize_expert_keys(local, num_experts, ep_rank, ep_size) if is_expert_key(k))
    expected = [t.format(L=layer, i=e) for layer in range(2) for t in expert_templates for e in range(num_experts)]
    assert sorted(seen) == sorted(expected)  # every global expert once, none twice, none lost
    assert len(seen) == len(set(seen))
    # And the whole-model dict splits back into each rank's local one.
    whole: dict[str, int] = {}
    for ep_rank in range(ep_size):
        whole |= globalize_expert_keys(local, num_experts, ep_rank, ep_size)
    for ep_rank in range(ep_size):
        mine = localize_expert_keys(whole, num_experts, ep_rank, ep_size, foreign="skip")
        assert mine == local


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 64), st.integers(1, 64))
def test_index_arithmetic(num_experts: int, ep_size: int) -> None:
    if num_experts % ep_size:
        with pytest.raises(ValueError, match="does not divide"):
            global_expert_index(0, num_experts, 0, ep_size)
        return
    indices = [
        global_expert_index(i, num_experts, r, ep_size) for r in range(ep_size) for i in range(num_experts // ep_size)
    ]
    assert indices == list(range(num_experts))
    assert [expert_owner(g, num_experts, ep_size) for g in indices] == [
        (r, i) for r in range(ep_size) for i in range(num_experts // ep_size)
    ]


@pytest.mark.parametrize(
    ("call", "message"),
    [
        # ep_size 0 divided by zero; -2 answered (0, 0) for expert 0 of 8 and (-1, ...) for others; True read as 1
        (lambda: expert_owner(0, 8, 0), "ep_size must be a positive integer, got 0"),
        (lambda: expert_owner(5, 8, -2), "ep_size must be a positive integer, got -2"),
        (lambda: expert_owner(5, 8, True), "ep_size must be a positive integer, got True"),
        (lambda: expert_owner(5, 8, 2.0), "ep_size must be a positive integer, got 2.0"),
        # an index of no int type: 3.0 answered (0.0, 3.0), True read as expert 1, '0' failed in a comparison
        (lambda: expert_owner(3.0, 8, 2), "global_index must be an integer, got 3.0"),
        (lambda: expert_owner(True, 8, 2), "global_index must be an integer, got True"),
        (lambda: global_expert_index(1.0, 8, 0, 2), "local_index must be an integer, got 1.0"),
        (lambda: global_expert_index(True, 8, 0, 2), "local_index must be an integer, got True"),
        (lambda: global_expert_index("0", 8, 0, 2), "local_index must be an integer, got '0'"),
        (lambda: global_expert_index(None, 8, 0, 2), "local_index must be an integer, got None"),
    ],
)
def test_a_size_or_index_of_no_plain_integer_is_refused_naming_it(call: Callable[[], object], message: str) -> None:
    """Found by a hostile-input audit: ``expert_owner`` took any ``ep_size`` and index, answering wrong owners."""
    with pytest.raises(ValueError, match=re.escape(message)):
        call()
    assert expert_owner(5, 8, 2) == (1, 1)
    assert global_expert_index(1, 8, 1, 2) == 5


def test_a_key_that_is_no_str_or_a_state_dict_that_is_no_mapping_is_named() -> None:
    """``is_expert_key(None)`` and a state dict with an int key raised ``AttributeError: ... has no attribute
    'split'``; a list of keys given as the state dict ``'list' object has no attribute 'items'``."""
    key = "decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight"
    with pytest.raises(TypeError, match=re.escape("a state-dict key must be a str, got None (NoneType)")):
        is_expert_key(None)  # type: ignore[arg-type]
    for rename in (globalize_expert_keys, localize_expert_keys):
        with pytest.raises(TypeError, match=re.escape("a state-dict key must be a str, got 1 (int)")):
            rename({key: 0, 1: 1}, 2, 0, 2)  # type: ignore[dict-item]
        with pytest.raises(TypeError, match=re.escape("state_dict must be a mapping of key -> value (a state dict), "
                                                      "got list")):
            rename([key], 2, 0, 2)  # type: ignore[arg-type]


@pytest.mark.parametrize("strict", [None, 0, "no"], ids=repr)
def test_a_strict_that_is_no_bool_is_refused_not_read_by_its_truth(strict: object) -> None:
    """``strict=None`` (or 0) renamed a partial state dict as ``strict=False`` does: 16 experts given for a model of
    8 named rank 1's experts 8-11 instead of 4-7, without a word; ``"no"`` was read as true."""
    local = {f"layers.0.mlp.experts.local_experts.{i}.linear_fc1.weight": i for i in range(4)}
    for call in (lambda: globalize_expert_keys(local, 16, 1, 2, strict=strict),  # type: ignore[arg-type]
                 lambda: localize_expert_keys(local, 16, 0, 2, strict=strict)):  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=re.escape(f"strict must be True or False, got {strict!r}")):
            call()


def test_numpy_integers_are_taken_as_their_values() -> None:
    """Sizes and indices read from a NumPy array were refused: "local_index must be an integer, got np.int64(1)"."""
    assert global_expert_index(np.int64(1), np.int64(8), np.int32(2), np.int64(4)) == 5
    assert type(global_expert_index(np.int64(1), 8, 2, 4)) is int
    assert expert_owner(np.int64(5), np.int64(8), np.int64(4)) == (2, 1)
    local = {"local_experts.0.w": "a", "local_experts.1.w": "b"}
    assert globalize_expert_keys(local, np.int64(8), np.int64(1), np.int64(4)) == {
        "local_experts.2.w": "a", "local_experts.3.w": "b"}
    assert localize_expert_keys({"local_experts.2.w": "a", "local_experts.3.w": "b"}, np.int64(8), np.int64(1),
                                np.int64(4)) == local

"""EP rank and size from collections and models, and global unique parameter names.

Oracle for names: the toy model built whole (EP 1, PP 1, one chunk) has, by construction, the global names; every
sharded build must name each of its parameters as the whole model names the parameter with the same coordinates.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pytest
import torch
from fixtures.groups import SizeRankGroup
from torch import nn
from toy_moe import NUM_EXPERTS, NUM_LAYERS, ToyMoE, build_stage, names_by_key

from pgregistry import ProcessGroupCollection, ProcessGroupFallbackWarning, attach, collection_of
from pgregistry.experts import (
    get_ep_rank_and_size,
    get_global_unique_param_name,
    global_param_name_fn,
    named_global_parameters,
)
from pgregistry.global_grid import initialize_global_grid
from pgregistry.layout import ParallelLayout
from pgregistry.registry import build
from pgregistry.testing import run_world


def ep_collection(ep_rank: int, ep_size: int) -> ProcessGroupCollection:
    """A collection of a rank ``ep_rank`` of ``ep_size`` (a stand-in group: these tests run no collective)."""
    ep = SizeRankGroup(ep_size, ep_rank) if ep_size > 1 else None
    return ProcessGroupCollection(ep=ep, pp=None)  # type: ignore[arg-type]


def _whole_names() -> dict[tuple[int, int, str], str]:
    return names_by_key(build_stage(0, 1, 0, 1))


def test_ep_rank_and_size_from_a_collection() -> None:
    # No collection is never "EP off": without a global grid it is an error (tests/core/test_resolver.py has the
    # global-grid case).
    with pytest.raises(RuntimeError, match="get_ep_rank_and_size was not given a ProcessGroupCollection"):
        get_ep_rank_and_size(None)
    assert get_ep_rank_and_size(ProcessGroupCollection(ep=None)) == (0, 1)
    assert get_ep_rank_and_size(ProcessGroupCollection(ep=SizeRankGroup(4, 2))) == (2, 4)  # type: ignore[arg-type]
    with pytest.warns(ProcessGroupFallbackWarning, match="get_ep_rank_and_size was not given process group 'ep'"):
        with pytest.raises(RuntimeError, match="no global grid is initialised"):
            get_ep_rank_and_size(ProcessGroupCollection())


@pytest.mark.parametrize(("ep_size", "pp_size"), [(1, 1), (2, 1), (4, 2), (8, 4), (2, 2)])
def test_every_layout_names_parameters_as_the_whole_model_does(ep_size: int, pp_size: int) -> None:
    expected = _whole_names()
    seen: list[str] = []
    for pp_rank in range(pp_size):
        for ep_rank in range(ep_size):
            stage = build_stage(ep_rank, ep_size, pp_rank, pp_size)
            ep = ep_collection(ep_rank, ep_size)
            named = dict((id(p), n) for n, p in named_global_parameters(stage, pg_collection=ep))
            for param, key in stage.catalog:
                name = get_global_unique_param_name([stage], param, pg_collection=ep)
                assert name == named[id(param)] == expected[key]
                if key[1] >= 0 or ep_rank == 0:  # dense parameters are replicated over EP ranks
                    seen.append(name)
    assert sorted(seen) == sorted(expected.values())  # every parameter once, nothing lost


def test_standard_grid_names_are_unchanged() -> None:
    model = build_stage(0, 1, 0, 1, set_layer_offset=False)
    attach(model, ProcessGroupCollection(ep=None, pp=None))
    for name, param in model.named_parameters():
        assert get_global_unique_param_name(model, param) == name


def test_virtual_chunks_use_their_offsets() -> None:
    chunks = [
        ToyMoE(ep_rank=1, ep_size=2, first_layer=f, num_layers=1, is_first=f == 0, is_last=f == 3,
               set_layer_offset=False)
        for f in (0, 2)
    ]
    expected = _whole_names()
    for chunk in chunks:
        for param, key in chunk.catalog:
            name = get_global_unique_param_name(chunks, param, pg_collection=ep_collection(1, 2), layer_offsets=[0, 2])
            assert name == expected[key]
    with pytest.raises(ValueError, match="no first global layer index"):
        get_global_unique_param_name(chunks, chunks[1].catalog[0][0], pg_collection=ep_collection(1, 2))
    with pytest.raises(ValueError, match="layer_offsets has 1 entries for 2 model chunks"):
        get_global_unique_param_name(
            chunks, chunks[1].catalog[0][0], pg_collection=ep_collection(1, 2), layer_offsets=[0]
        )


def test_layer_offsets_given_as_numpy_integers_are_taken_as_their_values() -> None:
    """``layer_offsets=[np.int64(0), np.int64(2)]`` (or a chunk's ``layer_offset``) was refused: "layer offset of
    model chunk 0 must be a non-negative integer: np.int64(0)"."""
    chunks = [
        ToyMoE(ep_rank=1, ep_size=2, first_layer=f, num_layers=1, is_first=f == 0, is_last=f == 3,
               set_layer_offset=False)
        for f in (0, 2)
    ]
    expected = _whole_names()
    for offsets in ([np.int64(0), np.int64(2)], None):
        if offsets is None:  # each chunk's own
            chunks[0].layer_offset, chunks[1].layer_offset = np.int64(0), np.int64(2)  # type: ignore[assignment]
        for chunk in chunks:
            for param, key in chunk.catalog:
                name = get_global_unique_param_name(
                    chunks, param, pg_collection=ep_collection(1, 2), layer_offsets=offsets  # type: ignore[arg-type]
                )
                assert name == expected[key]


def test_pipeline_without_offsets_is_an_error() -> None:
    stage = build_stage(0, 1, 1, 2, set_layer_offset=False)
    attach(stage, ProcessGroupCollection(ep=None, pp=SizeRankGroup(2, 1)))  # type: ignore[arg-type]
    param = stage.layers[0].norm.weight
    with pytest.raises(ValueError, match="set chunk.layer_offset on each chunk, or pass layer_offsets"):
        get_global_unique_param_name(stage, param)
    assert get_global_unique_param_name(stage, param, layer_offsets=[2]) == "layers.2.norm.weight"
    assert get_global_unique_param_name(stage, stage.final_norm.weight) == "final_norm.weight"  # no layer number


def test_unknown_parameter_and_unknown_expert_count_are_errors() -> None:
    stage = build_stage(0, 2, 0, 1)
    with pytest.raises(ValueError, match=r"parameter of shape \(3,\) is not held by any of the 1 model chunks"):
        get_global_unique_param_name(stage, nn.Parameter(torch.zeros(3)))
    stage.num_experts = None  # type: ignore[assignment]
    expert_weight = stage.layers[0].mlp.experts.local_experts[0].linear_fc1.weight
    with pytest.raises(ValueError, match="the number of experts is unknown"):
        get_global_unique_param_name(stage, expert_weight, pg_collection=ep_collection(0, 2))
    ep = ep_collection(1, 2)
    assert get_global_unique_param_name(stage, expert_weight, pg_collection=ep, num_experts=NUM_EXPERTS) == (
        "layers.0.mlp.experts.local_experts.4.linear_fc1.weight"
    )
    with pytest.raises(TypeError, match=r"unexpected keyword argument\(s\) \['ep_rank'\]"):
        get_global_unique_param_name(stage, expert_weight, ep_rank=1)  # type: ignore[call-arg]


def test_config_num_moe_experts_and_wrappers_are_read() -> None:
    class Config:
        num_moe_experts = NUM_EXPERTS

    class Wrapper(nn.Module):
        def __init__(self, module: nn.Module) -> None:
            super().__init__()
            self.module = module

    stage = build_stage(1, 4, 0, 1)
    stage.num_experts = None  # type: ignore[assignment]
    stage.config = Config()
    wrapped = Wrapper(stage)
    attach(stage, ProcessGroupCollection(ep=SizeRankGroup(4, 1), pp=None))  # type: ignore[arg-type]
    assert get_ep_rank_and_size(collection_of(wrapped)) == (1, 4)
    weight = stage.layers[1].mlp.experts.linear_fc1.weight1_w
    assert get_global_unique_param_name([wrapped], weight) == "module.layers.1.mlp.experts.linear_fc1.weight3_w"


def _two_models() -> dict[str, Any]:
    wide = ParallelLayout(num_ranks=8, ep=4, expt_tp=1)
    narrow = ParallelLayout(num_ranks=8, ep=2, expt_tp=1)
    model_a, model_b = nn.Linear(1, 1), nn.Linear(1, 1)
    attach(model_a, build(wide, name="wide"))
    attach([model_b], build(narrow, name="narrow"))
    grid = initialize_global_grid(ParallelLayout(num_ranks=8, ep=8, expt_tp=1))
    return {
        "a": get_ep_rank_and_size(collection_of(model_a)),
        "b": get_ep_rank_and_size(collection_of([model_b])),
        "explicit": get_ep_rank_and_size(grid),
    }


def test_models_on_different_grids_get_their_own_ep_layout() -> None:
    for rank, out in enumerate(run_world(8, _two_models)):
        assert out["a"] == (ParallelLayout(num_ranks=8, ep=4, expt_tp=1).coords(rank)["ep"], 4)
        assert out["b"] == (ParallelLayout(num_ranks=8, ep=2, expt_tp=1).coords(rank)["ep"], 2)
        assert out["explicit"] == (rank, 8)


def test_chunks_with_different_collections_are_refused() -> None:
    a, b = nn.Linear(1, 1), nn.Linear(1, 1)
    attach(a, ProcessGroupCollection(ep=None))
    attach(b, ProcessGroupCollection(ep=SizeRankGroup(2, 0)))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="different process-group collections"):
        collection_of([a, b])


def test_global_names_are_unique_across_every_rank_of_a_pipeline() -> None:
    names = set()
    total = 0
    for pp_rank in range(2):
        for ep_rank in range(4):
            stage = build_stage(ep_rank, 4, pp_rank, 2)
            named = named_global_parameters(stage, pg_collection=ep_collection(ep_rank, 4))
            total += sum(1 for n, _ in named if ".experts." in n)
            names.update(n for n, _ in named if ".experts." in n)
    assert total == len(names) > 0
    assert {int(n.split(".")[1]) for n in names} == set(range(NUM_LAYERS))


class _StageWithMTP(nn.Module):
    """A last pipeline stage: decoder layers from ``layer_offset`` on, and a multi-token-prediction block."""

    def __init__(self, layer_offset: int, num_layers: int) -> None:
        super().__init__()
        self.layer_offset = layer_offset
        self.layers = nn.ModuleList(nn.Linear(2, 2, bias=False) for _ in range(num_layers))
        self.mtp = nn.Module()
        self.mtp.layers = nn.ModuleList([nn.Linear(2, 2, bias=False)])


def test_mtp_names_do_not_depend_on_the_pipeline_layout() -> None:
    # Saved at PP 2 (the last stage holds decoder layers 2-3 and the MTP block), reloaded at PP 1.
    at_pp2 = [name for name, _ in named_global_parameters(_StageWithMTP(2, 2), pg_collection=ep_collection(0, 1))]
    at_pp1 = [name for name, _ in named_global_parameters(_StageWithMTP(0, 4), pg_collection=ep_collection(0, 1))]
    assert at_pp2 == ["layers.2.weight", "layers.3.weight", "mtp.layers.0.weight"]
    assert at_pp1[-1] == "mtp.layers.0.weight" and set(at_pp2) <= set(at_pp1)


@pytest.mark.parametrize("count", [NUM_EXPERTS + 0.5, NUM_EXPERTS - 0.5, True, "8"])
def test_a_chunks_num_experts_of_no_integer_is_refused_not_truncated(count: object) -> None:
    """A chunk's ``num_experts`` (or ``config.num_moe_experts``) went through ``int()``: 8.5 named the experts as 8
    did, without an error, 7.5 was reported as "num_experts is 7", ``True`` was 1 expert, ``'8'`` was 8."""
    stage = build_stage(0, 1, 0, 1)
    stage.num_experts = count  # type: ignore[assignment]
    expert_weight = stage.layers[0].mlp.experts.local_experts[0].linear_fc1.weight
    with pytest.raises(ValueError, match=rf"num_experts of model chunk 0 must be a positive integer, got {count!r} "
                                         r"\(its num_experts or config.num_moe_experts\): set it, or pass num_experts"):
        get_global_unique_param_name(stage, expert_weight, pg_collection=ep_collection(0, 1))
    stage.num_experts = NUM_EXPERTS
    assert get_global_unique_param_name(stage, expert_weight, pg_collection=ep_collection(0, 1)) == (
        "layers.0.mlp.experts.local_experts.0.linear_fc1.weight"
    )


@pytest.mark.parametrize("offsets", [5, iter([0]), "0"])
def test_layer_offsets_that_are_no_sequence_of_ints_are_named(offsets: object) -> None:
    """``layer_offsets=5`` raised ``TypeError: object of type 'int' has no len()``, a generator likewise."""
    stage = build_stage(0, 1, 0, 1)
    with pytest.raises(TypeError, match=rf"layer_offsets must be a sequence of ints, one per model chunk "
                                        rf"\(a list\), got {type(offsets).__name__}"):
        named_global_parameters(stage, pg_collection=ep_collection(0, 1), layer_offsets=offsets)  # type: ignore[arg-type]


@pytest.mark.parametrize("param", [None, "layers.0.norm.weight"])
def test_a_param_that_is_no_tensor_is_named(param: object) -> None:
    """``get_global_unique_param_name(model, None)`` raised ``AttributeError: ... has no attribute 'shape'``, and so
    did the function of ``global_param_name_fn``."""
    stage = build_stage(0, 1, 0, 1)
    message = rf"param must be a parameter of the model chunks, got {type(param).__name__}"
    with pytest.raises(TypeError, match=message):
        get_global_unique_param_name(stage, param, pg_collection=ep_collection(0, 1))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=message):
        global_param_name_fn(stage, pg_collection=ep_collection(0, 1))(param)  # type: ignore[arg-type]


@pytest.mark.parametrize("item", [5, None, torch.zeros(2)])
def test_model_chunks_with_an_item_that_is_no_module_name_its_position_and_type(item: object) -> None:
    """``named_global_parameters([model, 5])`` said ``param[0] is a ToyMoE``: the first chunk, which is fine, under a
    tensor's name. The item that is no module is named, by position and type."""
    stage = build_stage(0, 1, 0, 1)
    message = rf"model chunk 1 is {re.escape(repr(item))} \({type(item).__name__}\), not a module"
    with pytest.raises(TypeError, match=message) as raised:
        named_global_parameters([stage, item], pg_collection=ep_collection(0, 1))  # type: ignore[list-item]
    assert "param[0]" not in str(raised.value) and "ToyMoE" not in str(raised.value)


class _TwoLayers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(2, 2) for _ in range(2)])


def test_two_parameters_given_one_global_name_are_refused_naming_both() -> None:
    """Two virtual chunks given the same layer offset (``layer_offsets=[0, 0]``) named both chunks' layers
    ``layers.0...`` and ``layers.1...``: 8 parameters under 4 names, which an optimizer's state keyed by
    ``global_param_name_fn`` held one parameter under for both."""
    chunks = [_TwoLayers(), _TwoLayers()]
    message = re.escape("parameters 'layers.0.weight' of model chunk 0 and 'layers.0.weight' of model chunk 1 both "
                        "have the global name 'layers.0.weight': is each chunk's layer offset its first global layer")
    for name_all in (named_global_parameters, global_param_name_fn):
        with pytest.raises(ValueError, match=message):
            name_all(chunks, pg_collection=ep_collection(0, 1), layer_offsets=[0, 0])  # type: ignore[operator]
    names = [name for name, _ in named_global_parameters(chunks, pg_collection=ep_collection(0, 1),
                                                         layer_offsets=[0, 2])]
    assert names == [f"layers.{layer}.{kind}" for layer in range(4) for kind in ("weight", "bias")]


def test_one_experts_name_refuses_a_num_experts_its_chunk_does_not_hold() -> None:
    """EP rank 1 of 2 holds local experts 0-3 of 8; given ``num_experts=16``, ``get_global_unique_param_name`` named
    its local expert 0 as global expert 8 (4 is right), where ``named_global_parameters`` refused the same call."""
    stage = build_stage(1, 2, 0, 1)
    expert_weight = stage.layers[0].mlp.experts.local_experts[0].linear_fc1.weight
    ep = ep_collection(1, 2)
    with pytest.raises(ValueError, match=r"num_experts is 16, but model chunk 0 holds 4 local experts"):
        named_global_parameters(stage, pg_collection=ep, num_experts=2 * NUM_EXPERTS)
    with pytest.raises(ValueError, match=r"num_experts is 16, but model chunk 0 holds 4 local experts"):
        get_global_unique_param_name(stage, expert_weight, pg_collection=ep, num_experts=2 * NUM_EXPERTS)
    assert get_global_unique_param_name(stage, expert_weight, pg_collection=ep, num_experts=NUM_EXPERTS) == (
        "layers.0.mlp.experts.local_experts.4.linear_fc1.weight"
    )

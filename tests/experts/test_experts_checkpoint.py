"""Checkpoint helpers in one process: state by global name, optimizer state by name, refusals and bad files.

Multi-rank resharding is in test_experts_resharding.py.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from fixtures.groups import SizeRankGroup
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from toy_moe import NUM_EXPERTS, adam, build_stage, initialise

from pgregistry import ProcessGroupCollection, ProcessGroupFallbackWarning, attach
from pgregistry.checkpoint import (
    load_distributed,
    load_optimizer_state_by_name,
    load_rank_files,
    save_distributed,
    save_rank_files,
    state_by_name,
)
from pgregistry.checkpoint._optimizer_shards import cut_optimizer_shards, merge_optimizer_shards
from pgregistry.experts import (
    get_global_unique_param_name,
    global_param_name_fn,
    named_global_parameters,
)
from pgregistry.params import mark_tensor_parallel

_OFF: dict[str, Any] = dict(
    ep=None, dp_cp=None, expt_dp=None, tp=None, expt_tp=None, gtp_remat=None, expt_gtp_remat=None, pp=None
)


def _stage(ep_rank: int, ep_size: int, **groups: Any) -> nn.Module:
    model = build_stage(ep_rank, ep_size, 0, 1)
    ep = SizeRankGroup(ep_size, ep_rank) if ep_size > 1 else None
    attach(model, ProcessGroupCollection(**(_OFF | {"ep": ep} | groups)))
    return model


def _stepped(model: nn.Module) -> torch.optim.Adam:
    initialise(model)  # type: ignore[arg-type]
    optimizer = adam(list(model.parameters()))
    optimizer.step()
    return optimizer


def test_standard_grid_state_uses_the_local_names() -> None:
    model = _stage(0, 1)
    optimizer = _stepped(model)
    state = state_by_name(model, optimizer)
    assert list(state["model"]) == [n for n, _ in model.named_parameters()]
    assert list(state["optimizer"]) == list(state["model"])
    for name, param in model.named_parameters():
        assert state["model"][name] is not None and torch.equal(state["model"][name], param)
        assert set(state["optimizer"][name]) == {"step", "exp_avg", "exp_avg_sq"}


def test_optimizer_state_reloads_by_name_under_another_ep_layout() -> None:
    whole = _stage(0, 1)
    whole_state = state_by_name(whole, _stepped(whole))["optimizer"]
    for ep_rank in range(4):
        part = _stage(ep_rank, 4)
        params = list(part.parameters())
        optimizer = adam(params[::-1])  # another parameter order than the writer's
        # One process plays each EP rank in turn, with no world: the other ranks' experts are held by no rank here
        # (in a world, the strict check's union over the ranks holds them), so the subset is loaded on purpose.
        load_optimizer_state_by_name(optimizer, part, whole_state, strict=False)
        for name, param in named_global_parameters(part):  # the attached collection gives the EP rank
            for key, value in whole_state[name].items():
                assert torch.equal(optimizer.state[param][key], value)
                assert optimizer.state[param][key] is not value  # copied, not aliased


def test_gtp_remat_and_interleaved_tensor_parallel_shards_are_refused() -> None:
    """Whole TP shards are gathered (tests/modules/test_modules_checkpoint.py); GTP-remat and interleaved TP
    shards are not joined, so a model with them is refused, naming the axis or the parameter."""
    model = _stage(0, 1, gtp_remat=SizeRankGroup(2, 0))
    with pytest.raises(ValueError, match="the model's gtp_remat axis has more than one rank"):
        state_by_name(model)
    model = _stage(0, 1, tp=SizeRankGroup(2, 0))
    mark_tensor_parallel(next(model.parameters()), 0, stride=2)
    with pytest.raises(ValueError, match=r"parameter 'embedding\.weight' is TP-sharded with partition_stride 2"):
        state_by_name(model)


def test_only_primary_replicas_are_written(tmp_path: Path) -> None:
    model = _stage(0, 2, dp_cp=SizeRankGroup(2, 1), expt_dp=SizeRankGroup(2, 0))
    optimizer = _stepped(model)
    primary = state_by_name(model, optimizer, primary_only=True)
    assert primary["model"] and all(".experts." in n for n in primary["model"])  # dense: dp_cp rank 1 skips
    path = save_rank_files(tmp_path, model, optimizer)
    assert path.name == "rank-00000.pt"
    stored = torch.load(path, weights_only=True)["state"]
    assert sorted(k.split("/")[1] for k in stored if k.startswith("model/")) == sorted(primary["model"])


def test_round_trip_through_rank_files(tmp_path: Path) -> None:
    model = _stage(0, 1)
    optimizer = _stepped(model)
    save_rank_files(tmp_path, model, optimizer)
    fresh = _stage(0, 1)
    fresh_optimizer = adam(list(fresh.parameters()))
    load_rank_files(tmp_path, fresh, fresh_optimizer)
    for (name, a), (_, b) in zip(model.named_parameters(), fresh.named_parameters(), strict=True):
        assert torch.equal(a, b), name
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(optimizer.state[a][key], fresh_optimizer.state[b][key])


def test_bad_checkpoint_directories_are_refused(tmp_path: Path) -> None:
    model = _stage(0, 1)
    save_rank_files(tmp_path / "ok", model)
    with pytest.raises(ValueError, match="no rank-<rank>.pt files"):
        load_rank_files(tmp_path / "ok" / "..", model)
    # A stale file from a save with another world size.
    stale = torch.load(tmp_path / "ok" / "rank-00000.pt", weights_only=True)
    torch.save(stale | {"rank": 1, "world_size": 2}, tmp_path / "ok" / "rank-00001.pt")
    with pytest.raises(ValueError, match="does not hold exactly one checkpoint"):
        load_rank_files(tmp_path / "ok", model)
    # Two ranks that both stored one tensor.
    torch.save(stale | {"world_size": 2}, tmp_path / "ok" / "rank-00000.pt")
    with pytest.raises(ValueError, match="is stored more than once"):
        load_rank_files(tmp_path / "ok", model)
    # A parameter the checkpoint lacks, and one of another shape.
    off = ProcessGroupCollection(**_OFF)
    save_rank_files(tmp_path / "small", nn.Linear(2, 2, bias=False), pg_collection=off)
    with pytest.raises(ValueError, match="lacks 1 of this rank's parameters, e.g. 'bias'"):
        load_rank_files(tmp_path / "small", nn.Linear(2, 2), pg_collection=off)
    with pytest.raises(ValueError, match=r"has shape \(3, 2\) but the checkpoint holds \(2, 2\)"):
        load_rank_files(tmp_path / "small", nn.Linear(2, 3, bias=False), pg_collection=off)


def test_a_misspelt_naming_keyword_is_refused(tmp_path: Path) -> None:
    # The naming keywords reach these functions as **kwargs (NamingOptions): a misspelt one must raise, never be
    # ignored (a silently ignored layer_offset would name every layer as if PP were off).
    model = _stage(0, 1)
    param = next(model.parameters())
    calls: list[Any] = [
        lambda: state_by_name(model, layer_offset=[0]),
        lambda: load_optimizer_state_by_name(adam([param]), model, {}, num_expert=4),
        lambda: save_rank_files(tmp_path, model, num_expert=4),
        lambda: load_rank_files(tmp_path, model, pg_colection=None),
        lambda: save_distributed(tmp_path, model, layer_offset=[0]),
        lambda: load_distributed(tmp_path, model, layer_offset=[0]),
        lambda: named_global_parameters(model, ep_rnk=0),
        lambda: get_global_unique_param_name(model, param, ep_rnk=0),
        lambda: global_param_name_fn(model, layer_offset=[0]),
    ]
    for call in calls:
        with pytest.raises(TypeError, match="unexpected keyword argument"):
            call()
    assert not any(tmp_path.iterdir())  # nothing was written


def test_optimizer_of_foreign_parameters_is_refused() -> None:
    model = _stage(0, 1)
    optimizer = adam([nn.Parameter(torch.zeros(2))])
    with pytest.raises(ValueError, match="the optimizer holds a parameter of shape"):
        state_by_name(model, optimizer)


def test_global_param_name_fn() -> None:
    model = build_stage(1, 4, 0, 1)
    ep = ProcessGroupCollection(ep=SizeRankGroup(4, 1), pp=None)  # type: ignore[arg-type]
    name_of = global_param_name_fn(model, pg_collection=ep, num_experts=NUM_EXPERTS)
    weight = model.layers[0].mlp.experts.local_experts[1].linear_fc1.weight
    assert name_of(weight) == "layers.0.mlp.experts.local_experts.3.linear_fc1.weight"
    with pytest.raises(ValueError, match="not held by any of the 1 model chunks"):
        name_of(torch.zeros(1))


def test_an_explicit_collection_is_read_for_the_pipeline_too() -> None:
    # An unattached single-chunk model without layer_offset: the collection passed in says PP is off; the global
    # grid (there is none here) must not be read.
    model = build_stage(0, 1, 0, 1, set_layer_offset=False)
    off = ProcessGroupCollection(**_OFF)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ProcessGroupFallbackWarning)
        state = state_by_name(model, pg_collection=off)
        assert list(state["model"]) == [n for n, _ in model.named_parameters()]
        assert [n for n, _ in named_global_parameters(model, pg_collection=off)] == list(state["model"])


# --------------------------------------------------------------------------------------------------- shards


def _whole_state(numel: int, seed: int) -> dict[str, Any]:
    generator = torch.Generator()
    generator.manual_seed(seed)
    return {
        "main": torch.randn(numel, generator=generator),
        "state": {
            "exp_avg": torch.randn(numel, generator=generator),
            "exp_avg_sq": torch.rand(numel, generator=generator),
            "step": torch.tensor(3.0),
        },
    }


def _pieces(name: str, whole: dict[str, Any], cuts: list[int]) -> list[dict[str, dict[str, Any]]]:
    """One shard dict per piece, as ranks of a sharded optimizer would save them."""
    bounds = [0, *cuts, whole["main"].numel()]
    out = []
    for start, stop in zip(bounds, bounds[1:], strict=False):
        state = {k: v[start:stop].clone() if v.dim() else v.clone() for k, v in whole["state"].items()}
        piece = {"offset": start, "numel": stop - start, "main": whole["main"][start:stop].clone(), "state": state}
        out.append({name: piece})
    return out


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 40), st.data())
def test_optimizer_shards_merge_and_cut_for_another_layout(numel: int, data: st.DataObject) -> None:
    cut_points = st.lists(st.integers(1, max(numel - 1, 1)), unique=True).map(sorted)
    saved_cuts = [c for c in data.draw(cut_points) if c < numel]
    new_cuts = [c for c in data.draw(cut_points) if c < numel]
    whole = {"a.experts.fc.weight3": _whole_state(numel, 1), "b.weight": _whole_state(numel + 1, 2)}
    saved = [p for name, w in whole.items() for p in _pieces(name, w, saved_cuts)]
    merged = merge_optimizer_shards(reversed(saved))  # the order of the ranks does not matter
    for name, w in whole.items():
        assert torch.equal(merged[name]["main"], w["main"])
        for key, value in w["state"].items():
            assert torch.equal(merged[name]["state"][key], value)
    for template in _pieces("a.experts.fc.weight3", whole["a.experts.fc.weight3"], new_cuts):
        cut = cut_optimizer_shards(merged, template)
        piece = template["a.experts.fc.weight3"]
        got = cut["a.experts.fc.weight3"]
        assert (got["offset"], got["numel"]) == (piece["offset"], piece["numel"])
        assert torch.equal(got["main"], piece["main"])
        for key, value in piece["state"].items():
            assert torch.equal(got["state"][key], value)


def test_bad_optimizer_shards_are_refused() -> None:
    whole = _whole_state(6, 0)
    a, b = _pieces("w", whole, [3])
    with pytest.raises(ValueError, match="leave a gap at element 0"):
        merge_optimizer_shards([b])
    with pytest.raises(ValueError, match="overlap at element 3"):
        merge_optimizer_shards([a, b, b])
    b["w"]["state"]["step"] = torch.tensor(4.0)
    with pytest.raises(ValueError, match="disagree on the per-parameter state 'step'"):
        merge_optimizer_shards([a, b])
    del b["w"]["state"]["step"]
    with pytest.raises(ValueError, match="different optimizer state keys"):
        merge_optimizer_shards([a, b])
    merged = merge_optimizer_shards([a])
    with pytest.raises(ValueError, match="lacks parameter 'v'"):
        cut_optimizer_shards(merged, {"v": a["w"]})
    with pytest.raises(ValueError, match=r"piece \[3, 6\) exceeds the saved 3 elements"):
        cut_optimizer_shards(merged, b)


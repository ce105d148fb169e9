"""One meaning for an omitted collection, at every entry point's door (pgregistry._runtime.resolve), in gloo worlds.

Before, ``pg_collection=None`` meant four things: the global grid with a warning (grad statistics, RNG seeding),
the first chunk's attached collection without looking through wrappers (``build_optimizer``), the attached
collection through wrappers (expert names, checkpoints), and "EP off" (``get_ep_rank_and_size(None)`` returned
``(0, 1)`` on every rank of an EP 4 grid, so every rank's experts got the same global names). Now it is always:
explicit, else attached to the model (through ``.module`` wrappers, the same on every chunk), else the global grid
with a warning, else an error.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import pgregistry
from pgregistry import ParallelLayout, ProcessGroupFallbackWarning, registry
from pgregistry.experts import get_ep_rank_and_size, globalize_expert_keys
from pgregistry.global_grid import initialize_global_grid
from pgregistry.grad_stats import count_zeros, grad_norm
from pgregistry.optim import build_optimizer
from pgregistry.params import mark_expert, mark_expert_module
from pgregistry.testing import run_world


class Wrapper(nn.Module):
    """A DDP-like wrapper: the model is its ``module``."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module


def _model() -> nn.Module:
    model = nn.Module()
    model.dense = nn.Linear(4, 4, bias=False)
    model.experts = mark_expert_module(nn.Module())
    model.experts.w = mark_expert(nn.Parameter(torch.zeros(2, 4)))
    return model


def _outcome(call: Callable[[], object]) -> str:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            result = call()
        except (ValueError, RuntimeError) as exc:
            return f"{type(exc).__name__}: {exc}"
    warned = [str(w.message) for w in caught if issubclass(w.category, ProcessGroupFallbackWarning)]
    return f"{result!r}" + (f" warned: {warned}" if warned else "")


# ------------------------------------------------------------------------------------------------ EP rank

EXPERT_KEY = "layers.0.mlp.experts.local_experts.0.weight"


def _ep_on_a_global_ep4_grid() -> dict[str, Any]:
    out = {"no_grid": _outcome(lambda: get_ep_rank_and_size(None))}
    initialize_global_grid(ParallelLayout(num_ranks=4, ep=4, expt_tp=1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ep_rank, ep_size = get_ep_rank_and_size(None)
    out["ep"] = (ep_rank, ep_size)
    out["warned"] = [str(w.message) for w in caught if issubclass(w.category, ProcessGroupFallbackWarning)]
    out["key"] = next(iter(globalize_expert_keys({EXPERT_KEY: 0}, 4, ep_rank, ep_size)))
    return out


def test_no_collection_is_the_global_grid_with_a_warning_never_ep_off() -> None:
    results = run_world(4, _ep_on_a_global_ep4_grid)
    for rank, out in enumerate(results):
        assert out["no_grid"].startswith(
            "RuntimeError: get_ep_rank_and_size was not given a ProcessGroupCollection and no global grid"
        )
        assert out["ep"] == (rank, 4)  # EP rank = rank on this layout (ep is the fastest expert axis with etp 1)
        [warned] = out["warned"]
        assert warned.startswith("get_ep_rank_and_size was not given a ProcessGroupCollection")
    keys = [out["key"] for out in results]
    assert len(set(keys)) == 4  # one global name per rank's expert: nothing overwrites another in a checkpoint


# ------------------------------------------------------------------------------------------------ attached

GRADS = {0: [0.5, -1.5, 2.0, 0.25], 1: [3.0, 1.0, -0.5, 0.75]}
"""The dense weight's grad row on each rank: a replica per data-parallel rank on the model's grid."""


def _attached_wins() -> dict[str, Any]:
    rank = dist.get_rank()
    initialize_global_grid(ParallelLayout(num_ranks=2, tp=2))  # another grid: TP 2
    own = registry.build(ParallelLayout(num_ranks=2), name="own")  # the model's grid: DP 2, TP off
    model = _model()
    pgregistry.attach(model, own)
    model.dense.weight.grad = torch.tensor(GRADS[rank]).repeat(4, 1)
    model.experts.w.grad = torch.zeros(2, 4)
    out: dict[str, Any] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("error", ProcessGroupFallbackWarning)  # the attached collection is complete
        out["norm"] = float(grad_norm(Wrapper(model), None).item())
        out["zeros"] = count_zeros([Wrapper(model)], None)
        optimizer = build_optimizer(Wrapper(model), optimizer="sgd", lr=0.1)
        out["optimizer_on_own_grid"] = all(
            child.process_groups.dp_cp is own.dp_cp for child in optimizer.chained_optimizers
        )
        out["ep"] = get_ep_rank_and_size(pgregistry.collection_of(Wrapper(Wrapper(model))))
        # However the chunks come (a generator, a list, a tuple), the door finds the attached collection.
        out["generator"] = float(grad_norm(chunk for chunk in [Wrapper(model)]).item())
        out["tuple"] = count_zeros((model,))
    return out


def test_the_collection_attached_to_a_wrapped_model_is_used_by_every_entry_point() -> None:
    for rank, out in enumerate(run_world(2, _attached_wins)):
        oracle = math.sqrt(4 * sum(float(g) ** 2 for g in GRADS[rank]))  # the model's own grid: TP off
        assert out["norm"] == pytest.approx(oracle, rel=1e-6)
        assert out["zeros"] == 8  # the expert's zero grad; the dense grad has none
        assert out["optimizer_on_own_grid"]
        assert out["ep"] == (0, 1)  # the model's own grid has EP off; the global grid's is not read
        assert out["generator"] == pytest.approx(oracle, rel=1e-6)
        assert out["tuple"] == 8


# ------------------------------------------------------------------------------------------------ chunks disagree


def _chunks_disagree() -> dict[str, str]:
    first = registry.build(ParallelLayout(num_ranks=2, ep=2, expt_tp=1), name="first")
    second = registry.build(ParallelLayout(num_ranks=2), name="second")
    chunks = [_model(), Wrapper(_model())]
    pgregistry.attach(chunks[0], first)
    pgregistry.attach(chunks[1].module, second)
    for chunk in chunks:
        for param in chunk.parameters():
            param.grad = torch.ones_like(param)
    bare = [chunks[0], _model()]
    return {
        "grad_norm": _outcome(lambda: grad_norm(chunks, None)),
        "build_optimizer": _outcome(lambda: build_optimizer(chunks)),
        "ep": _outcome(lambda: get_ep_rank_and_size(pgregistry.collection_of(chunks))),
        "one_bare": _outcome(lambda: build_optimizer(bare)),
        "nothing": _outcome(lambda: grad_norm(_model(), None)),
    }


def test_chunks_with_different_collections_are_refused_naming_them() -> None:
    for out in run_world(2, _chunks_disagree):
        for entry in ("grad_norm", "build_optimizer", "ep"):
            assert out[entry].startswith(
                "ValueError: model chunks 0 and 1 carry different process-group collections (layout 'first' "
            ), (entry, out[entry])
        assert "and none attached)" in out["one_bare"]
        assert out["nothing"].startswith(
            "RuntimeError: grad_norm was not given a ProcessGroupCollection and the model has no collection attached"
        )


# ------------------------------------------------------------------------------------------------ misuse at the door


def _misuse() -> dict[str, str]:
    own = registry.build(ParallelLayout(num_ranks=2), name="own")
    other = registry.build(ParallelLayout(num_ranks=2, tp=2), name="other")
    model = _model()
    pgregistry.attach(model, own)
    for param in model.parameters():
        param.grad = torch.ones_like(param)
    out = {
        "disagree": _outcome(lambda: grad_norm(model, other)),
        "agree": _outcome(lambda: grad_norm(model, own)),
    }
    registry.destroy()
    out["destroyed"] = _outcome(lambda: grad_norm(model))
    out["destroyed_explicit"] = _outcome(lambda: get_ep_rank_and_size(own))
    return out


def test_an_explicit_collection_that_disagrees_with_the_attached_one_and_a_destroyed_one_are_refused() -> None:
    for out in run_world(2, _misuse):
        assert out["disagree"].startswith("ValueError: grad_norm was given layout 'other' ")
        assert "but the model carries layout 'own' " in out["disagree"]
        assert out["agree"].startswith("tensor(")
        assert out["destroyed"].startswith("ValueError: grad_norm was given layout 'own' ")
        assert "whose groups pgregistry.registry.destroy() destroyed" in out["destroyed"]
        assert "get_ep_rank_and_size was given layout 'own'" in out["destroyed_explicit"]


@pytest.mark.parametrize(
    ("owner", "call"),
    [
        ("build_optimizer", lambda given: build_optimizer(given, None)),
        ("named_global_parameters", lambda given: list(pgregistry.experts.named_global_parameters(given))),
        ("global_param_name_fn", pgregistry.experts.global_param_name_fn),
    ],
)
def test_entry_points_that_need_modules_refuse_tensors_naming_them(owner: str, call: Callable[[Any], Any]) -> None:
    """Parameters where a model belongs: a ``TypeError`` naming the entry point, before any collection is read."""
    with pytest.raises(TypeError, match=rf"^{owner} expects a model or model chunks, got list$"):
        call([nn.Parameter(torch.zeros(2))])

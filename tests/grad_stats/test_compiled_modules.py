"""``torch.compile`` beside pgregistry: a compiled model builds, its roles hold, and its grad norm is the oracle's.

pgregistry installs torch's module-registration hooks once both are imported (the roles must survive
``fully_shard``). The hook read an attribute of the module being built with ``getattr``; ``torch.compile``'s
``OptimizedModule`` registers its ``_orig_mod`` first, and its ``__getattr__`` then raised ``KeyError: '_orig_mod'``
from inside torch: no model could be compiled in a program that imported pgregistry.
"""

from __future__ import annotations

import math
import warnings

import torch
import torch.distributed as dist
from torch import nn

import pgregistry.params  # the registration hooks, as every program importing pgregistry and torch has them
from pgregistry import ParallelLayout, attach, build
from pgregistry.global_grid import initialize_global_grid
from pgregistry.grad_stats import grad_norm
from pgregistry.params import mark_expert, mark_expert_module, mark_tensor_parallel
from pgregistry.testing import run_world


def _filled_linear(value: float) -> nn.Linear:
    linear = nn.Linear(2, 2)
    with torch.no_grad():
        for param in linear.parameters():
            param.fill_(value)
    return linear


def _compiled_moe(ep_rank: int) -> nn.Module:
    """A compiled dense layer, and a marked expert module holding this EP rank's expert compiled after the mark."""
    model = nn.Module()
    model.dense = torch.compile(_filled_linear(0.5), backend="eager")
    model.experts = mark_expert_module(nn.Module())
    model.experts.local_experts = nn.ModuleList([torch.compile(_filled_linear(1.0 + ep_rank), backend="eager")])
    for param in model.experts.parameters():
        mark_expert(param)
    return model


def _norm_of_a_compiled_model() -> tuple[float, bool]:
    collection = build(ParallelLayout(num_ranks=2, ep=2))
    model = _compiled_moe(dist.get_rank())
    attach(model, collection)
    x = torch.tensor([[1.0, 2.0]])
    (model.dense(x).sum() + model.experts.local_experts[0](x).sum()).backward()
    marked = all(getattr(param, "in_expert_module", False) for param in model.experts.parameters())
    return float(grad_norm(model, collection)), marked


def test_a_compiled_model_builds_keeps_its_roles_and_gives_the_oracles_norm() -> None:
    assert pgregistry.params.is_expert_param(mark_expert(nn.Parameter(torch.zeros(1))))
    compiled = torch.compile(nn.Linear(2, 2), backend="eager")  # raised KeyError: '_orig_mod'
    assert compiled(torch.ones(1, 2)).shape == (1, 2)
    # The oracle: the same layers uncompiled in float64, by plain torch: a replica's dense grads (they are summed
    # over mp, one rank here) and every EP rank's expert once.
    squares = 0.0
    for layer in [_filled_linear(0.5)] + [_filled_linear(1.0 + ep_rank) for ep_rank in range(2)]:
        layer = layer.double()
        layer(torch.tensor([[1.0, 2.0]], dtype=torch.float64)).sum().backward()
        squares += sum(float((param.grad**2).sum()) for param in layer.parameters())
    oracle = math.sqrt(squares)
    for rank, (norm, marked) in enumerate(run_world(2, _norm_of_a_compiled_model, timeout=60.0)):
        assert marked, rank
        assert math.isclose(norm, oracle, rel_tol=1e-6), (rank, norm, oracle)


def _norms_of_a_model_attached_then_compiled() -> tuple[float, float, float, list[str]]:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    initialize_global_grid(ParallelLayout(num_ranks=2))  # the job's global grid: data parallel
    collection = build(ParallelLayout(num_ranks=2, tp=2), name="model")
    model = nn.Linear(2, 2, bias=False)
    mark_tensor_parallel(model.weight, 0)  # this rank's 2 rows of a (4, 2) weight
    attach(model, collection)
    model(torch.ones(1, 2)).sum().backward()
    compiled = torch.compile(model, backend="eager")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        norms = float(grad_norm(model)), float(grad_norm(compiled)), float(grad_norm(checkpoint_wrapper(model)))
    return (*norms, [str(warning.message) for warning in caught])


def test_a_model_attached_then_compiled_runs_on_its_collection_not_the_global_grid() -> None:
    """The collection is found along a wrapper chain of ``.module`` attributes; ``OptimizedModule`` (and
    activation checkpointing's ``checkpoint_wrapper``) answers ``.module`` from inside the model it wraps, so the
    chain stopped at it: a TP model attached and then compiled fell back to the global (data-parallel) grid,
    warning "nor a model with one attached", and its norm was this rank's shard's alone, 2.0 for the 2.83 of the
    whole weight."""
    whole = nn.Linear(2, 4, bias=False).double()  # the unsharded layer, by plain torch in float64
    whole(torch.ones(1, 2, dtype=torch.float64)).sum().backward()
    oracle = float(whole.weight.grad.norm())
    for rank, (*norms, caught) in enumerate(run_world(2, _norms_of_a_model_attached_then_compiled)):
        assert all(math.isclose(norm, oracle, rel_tol=1e-6) for norm in norms), (rank, norms, oracle)
        assert caught == [], (rank, caught)

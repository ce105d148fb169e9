"""Grad statistics over DTensor grads of dense models: FSDP2, TP through parallelize_module, FSDP2 + TP on a 2-D
mesh, HSDP; each against the float64 oracle of the unsharded model (norm, inf-norm, zero count, clipped grads).

Before DTensor support, TP through parallelize_module hung (rank 0 never returned: only TP rank 0 counted the
replicated grads, and the norm of a DTensor is itself a collective); FSDP2 grads raised from an all-reduce
issued on a DTensor. Every world here is bounded by the harness deadline.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from dtensor_support import MAX_NORM, backward, close, dense_model, error_of, full_grads, oracle
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Partial, Replicate, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from pgregistry import registry
from pgregistry.audit import audit_grad_replication
from pgregistry.grad_stats import clip_grad_norm_, count_zeros, grad_norm
from pgregistry.layout import ParallelLayout
from pgregistry.mesh import to_device_mesh, with_hsdp_groups
from pgregistry.params import mark_shared
from pgregistry.testing import run_world


def _scenario(model: nn.Module, expected: dict[str, Any], collection: Any) -> dict[str, Any]:
    backward(model)
    report = audit_grad_replication(model, collection)
    truth = close(report.true_norm, expected["norm"]) and close(report.classified_norm, report.true_norm)
    got = {
        "audit": report.ok and truth,
        "norm": float(grad_norm(model, collection)),
        "inf": float(grad_norm(model, collection, norm_type=float("inf"))),
        "zeros": count_zeros(model, collection),
        "clip_returned": float(clip_grad_norm_(model, MAX_NORM, collection)),
    }
    clipped = full_grads(model)
    return {
        "audit": got["audit"],
        "norm": close(got["norm"], expected["norm"]),
        "inf": close(got["inf"], expected["inf"]),
        "zeros": (got["zeros"], expected["zeros"]),
        "clip_returned": close(got["clip_returned"], expected["norm"]),
        "clipped": all(
            (clipped[name] - grad).abs().max().item() <= 1e-6 * max(1.0, grad.abs().max().item())
            for name, grad in expected["clipped"].items()
        ),
        "after_clip": close(float(grad_norm(model, collection)), MAX_NORM),
    }


def _tp_dp_world() -> dict[str, Any]:
    layout = ParallelLayout(num_ranks=4, tp=2)  # dp 2
    collection = registry.build(layout)
    mesh = to_device_mesh(collection, ("dp_cp", "tp"))
    out: dict[str, Any] = {}

    # FSDP2 over dp only: the grads are replicated across TP, which the mesh does not span (roles decide).
    model = dense_model()
    expected = oracle(model)
    fully_shard(model, mesh=mesh["dp_cp"])
    out["fsdp"] = _scenario(model, expected, collection)

    # TP through parallelize_module; dp ranks hold plain replicas. Mixed: the second bias stays a plain tensor.
    model = dense_model()
    expected = oracle(model)
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    out["tp"] = _scenario(model, expected, collection)

    # FSDP2 + TP on the 2-D mesh torchtitan uses.
    model = dense_model()
    expected = oracle(model)
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp_cp"])
    out["fsdp_tp"] = _scenario(model, expected, collection)

    # Mixed: only the first layer is sharded (DTensor grads); the second keeps plain grads.
    model = dense_model()
    expected = oracle(model)
    fully_shard(model[0], mesh=mesh["dp_cp"])
    out["mixed"] = _scenario(model, expected, collection)

    # Partial grads (each TP rank holds a part of the sum) over replicated DTensor parameters: reduced first.
    model = dense_model()
    expected = oracle(model)
    backward(model)
    share = 0.25 if mesh["tp"].get_local_rank() == 0 else 0.75
    partial = {}
    for name, param in model.named_parameters():
        partial[name] = nn.Parameter(distribute_tensor(param.detach(), mesh["tp"], [Replicate()]))
        partial[name].grad = DTensor.from_local(param.grad * share, mesh["tp"], [Partial()], run_check=False)
    got = (float(grad_norm(partial, collection)), count_zeros(partial, collection))
    clip_grad_norm_(partial, MAX_NORM, collection)
    clipped = {name: p.grad.full_tensor().double() for name, p in partial.items()}
    out["partial"] = (
        close(got[0], expected["norm"]),
        got[1] == expected["zeros"],
        all(torch.allclose(clipped[n], g, rtol=1e-5, atol=1e-7) for n, g in expected["clipped"].items()),
    )

    # A shared copy is never counted, DTensor or not.
    model = dense_model()
    mark_shared(model[2].bias)
    fully_shard(model, mesh=mesh["dp_cp"])
    backward(model)
    bias = float(model[2].bias.grad.full_tensor().double().norm())
    rest = [float(p.grad.full_tensor().double().norm()) ** 2 for n, p in model.named_parameters() if n != "2.bias"]
    out["shared"] = close(float(grad_norm(model, collection)), sum(rest) ** 0.5) and bias > 0

    # FSDP2 over the TP groups of a mesh built by hand: a distinct piece per TP rank, summed over mp.
    by_hand = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))  # "b": ranks {0, 1}, {2, 3} = tp
    model = dense_model()
    expected = oracle(model)
    fully_shard(model, mesh=by_hand["b"])
    backward(model)
    out["fsdp_over_tp"] = close(float(grad_norm(model, collection)), expected["norm"])
    # A mesh dim over ranks that are no group of the collection ({0, 3}, {1, 2}): refused, naming the parameter.
    odd = DeviceMesh("cpu", torch.tensor([[0, 3], [1, 2]]), mesh_dim_names=("x", "y"))
    model = dense_model()
    fully_shard(model, mesh=odd["y"])
    backward(model)
    out["no_group"] = error_of(lambda: grad_norm(model, collection))
    # Sharded over every rank (tp_dp_cp): part model-parallel (TP), part data-parallel; refused.
    model = dense_model()
    fully_shard(model, mesh=to_device_mesh(collection, ("tp_dp_cp",)))
    backward(model)
    out["straddle"] = error_of(lambda: count_zeros(model, collection))
    return out


@pytest.fixture(scope="module")
def tp_dp_results() -> list[dict[str, Any]]:
    return run_world(4, _tp_dp_world, timeout=60)


@pytest.mark.parametrize("scenario", ["fsdp", "tp", "fsdp_tp", "mixed"])
def test_dense_dtensor_stats_match_the_oracle(tp_dp_results: list[dict[str, Any]], scenario: str) -> None:
    for out in tp_dp_results:
        got = out[scenario]
        assert got["zeros"][0] == got["zeros"][1] > 0
        assert {k: v for k, v in got.items() if k != "zeros"} == {
            "audit": True, "norm": True, "inf": True, "clip_returned": True, "clipped": True, "after_clip": True,
        }


def test_shared_and_mesh_mismatches(tp_dp_results: list[dict[str, Any]]) -> None:
    for out in tp_dp_results:
        assert out["shared"]
        assert out["partial"] == (True, True, True)
        assert out["fsdp_over_tp"]
        assert out["no_group"].startswith("ValueError: 0.weight: its grad's mesh dim 'y' spans ranks [")
        assert "which are no group of the collection the statistics run on" in out["no_group"]
        assert out["straddle"] == (
            "ValueError: 0.weight: mesh dim 'tp_dp_cp' (the collection's 'tp_dp_cp') straddles the parameter's dense "
            "reduction group: part of it is model-parallel, part not"
        )


def _hsdp_world() -> dict[str, Any]:
    layout = ParallelLayout(num_ranks=4)  # dp 4: HSDP 2 replicas x 2 shards
    collection = with_hsdp_groups(registry.build(layout), 2)
    mesh = to_device_mesh(collection, ("inter_dist_opt", "intra_dp_cp"))
    model = dense_model()
    expected = oracle(model)
    fully_shard(model, mesh=mesh)
    return _scenario(model, expected, collection)


def test_hsdp_matches_the_oracle() -> None:
    for got in run_world(4, _hsdp_world, timeout=60):
        assert got["zeros"][0] == got["zeros"][1] > 0
        assert {k: v for k, v in got.items() if k != "zeros"} == {
            "audit": True, "norm": True, "inf": True, "clip_returned": True, "clipped": True, "after_clip": True,
        }

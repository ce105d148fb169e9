"""The xorl scenario: per-expert LoRA factors, FSDP2 over expert data parallelism, EP 2 (4 ranks) and EP 4
(8 ranks), marked before ``fully_shard``.

xorl reported the expert grad norm low by exactly 1/sqrt(ep): per-expert factors were classified EP-replicated by
a fallback ``Replicate()`` placement. Checked against the float64 norm and zero count of the full (unsharded,
all-experts) grads: correctly marked, the statistics are exact, clipping included; a factor without an EP
classification, or a ``Replicate`` placement over EP contradicting ``mark_expert``, is an error naming it.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.distributed as dist
from dtensor_support import MAX_NORM, close, error_of
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import distribute_tensor

from pgregistry import registry
from pgregistry.audit import audit_grad_replication
from pgregistry.grad_stats import clip_grad_norm_, count_zeros, grad_norm
from pgregistry.layout import ParallelLayout
from pgregistry.mesh import to_device_mesh, with_hsdp_groups
from pgregistry.params import mark_expert, mark_expert_module, mark_expert_replicated
from pgregistry.testing import run_world

EXPERTS, HIDDEN, RANK = 8, 6, 2


def _full_grads() -> dict[str, torch.Tensor]:
    """Unsharded float64 grads, all experts; every seventh element exactly zero."""
    gen = torch.Generator().manual_seed(7)

    def grad(*shape: int) -> torch.Tensor:
        values = torch.randn(shape, generator=gen, dtype=torch.float64)
        mask = (torch.arange(values.numel()) % 7 != 0).reshape(shape)
        return values.float().double() * mask  # float32-representable, so the oracle and the ranks agree exactly

    return {
        "experts.lora_a": grad(EXPERTS, RANK, HIDDEN),
        "experts.lora_b": grad(EXPERTS, HIDDEN, RANK),
        "experts.shared_a": grad(RANK, HIDDEN),
        "router": grad(EXPERTS, HIDDEN),
    }


class _Experts(nn.Module):
    def __init__(self, local: int, marks: dict[str, Any], in_expert_module: bool = True) -> None:
        super().__init__()
        if in_expert_module:
            mark_expert_module(self)
        self.lora_a = nn.Parameter(torch.zeros(local, RANK, HIDDEN))
        self.lora_b = nn.Parameter(torch.zeros(local, HIDDEN, RANK))
        self.shared_a = nn.Parameter(torch.zeros(RANK, HIDDEN))
        for name, mark in marks.items():
            if mark is not None:
                mark(getattr(self, name))


class _Model(nn.Module):
    def __init__(self, experts: _Experts) -> None:
        super().__init__()
        self.router = nn.Parameter(torch.zeros(EXPERTS, HIDDEN))
        self.experts = experts


_CORRECT = {"lora_a": mark_expert, "lora_b": mark_expert, "shared_a": mark_expert_replicated}


def _build(
    ep: int, marks: dict[str, Any], expert_axes: tuple[str, ...], replicas: int = 1, **kwargs: Any
) -> tuple[_Model, Any]:
    """The model sharded as the xorl stack shards it, with each grad set from the full grads as FSDP2 lays it out;
    with ``replicas`` > 1, HSDP: the dense model over ``("inter_dist_opt", "intra_dp_cp")``."""
    layout = ParallelLayout(num_ranks=dist.get_world_size(), ep=ep)
    collection = registry.build(layout)
    if replicas > 1:
        collection = with_hsdp_groups(collection, replicas)
    dense_mesh = to_device_mesh(collection, ("inter_dist_opt", "intra_dp_cp") if replicas > 1 else ("dp_cp",))
    expert_mesh = to_device_mesh(collection, expert_axes)
    local = EXPERTS // ep
    model = _Model(_Experts(local, marks, **kwargs))  # marked before fully_shard
    fully_shard(model.experts, mesh=expert_mesh)
    fully_shard(model, mesh=dense_mesh)
    mine = slice(layout.coords(dist.get_rank())["ep"] * local, (layout.coords(dist.get_rank())["ep"] + 1) * local)
    for name, full in _full_grads().items():
        param = model.get_parameter(name)
        value = full[mine] if name in ("experts.lora_a", "experts.lora_b") else full
        param.grad = distribute_tensor(value.float(), param.device_mesh, param.placements, src_data_rank=None)
    return model, collection


def _on_rank(ep: int) -> dict[str, Any]:
    full = _full_grads()
    flat = torch.cat([g.reshape(-1) for g in full.values()])
    norm = float(flat.norm())
    out: dict[str, Any] = {}

    model, collection = _build(ep, _CORRECT, ("expt_dp",))
    report = audit_grad_replication(model, collection)
    out["audit"] = (report.ok, report.classified_norm, report.true_norm, str(report))
    out["norm"] = (float(grad_norm(model, collection)), norm)
    out["zeros"] = (count_zeros(model, collection), int((flat == 0).sum()))
    out["clip"] = (float(clip_grad_norm_(model, MAX_NORM, collection)), float(grad_norm(model, collection)))
    coeff = MAX_NORM / (norm + 1e-6)
    router = model.router.grad.full_tensor().double()
    out["clipped_router"] = float((router - full["router"] * coeff).abs().max())

    # Classified replicated with EP off the mesh: no placement can tell, the replication audit measures it.
    everything_replicated = dict.fromkeys(_CORRECT, mark_expert_replicated)
    model, collection = _build(ep, everything_replicated, ("expt_dp",))
    report = audit_grad_replication(model, collection)
    out["audit_wrong"] = (
        sorted((m.name, m.axis, m.effect) for m in report.mismatches),
        report.classified_norm,
        report.true_norm,
    )

    unmarked = {"lora_a": mark_expert, "shared_a": mark_expert_replicated}
    model, collection = _build(ep, unmarked, ("expt_dp",))
    out["unclassified"] = error_of(lambda: grad_norm(model, collection))
    model, collection = _build(ep, unmarked, ("expt_dp",), in_expert_module=False)
    out["unclassified_outside_module"] = error_of(lambda: count_zeros(model, collection))
    # xorl: per-expert factors replicated over EP by placement (an HSDP-style mesh whose replicate dim is EP).
    model, collection = _build(ep, _CORRECT, ("ep", "expt_dp"))
    out["replicate_over_ep"] = error_of(lambda: grad_norm(model, collection))
    # Experts sharded over the dense data-parallel group, which holds ranks of other EP coordinates.
    model, collection = _build(ep, _CORRECT, ("dp_cp",))
    out["expert_over_dense"] = error_of(lambda: grad_norm(model, collection))
    return out


@pytest.mark.parametrize("world, ep", [(4, 2), (8, 4)])
def test_xorl_per_expert_lora_under_fsdp2(world: int, ep: int) -> None:
    for out in run_world(world, _on_rank, ep, timeout=60):
        got, expected = out["norm"]
        assert close(got, expected)
        ok, classified, true, text = out["audit"]
        assert ok, text
        assert close(classified, expected) and close(true, expected)
        mismatches, classified, true = out["audit_wrong"]
        assert mismatches == [("experts.lora_a", "ep", "undercount"), ("experts.lora_b", "ep", "undercount")]
        assert close(true, expected) and classified < expected
        assert out["zeros"][0] == out["zeros"][1] > 0
        assert close(out["clip"][0], expected) and close(out["clip"][1], MAX_NORM)
        assert out["clipped_router"] < 1e-6
        assert out["unclassified"].startswith(
            "ValueError: 1 parameter(s) of a marked expert module carry no EP classification: experts.lora_b."
        )
        assert out["unclassified_outside_module"].startswith(
            "ValueError: experts.lora_b: its grad is laid out over mesh dim 'expt_dp', the collection's expert group "
            "'expt_dp', but the parameter carries no EP classification"
        )
        assert out["replicate_over_ep"].startswith(
            "ValueError: experts.lora_a: marked distinct per EP rank, but its grad is Replicate() over mesh dim 'ep'"
        )
        assert f"norm low by 1/sqrt({ep})" in out["replicate_over_ep"]
        assert out["expert_over_dense"].startswith(
            "ValueError: experts.lora_a: a routed expert (allreduce=False) laid out over mesh dim 'dp_cp', the "
            "collection's dense group"
        )
        assert not math.isclose(expected / math.sqrt(ep), expected)


_EXPERT_HSDP = ("inter_dist_opt", "intra_expt_dp")


def _expert_hsdp_on_rank() -> dict[str, Any]:
    """EP 2 on 8 ranks: expert DP 4 split into 2 replicas x 2 shards, the experts under FSDP2's HSDP over it."""
    full = _full_grads()
    flat = torch.cat([g.reshape(-1) for g in full.values()])
    model, collection = _build(2, _CORRECT, _EXPERT_HSDP, replicas=2)
    mesh = model.experts.lora_a.device_mesh
    out: dict[str, Any] = {
        "mesh": (mesh.mesh.tolist(), [type(p).__name__ for p in model.experts.lora_a.grad.placements]),
        # The mesh runs on the collection's groups: the registry's replicate group is inter_dist_opt's.
        "shared": [mesh.get_group(i) is collection.get(field) for i, field in enumerate(_EXPERT_HSDP)],
        "norm": (float(grad_norm(model, collection)), float(flat.norm())),
        "zeros": (count_zeros(model, collection), int((flat == 0).sum())),
        "clip": (float(clip_grad_norm_(model, MAX_NORM, collection)), float(grad_norm(model, collection))),
    }
    report = audit_grad_replication(model, collection)
    out["audit"] = (report.ok, str(report))
    # With EP slower than DP the one replicate group crosses EP ranks: no expert HSDP mesh, a clear error.
    crossed = ParallelLayout(num_ranks=8, ep=2, order="tp-cp-dp-ep-pp")
    hsdp = with_hsdp_groups(registry.build(crossed), 2)
    out["crossed"] = error_of(lambda: to_device_mesh(hsdp, _EXPERT_HSDP))
    return out


def test_expert_hsdp_over_expert_data_parallelism() -> None:
    for rank, out in enumerate(run_world(8, _expert_hsdp_on_rank, timeout=60)):
        # Expert DP of rank r: the ranks of its EP coordinate (r % 2); 2 contiguous blocks of 2, replicated.
        group = list(range(rank % 2, 8, 2))
        assert out["mesh"] == ([group[:2], group[2:]], ["Replicate", "Shard"])
        assert out["shared"] == [True, True]
        got, expected = out["norm"]
        assert close(got, expected)
        assert out["zeros"][0] == out["zeros"][1] > 0
        assert close(out["clip"][0], expected) and close(out["clip"][1], MAX_NORM)
        assert out["audit"][0], out["audit"][1]
        assert out["crossed"].startswith("ValueError: the collection's 'inter_dist_opt' group holds ranks [")
        assert "'expt_dp' group" in out["crossed"] and "form no HSDP mesh" in out["crossed"]

"""Roles survive the parameter replacement torch-native sharding does, whether marked before or after it.

``fully_shard`` (FSDP2), ``parallelize_module`` and ``nn.Parameter(distribute_tensor(...))`` each register a new
Parameter object under the old name; roles set as attributes on the old object would be lost (the issue's
``... carry no EP classification: experts.w`` after ``fully_shard``). Real 2-rank gloo world.
"""

from __future__ import annotations

from typing import Any

import torch
from dtensor_support import error_of
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

from pgregistry._runtime.resolve import normalise_params
from pgregistry.grad_stats import check_expert_classification
from pgregistry.params import (
    mark_expert,
    mark_expert_module,
    mark_expert_replicated,
    mark_shared,
    mark_tensor_parallel,
    param_roles,
)
from pgregistry.testing import run_world


class _Experts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        mark_expert_module(self)
        self.w = nn.Parameter(torch.randn(4, 3))
        mark_expert(self.w)  # marked after registration
        self.register_parameter("lora", mark_expert(nn.Parameter(torch.randn(4, 2))))  # marked before
        self.shared = nn.Parameter(torch.randn(2, 2))
        self.unmarked = nn.Parameter(torch.randn(2, 2))


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(3, 4)
        self.experts = _Experts()


def _roles(model: nn.Module) -> dict[str, dict[str, Any]]:
    return {name: param_roles(param) for name, param in normalise_params(model).named}


def _on_rank() -> dict[str, Any]:
    from pgregistry.collection import ProcessGroupCollection

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    ep = ProcessGroupCollection(ep=mesh.get_group("dp"))  # EP on: expert classification is checked
    out: dict[str, Any] = {}

    model = _Model()
    mark_tensor_parallel(model.proj.weight, 0)
    mark_expert_replicated(model.experts.shared)
    fully_shard(model.experts, mesh=mesh)
    fully_shard(model, mesh=mesh)
    out["fsdp_types"] = sorted({type(p).__name__ for p in model.parameters()})
    out["fsdp_unmarked"] = error_of(lambda: check_expert_classification(model, ep))
    mark_expert(model.experts.unmarked)  # after fully_shard
    mark_expert_replicated(model.experts.lora)  # after overrides before
    out["fsdp_roles"] = _roles(model)
    out["fsdp_classified"] = error_of(lambda: check_expert_classification(model, ep))

    tp_model = nn.Sequential(nn.Linear(3, 4))
    mark_tensor_parallel(tp_model[0].weight, 0)
    mark_shared(tp_model[0].bias)
    parallelize_module(tp_model, mesh, {"0": ColwiseParallel()})
    # Carried onto the new parameter object at registration: no model walk needed.
    out["tp_direct"] = {name: param_roles(p) for name, p in tp_model.named_parameters()}
    out["tp_types"] = [isinstance(p, DTensor) for p in tp_model.parameters()]

    plain = nn.Linear(3, 4)
    mark_expert(plain.weight)
    plain.weight = nn.Parameter(distribute_tensor(plain.weight.detach(), mesh, [Replicate()]))
    out["distribute"] = (param_roles(plain.weight), isinstance(plain.weight, DTensor))
    return out


def test_roles_survive_fully_shard_parallelize_module_and_distribute_tensor() -> None:
    for out in run_world(2, _on_rank):
        assert out["fsdp_types"] == ["DTensor"]
        assert out["fsdp_unmarked"].startswith(
            "ValueError: 1 parameter(s) of a marked expert module carry no EP classification: experts.unmarked."
        )
        tp_roles = {"tensor_model_parallel": True, "partition_dim": 0, "partition_stride": 1}
        assert out["fsdp_roles"] == {
            "proj.weight": tp_roles,
            "proj.bias": {},
            "experts.w": {"allreduce": False},
            "experts.lora": {"allreduce": True},
            "experts.shared": {"allreduce": True},
            "experts.unmarked": {"allreduce": False},
        }
        assert out["fsdp_classified"] == "no error"
        assert out["tp_direct"] == {"0.weight": tp_roles, "0.bias": {"shared": True}}
        assert out["tp_types"] == [True, True]
        assert out["distribute"] == ({"allreduce": False}, True)

"""Roles follow the parameter, not its module slot: a replacement of the same parameter (its ``fully_shard``
DTensor, its ``distribute_tensor``, a view of its memory, its dictionary swapped by ``to_empty``) keeps them; an
unrelated ``nn.Parameter`` assigned into the slot gets none, however it is assigned, before or after ``fully_shard``.

Reported: keeping roles across ``fully_shard`` made a fresh parameter put where Megatron-Core had marked ``shared``
inherit ``shared=True``, so it was not counted (norm 2.83 for 4.0); the same held for every role. A real 2-rank gloo
world (DP 2); the oracle is the float64 norm of the grads set, each parameter counted once.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch
from torch import nn

from pgregistry import ParallelLayout, registry
from pgregistry.collection import group_rank
from pgregistry.params import ROLE_ATTRIBUTES, param_roles
from pgregistry.testing import run_world

EVERY_ROLE: dict[str, Any] = {
    "tensor_model_parallel": True,
    "partition_dim": 0,
    "partition_stride": 1,
    "allreduce": False,
    "shared": True,
    "shared_embedding": True,
    "is_gtp_weight_remat": True,
    "expert_tp": True,
    "is_qkv": True,
    "qkv_split_shapes": [2, 2],
    "pad_length": 0,
}
"""Every role but pgregistry's own ``in_expert_module`` (derived from the module), set as plain attributes, as
Megatron-Core sets its own."""
assert set(EVERY_ROLE) == set(ROLE_ATTRIBUTES) - {"in_expert_module"}


def _values(seed: int) -> torch.Tensor:
    return torch.randn(4, 2, generator=torch.Generator().manual_seed(seed))


def _slot(device: str = "cpu") -> nn.Module:
    module = nn.Module()
    module.w = nn.Parameter(_values(1).to(device))
    for name, value in EVERY_ROLE.items():
        setattr(module.w, name, value)
    return module


def _roles_after(replace: str, mesh: Any) -> dict[str, Any]:
    """The roles of the parameter in the slot after ``replace``, read through a model walk (which restores them)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from pgregistry._runtime.resolve import normalise_params

    module = _slot("meta" if "meta" in replace else "cpu")
    old = module.w
    if replace == "fresh, then fully_shard":
        module.w = nn.Parameter(_values(2))
        fully_shard(module, mesh=mesh)
    elif replace == "fresh bypassing torch, then fully_shard":
        module._parameters["w"] = nn.Parameter(_values(2))
        fully_shard(module, mesh=mesh)
    elif replace == "fully_shard, then fresh":
        fully_shard(module, mesh=mesh)
        module.w = nn.Parameter(_values(2))
    elif replace == "fully_shard, then fresh bypassing torch":
        fully_shard(module, mesh=mesh)
        module._parameters["w"] = nn.Parameter(_values(2))
    elif replace == "fully_shard, then a fresh DTensor":
        fully_shard(module, mesh=mesh)
        module.w = nn.Parameter(distribute_tensor(_values(2), mesh, [Shard(0)]))
    elif replace == "a fresh DTensor":
        module.w = nn.Parameter(distribute_tensor(_values(2), mesh, [Shard(0)]))
    elif replace == "fully_shard":
        fully_shard(module, mesh=mesh)
    elif replace == "fully_shard, then to_empty":
        fully_shard(module, mesh=mesh)
        normalise_params(module)
        module.to_empty(device="cpu")  # DTensor parameters: torch swaps each one's attribute dictionary
    elif replace == "distribute_tensor Shard(0)":
        module.w = nn.Parameter(distribute_tensor(old.detach(), mesh, [Shard(0)]))
    elif replace == "distribute_tensor Replicate":
        module.w = nn.Parameter(distribute_tensor(old.detach(), mesh, [Replicate()]))
    elif replace == "a view of its memory":
        module.w = nn.Parameter(old.data)
    elif replace.startswith("load_state_dict(assign=True)"):
        module.load_state_dict({"w": _values(2)}, assign=True)
    elif replace == "copy.deepcopy of its module":  # torch's deepcopy of a parameter drops its attributes
        module = copy.deepcopy(module)
    else:
        raise AssertionError(replace)
    assert module.w is not old or replace == "fully_shard, then to_empty"
    assert not module.w.is_meta
    normalise_params(module)
    return param_roles(module.w)


FRESH = (
    "fresh, then fully_shard",
    "fresh bypassing torch, then fully_shard",
    "fully_shard, then fresh",
    "fully_shard, then fresh bypassing torch",
    "fully_shard, then a fresh DTensor",
    "a fresh DTensor",
)
SAME = (
    "fully_shard",
    "fully_shard, then to_empty",
    "distribute_tensor Shard(0)",
    "distribute_tensor Replicate",
    "a view of its memory",
    "copy.deepcopy of its module",
    "load_state_dict(assign=True) into a meta model",
    "load_state_dict(assign=True)",
)


def _id(case: str) -> str:
    """The case as a pytest id without spaces (``scripts/mutants.py`` reads failed ids from pytest's summary)."""
    return case.replace(",", "").replace(" ", "-")


def _grad(name: str) -> torch.Tensor:
    return torch.randn(4, 2, generator=torch.Generator().manual_seed(sum(map(ord, name))), dtype=torch.float64)


def _issue_norm(sharded_first: bool) -> float:
    """The reported case: Megatron-Core marked ``output`` a shared copy; a fresh, untied parameter takes its slot."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from pgregistry.grad_stats import grad_norm
    from pgregistry.mesh import to_device_mesh

    collection = registry.build(ParallelLayout(num_ranks=2))
    mesh = to_device_mesh(collection, ("dp_cp",))
    model = nn.Module()
    model.embedding = nn.Parameter(_values(3))
    model.output = nn.Parameter(_values(3))
    model.output.shared = True  # type: ignore[union-attr]
    if sharded_first:
        fully_shard(model, mesh=mesh)
        model.output = nn.Parameter(_values(4))
    else:
        model.output = nn.Parameter(_values(4))
        fully_shard(model, mesh=mesh)
    for name, param in model.named_parameters():
        full = _grad(name).float()
        if isinstance(param, DTensor):
            local = full.chunk(2)[group_rank(collection.get("dp_cp"))].contiguous()
            param.grad = DTensor.from_local(local, param.device_mesh, param.placements, run_check=False,
                                            shape=param.shape, stride=param.stride())
        else:
            param.grad = full
    return float(grad_norm(model, collection))


def _on_rank() -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    out: dict[str, Any] = {case: _roles_after(case, mesh) for case in (*FRESH, *SAME)}
    out["norm"] = {first: _issue_norm(first) for first in (False, True)}
    return out


@pytest.fixture(scope="module")
def world() -> list[dict[str, Any]]:
    return run_world(2, _on_rank)


@pytest.mark.parametrize("case", FRESH, ids=_id)
def test_an_unrelated_parameter_put_in_a_marked_slot_gets_no_role(world: list[dict[str, Any]], case: str) -> None:
    for rank, out in enumerate(world):
        assert out[case] == {}, (rank, out[case])


@pytest.mark.parametrize("case", SAME, ids=_id)
def test_a_replacement_of_the_same_parameter_keeps_every_role(world: list[dict[str, Any]], case: str) -> None:
    for rank, out in enumerate(world):
        assert out[case] == EVERY_ROLE, (rank, out[case])


def test_a_fresh_parameter_where_megatron_marked_shared_is_counted(world: list[dict[str, Any]]) -> None:
    both = math.sqrt(sum(float(_grad(name).square().sum()) for name in ("embedding", "output")))
    for rank, out in enumerate(world):
        for sharded_first, norm in out["norm"].items():
            assert norm == pytest.approx(both, rel=1e-6), (rank, sharded_first, norm)

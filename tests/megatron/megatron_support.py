"""Helpers for the tests that run the real Megatron-Core (imported as ``megatron_support``).

``make setup`` installs megatron-core; without it these tests skip, unless ``PGREGISTRY_REQUIRE_MEGATRON=1`` (set by
``make test``) makes the missing package a failure, so CI can never pass by skipping them.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

__all__ = [
    "CudaAllocationsOnTheCpu",
    "describe_groups",
    "error_of",
    "fake_world",
    "megatron_fields",
    "megatron_initialize",
    "megatron_kwargs",
    "megatron_tests_groups",
    "require_megatron",
]


def require_megatron() -> None:
    """Import megatron.core, or skip the calling test module (fail instead under PGREGISTRY_REQUIRE_MEGATRON=1)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "Apex is not installed": Megatron-Core falls back to torch norms
            import megatron.core.parallel_state  # noqa: F401
            import megatron.core.process_groups_config  # noqa: F401
    except ImportError as exc:
        if os.environ.get("PGREGISTRY_REQUIRE_MEGATRON") == "1":
            raise
        pytest.skip(f"megatron-core is not importable ({exc}); `make setup` installs it", allow_module_level=True)


def error_of(call: Any) -> str:
    """``"<ExceptionType>: <message>"`` for a ValueError or TypeError ``call`` raises, ``"no error"`` otherwise (run
    inside a world, so each rank's outcome comes back to the test as text)."""
    try:
        call()
    except (ValueError, TypeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def megatron_fields() -> tuple[str, ...]:
    """Every field of the installed Megatron-Core's ProcessGroupCollection."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    return tuple(f.name for f in dataclasses.fields(ProcessGroupCollection))


def megatron_kwargs(sizes: Mapping[str, Any]) -> dict[str, Any]:
    """``initialize_model_parallel`` keywords for pgregistry layout sizes, written out here, independently of
    pgregistry.interop, so the parity tests do not take the mapping they check from the code under test."""
    names = {
        "tp": "tensor_model_parallel_size", "pp": "pipeline_model_parallel_size", "cp": "context_parallel_size",
        "ep": "expert_model_parallel_size", "expt_tp": "expert_tensor_parallel_size", "gtp_remat": "gtp_remat_size",
        "expt_gtp_remat": "expert_gtp_remat_size", "order": "order",
    }
    return {names[key]: value for key, value in sizes.items() if key != "num_ranks"}


@contextmanager
def megatron_initialize(sizes: Mapping[str, Any]) -> Iterator[Any]:
    """Megatron-Core's own ``initialize_model_parallel`` for ``sizes``; yields its
    ``ProcessGroupCollection.use_mpu_process_groups()`` and destroys Megatron's globals on exit."""
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection

    try:
        parallel_state.initialize_model_parallel(**megatron_kwargs(sizes), create_gloo_process_groups=False)
        yield ProcessGroupCollection.use_mpu_process_groups()
    finally:
        parallel_state.destroy_model_parallel()


def _ranks(group: Any) -> Any:
    if group is None:
        return None
    if isinstance(group, list):
        return [_ranks(g) for g in group]
    return tuple(dist.get_process_group_ranks(group))


def describe_groups(collection: Any, names: tuple[str, ...]) -> dict[str, Any]:
    """Field -> the ranks of its group (``None`` for None, a list for ``hcp``), for either package's collection.

    A field absent from ``vars()`` (Megatron-Core) or UNSET (pgregistry) is reported as ``"unset"``."""
    from pgregistry.collection import UNSET, ProcessGroupCollection

    out: dict[str, Any] = {}
    for name in names:
        if isinstance(collection, ProcessGroupCollection):
            value = collection.get(name) if collection.is_set(name) else UNSET
        else:
            value = vars(collection).get(name, UNSET)
        out[name] = "unset" if value is UNSET else _ranks(value)
    return out


@contextmanager
def fake_world(rank: int, world_size: int) -> Iterator[None]:
    """This process as ``rank`` of a ``world_size`` world on torch's fake backend (collectives compute nothing):
    enough to run Megatron-Core's and pgregistry's group creation for any rank of any world, in one process."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


class CudaAllocationsOnTheCpu(TorchFunctionMode):
    """Tensors created with ``device='cuda'`` (Megatron-Core's scalars and buffers) are created on the CPU."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = dict(kwargs or {})
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == "cuda":
            kwargs["device"] = "cpu"
        return func(*args, **kwargs)


def megatron_tests_groups(dp: int, tp: int) -> dict[str, Any]:
    """The groups Megatron-LM's test_get_megatron_optimizer_with_custom_process_groups builds from a DeviceMesh
    (PP 1, ``dp`` x ``tp``), under Megatron-Core's field names: ``expt_dp`` and ``tp_ep_pp`` None, no ``expt_tp``;
    and ``gtp_remat``, which that test predates: Megatron-Core 0.19's collection has the field, and its optimizer
    filters GTP duplicates by it (``param_is_not_gtp_duplicate``), so a collection without it makes a migrated
    Megatron-Core fall back to the global grid there. GTP remat is off: each rank alone (an older Megatron-Core,
    without the field, ignores it)."""
    from torch.distributed.device_mesh import init_device_mesh

    names = ("pp", "dp", "ep", "cp", "gtp_remat", "tp")
    mesh = init_device_mesh("cpu", (1, dp, 1, 1, 1, tp), mesh_dim_names=names)
    return {
        "dp": mesh.get_group("dp"), "dp_cp": mesh["dp", "cp"]._flatten().get_group(),
        "intra_dist_opt": mesh["dp", "cp"]._flatten().get_group(), "expt_dp": None,
        "tp": mesh.get_group("tp"), "cp": mesh.get_group("cp"), "pp": mesh.get_group("pp"),
        "mp": mesh["pp", "tp"]._flatten().get_group(), "tp_ep_pp": None, "gtp_remat": mesh.get_group("gtp_remat"),
    }

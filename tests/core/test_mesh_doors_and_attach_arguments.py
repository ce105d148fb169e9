"""``attach``, the doors and the DeviceMesh adapters given hostile but plausible arguments.

``attach(model.weight, pg)`` (or a list holding a tensor) recorded a collection nothing ever looks up (entry points
given tensors take ``pg_collection``); ``to_device_mesh(pg, ("dp_cp", "tp"), dim_names="dt")`` named the dims
``'d'`` and ``'t'``; ``pg_group(pg, None)`` raised difflib's ``'NoneType' object is not iterable``;
``from_device_mesh`` given a group raised ``AttributeError``; ``with_hsdp_groups(pg, np.int64(2))`` was refused as
no positive divisor."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch.distributed as dist
from core_support import errors_of
from torch import nn

from pgregistry import ParallelLayout, ProcessGroupCollection, attach, collection_of
from pgregistry import registry as reg
from pgregistry.collection import FIELD_NAMES
from pgregistry.doors import pg_group
from pgregistry.mesh import from_device_mesh, to_device_mesh, with_hsdp_groups
from pgregistry.testing import run_world

ALL_OFF = ProcessGroupCollection(**dict.fromkeys(FIELD_NAMES))


def test_attach_refuses_a_tensor_or_a_chunk_that_is_no_module() -> None:
    model = nn.Linear(2, 2)
    with pytest.raises(TypeError, match="attach records the collection of a module: model is a Parameter"):
        attach(model.weight, ALL_OFF)
    with pytest.raises(TypeError, match="model chunk 1 is a int; attach it to the model"):
        attach([model, 5], ALL_OFF)  # type: ignore[list-item]
    assert collection_of(model, None) is None  # nothing attached by the refused calls
    attach([model], ALL_OFF)
    assert collection_of(model) is ALL_OFF


def test_attach_refuses_an_empty_list_of_chunks_which_would_attach_nothing() -> None:
    """attach([], collection) returned having recorded nothing: every entry point given the chunks then fell back."""
    with pytest.raises(ValueError, match="attach was given an empty list of model chunks: nothing to attach"):
        attach([], ALL_OFF)
    with pytest.raises(ValueError, match="an empty tuple of model chunks"):
        attach((), ALL_OFF)
    attach(nn.Sequential(), ALL_OFF)  # a module without parameters is a module: attached
    assert collection_of(nn.Sequential(), None) is None


def test_a_field_name_that_is_no_str_or_dims_given_as_a_str_are_named() -> None:
    with pytest.raises(TypeError, match=r"a field name must be a str \(one of tp, .*\), got None \(NoneType\)"):
        pg_group(ALL_OFF, None)  # type: ignore[arg-type]
    for keywords in ({"fields": "tp"}, {"fields": ("dp_cp", "tp"), "dim_names": "dt"}):
        with pytest.raises(TypeError, match=r"must be a sequence of names, one per dim, got the str"):
            to_device_mesh(ALL_OFF, **keywords)  # type: ignore[arg-type]
    for device_type in ("gpu", "cuda:0"):  # DeviceMesh took any string: a mesh of "gpu" was made
        with pytest.raises(ValueError, match=rf"device_type '{device_type}' is no torch device type"):
            to_device_mesh(ALL_OFF, ("tp",), device_type)


def _mesh_arguments() -> dict[str, Any]:
    collection = reg.build(ParallelLayout(num_ranks=2))
    mesh = to_device_mesh(collection, ("dp_cp",), dim_names=("dp",))
    out = errors_of({
        "group": lambda: from_device_mesh(collection.get("dp_cp"), {"dp": "dp"}),
        "pairs": lambda: from_device_mesh(mesh, [("dp", "dp")]),  # type: ignore[arg-type]
        "none": lambda: from_device_mesh(mesh, {"dp": None}),  # type: ignore[dict-item]
    })
    split = with_hsdp_groups(collection, np.int64(2))
    out["replicas"] = dist.get_process_group_ranks(split.get("inter_dist_opt"))
    return out


def test_from_device_mesh_and_with_hsdp_groups_arguments() -> None:
    for out in run_world(2, _mesh_arguments, timeout=60.0):
        assert out["group"].startswith("TypeError: from_device_mesh takes a torch DeviceMesh, got ProcessGroup"), out
        assert out["pairs"].startswith("TypeError: field_dims must be a mapping of collection field"), out
        assert out["none"].startswith("TypeError: field 'dp' maps to None: give a mesh dim name"), out
        assert out["replicas"] == [0, 1]

"""Run in a fresh interpreter by ``test_roles_whatever_the_import_order.py``: imports in the order given on the
command line, then the README's order (``registry.build``, ``to_device_mesh``, a model with Megatron-Core's marks
as plain attributes, ``fully_shard``, ``grad_norm``) in a 2-rank gloo world; prints each rank's norm and the
warnings ``pgregistry.params`` logged as JSON. ``model before pgregistry`` builds the model before importing
pgregistry at all (the ranks inherit it).

Only the standard library is imported at module level, so the order given is the order the interpreter sees.
"""

from __future__ import annotations

import json
import sys
from typing import Any

ORDERS = ("helpers first", "torch first", "pgregistry first")
MODEL_FIRST = "model before pgregistry"
_BUILT: list[Any] = []
SHAPES = {"embedding": (6, 2), "hidden": (2, 2), "output": (6, 2)}


def grad(name: str) -> Any:
    """The grad of each parameter, in float64; the tie (``output``, a copy of ``embedding``) has the embedding's."""
    import torch

    seed = sum(map(ord, "embedding" if name == "output" else name))
    return torch.randn(SHAPES[name], generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _model() -> Any:
    import torch
    from torch import nn

    model = nn.Module()
    for name, shape in SHAPES.items():
        setattr(model, name, nn.Parameter(torch.zeros(shape)))
    model.embedding.shared_embedding = True  # Megatron-Core's marks, plain attributes set after registration
    model.output.shared = True
    model.output.shared_embedding = True
    return model


def _on_rank() -> tuple[float, list[str]]:
    import logging

    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    import pgregistry
    from pgregistry import registry
    from pgregistry.collection import group_rank
    from pgregistry.mesh import to_device_mesh

    logged: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: logged.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("pgregistry.params").addHandler(handler)
    collection = registry.build(pgregistry.ParallelLayout(num_ranks=2))
    mesh = to_device_mesh(collection, ("dp_cp",))
    model = _BUILT[0] if _BUILT else _model()
    fully_shard(model, mesh=mesh)
    dp_rank = group_rank(collection.get("dp_cp"))
    for name, param in model.named_parameters():
        local = grad(name).float().chunk(2)[dp_rank].contiguous()
        param.grad = DTensor.from_local(local, param.device_mesh, param.placements, run_check=False,
                                        shape=param.shape, stride=param.stride())
    return float(pgregistry.grad_norm(model, collection)), logged


def main(order: str) -> None:
    if order == "helpers first":
        import pgregistry.params  # noqa: F401
    elif order == "torch first":
        import torch  # noqa: F401
    elif order == MODEL_FIRST:
        _BUILT.append(_model())
    elif order != "pgregistry first":
        raise SystemExit(f"unknown order {order!r}: one of {(*ORDERS, MODEL_FIRST)}")
    import pgregistry  # noqa: F401
    from pgregistry.testing import run_world

    print(json.dumps(run_world(2, _on_rank)))


if __name__ == "__main__":
    main(sys.argv[1])

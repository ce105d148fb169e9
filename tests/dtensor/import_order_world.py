"""Run in a fresh interpreter by ``test_roles_whatever_the_import_order.py``: imports in the order given on the
command line, then the README's order (``registry.build``, ``to_device_mesh``, a model with Megatron-Core's marks
as plain attributes, ``fully_shard``, ``grad_norm``) in a 2-rank gloo world; prints each rank's norm, or the error
it raised, as JSON. ``model before pgregistry`` builds the model before importing pgregistry at all (the ranks
inherit it); ``sharded before pgregistry`` builds the world, a torch device mesh, the model and ``fully_shard`` it
before anything imports pgregistry (ranks started by torch's own ``multiprocessing.spawn``, since the harness of
``pgregistry.testing`` imports pgregistry).

Only the standard library is imported at module level, so the order given is the order the interpreter sees.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any

ORDERS = ("helpers first", "torch first", "pgregistry first")
MODEL_FIRST = "model before pgregistry"
SHARDED_FIRST = "sharded before pgregistry"
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


def _norm_or_refusal(model: Any, collection: Any) -> list[Any]:
    """``[norm, None]`` from ``grad_norm`` of ``model`` (sharded over 2 ranks) with :func:`grad`'s grads, or
    ``[None, "<type>: <message>"]`` when it raised."""
    from torch.distributed.tensor import DTensor

    import pgregistry
    from pgregistry.collection import group_rank

    dp_rank = group_rank(collection.get("dp_cp"))
    for name, param in model.named_parameters():
        local = grad(name).float().chunk(2)[dp_rank].contiguous()
        param.grad = DTensor.from_local(local, param.device_mesh, param.placements, run_check=False,
                                        shape=param.shape, stride=param.stride())
    try:
        return [float(pgregistry.grad_norm(model, collection)), None]
    except Exception as exc:  # noqa: BLE001 - the type and text are what the test checks
        return [None, f"{type(exc).__name__}: {exc}"]


def _on_rank() -> list[Any]:
    from torch.distributed.fsdp import fully_shard

    import pgregistry
    from pgregistry import registry
    from pgregistry.mesh import to_device_mesh

    collection = registry.build(pgregistry.ParallelLayout(num_ranks=2))
    mesh = to_device_mesh(collection, ("dp_cp",))
    model = _BUILT[0] if _BUILT else _model()
    fully_shard(model, mesh=mesh)
    return _norm_or_refusal(model, collection)


def _sharded_first_rank(rank: int, directory: str) -> None:
    """One rank of :data:`SHARDED_FIRST`: the world, the model and ``fully_shard`` with torch alone, then pgregistry;
    writes its result to ``directory/<rank>.json``."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"file://{directory}/store", rank=rank, world_size=2)
    model = _model()
    fully_shard(model, mesh=init_device_mesh("cpu", (2,)))
    assert not any(name.startswith("pgregistry") for name in sys.modules)
    import pgregistry
    from pgregistry import registry

    result = _norm_or_refusal(model, registry.build(pgregistry.ParallelLayout(num_ranks=2)))
    Path(directory, f"{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def _sharded_first() -> list[Any]:
    import torch.multiprocessing

    with tempfile.TemporaryDirectory() as directory:
        torch.multiprocessing.spawn(_sharded_first_rank, args=(directory,), nprocs=2, join=True)
        return [json.loads(Path(directory, f"{rank}.json").read_text()) for rank in range(2)]


def main(order: str) -> None:
    if order == SHARDED_FIRST:
        print(json.dumps(_sharded_first()))
        return
    if order == "helpers first":
        import pgregistry.params  # noqa: F401
    elif order == "torch first":
        import torch  # noqa: F401
    elif order == MODEL_FIRST:
        _BUILT.append(_model())
    elif order != "pgregistry first":
        raise SystemExit(f"unknown order {order!r}: one of {(*ORDERS, MODEL_FIRST, SHARDED_FIRST)}")
    import pgregistry  # noqa: F401
    from pgregistry.testing import run_world

    print(json.dumps(run_world(2, _on_rank)))


if __name__ == "__main__":
    main(sys.argv[1])

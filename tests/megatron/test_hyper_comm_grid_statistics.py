"""Collections read off Megatron-Core's ``HyperCommGrid`` in job-wide statistics and the job's optimizer.

The MIMO shape in a 4-rank gloo world: an encoder on ranks 0-1 (DP 2) whose grid is dense (no expert view), and a
language model on ranks 2-3 (TP 2) whose grid has Megatron-Core's ``"expert"`` view (EP 2, expert TP 1). The grids'
communicators are the only ones: ``from_hyper_comm_grid``, ``pgregistry.modules.grad_norm``, ``clip_grad_norm_``
and ``build_optimizer`` create none and read no global grid (there is none). An axis a grid does not have (GTP
remat; every expert axis of the dense grid) is off in the layout it describes, so it is ``None`` in the collection.

These failed with "needs process group 'gtp_remat' ... no global grid is initialised" (or 'ep'): the collection
left those axes UNSET. The norm is the float64 oracle's of the unsharded grads.

An 8-rank grid (TP 2 x DP 2 x PP 2, its expert view EP 4) holding only the groups Megatron-Core's MIMO optimizer
reads (``_get_pg_collection_for_optimizer``: ``tp_ep_pp``, not ``ep``) gets its ``ep`` group through its own
``create_pg``, so statistics do not read a global grid for it.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
from megatron_support import require_megatron

require_megatron()

from megatron.core.hyper_comm_grid import HyperCommGrid  # noqa: E402
from megatron.core.models.mimo.optimizer import _get_pg_collection_for_optimizer  # noqa: E402

from pgregistry import grad_norm, modules, registry  # noqa: E402
from pgregistry.fallback import ProcessGroupFallbackWarning  # noqa: E402
from pgregistry.interop.megatron import from_hyper_comm_grid, to_megatron  # noqa: E402
from pgregistry.layout import ParallelLayout  # noqa: E402
from pgregistry.params import mark_expert, mark_tensor_parallel  # noqa: E402
from pgregistry.testing import run_world  # noqa: E402

WORLD = 4
BASE = (["tp"], ["cp"], ["dp"], ["pp"], ["dp", "cp"], ["tp", "pp"], ["tp", "cp", "dp"], ["tp", "cp", "dp", "pp"])
EXPERT = (["expt_tp"], ["ep"], ["expt_dp"], ["expt_tp", "ep", "pp"])


def _grads() -> dict[str, torch.Tensor]:
    """The unsharded float64 grads: the encoder's weight, the language model's TP-sharded weight (rows split over
    TP), its TP-replicated bias and one expert weight per EP rank."""
    generator = torch.Generator().manual_seed(8)
    shapes = {"encoder": (3, 4), "weight": (4, 3), "bias": (4,), "expert0": (2, 3), "expert1": (2, 3)}
    return {name: torch.randn(shape, generator=generator, dtype=torch.float64) for name, shape in shapes.items()}


def _grids() -> dict[str, HyperCommGrid]:
    encoder = HyperCommGrid([1, 1, 2, 1], ["tp", "cp", "dp", "pp"], rank_offset=0)
    language = HyperCommGrid([2, 1, 1, 1], ["tp", "cp", "dp", "pp"], rank_offset=2)
    language.register_view("expert", [1, 2, 1, 1], ["expt_tp", "ep", "expt_dp", "pp"], shared_dims=["pp"])
    for grid in (encoder, language):
        for dims in BASE:
            grid.create_pg(dims)
    for dims in EXPERT:
        language.create_pg(dims, view="expert")
    return {"encoder": encoder, "language": language}


def _model(name: str, rank: int) -> torch.nn.Module:
    grads = _grads()
    model = torch.nn.Module()
    if name == "encoder":
        model.weight = torch.nn.Parameter(torch.zeros(3, 4))
        model.weight.grad = grads["encoder"].float()
        return model
    tp_rank = rank - 2
    model.weight = mark_tensor_parallel(torch.nn.Parameter(torch.zeros(2, 3)), 0)
    model.weight.grad = grads["weight"][2 * tp_rank : 2 * tp_rank + 2].float()
    model.bias = torch.nn.Parameter(torch.zeros(4))
    model.bias.grad = grads["bias"].float()
    model.expert = mark_expert(torch.nn.Parameter(torch.zeros(2, 3)))  # EP rank = TP rank here (expert TP 1)
    model.expert.grad = grads[f"expert{tp_rank}"].float()
    return model


def _on_rank() -> dict[str, Any]:
    warnings.simplefilter("error", ProcessGroupFallbackWarning)
    rank = dist.get_rank()
    groups_before = dist.distributed_c10d._world.group_count
    grids = _grids()
    created = dist.distributed_c10d._world.group_count - groups_before
    collections = {name: from_hyper_comm_grid(grid, name=name) for name, grid in grids.items()}
    job = modules.MultiModuleCollection(collections, language_model="language", disjoint=True)
    here = job.here()
    out: dict[str, Any] = {"layouts": job.layouts()}
    mine = collections[here[0]]
    models = {name: _model(name, rank) for name in here}
    out["norm"] = float(modules.grad_norm(models, job))
    optimizer = modules.build_optimizer(models, job, optimizer="sgd", lr=0.1)
    out["optimizer norm"] = float(optimizer.get_grad_norm())
    out["clipped"] = float(modules.clip_grad_norm_(models, 1.0, job))
    out["off"] = {
        name: "unset" if not mine.is_set(name) else "off" if mine.get(name) is None else mine.get(name).size()
        for name in ("gtp_remat", "expt_gtp_remat", "ep", "expt_tp", "tp_ep_pp", "expt_dp")
    }
    out["expert groups are the grid's"] = here != ("encoder",) or (
        mine.get("tp_ep_pp") is None and any(mine.get("expt_dp") is grids["encoder"].get_pg(dims) for dims in BASE)
    )
    out["new communicators"] = (dist.distributed_c10d._world.group_count - groups_before - created,
                                registry.communicators_created())
    # A grid that made no one-rank group gets pgregistry's (one per rank, as every build makes them), for its off
    # axes to go to Megatron-Core as one-rank groups: none of them reads Megatron-Core's global groups.
    bare = HyperCommGrid([2, 1, 2, 1], ["tp", "cp", "dp", "pp"])
    for dims in (["tp"], ["dp"], ["dp", "cp"], ["tp", "pp"]):
        bare.create_pg(dims)
    megatron = to_megatron(from_hyper_comm_grid(bare, name="bare"))
    out["bare to megatron"] = {
        name: dist.get_process_group_ranks(group) for name, group in sorted(vars(megatron).items())
        if name in ("tp", "cp", "gtp_remat", "ep")
    }
    return out


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_world(WORLD, _on_rank, timeout=60)


def test_hyper_comm_grid_collections_give_the_oracles_job_wide_norm(results: list[dict[str, Any]]) -> None:
    want = math.sqrt(sum(float(g.pow(2).sum()) for g in _grads().values()))
    for rank, out in enumerate(results):
        assert out["norm"] == pytest.approx(want, rel=1e-6), rank
        assert out["optimizer norm"] == pytest.approx(want, rel=1e-6), rank
        assert out["clipped"] == pytest.approx(want, rel=1e-6), rank
        assert out["new communicators"] == (0, 0), rank
        assert out["bare to megatron"] == {"cp": [rank], "ep": [rank], "gtp_remat": [rank], "tp": [rank - rank % 2,
                                           rank - rank % 2 + 1]}, out["bare to megatron"]


def test_axes_a_grid_does_not_have_are_off(results: list[dict[str, Any]]) -> None:
    for rank, out in enumerate(results):
        assert out["layouts"] == {
            "encoder": ParallelLayout(num_ranks=2, expt_tp=1),
            "language": ParallelLayout(num_ranks=2, tp=2, ep=2, expt_tp=1, rank_offset=2),
        }
        if rank < 2:  # the dense grid: expert axes off, its expert data-parallel group one of the grid's
            off = dict.fromkeys(("gtp_remat", "expt_gtp_remat", "ep", "expt_tp", "tp_ep_pp"), "off")
            assert out["off"] == {**off, "expt_dp": 2}, rank
        else:
            assert out["off"] == {
                "gtp_remat": "off", "expt_gtp_remat": "off", "ep": 2, "expt_tp": 1, "tp_ep_pp": 2, "expt_dp": 1,
            }, rank
        assert out["expert groups are the grid's"], rank


MIMO_BASE = ("dp", ["dp", "cp"], "tp", "pp", ["tp", "pp"], ["tp", "cp", "dp", "pp"])
MIMO_EXPERT = (["expt_tp", "ep", "pp"], "expt_dp")
"""The groups Megatron-Core's MIMO optimizer collection reads (``_get_pg_collection_for_optimizer``)."""


def _mimo_grads() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Float64 grads: a dense bias per pipeline stage (replicated over TP and DP), an expert weight per rank."""
    generator = torch.Generator().manual_seed(88)
    biases = [torch.randn(3, generator=generator, dtype=torch.float64) for _ in range(2)]
    experts = [torch.randn(2, 2, generator=generator, dtype=torch.float64) for _ in range(8)]
    return biases, experts


def _grid_with_the_mimo_optimizers_groups() -> dict[str, Any]:
    warnings.simplefilter("error", ProcessGroupFallbackWarning)
    rank = dist.get_rank()
    grid = HyperCommGrid([2, 1, 2, 2], ["tp", "cp", "dp", "pp"])
    grid.register_view("expert", [1, 4, 1, 2], ["expt_tp", "ep", "expt_dp", "pp"], shared_dims=["pp"])
    for dims in MIMO_BASE:
        grid.create_pg(dims)
    for dims in MIMO_EXPERT:
        grid.create_pg(dims, view="expert")
    _get_pg_collection_for_optimizer(grid)  # the grid holds what Megatron-Core's MIMO optimizer reads
    collection = from_hyper_comm_grid(grid, name="language")
    biases, experts = _mimo_grads()
    model = torch.nn.Module()
    model.bias = torch.nn.Parameter(torch.zeros(3))
    model.bias.grad = biases[rank // 4].float()
    model.expert = mark_expert(torch.nn.Parameter(torch.zeros(2, 2)))  # EP rank rank % 4 of stage rank // 4
    model.expert.grad = experts[rank].float()
    return {
        "norm": float(grad_norm(model, collection)),
        "ep is the grid's": collection.get("ep") is grid.get_pg(["ep"], view="expert"),
        "ep ranks": dist.get_process_group_ranks(collection.get("ep")),
    }


def test_a_grid_with_only_the_mimo_optimizers_groups_gets_its_ep_group_from_the_grid() -> None:
    biases, experts = _mimo_grads()
    want = math.sqrt(sum(float(g.pow(2).sum()) for g in (*biases, *experts)))
    for rank, out in enumerate(run_world(8, _grid_with_the_mimo_optimizers_groups, timeout=60)):
        assert out["norm"] == pytest.approx(want, rel=1e-6), rank
        assert out["ep is the grid's"] and out["ep ranks"] == list(range(rank - rank % 4, rank - rank % 4 + 4)), out

"""Grad statistics of a model without experts on the collection Megatron-LM's own
``test_get_megatron_optimizer_with_custom_process_groups`` builds, with no global grid.

That collection (tp, cp, pp, mp, dp, dp_cp, intra_dist_opt from a ``DeviceMesh``; ``expt_dp=None``,
``tp_ep_pp=None``; no ``expt_tp``) leaves expert GTP unset, which only expert parameters read. In a 4-rank gloo world
(DP 2 x TP 2), against the float64 oracle of the unsharded model:

* ``pgregistry.grad_norm`` and ``count_zeros`` of a dense model read no expert field: the oracle's values, no
  fallback warning, no global grid needed (they raised "needs process group 'expt_gtp_remat'" before);
* the "has experts" verdict is agreed over ``mp``: with an expert parameter on rank 0 only, rank 0 and its TP peer
  both ask for the expert fields and raise alike (rank 0 alone raised, and its peer waited in the reduction);
* ``from_megatron`` of a Megatron-Core ``MultiModuleProcessGroupCollection`` of that collection recovers a layout
  with the expert axes off (it set expert TP to TP and refused the collection's ``tp_ep_pp=None``), and
  ``pgregistry.modules.grad_norm`` / ``count_zeros`` and the module's optimizer on it give the oracle's values.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from megatron_support import megatron_tests_groups, require_megatron

require_megatron()

from megatron.core.process_groups_config import MultiModuleProcessGroupCollection  # noqa: E402
from megatron.core.process_groups_config import ProcessGroupCollection as MegatronCollection  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402

import pgregistry  # noqa: E402
import pgregistry.modules  # noqa: E402
from pgregistry import registry  # noqa: E402
from pgregistry.collection import ProcessGroupCollection  # noqa: E402
from pgregistry.fallback import ProcessGroupFallbackWarning  # noqa: E402
from pgregistry.interop.megatron import from_megatron  # noqa: E402
from pgregistry.optim import build_optimizer  # noqa: E402
from pgregistry.params import mark_expert  # noqa: E402
from pgregistry.testing import run_world  # noqa: E402

WORLD, TP, DP = 4, 2, 2
ROWS, COLS = 6, 5


def _full_grads() -> tuple[torch.Tensor, torch.Tensor]:
    """The float64 grads of the unsharded model: a TP-replicated weight and a TP-sharded one (rows split over TP),
    each with some exact zeros."""
    generator = torch.Generator().manual_seed(83)
    replicated = torch.randn(ROWS, COLS, generator=generator, dtype=torch.float64)
    sharded = torch.randn(2 * ROWS, COLS, generator=generator, dtype=torch.float64)
    replicated[0, :2] = 0.0
    sharded[1:4, 3] = 0.0
    return replicated, sharded


def _model(tp_rank: int) -> torch.nn.Module:
    """This rank's chunk: the replicated weight whole, its row block of the sharded weight."""
    replicated, sharded = _full_grads()
    model = torch.nn.Module()
    model.replicated = torch.nn.Parameter(torch.zeros(ROWS, COLS))
    model.sharded = torch.nn.Parameter(torch.zeros(ROWS, COLS))
    model.sharded.tensor_model_parallel = True  # type: ignore[attr-defined]
    model.replicated.grad = replicated.to(torch.float32)
    model.sharded.grad = sharded[tp_rank * ROWS : (tp_rank + 1) * ROWS].to(torch.float32)
    return model


def _error_of(call: Any) -> str:
    try:
        call()
    except (ValueError, TypeError, RuntimeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def _on_rank() -> dict[str, Any]:
    import torch.distributed as dist

    warnings.simplefilter("ignore")  # Megatron-Core's notices about optional packages
    warnings.simplefilter("error", ProcessGroupFallbackWarning)  # nothing the model does not need is read
    rank = dist.get_rank()
    groups = megatron_tests_groups(DP, TP)
    mine = ProcessGroupCollection(**groups)
    model = _model(rank % TP)
    out: dict[str, Any] = {
        "norm": float(pgregistry.grad_norm(model, mine)),
        "inf norm": float(pgregistry.grad_norm(model, mine, norm_type=float("inf"))),
        "zeros": pgregistry.count_zeros(model, mine),
        "again": float(pgregistry.grad_norm(model, mine)),  # the kept plan, its verdict kept
    }
    theirs = MegatronCollection()
    for name, group in groups.items():
        setattr(theirs, name, group)
    out["from_megatron"] = float(pgregistry.grad_norm(_model(rank % TP), from_megatron(theirs)))
    expert_here = _model(rank % TP)
    if rank == 0:
        mark_expert(expert_here.replicated)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ProcessGroupFallbackWarning)  # the expert fields are asked for, alike
        out["expert on rank 0"] = _error_of(lambda: pgregistry.grad_norm(expert_here, mine))
    return out


def _modules_on_rank() -> dict[str, Any]:
    import torch.distributed as dist

    warnings.simplefilter("ignore")
    warnings.simplefilter("error", ProcessGroupFallbackWarning)
    groups = megatron_tests_groups(DP, TP)
    model = _model(dist.get_rank() % TP)
    out: dict[str, Any] = {}
    # A MIMO module's collection: Megatron-Core's MIMO optimizer gives intra_dist_opt the module's whole span.
    theirs = MegatronCollection()
    for name, group in {**groups, "intra_dist_opt": init_device_mesh("cpu", (WORLD,)).get_group()}.items():
        setattr(theirs, name, group)
    mimo = MultiModuleProcessGroupCollection(module_pgs={"llm": theirs}, language_model_module_name="llm")
    modules = from_megatron(mimo)
    layout = modules["llm"].layout
    out["layout"] = (layout.tp, layout.dp, layout.ep, layout.expt_tp, layout.expt_dp)
    llm = modules["llm"]  # "not needed" as the layout has it: tp_ep_pp one rank, expt_dp the whole span
    out["off fields"] = (llm.get("tp_ep_pp") is None, llm.get("expt_dp") is theirs.intra_dist_opt)
    out["modules norm"] = float(pgregistry.modules.grad_norm({"llm": model}, modules))
    out["modules zeros"] = pgregistry.modules.count_zeros({"llm": model}, modules)
    out["optimizer"] = _optimizer_norm(llm, dist.get_rank() % TP)
    registry.destroy()
    return out


def _optimizer_norm(collection: ProcessGroupCollection, tp_rank: int) -> float:
    """The grad norm of pgregistry's optimizer over the model on ``collection`` (equal grads on every DP rank)."""
    model = _model(tp_rank)
    grads = {name: param.grad for name, param in model.named_parameters()}
    optimizer = build_optimizer(model, collection, optimizer="sgd", lr=0.1)
    for name, param in model.named_parameters():
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        param.grad.copy_(grads[name])
    optimizer.sync_grads()  # an average over DP of equal grads
    return float(optimizer.get_grad_norm())


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_world(WORLD, _on_rank, timeout=60)


@pytest.fixture(scope="module")
def modules_results() -> list[dict[str, Any]]:
    return run_world(WORLD, _modules_on_rank, timeout=60)


def _oracle() -> tuple[float, float, int]:
    replicated, sharded = _full_grads()
    both = torch.cat([replicated.flatten(), sharded.flatten()])  # each element of the unsharded model once
    return float(both.norm()), float(both.abs().max()), int((both == 0).sum())


def test_a_dense_models_statistics_read_no_expert_field(results: list[dict[str, Any]]) -> None:
    norm, largest, zeros = _oracle()
    for rank, out in enumerate(results):
        assert out["norm"] == pytest.approx(norm, rel=1e-6), (rank, out["norm"])
        assert out["again"] == pytest.approx(norm, rel=1e-6), (rank, out["again"])
        assert out["from_megatron"] == pytest.approx(norm, rel=1e-6), (rank, out["from_megatron"])
        assert out["inf norm"] == pytest.approx(largest, rel=1e-6), (rank, out["inf norm"])
        assert out["zeros"] == zeros, (rank, out["zeros"])


def test_the_has_experts_verdict_is_the_same_on_every_rank(results: list[dict[str, Any]]) -> None:
    for rank, out in enumerate(results):
        message = out["expert on rank 0"]
        if rank < TP:  # rank 0's mp group: its TP peer without experts asks for the expert fields too
            assert message.startswith("RuntimeError: grad_norm needs process group 'expt_gtp_remat'"), (rank, message)
        else:  # the other replica holds no expert parameter on any rank of its mp group
            assert message == "no error", (rank, message)


def test_a_megatron_multi_module_collection_without_experts_has_its_expert_axes_off(
    modules_results: list[dict[str, Any]],
) -> None:
    norm, _, zeros = _oracle()
    for rank, out in enumerate(modules_results):
        assert out["layout"] == (TP, DP, 1, 1, DP * TP), (rank, out["layout"])
        assert out["off fields"] == (True, True), (rank, out["off fields"])
        assert out["modules norm"] == pytest.approx(norm, rel=1e-6), (rank, out["modules norm"])
        assert out["modules zeros"] == zeros, (rank, out["modules zeros"])
        assert out["optimizer"] == pytest.approx(norm, rel=1e-6), (rank, out["optimizer"])

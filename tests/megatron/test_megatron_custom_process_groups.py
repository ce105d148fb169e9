"""A collection built as Megatron-LM's own ``test_get_megatron_optimizer_with_custom_process_groups`` builds it.

That test (``tests/unit_tests/test_optimizer.py`` in Megatron-LM) makes tp, cp, pp, mp, dp, dp_cp and intra_dist_opt
from a ``DeviceMesh``, sets ``expt_dp`` and ``tp_ep_pp`` to ``None`` ("not using expert parallelism"), gives no
``expt_tp``, and runs ``get_megatron_optimizer`` at TP 2 on a model without experts, after Megatron-Core's global
groups were initialised. Here, in a 4-rank gloo world (DP 2 x TP 2) with a global grid of the same sizes:

* Megatron-Core's own ``get_megatron_optimizer`` takes that collection and computes the grad norm;
* pgregistry's ``build_optimizer`` takes the same groups (assembled by hand, and through ``from_megatron`` of
  Megatron-Core's collection), plain and sharded, reads no expert field the model does not need, and fills none so
  that it contradicts ``tp_ep_pp``: its grad norm is the float64 oracle's (and Megatron-Core's);
* a field filled from the global grid that would contradict a field the collection sets is refused, naming both.

This was refused after the collection started checking composite groups: the optimizer filled ``expt_tp`` from the
global grid (2 ranks), which contradicts ``tp_ep_pp=None`` (1 rank).
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from megatron_support import (
    CudaAllocationsOnTheCpu,
    error_of,
    megatron_initialize,
    megatron_tests_groups,
    require_megatron,
)

require_megatron()

from megatron.core.distributed import DistributedDataParallelConfig  # noqa: E402
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer  # noqa: E402
from megatron.core.process_groups_config import ProcessGroupCollection as MegatronCollection  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402

from pgregistry import registry  # noqa: E402
from pgregistry.collection import ProcessGroupCollection  # noqa: E402
from pgregistry.fallback import ProcessGroupFallbackWarning  # noqa: E402
from pgregistry.global_grid import initialize_global_grid  # noqa: E402
from pgregistry.interop.megatron import from_megatron  # noqa: E402
from pgregistry.layout import ParallelLayout  # noqa: E402
from pgregistry.optim import build_optimizer  # noqa: E402
from pgregistry.params import mark_expert  # noqa: E402
from pgregistry.testing import run_world  # noqa: E402

WORLD, TP, DP = 4, 2, 2
SHAPE = (6, 5)


def _grad() -> torch.Tensor:
    """The (DP-reduced) grad of the replicated weight, the same on every rank."""
    generator = torch.Generator().manual_seed(29)
    return torch.randn(SHAPE, generator=generator, dtype=torch.float64)


def _model() -> torch.nn.Module:
    model = torch.nn.Linear(SHAPE[1], SHAPE[0], bias=False)
    model.weight.grad = _grad().to(torch.float32)
    return model


def _instance_group() -> Any:
    """Every rank of the one optimizer instance (Megatron-Core's intra_dist_opt): TP x PP x DP x CP."""
    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("instance",))
    return mesh.get_group("instance")


def _norm(collection: ProcessGroupCollection, **options: Any) -> tuple[float, float]:
    """(grad norm, largest distance of the stepped weight from the float64 SGD step) of pgregistry's optimizer."""
    model = torch.nn.Linear(SHAPE[1], SHAPE[0], bias=False)
    before = model.weight.detach().to(torch.float64).clone()
    optimizer = build_optimizer(model, collection, optimizer="sgd", lr=0.1, **options)
    if model.weight.grad is None:
        model.weight.grad = torch.zeros_like(model.weight)
    model.weight.grad.copy_(_grad())
    optimizer.sync_grads()  # an average over DP of equal grads
    norm = float(optimizer.get_grad_norm())
    optimizer.step()
    return norm, float((model.weight.detach().to(torch.float64) - (before - 0.1 * _grad())).abs().max())


def _fallbacks_raise() -> bool:
    """Whether the run makes every fallback an error (the suite's setting, and migration mode's; a run that asks
    ``-W default::pgregistry.ProcessGroupFallbackWarning`` does not): the first filter that applies says."""
    for action, message, category, module, _ in warnings.filters:
        if issubclass(ProcessGroupFallbackWarning, category) and message is None and module is None:
            return action == "error"
    return False


def _on_rank() -> dict[str, Any]:
    raising = _fallbacks_raise()
    warnings.simplefilter("ignore")  # Megatron-Core's notices about optional packages
    warnings.simplefilter("error", ProcessGroupFallbackWarning)  # no field the model does not need is read
    if not raising:
        # A Megatron-Core that ``pgregistry migrate`` rewrote warns where its own code still passes no collection
        # (its optimizer filters GTP duplicates through the global grid): Megatron-Core's fallback, not
        # pgregistry's, shown rather than raised when the run asks fallbacks to be shown. The released package
        # never warns, so this changes nothing for it.
        warnings.filterwarnings("default", category=ProcessGroupFallbackWarning, module=r"megatron\.")
    out: dict[str, Any] = {}
    initialize_global_grid(ParallelLayout(num_ranks=WORLD, tp=TP))
    with megatron_initialize({"tp": TP}):
        groups = megatron_tests_groups(DP, TP)
        theirs = MegatronCollection()
        for name, group in groups.items():
            setattr(theirs, name, group)
        model = _model()
        model.ddp_config = DistributedDataParallelConfig()  # type: ignore[assignment]  # what Megatron-Core reads
        with CudaAllocationsOnTheCpu():
            optimizer = get_megatron_optimizer(
                OptimizerConfig(optimizer="sgd", lr=0.1), [model], use_gloo_process_groups=False,
                pg_collection=theirs,
            )
            out["megatron"] = float(optimizer.get_grad_norm())
        mine = ProcessGroupCollection(**groups)
        out["by hand"] = _norm(mine)
        out["sharded over dp_cp"] = error_of(lambda: _norm(mine, sharded=True))
        out["sharded"] = _norm(mine.evolve(intra_dist_opt=_instance_group()), sharded=True)
        out["from_megatron"] = _norm(from_megatron(theirs))
    # The same collection where the global grid contradicts it: expt_tp must be filled for an expert model, and
    # tp_ep_pp (2 ranks, ep and pp off) leaves it 2 ranks; the global grid's is 1.
    registry.destroy()
    out["no global grid"] = _norm(mine)  # nothing the model needs is missing: no grid to read is needed either
    initialize_global_grid(ParallelLayout(num_ranks=WORLD))
    expert = _model()
    mark_expert(expert.weight)
    contradicted = ProcessGroupCollection(**{**groups, "tp_ep_pp": groups["tp"], "ep": None, "expt_dp": groups["dp"]})
    warnings.simplefilter("ignore", ProcessGroupFallbackWarning)
    out["contradiction"] = error_of(lambda: build_optimizer(expert, contradicted, optimizer="sgd", lr=0.1))
    registry.destroy()
    return out


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_world(WORLD, _on_rank, timeout=60)


def test_megatron_tests_collection_builds_an_optimizer_with_the_oracles_norm(results: list[dict[str, Any]]) -> None:
    grad = _grad()
    want = float(grad.norm())  # the weight is replicated over TP: counted once
    for rank, out in enumerate(results):
        assert out["megatron"] == pytest.approx(want, rel=1e-6), rank
        for path in ("by hand", "sharded", "from_megatron", "no global grid"):
            norm, step_error = out[path]
            assert norm == pytest.approx(want, rel=1e-6), (rank, path, norm)
            assert step_error < 1e-6, (rank, path, step_error)


def test_a_sharded_optimizer_over_part_of_its_instance_is_refused_on_every_rank(
    results: list[dict[str, Any]],
) -> None:
    for rank, out in enumerate(results):
        # The test's intra_dist_opt holds dp_cp's ranks: a sharded optimizer would leave the TP peers out of its
        # norm (0 on TP rank 1), so it is refused on every rank.
        assert out["sharded over dp_cp"].startswith(
            f"ValueError: intra_dist_opt must hold every rank of the statistics groups a sharded optimizer reduces "
            f"over it, but on rank {rank} it holds {[rank % TP, rank % TP + TP]}, not this rank's mp group "
            f"{[rank - rank % TP, rank - rank % TP + 1]}"
        ), out["sharded over dp_cp"]


def test_a_filled_field_that_contradicts_a_set_one_is_refused(results: list[dict[str, Any]]) -> None:
    for out in results:
        message = out["contradiction"]
        assert message.startswith("ValueError: build_optimizer needs process group 'expt_tp'"), message
        assert "'tp_ep_pp'" in message and "pass expt_tp" in message, message

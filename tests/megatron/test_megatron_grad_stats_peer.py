"""pgregistry's grad norm and zero count equal Megatron-Core's own, computed by Megatron-Core's optimizer code.

The peer is Megatron-Core itself: ``get_megatron_optimizer`` builds its dense and expert optimizers over the model,
given pgregistry's collection (``to_megatron``) as its process groups, and its ``get_grad_norm`` and
``count_zeros`` filter the grads with its own rules (``param_is_not_shared``,
``param_is_not_tensor_parallel_duplicate`` with the TP and expert TP groups, ``param_is_not_gtp_duplicate`` with
the GTP-remat ranks of its own ``initialize_model_parallel``) and reduce them with its own
``get_grad_norm_fp32`` and ``count_zeros_fp32`` over its own groups (model-parallel for dense grads,
expert-tensor-model-pipeline for expert grads), combining the two norms as its ``ChainedOptimizer`` does.

The model is the toy model of every kind of parameter (``pgregistry.testing._toy_models``: TP, GTP-remat and expert
TP shards, routed experts over EP, a LoRA factor shared by all experts, pipeline stages with a tied embedding),
with random float32 grads (a third of the elements zero, one tensor all zero) that make every replica of a piece
agree, in 8-rank gloo worlds with pipeline, context and GTP-remat parallelism. Both are also checked against the
float64 oracle of the unsharded grads.

Megatron-Core allocates its scalars with ``device='cuda'``; on a machine without a GPU, a torch function mode puts
those allocations on the CPU (every computation is still Megatron-Core's).
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import pytest
import torch.distributed as dist
from fixtures.unsharded_oracle import oracle_norm, oracle_zeros
from megatron_support import CudaAllocationsOnTheCpu, megatron_initialize, require_megatron

require_megatron()

from megatron.core.distributed import DistributedDataParallelConfig  # noqa: E402
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer  # noqa: E402

from pgregistry import (  # noqa: E402
    count_zeros,
    grad_norm,
    registry,  # noqa: E402
)
from pgregistry.interop.megatron import to_megatron  # noqa: E402
from pgregistry.layout import ParallelLayout  # noqa: E402
from pgregistry.testing import run_world  # noqa: E402
from pgregistry.testing._toy_models import full_grads, local_model  # noqa: E402

WORLD = 8

LAYOUTS: dict[str, dict[str, Any]] = {
    "tp2-pp2-cp2-ep2-etp1": {"tp": 2, "pp": 2, "cp": 2, "ep": 2, "expt_tp": 1},
    "gtp2-pp2-ep2-etp1-egtp2": {"gtp_remat": 2, "pp": 2, "ep": 2, "expt_tp": 1, "expt_gtp_remat": 2},
    "tp2-gtp2-cp2-ep4-etp1": {"tp": 2, "gtp_remat": 2, "cp": 2, "ep": 4, "expt_tp": 1},
}


def _both_on_this_rank() -> dict[str, tuple[float, int, float, int]]:
    """Layout name -> (pgregistry's norm and zero count, Megatron-Core's norm and zero count) on this rank."""
    warnings.simplefilter("ignore")  # Megatron-Core's notices about optional packages (Apex, Transformer Engine)
    grads = full_grads("random")
    out = {}
    for name, sizes in LAYOUTS.items():
        layout = ParallelLayout(num_ranks=dist.get_world_size(), **sizes)
        model, _ = local_model(layout, dist.get_rank(), grads)
        try:
            pg = registry.build(layout, name=name)
            ours = float(grad_norm(model, pg)), int(count_zeros(model, pg))
            with megatron_initialize(sizes), CudaAllocationsOnTheCpu():
                model.ddp_config = DistributedDataParallelConfig()  # what get_megatron_optimizer reads of a chunk
                config = OptimizerConfig(optimizer="sgd", lr=0.1, log_num_zeros_in_grad=True)
                optimizer = get_megatron_optimizer(
                    config, [model], use_gloo_process_groups=False, pg_collection=to_megatron(pg)
                )
                theirs = float(optimizer.get_grad_norm()), int(optimizer.count_zeros())
        finally:
            registry.destroy()
        out[name] = (*ours, *theirs)
    return out


@pytest.fixture(scope="module")
def both() -> list[dict[str, tuple[float, int, float, int]]]:
    return run_world(WORLD, _both_on_this_rank, timeout=60.0)


@pytest.mark.parametrize("name", LAYOUTS)
def test_grad_norm_and_zero_count_equal_megatron_cores_own(
    name: str, both: list[dict[str, tuple[float, int, float, int]]]
) -> None:
    grads = full_grads("random")
    want_norm, want_zeros = oracle_norm(grads, 2.0), oracle_zeros(grads)
    assert math.isfinite(want_norm) and 0 < want_zeros
    for rank, by_layout in enumerate(both):
        ours_norm, ours_zeros, theirs_norm, theirs_zeros = by_layout[name]
        assert ours_norm == pytest.approx(theirs_norm, rel=1e-6), (name, rank)
        assert ours_zeros == theirs_zeros, (name, rank)
        assert theirs_norm == pytest.approx(want_norm, rel=1e-6) and theirs_zeros == want_zeros, (name, rank)

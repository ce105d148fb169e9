"""torchtitan's Qwen3 MoE, parallelized by torchtitan's own ``parallelize_qwen3`` (FSDP2 + EP, with TP where the
world has room), trained on a ``ParallelDims`` from ``to_parallel_dims``: every rank's grad norm, zero count and
clipping equal those of the unsharded model in float64 (computed here, in the test process, by plain torch),
step after step; torchtitan's own ``clip_grad_norm_(..., ep_enabled=True)`` is compared in the same steps.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.distributed as dist
from titan_support import (
    BATCH,
    build_model,
    close,
    communicators,
    forward_backward,
    global_batch,
    model_config,
    oracle_steps,
    parallelize,
    require_torchtitan,
    use_cpu,
)

require_torchtitan()

from pgregistry import registry  # noqa: E402
from pgregistry.grad_stats import clip_grad_norm_, count_zeros, grad_norm  # noqa: E402
from pgregistry.interop.torchtitan import mark_torchtitan_experts, to_parallel_dims  # noqa: E402
from pgregistry.layout import ParallelLayout  # noqa: E402
from pgregistry.mesh import with_hsdp_groups  # noqa: E402
from pgregistry.testing import run_world  # noqa: E402

STEPS, MAX_NORM, LR = 3, 0.05, 0.5

# name: (world, layout sizes, dp_replicate, spmd_backend)
SHAPES: dict[str, tuple[int, dict[str, int], int, str]] = {
    "8 ranks dp_shard 4 x tp 2, ep 4": (8, {"tp": 2, "ep": 4, "expt_tp": 1}, 1, "partial_dtensor"),
    "4 ranks hsdp 2 x 2, ep 2": (4, {"ep": 2, "expt_tp": 1}, 2, "partial_dtensor"),
}


def _train(sizes: dict[str, int], dp_replicate: int, spmd_backend: str) -> dict[str, Any]:
    use_cpu()
    layout = ParallelLayout(num_ranks=dist.get_world_size(), **sizes)
    pg = registry.build(layout)
    if dp_replicate > 1:
        pg = with_hsdp_groups(pg, dp_replicate)
    before = communicators()
    parallel_dims = to_parallel_dims(pg, spmd_backend=spmd_backend, device_type="cpu")
    created = sorted(set(communicators()) - set(before))
    model = parallelize(build_model(model_config(ep=layout.ep)), parallel_dims)
    marked = mark_torchtitan_experts(model)
    batch_mesh = parallel_dims.get_optional_mesh("batch")
    dp, dp_rank = (1, 0) if batch_mesh is None else (batch_mesh.size(), batch_mesh.get_local_rank())
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    steps = []
    for step in range(STEPS):
        optimizer.zero_grad()
        tokens = global_batch(step, dp)[dp_rank * BATCH : (dp_rank + 1) * BATCH]
        forward_backward(model, tokens, parallel_dims)
        steps.append(_statistics(model, pg, parallel_dims))
        optimizer.step()
    return {"created": created, "marked": marked, "steps": steps}


def _statistics(model: torch.nn.Module, pg: Any, parallel_dims: Any) -> dict[str, Any]:
    from torchtitan.distributed.utils import clip_grad_norm_ as titan_clip

    params = list(model.parameters())
    # torchtitan's own norm first: clipping to infinity scales every grad by 1.
    titan = float(titan_clip(params, math.inf, ep_enabled=parallel_dims.ep_enabled))
    return {
        "norm": float(grad_norm(model, pg)),
        "zeros": count_zeros(model, pg),
        "titan": titan,
        "clip": float(clip_grad_norm_(model, MAX_NORM, pg)),
        "after_clip": float(grad_norm(model, pg)),
    }


@pytest.mark.parametrize("shape", SHAPES)
def test_torchtitan_moe_trains_with_exact_grad_norm_on_every_rank(shape: str) -> None:
    world, sizes, dp_replicate, spmd_backend = SHAPES[shape]
    dp = world // sizes.get("tp", 1)
    expected = oracle_steps(model_config(ep=sizes["ep"]), dp=dp, steps=STEPS, max_norm=MAX_NORM, lr=LR)
    results = run_world(world, _train, sizes, dp_replicate, spmd_backend, timeout=60)
    for rank, out in enumerate(results):
        assert out["created"] == [], f"rank {rank}: to_parallel_dims created communicators {out['created']}"
        assert out["marked"] == 1
        for step, (got, want) in enumerate(zip(out["steps"], expected, strict=True)):
            where = f"rank {rank} step {step}"
            assert close(got["norm"], want["norm"]), (where, got["norm"], want["norm"])
            assert got["zeros"] == want["zeros"] > 0, (where, got["zeros"], want["zeros"])
            assert close(got["clip"], want["norm"]), (where, got["clip"], want["norm"])
            assert close(got["titan"], want["norm"]), (where, got["titan"], want["norm"])
            assert close(got["after_clip"], min(MAX_NORM, want["norm"]), rel=1e-5), where
    assert all(step["norm"] > MAX_NORM for step in expected)  # every step clips

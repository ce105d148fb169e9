"""The docs' torchtitan example (examples/torchtitan_moe.py) on a local 4-rank world: torchtitan's own Qwen3 MoE (its
bfloat16 expert matmuls included) parallelized by torchtitan with FSDP2 + TP 2 + EP 2 on ``to_parallel_dims``'
meshes. pgregistry's norm and zero count equal the float64 statistics of the full grads (gathered here by torch's
own ``full_tensor``), and torchtitan's own norm; the meshes hold one communicator per rank set, plus the second
one expert FSDP needs where its ranks are the dense FSDP ranks (EP = TP, as here)."""

from __future__ import annotations

import math
from typing import Any

import torch.distributed as dist
from titan_support import require_torchtitan

require_torchtitan()

from examples import torchtitan_moe as example  # noqa: E402
from pgregistry.grad_stats import count_zeros, grad_norm  # noqa: E402
from pgregistry.testing import run_world  # noqa: E402


def _on_rank() -> dict[str, Any]:
    from torchtitan.distributed.utils import clip_grad_norm_ as titan_clip_grad_norm_

    _, pg, parallel_dims, model = example.build()
    example.backward(model, example.batch(0, parallel_dims), parallel_dims)
    squares, zeros = 0.0, 0
    for param in model.parameters():
        full = param.grad.full_tensor().double()
        squares += float(full.square().sum())
        zeros += int((full == 0).sum())
    dense = parallel_dims.get_mesh("fsdp").get_group()
    expert = parallel_dims.get_mesh("efsdp").get_group()
    return {
        "truth": (math.sqrt(squares), zeros),
        "pgregistry": (float(grad_norm(model, pg)), count_zeros(model, pg)),
        "torchtitan": float(titan_clip_grad_norm_(list(model.parameters()), math.inf, ep_enabled=True)),
        "fsdp twins": (dist.get_process_group_ranks(dense) == dist.get_process_group_ranks(expert), dense is expert),
    }


def test_torchtitan_example_norm_matches_the_full_grads() -> None:
    for out in run_world(4, _on_rank, timeout=60):
        norm, zeros = out["truth"]
        assert zeros > 0
        assert math.isclose(out["pgregistry"][0], norm, rel_tol=2e-6) and out["pgregistry"][1] == zeros
        assert math.isclose(out["torchtitan"], norm, rel_tol=2e-6)
        assert out["fsdp twins"] == (True, False)  # same ranks, two communicators: FSDP2 needs them apart

"""Helpers for the tests that run the real torchtitan (imported as ``titan_support``).

``make setup`` installs torchtitan 0.3.0 (with the few packages its import needs); without it these tests skip,
unless ``PGREGISTRY_REQUIRE_TORCHTITAN=1`` (set by ``make test``) makes the missing package a failure, so CI can
never pass by skipping them.

The model is the example's (examples/torchtitan_moe.py): torchtitan's own Qwen3 MoE, small, with SDPA as inner
attention; where a test compares with a float64 oracle, its experts are :func:`exact_grouped_experts`, the
expert matmuls in the parameters' dtype (torchtitan's ``GroupedExperts`` rounds them to bfloat16 whatever the
dtype, so sharding, which changes the order tokens reach an expert and splits each expert's grad sum over FSDP
ranks, would move expert grads by bfloat16 rounding). Parameters, their sharding, the token dispatch and the
parallelize function are torchtitan's.
"""

from __future__ import annotations

import functools
import math
import os
import warnings
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.distributed as dist

__all__ = [
    "BATCH",
    "build_model",
    "close",
    "communicators",
    "exact_grouped_experts",
    "forward_backward",
    "global_batch",
    "loss_of",
    "model_config",
    "oracle_steps",
    "parallelize",
    "require_torchtitan",
    "use_cpu",
]

BATCH = 2  # rows per data-parallel rank


def require_torchtitan() -> None:
    """Import torchtitan, or skip the calling test module (fail instead under PGREGISTRY_REQUIRE_TORCHTITAN=1)."""
    try:
        with warnings.catch_warnings():
            # Importing torchtitan compiles FlexAttention's kernel wrapper, whose import of torch's inductor trips
            # torch's own deprecation notices (torch.jit.script_method): torch's, raised once, at import.
            warnings.simplefilter("ignore", DeprecationWarning)
            import torch.testing._internal.distributed.fake_pg  # noqa: F401  # torchtitan's degree-1 dims use it
            import torchtitan.distributed.parallel_dims  # noqa: F401
            import torchtitan.models.qwen3  # noqa: F401
    except ImportError as exc:
        if os.environ.get("PGREGISTRY_REQUIRE_TORCHTITAN") == "1":
            raise
        pytest.skip(f"torchtitan is not importable ({exc}); `make setup` installs it", allow_module_level=True)


def use_cpu() -> None:
    """torchtitan's device type is "cuda" when it finds no accelerator; its mesh building reads it from here."""
    import torchtitan.distributed.parallel_dims as titan_parallel_dims

    titan_parallel_dims.device_type = "cpu"


def communicators() -> list[tuple[int, ...]]:
    """The ranks of every real communicator this process holds, read from torch's process-group registry here in
    the test (not from the code under test): one entry per communicator, fake-backend groups left out."""
    from torch.distributed.distributed_c10d import _world

    return sorted(
        tuple(sorted(dist.get_process_group_ranks(group)))
        for group, (backend, _) in _world.pg_map.items()
        if str(backend) != "fake"
    )


@functools.cache
def exact_grouped_experts() -> type:
    from torchtitan.models.common.moe import GroupedExperts

    class _ExactGroupedExperts(GroupedExperts):
        """torchtitan's ``GroupedExperts`` (same parameters, sharding, init) with each expert's SwiGLU computed in
        the parameters' dtype, one matmul per expert over its rows of ``x_RD`` (rows past the counted ones are
        padding and give zeros)."""

        @dataclass(kw_only=True, slots=True)
        class Config(GroupedExperts.Config):
            pass

        def forward(self, x_RD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
            w1, w2, w3 = (
                w.to_local() if hasattr(w, "to_local") else w for w in (self.w1_EFD, self.w2_EDF, self.w3_EFD)
            )
            rows, start = [], 0
            for expert, count in enumerate(num_tokens_per_expert_E.tolist()):
                x = x_RD[start : start + count]
                start += count
                rows.append((torch.nn.functional.silu(x @ w1[expert].T) * (x @ w3[expert].T)) @ w2[expert].T)
            rows.append(x_RD.new_zeros(x_RD.shape[0] - start, w2.shape[1]))
            return torch.cat(rows)

    return _ExactGroupedExperts


def model_config(*, ep: int, experts: int = 8, layers: int = 1, exact: bool = True) -> Any:
    """The example's small Qwen3 MoE config (torchtitan's sharding set), with :func:`exact_grouped_experts` as its
    experts when ``exact``."""
    from examples.torchtitan_moe import qwen3_moe_config

    config = qwen3_moe_config(ep=ep, experts=experts, layers=layers)
    for layer in config.layers if exact else ():
        stock = layer.moe.routed_experts.inner_experts
        layer.moe.routed_experts.inner_experts = exact_grouped_experts().Config(
            dim=stock.dim, hidden_dim=stock.hidden_dim, num_experts=stock.num_experts,
            param_init=stock.param_init, sharding_config=stock.sharding_config,
        )
    return config


def build_model(config: Any, dtype: torch.dtype = torch.float64) -> torch.nn.Module:
    """The unsharded model, initialised by torchtitan's own init from seed 0: the same weights in every process."""
    torch.manual_seed(0)
    model = config.build()
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    return model.to(dtype)


def parallelize(model: torch.nn.Module, parallel_dims: Any, *, dtype: torch.dtype = torch.float64) -> torch.nn.Module:
    """torchtitan's ``parallelize_qwen3`` (its TP / EP sharding, then FSDP2) with params and reductions in
    ``dtype``. torchtitan's dtype table has no float64, so it gets one in this process."""
    from torchtitan.config import TORCH_DTYPE_MAP, CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import utils as titan_utils
    from torchtitan.models.qwen3 import parallelize_qwen3

    name = str(dtype).removeprefix("torch.")
    TORCH_DTYPE_MAP.setdefault(name, dtype)
    titan_utils.set_spmd_backend(parallel_dims.spmd_backend)
    parallelism = ParallelismConfig(
        data_parallel_replicate_degree=parallel_dims.dp_replicate, data_parallel_shard_degree=parallel_dims.dp_shard,
        tensor_parallel_degree=parallel_dims.tp, expert_parallel_degree=parallel_dims.ep,
        spmd_backend=parallel_dims.spmd_backend,
    )
    training = TrainingConfig(mixed_precision_param=name, mixed_precision_reduce=name)
    return parallelize_qwen3(
        model, parallel_dims=parallel_dims, training=training, parallelism=parallelism,
        compile_config=CompileConfig(), ac_config=None, dump_folder="",
    )


def global_batch(step: int, dp: int) -> torch.Tensor:
    """Step ``step``'s tokens, ``BATCH`` rows per data-parallel rank, rank ``i``'s rows at ``[i * BATCH:]``."""
    from examples.torchtitan_moe import SEQ, VOCAB

    return torch.randint(0, VOCAB, (dp * BATCH, SEQ), generator=torch.Generator().manual_seed(1000 + step))


def loss_of(output: torch.Tensor) -> torch.Tensor:
    """A loss that sums over tokens, so the data-parallel ranks' grads add up to the global batch's."""
    full = output.full_tensor() if hasattr(output, "full_tensor") else output
    return full.square().sum() / BATCH


def forward_backward(model: torch.nn.Module, tokens: torch.Tensor, parallel_dims: Any = None) -> None:
    from torchtitan.distributed import full_dtensor
    from torchtitan.distributed import utils as titan_utils

    if parallel_dims is not None and parallel_dims.spmd_backend == "full_dtensor":
        # As torchtitan's trainer does: under full_dtensor the model takes its inputs as DTensors.
        tokens = full_dtensor.parallelize_inputs(parallel_dims, tokens, tokens, {})[0]
    with titan_utils.get_spmd_context(parallel_dims=parallel_dims)():
        loss_of(model(tokens)).backward()


def oracle_steps(config: Any, *, dp: int, steps: int, max_norm: float, lr: float) -> list[dict[str, Any]]:
    """The unsharded model in float64 on this process, trained ``steps`` SGD steps on the global batches with its
    grads clipped to ``max_norm``: per step the grad norm and zero count before clipping (plain torch)."""
    model = build_model(config)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    out = []
    for step in range(steps):
        optimizer.zero_grad()
        forward_backward(model, global_batch(step, dp))
        grads = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])
        norm = float(grads.norm())
        out.append({"norm": norm, "zeros": int((grads == 0).sum())})
        for param in model.parameters():
            if param.grad is not None:
                param.grad.mul_(min(1.0, max_norm / (norm + 1e-6)))
        optimizer.step()
    return out


def close(a: float, b: float, rel: float = 2e-6) -> bool:
    """pgregistry accumulates norms in float32: equal to float64 within a few float32 ulps."""
    return math.isclose(a, b, rel_tol=rel)

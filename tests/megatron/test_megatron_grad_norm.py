"""pgregistry.grad_norm / count_zeros on a real Megatron-Core MoE GPTModel built with ``to_megatron(pg)``.

The model is Megatron-Core's own (local layer spec, sequential experts, CPU initialisation), sharded by TP, EP and
expert TP as Megatron-Core shards it and carrying the parameter attributes Megatron-Core sets. Every gradient
element of a parameter is set to a value that depends only on the parameter's name in the unsharded model (a routed
expert's local index mapped to its global one), so the replicas of a piece agree and the shards of a parameter
together hold its whole. The oracle is float64 over the unsharded model, built by Megatron-Core in a 1-rank world:
sum over its parameters of numel x value^2, and the numel of the parameters whose value is zero.
"""

from __future__ import annotations

import math
import re
import zlib
from typing import Any

import pytest
import torch
from megatron_support import require_megatron

require_megatron()

from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

from pgregistry import count_zeros, grad_norm, registry  # noqa: E402
from pgregistry.collection import group_rank, group_size  # noqa: E402
from pgregistry.interop.megatron import mark_megatron_experts, megatron_config_kwargs, to_megatron  # noqa: E402
from pgregistry.layout import ParallelLayout  # noqa: E402
from pgregistry.testing import run_world  # noqa: E402

NUM_EXPERTS = 4
LAYOUTS: dict[str, dict[str, int]] = {
    "tp2-ep2-etp1": {"tp": 2, "ep": 2, "expt_tp": 1},
    "tp2-ep2-etp2": {"tp": 2, "ep": 2, "expt_tp": 2},
    "ep4-etp1": {"ep": 4, "expt_tp": 1},
}
_LOCAL_EXPERT = re.compile(r"\.local_experts\.(\d+)\.")


def _value(name: str) -> float:
    """The gradient value of every element of the parameter called ``name`` in the unsharded model; a third of
    the parameters get 0, so the zero count is tested on a mix."""
    digest = zlib.crc32(name.encode())
    return 0.0 if digest % 3 == 0 else 1.0 + (digest % 7) / 4.0


def _model(layout: ParallelLayout) -> tuple[GPTModel, Any]:
    pg = registry.build(layout)
    config = TransformerConfig(
        num_layers=2, hidden_size=16, ffn_hidden_size=32, num_attention_heads=4, num_moe_experts=NUM_EXPERTS,
        moe_router_topk=2, moe_token_dispatcher_type="allgather", add_bias_linear=False,
        use_cpu_initialization=True, params_dtype=torch.float32, **megatron_config_kwargs(layout),
    )
    spec = get_gpt_layer_local_spec(num_experts=NUM_EXPERTS, moe_grouped_gemm=False)
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=64, max_sequence_length=8,
                     pg_collection=to_megatron(pg))
    return model, pg


def _unsharded_on_rank() -> dict[str, int]:
    model, _ = _model(ParallelLayout(num_ranks=1))
    registry.destroy()
    return {name: param.numel() for name, param in model.named_parameters()}


def _stats_on_rank(layout_sizes: dict[str, int]) -> dict[str, Any]:
    layout = ParallelLayout(num_ranks=torch.distributed.get_world_size(), **layout_sizes)
    model, pg = _model(layout)
    local_experts = NUM_EXPERTS // group_size(pg.get("ep"))
    first_expert = group_rank(pg.get("ep")) * local_experts
    for name, param in model.named_parameters():
        unsharded_name = _LOCAL_EXPERT.sub(lambda m: f".local_experts.{first_expert + int(m.group(1))}.", name)
        param.grad = torch.full_like(param, _value(unsharded_name))
    out: dict[str, Any] = {
        "marked": mark_megatron_experts(model),
        "norm": float(grad_norm(model, pg)),
        "zeros": float(count_zeros(model, pg)),
    }
    # A copy that lost the expert role (Megatron-LM PR 6470) would count as dense: the marked module refuses it.
    expert_name, expert = next((n, p) for n, p in model.named_parameters() if ".local_experts." in n)
    del expert.allreduce
    try:
        grad_norm(model, pg)
        out["lost_role"] = "no error"
    except ValueError as exc:
        out["lost_role"] = str(exc)
    out["expert_name"] = expert_name
    registry.destroy()
    return out


@pytest.fixture(scope="module")
def unsharded_numel() -> dict[str, int]:
    return run_world(1, _unsharded_on_rank, timeout=60)[0]


@pytest.mark.parametrize("name", LAYOUTS)
def test_grad_norm_of_a_megatron_moe_model_matches_the_float64_oracle(
    name: str, unsharded_numel: dict[str, int]
) -> None:
    want_norm = math.sqrt(math.fsum(n * _value(p) ** 2 for p, n in unsharded_numel.items()))
    want_zeros = sum(n for p, n in unsharded_numel.items() if _value(p) == 0.0)
    assert 0 < want_zeros < sum(unsharded_numel.values())
    for rank, stats in enumerate(run_world(4, _stats_on_rank, LAYOUTS[name], timeout=60)):
        assert stats["norm"] == pytest.approx(want_norm, rel=1e-6), (name, rank)
        assert stats["zeros"] == want_zeros, (name, rank)
        assert stats["marked"] == 2, (name, rank)  # one MoE layer per decoder layer
        assert "carry no EP classification" in stats["lost_role"] and stats["expert_name"] in stats["lost_role"]

"""copy_param_roles carries every attribute Megatron-Core's own copy helpers carry (read from Megatron-Core)."""

from __future__ import annotations

import torch
from megatron_support import require_megatron

require_megatron()

from megatron.core.tensor_parallel import layers as megatron_layers  # noqa: E402

from pgregistry.params import ROLE_ATTRIBUTES, copy_param_roles  # noqa: E402

# Every attribute name either library is known to set on parameters; the test asks Megatron-Core which it copies.
_CANDIDATES = (
    *megatron_layers._MODEL_PARALLEL_ATTRIBUTE_DEFAULTS,
    "is_gtp_weight_remat", "allreduce", "pad_length", "shared", "sequence_parallel", "main_grad",
    *ROLE_ATTRIBUTES,
)


def _with_every_candidate() -> torch.Tensor:
    source = torch.zeros(2)
    for index, name in enumerate(_CANDIDATES):
        setattr(source, name, f"value-{index}")
    return source


def _copied(copy: object) -> set[str]:
    source, destination = _with_every_candidate(), torch.zeros(2)
    copy(destination, source)  # type: ignore[operator]
    return {name for name in _CANDIDATES if getattr(destination, name, None) == getattr(source, name)}


def test_copy_param_roles_copies_what_megatrons_helpers_copy() -> None:
    megatron = _copied(megatron_layers.copy_tensor_model_parallel_attributes) | _copied(
        megatron_layers.copy_gtp_attributes
    )
    ours = _copied(lambda destination, source: copy_param_roles(source, destination))
    assert {"is_qkv", "qkv_split_shapes", "expert_tp", "allreduce", "is_gtp_weight_remat"} <= megatron
    assert megatron <= ours, sorted(megatron - ours)
    assert "pad_length" in ours  # a GTP shard's padding, which Megatron-Core's checkpointing reads


def test_mark_megatron_experts_given_a_parameter_says_to_mark_it_with_mark_expert() -> None:
    import pytest

    from pgregistry.interop.megatron import mark_megatron_experts

    with pytest.raises(TypeError, match=r"takes the model \(an nn.Module\), but was given a Parameter; .*mark_expert"):
        mark_megatron_experts(torch.nn.Parameter(torch.zeros(2)))  # type: ignore[arg-type]

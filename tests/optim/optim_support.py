"""Helpers of the optimizer tests over :mod:`pgregistry.toy_shards` (the sharded toy model and its oracles)."""

from __future__ import annotations

import torch
from torch import nn

from pgregistry.layout import ParallelLayout
from pgregistry.toy_shards import EXPERT, Shard


def set_main_grads(
    model: nn.Module, shards: list[Shard], grads: dict[str, torch.Tensor], layout: ParallelLayout | None = None
) -> None:
    """Write this rank's shards of ``grads`` into each parameter's ``main_grad`` (its view of the grad buffer).

    With ``layout``, write the raw per-rank grads that ``sync_grads`` turns into ``grads`` when every data-parallel
    replica holds the same: expert grads times ``dp_cp / expt_dp``, since they are divided by the ``dp_cp`` size
    and summed over ``expt_dp`` (a power of two in every test layout, so exact).
    """
    expert_scale = 1.0 if layout is None else layout.dp * layout.cp / layout.expt_dp
    params = dict(model.named_parameters())
    for shard in shards:
        scale = expert_scale if shard.spec.kind == EXPERT else 1.0
        params[shard.local_name].main_grad.copy_(shard.take(grads[shard.full_name]) * scale)

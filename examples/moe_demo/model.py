"""A small MoE model, sharded from a collection, and its float64 unsharded twin (the oracle).

Each layer is ``x -> x + MLP(x * norm) -> + MoE(.)``:

* the dense MLP is tensor-parallel: ``fc1`` column-parallel (rows sharded, ``partition_dim=0``),
  ``fc2`` row-parallel (columns sharded, ``partition_dim=1``); ``norm`` is replicated over TP (a TP
  duplicate);
* the MoE block routes each token to expert ``token_id % num_experts`` (hash routing, so sharded and
  reference runs route identically whatever the precision) and scales the expert's output by a
  learned gate ``num_experts * softmax(x @ router)`` (about 1 on average, so experts weigh as much
  as the dense MLP); the router is a replicated dense parameter. Experts are split over EP ranks,
  ETP 1.

Tokens reach experts the Megatron way: each TP rank takes its chunk of the (TP-replicated) tokens,
the chunks are all-gathered over EP, every rank runs its local experts, the partial outputs are
reduce-scattered back and the chunks gathered over TP again. Every token is then processed exactly
once per EP group.

The loss of a data-parallel rank is the mean squared error of its own tokens, and the global loss
the mean over data-parallel ranks; as in Megatron-Core, dense grads are then averaged over ``dp_cp``
and expert grads summed over ``expt_dp`` and divided by the ``dp_cp`` size (tokens reach experts
across the whole EP group).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import attrs
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup

from examples.moe_demo.comm import (
    enter_sharded,
    gather_distinct,
    gather_replicated,
    leave_sharded,
    scatter_distinct,
    split_replicated,
)
from pgregistry.collection import ProcessGroupCollection, group_rank, group_size

__all__ = ["ReferenceMoE", "ShardedMoE", "ToyMoEConfig", "full_weights", "make_batch", "shard_of"]


@attrs.frozen(slots=True, kw_only=True)
class ToyMoEConfig:
    """Sizes of the demo model and its data."""

    hidden: int = 16
    ffn: int = 32
    expert_ffn: int = 16
    num_experts: int = 8
    num_layers: int = 2
    tokens_per_dp_rank: int = 8
    seed: int = 1234


def full_weights(config: ToyMoEConfig) -> dict[str, torch.Tensor]:
    """The unsharded float64 weights, deterministic in ``config.seed`` (global expert indices in
    names)."""
    gen = torch.Generator().manual_seed(config.seed)

    def normal(*shape: int, fan_in: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64) / math.sqrt(fan_in)

    weights: dict[str, torch.Tensor] = {}
    for layer in range(config.num_layers):
        p = f"layers.{layer}."
        weights[p + "norm"] = 1.0 + 0.1 * torch.randn(
            config.hidden, generator=gen, dtype=torch.float64
        )
        weights[p + "mlp.fc1"] = normal(config.ffn, config.hidden, fan_in=config.hidden)
        weights[p + "mlp.fc2"] = normal(config.hidden, config.ffn, fan_in=config.ffn)
        weights[p + "moe.router"] = normal(config.num_experts, config.hidden, fan_in=config.hidden)
        for e in range(config.num_experts):
            q = f"{p}moe.experts.local_experts.{e}."
            weights[q + "fc1"] = normal(config.expert_ffn, config.hidden, fan_in=config.hidden)
            weights[q + "fc2"] = normal(config.hidden, config.expert_ffn, fan_in=config.expert_ffn)
    return weights


def make_batch(
    config: ToyMoEConfig, step: int, dp_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The global batch of ``step``: inputs, targets (float64) and token ids, ``dp_size`` ranks'
    worth."""
    gen = torch.Generator().manual_seed(config.seed * 1000 + step)
    n = config.tokens_per_dp_rank * dp_size
    x = torch.randn(n, config.hidden, generator=gen, dtype=torch.float64)
    target = torch.randn(n, config.hidden, generator=gen, dtype=torch.float64)
    return x, target, torch.arange(n)


def _moe_reference(
    x: torch.Tensor,
    ids: torch.Tensor,
    router: torch.Tensor,
    experts: Mapping[int, tuple[torch.Tensor, torch.Tensor]],
    num_experts: int,
) -> torch.Tensor:
    choice = ids % num_experts
    gate = num_experts * torch.softmax(x @ router.t(), dim=-1).gather(1, choice.unsqueeze(1))
    out = torch.zeros_like(x)
    for e, (fc1, fc2) in experts.items():
        rows = (choice == e).nonzero(as_tuple=True)[0]
        if rows.numel():
            out = out.index_put((rows,), F.gelu(x[rows] @ fc1.t()) @ fc2.t())
    return out * gate


class ReferenceMoE(nn.Module):
    """The unsharded model in float64: the oracle every sharded run is compared with."""

    def __init__(self, config: ToyMoEConfig, weights: Mapping[str, torch.Tensor]) -> None:
        super().__init__()
        self.config = config
        self.weights = nn.ParameterDict(
            {k.replace(".", "__"): nn.Parameter(v.clone()) for k, v in weights.items()}
        )

    def param(self, name: str) -> nn.Parameter:
        return self.weights[name.replace(".", "__")]

    def named_weights(self) -> dict[str, nn.Parameter]:
        return {k.replace("__", "."): v for k, v in self.weights.items()}

    def loss(self, x: torch.Tensor, target: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        c = self.config
        for layer in range(c.num_layers):
            p = f"layers.{layer}."
            h = x * self.param(p + "norm")
            x = x + F.gelu(h @ self.param(p + "mlp.fc1").t()) @ self.param(p + "mlp.fc2").t()
            q = f"{p}moe.experts.local_experts."
            experts = {
                e: (self.param(f"{q}{e}.fc1"), self.param(f"{q}{e}.fc2"))
                for e in range(c.num_experts)
            }
            x = x + _moe_reference(x, ids, self.param(p + "moe.router"), experts, c.num_experts)
        return ((x - target) ** 2).sum() / x.shape[0]


def shard_of(
    name: str, full: torch.Tensor, pg_collection: ProcessGroupCollection, num_experts: int
) -> torch.Tensor | None:
    """This rank's shard of the unsharded weight ``name`` (``None`` when the expert lives on another
    EP rank)."""
    tp, ep = pg_collection.get("tp"), pg_collection.get("ep")
    if ".local_experts." in name:
        from pgregistry.experts import expert_owner

        global_index = int(name.split(".local_experts.")[1].split(".")[0])
        owner, _ = expert_owner(global_index, num_experts, group_size(ep))
        return full if owner == group_rank(ep) else None
    if name.endswith("mlp.fc1"):
        return full.chunk(group_size(tp), dim=0)[group_rank(tp)]
    if name.endswith("mlp.fc2"):
        return full.chunk(group_size(tp), dim=1)[group_rank(tp)]
    return full


class _Expert(nn.Module):
    """One routed expert: ``fc2(gelu(fc1(x)))``."""

    def __init__(self, fc1: torch.Tensor, fc2: torch.Tensor) -> None:
        super().__init__()
        from pgregistry.params import mark_expert

        self.fc1 = mark_expert(nn.Parameter(fc1))
        self.fc2 = mark_expert(nn.Parameter(fc2))


class _Block(nn.Module):
    """One layer's shards: TP-sharded MLP, replicated norm and router, this rank's experts."""

    def __init__(self, shards: Mapping[str, torch.Tensor], experts: list[_Expert]) -> None:
        super().__init__()
        from pgregistry.params import mark_expert_module, mark_tensor_parallel

        self.norm = nn.Parameter(shards["norm"])
        self.mlp_fc1 = mark_tensor_parallel(nn.Parameter(shards["mlp.fc1"]), partition_dim=0)
        self.mlp_fc2 = mark_tensor_parallel(nn.Parameter(shards["mlp.fc2"]), partition_dim=1)
        self.moe_router = nn.Parameter(shards["moe.router"])
        self.experts = nn.ModuleList(experts)
        mark_expert_module(self.experts)

    def local_experts(self) -> list[_Expert]:
        return [expert for expert in self.experts if isinstance(expert, _Expert)]


class ShardedMoE(nn.Module):
    """The model as one rank holds it under ``pg_collection`` (TP x EP, ETP 1), in ``dtype``.

    Parameter names use *local* expert indices (``local_experts.<i>``), as checkpoints of sharded
    MoE models do; :func:`pgregistry.globalize_expert_keys` turns them into global ones.
    """

    def __init__(
        self,
        config: ToyMoEConfig,
        weights: Mapping[str, torch.Tensor],
        pg_collection: ProcessGroupCollection,
        dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        super().__init__()
        self.config = config
        self.tp: ProcessGroup | None = pg_collection.get("tp")
        self.ep: ProcessGroup | None = pg_collection.get("ep")
        if config.num_experts % group_size(self.ep):
            raise ValueError(
                f"num_experts {config.num_experts} is not "
                f"divisible by the EP size {group_size(self.ep)}"
            )
        self.experts_per_rank = config.num_experts // group_size(self.ep)
        self.first_expert = group_rank(self.ep) * self.experts_per_rank
        self.dtype = dtype
        blocks = []
        for layer in range(config.num_layers):
            p = f"layers.{layer}."
            shards = {}
            for local_name in ("norm", "mlp.fc1", "mlp.fc2", "moe.router"):
                shard = shard_of(
                    p + local_name, weights[p + local_name], pg_collection, config.num_experts
                )
                assert shard is not None  # dense weights live on every rank
                shards[local_name] = shard.to(dtype).clone()
            q = f"{p}moe.experts.local_experts."
            experts = [
                _Expert(
                    weights[f"{q}{e}.fc1"].to(dtype).clone(),
                    weights[f"{q}{e}.fc2"].to(dtype).clone(),
                )
                for e in range(self.first_expert, self.first_expert + self.experts_per_rank)
            ]
            blocks.append(_Block(shards, experts))
        self.layers = nn.ModuleList(blocks)

    def blocks(self) -> list[_Block]:
        return [block for block in self.layers if isinstance(block, _Block)]

    def checkpoint_names(self) -> dict[str, nn.Parameter]:
        """Local checkpoint-style names (``layers.0.moe.experts.local_experts.<local>.fc1``) ->
        parameters."""
        out: dict[str, nn.Parameter] = {}
        for layer, block in enumerate(self.blocks()):
            p = f"layers.{layer}."
            out[p + "norm"] = block.norm
            out[p + "mlp.fc1"] = block.mlp_fc1
            out[p + "mlp.fc2"] = block.mlp_fc2
            out[p + "moe.router"] = block.moe_router
            for local, expert in enumerate(block.local_experts()):
                out[f"{p}moe.experts.local_experts.{local}.fc1"] = expert.fc1
                out[f"{p}moe.experts.local_experts.{local}.fc2"] = expert.fc2
        return out

    def loss(
        self, x: torch.Tensor, target: torch.Tensor, ids: torch.Tensor, normalizer: int
    ) -> torch.Tensor:
        """Sum of squared errors of this data-parallel rank's tokens, divided by ``normalizer``."""
        x = x.to(self.dtype)
        for block in self.blocks():
            h = enter_sharded(x * block.norm, self.tp)
            x = x + leave_sharded(F.gelu(h @ block.mlp_fc1.t()) @ block.mlp_fc2.t(), self.tp)
            x = x + self._moe(x, ids, block)
        return ((x.double() - target) ** 2).sum() / normalizer

    def _moe(self, x: torch.Tensor, ids: torch.Tensor, block: _Block) -> torch.Tensor:
        # The gate is computed on this rank's own (TP-replicated) tokens, before dispatch, so the
        # router's grad is replicated over TP like any dense parameter's.
        gate = self.config.num_experts * torch.softmax(x @ block.moe_router.t(), dim=-1)
        gate = gate.gather(1, (ids % self.config.num_experts).unsqueeze(1))
        tokens = gather_distinct(split_replicated(x, self.tp), self.ep)
        choice = _gather_ids(_chunk_ids(ids, self.tp), self.ep) % self.config.num_experts
        # ``tokens * 0`` rather than zeros_like: the output must depend on the dispatched tokens
        # even when no token reaches this rank's experts, or this rank's backward would skip the EP
        # collectives its peers run.
        out = tokens * 0
        for local, expert in enumerate(block.local_experts()):
            rows = (choice == self.first_expert + local).nonzero(as_tuple=True)[0]
            if rows.numel():
                out = out.index_put((rows,), F.gelu(tokens[rows] @ expert.fc1.t()) @ expert.fc2.t())
        return gather_replicated(scatter_distinct(out, self.ep), self.tp) * gate


def _chunk_ids(ids: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    return ids.chunk(group_size(group), dim=0)[group_rank(group)]


def _gather_ids(ids: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    if group is None:
        return ids
    import torch.distributed as dist

    parts = [torch.empty_like(ids) for _ in range(group_size(group))]
    dist.all_gather(parts, ids.contiguous(), group=group)
    return torch.cat(parts)

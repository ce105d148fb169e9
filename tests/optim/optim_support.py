"""A toy model for optimizer tests: an unsharded float64 truth and one rank's shard of it on any layout.

The unsharded model (:data:`SPECS`) has a TP-sharded dense weight, TP-replicated dense parameters, a LoRA factor
in the expert module replicated across EP, and per-expert weights (expert-TP-sharded) and biases (replicated over
expert TP). With ``pp == 2`` the dense block lives on the first stage and the MoE block on the second, so the
first stage holds no expert parameter. Gradients are drawn per parameter from a generator seeded by its name,
float32-representable, about 30% zeros and one tensor entirely zero, so every rank and the parent reproduce them.

The oracle functions use only the unsharded float64 gradients and never the code under test.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import torch
from torch import nn

from pgregistry.layout import ParallelLayout
from pgregistry.params import mark_expert, mark_expert_module, mark_expert_replicated, mark_tensor_parallel

HIDDEN, EXPERTS = 4, 4


@dataclass(frozen=True)
class Spec:
    name: str
    shape: tuple[int, ...]
    stage: int  # 0: dense block, 1: MoE block (the second pipeline stage when pp == 2)
    tp_dim: int | None = None
    expert: int | None = None  # global expert index
    ep_replicated: bool = False


SPECS: tuple[Spec, ...] = (
    Spec("dense.fc", (8, HIDDEN), 0, tp_dim=0),
    Spec("dense.norm", (HIDDEN,), 0),
    Spec("moe.router", (EXPERTS, HIDDEN), 1),
    Spec("moe.experts.shared_lora", (2, HIDDEN), 1, ep_replicated=True),
    *(Spec(f"moe.experts.{e}.fc", (6, HIDDEN), 1, tp_dim=0, expert=e) for e in range(EXPERTS)),
    *(Spec(f"moe.experts.{e}.bias", (HIDDEN,), 1, expert=e) for e in range(EXPERTS)),
)

ZEROED = "moe.experts.1.bias"


def full_grads(kind: str = "random") -> dict[str, torch.Tensor]:
    """Unsharded float64 gradients: ``random``, ``ones`` or ``zeros``."""
    out: dict[str, torch.Tensor] = {}
    for spec in SPECS:
        if kind in ("ones", "zeros"):
            out[spec.name] = torch.full(spec.shape, 1.0 if kind == "ones" else 0.0, dtype=torch.float64)
            continue
        gen = torch.Generator().manual_seed(zlib.crc32(spec.name.encode()))
        values = torch.randn(spec.shape, generator=gen, dtype=torch.float32)
        keep = torch.rand(spec.shape, generator=gen) >= 0.3
        out[spec.name] = (values * keep).to(torch.float64)
    if kind == "random":
        out[ZEROED] = torch.zeros_like(out[ZEROED])
    return out


def oracle_norm(grads: dict[str, torch.Tensor], p: float = 2.0) -> float:
    flat = torch.cat([g.reshape(-1) for g in grads.values()])
    return float(flat.abs().max()) if math.isinf(p) else float(flat.abs().pow(p).sum().pow(1.0 / p))


def oracle_zeros(grads: dict[str, torch.Tensor]) -> int:
    return sum(int((g == 0).sum()) for g in grads.values())


@dataclass(frozen=True)
class Shard:
    local_name: str
    spec: Spec
    tp_parts: int
    tp_index: int

    def take(self, full: torch.Tensor) -> torch.Tensor:
        if self.spec.tp_dim is None:
            return full
        return full.chunk(self.tp_parts, dim=self.spec.tp_dim)[self.tp_index]


def shards_of(layout: ParallelLayout, rank: int) -> list[Shard]:
    """What ``rank`` holds: its stage's parameters, its EP rank's experts (renumbered locally), TP slices."""
    c = layout.coords(rank)
    per_rank = EXPERTS // layout.ep
    out = []
    for spec in SPECS:
        if layout.pp > 1 and spec.stage != c["pp"]:
            continue
        local_name = spec.name
        if spec.expert is not None:
            if spec.expert // per_rank != c["ep"]:
                continue
            local_name = spec.name.replace(f"experts.{spec.expert}.", f"experts.{spec.expert % per_rank}.")
            out.append(Shard(local_name, spec, layout.etp, c["etp"]))
        else:
            out.append(Shard(local_name, spec, layout.tp, c["tp"]))
    return out


def local_model(layout: ParallelLayout, rank: int, dtype: torch.dtype = torch.float32) -> tuple[nn.Module, list[Shard]]:
    """This rank's model (roles marked, zero weights), modules nested like the names; ``experts`` is marked."""
    root = nn.Module()
    shards = shards_of(layout, rank)
    for shard in shards:
        *path, leaf = shard.local_name.split(".")
        module = root
        for part in path:
            if not hasattr(module, part):
                child = nn.Module()
                if part == "experts":
                    mark_expert_module(child)
                module.add_module(part, child)
            module = getattr(module, part)
        param = nn.Parameter(torch.zeros(shard.take(torch.zeros(shard.spec.shape)).shape, dtype=dtype))
        if shard.spec.tp_dim is not None:
            mark_tensor_parallel(param, shard.spec.tp_dim)
        if shard.spec.expert is not None:
            mark_expert(param)
        elif shard.spec.ep_replicated:
            mark_expert_replicated(param)
        module.register_parameter(leaf, param)
    return root, shards


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
        scale = expert_scale if shard.spec.expert is not None else 1.0
        params[shard.local_name].main_grad.copy_(shard.take(grads[shard.spec.name]) * scale)

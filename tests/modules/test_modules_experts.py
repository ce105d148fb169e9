"""Per-module expert names and checkpoints in the mixed 8-rank job: a vision encoder with experts on ranks 0-3
(TP 2, EP 2), an audio encoder on ranks 2-3 inside its span, the language model with experts on ranks 4-7 (TP 2,
PP 2, EP 2).

Each module is a small MoE stage (Megatron's sequential expert names, ``experts.local_experts.<i>``, and a
TP-sharded projection) on its own layout. Each module numbers its experts over its own EP group: the ranks of a
module together name every expert of that module, whatever the other modules' layouts; were the EP rank read from
another module's collection (or the world), two EP ranks would name their experts alike and one would overwrite the
other in the checkpoint. The three modules' checkpoints, two of them written by overlapping ranks, round trip
exactly.
"""

from __future__ import annotations

import re
import zlib
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from modules_support import JOBS
from torch import nn

from pgregistry import modules as mm
from pgregistry.experts import get_ep_rank_and_size, named_global_parameters
from pgregistry.layout import ParallelLayout
from pgregistry.params import mark_expert, mark_expert_module, mark_tensor_parallel
from pgregistry.testing import run_world

JOB = JOBS["mixed"]
EXPERTS, HIDDEN = 8, 4
NAMING: dict[str, Any] = {name: {"num_experts": EXPERTS, "layer_offsets": [0]} for name in JOB}
_EXPERT = re.compile(r"local_experts\.([0-9]+)\.")


def _whole(module: str, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    generator = torch.Generator().manual_seed(zlib.crc32(f"{module}/{name}".encode()))
    return torch.randn(shape, generator=generator)


def _stage(module: str, layout: ParallelLayout, rank: int) -> nn.Module:
    """Module ``module``'s MoE stage on ``rank``: ``layers.<stage>.`` with a norm, a projection split over TP and
    the rank's ``EXPERTS / ep`` experts (sequential names, numbered from 0 on each EP rank)."""
    c = layout.coords(rank)
    prefix = f"layers.{c['pp']}"
    layer = nn.Module()
    layer.norm = nn.Parameter(_whole(module, f"{prefix}.norm", (HIDDEN,)))
    proj = _whole(module, f"{prefix}.proj", (2 * HIDDEN, HIDDEN)).chunk(layout.tp, 0)[c["tp"]]
    layer.proj = mark_tensor_parallel(nn.Parameter(proj.clone()), 0)
    layer.experts = mark_expert_module(nn.Module())
    per_rank = EXPERTS // layout.ep
    experts = []
    for local in range(per_rank):
        expert = nn.Module()
        weight = _whole(module, f"{prefix}.experts.{c['ep'] * per_rank + local}", (HIDDEN, HIDDEN))
        expert.weight = mark_expert(nn.Parameter(weight))
        experts.append(expert)
    layer.experts.local_experts = nn.ModuleList(experts)
    root = nn.Module()
    root.layers = nn.ModuleDict({str(c["pp"]): layer})
    return root


def _models(modules: mm.MultiModuleCollection, fill: float | None) -> dict[str, Any]:
    rank = dist.get_rank()
    models = {}
    for name in modules.here():
        models[name] = _stage(name, JOB[name], rank)
        if fill is not None:
            with torch.no_grad():
                for param in models[name].parameters():
                    param.fill_(fill)
    return models


def _on_rank(directory: Path) -> dict[str, Any]:
    modules = mm.build_modules(JOB, language_model="language")
    models = _models(modules, None)
    out: dict[str, Any] = {"ep": {}, "experts": {}}
    for name, model in models.items():
        out["ep"][name] = get_ep_rank_and_size(modules[name])
        names = [n for n, _ in named_global_parameters(model, pg_collection=modules[name], **NAMING[name])]
        out["experts"][name] = sorted({int(m.group(1)) for n in names if (m := _EXPERT.search(n))})
    saved = {name: {k: p.detach().clone() for k, p in model.named_parameters()} for name, model in models.items()}
    mm.save_checkpoint(directory, models, modules, naming=NAMING)
    fresh = _models(modules, 0.0)
    mm.load_checkpoint(directory, fresh, modules, naming=NAMING)
    out["round_trip"] = all(
        torch.equal(p, saved[name][k]) for name, model in fresh.items() for k, p in model.named_parameters()
    )
    return out


def test_each_module_names_its_experts_over_its_own_ep_group_and_checkpoints(tmp_path: Path) -> None:
    results = run_world(8, _on_rank, tmp_path, timeout=60)
    for name, layout in JOB.items():
        first, stop = layout.rank_range()
        named: list[int] = []
        for rank in range(first, stop):
            got = results[rank]
            ep_rank = layout.coords(rank)["ep"]
            assert got["ep"][name] == (ep_rank, layout.ep), (rank, name)
            assert got["round_trip"], rank
            experts = got["experts"][name]
            per_rank = EXPERTS // layout.ep
            assert experts == list(range(ep_rank * per_rank, (ep_rank + 1) * per_rank)), (rank, name, experts)
            named += experts
        assert sorted(set(named)) == list(range(EXPERTS)), (name, named)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["audio", "language", "vision"]

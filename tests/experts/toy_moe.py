"""A toy mixture-of-experts model for the expert-naming and resharding tests.

Each layer has a dense part (a norm and a router) and ``num_experts`` experts, of which a rank builds only its
``num_experts // ep_size`` local ones, numbered from 0 as a real EP model does. Layers cycle through the expert
key styles: sequential (``local_experts.<i>.linear_fc1.weight``), grouped with SwiGLU halves
(``linear_fc1.weight<i>_w``/``_v``, ``bias<i>``) and grouped plain (``weight<i>``, ``bias<i>``). A pipeline stage
holds a contiguous slice of the layers and knows its first global layer (``layer_offset``); the first stage has an
embedding, the last a final norm.

Every parameter is recorded in ``catalog`` with the coordinates the test knows it by, from construction alone:
``(global_layer, global_expert, role)`` (``global_expert`` is ``-1`` for dense parameters). Values and gradients
are a pure function of those coordinates, so a model built on any layout can be compared with one built whole.
"""

from __future__ import annotations

import zlib

import torch
from torch import nn

HIDDEN = 4
FFN = 3
NUM_LAYERS = 4
NUM_EXPERTS = 8
STYLES = ("sequential", "grouped_swiglu", "grouped")

Key = tuple[int, int, str]


class Expert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(HIDDEN, FFN)
        self.linear_fc2 = nn.Linear(FFN, HIDDEN)


class SequentialExperts(nn.Module):
    def __init__(self, num_local: int) -> None:
        super().__init__()
        self.local_experts = nn.ModuleList(Expert() for _ in range(num_local))


class GroupedLinear(nn.Module):
    """Per-expert weights as separate parameters ``weight<i>`` (``_w``/``_v`` halves for SwiGLU) and ``bias<i>``."""

    def __init__(self, num_local: int, rows: int, cols: int, swiglu: bool) -> None:
        super().__init__()
        for i in range(num_local):
            for suffix in ("_w", "_v") if swiglu else ("",):
                self.register_parameter(f"weight{i}{suffix}", nn.Parameter(torch.empty(rows, cols)))
            self.register_parameter(f"bias{i}", nn.Parameter(torch.empty(rows)))


class GroupedExperts(nn.Module):
    def __init__(self, num_local: int, swiglu: bool) -> None:
        super().__init__()
        self.linear_fc1 = GroupedLinear(num_local, FFN, HIDDEN, swiglu)
        self.linear_fc2 = GroupedLinear(num_local, HIDDEN, FFN, False)


class Mlp(nn.Module):
    def __init__(self, style: str, num_local: int, num_experts: int) -> None:
        super().__init__()
        self.router = nn.Linear(HIDDEN, num_experts, bias=False)
        if style == "sequential":
            self.experts: nn.Module = SequentialExperts(num_local)
        else:
            self.experts = GroupedExperts(num_local, swiglu=style == "grouped_swiglu")


class Layer(nn.Module):
    def __init__(self, style: str, num_local: int, num_experts: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.mlp = Mlp(style, num_local, num_experts)


class ToyMoE(nn.Module):
    """One pipeline stage (or virtual chunk) of the toy model on one EP rank."""

    def __init__(
        self,
        *,
        ep_rank: int,
        ep_size: int,
        first_layer: int,
        num_layers: int,
        is_first: bool,
        is_last: bool,
        num_experts: int = NUM_EXPERTS,
        set_layer_offset: bool = True,
    ) -> None:
        super().__init__()
        num_local = num_experts // ep_size
        self.num_experts = num_experts
        if set_layer_offset:
            self.layer_offset = first_layer
        if is_first:
            self.embedding = nn.Embedding(5, HIDDEN)
        self.layers = nn.ModuleList(
            Layer(STYLES[(first_layer + i) % len(STYLES)], num_local, num_experts) for i in range(num_layers)
        )
        if is_last:
            self.final_norm = nn.LayerNorm(HIDDEN)
        # Coordinates of every parameter, from construction alone.
        self.catalog: list[tuple[nn.Parameter, Key]] = []
        for name, param in self.named_parameters():
            self.catalog.append((param, _key_of(name, first_layer, ep_rank * num_local)))


def _key_of(name: str, first_layer: int, first_expert: int) -> Key:
    """(global layer, global expert or -1, role): the role drops the layer and expert indices."""
    parts = name.split(".")
    if parts[0] != "layers":
        return (-1, -1, name)
    layer = first_layer + int(parts[1])
    rest = parts[2:]
    if "local_experts" in rest:
        j = rest.index("local_experts")
        expert = first_expert + int(rest[j + 1])
        return (layer, expert, ".".join(rest[:j] + rest[j + 2 :]))
    if "experts" in rest:
        tail = rest[-1]
        kind = "weight" if tail.startswith("weight") else "bias"
        digits = "".join(ch for ch in tail if ch.isdigit())
        role = ".".join(rest[:-1] + [kind + tail[len(kind) + len(digits) :]])
        return (layer, first_expert + int(digits), role)
    return (layer, -1, ".".join(rest))


def build_stage(ep_rank: int, ep_size: int, pp_rank: int, pp_size: int, **kwargs: object) -> ToyMoE:
    """The chunk of pipeline stage ``pp_rank`` on EP rank ``ep_rank``."""
    per_stage = NUM_LAYERS // pp_size
    return ToyMoE(
        ep_rank=ep_rank,
        ep_size=ep_size,
        first_layer=pp_rank * per_stage,
        num_layers=per_stage,
        is_first=pp_rank == 0,
        is_last=pp_rank == pp_size - 1,
        **kwargs,  # type: ignore[arg-type]
    )


def value_of(key: Key, shape: torch.Size, what: str) -> torch.Tensor:
    """A deterministic tensor for ``key`` (``what`` tells values from gradients)."""
    generator = torch.Generator()
    generator.manual_seed(zlib.crc32(repr((key, what)).encode()))
    return torch.randn(shape, generator=generator)


def set_values(model: ToyMoE) -> None:
    """Values from each parameter's coordinates."""
    with torch.no_grad():
        for param, key in model.catalog:
            param.copy_(value_of(key, param.shape, "value"))


def initialise(model: ToyMoE) -> None:
    """Values and gradients from each parameter's coordinates."""
    set_values(model)
    for param, key in model.catalog:
        param.grad = value_of(key, param.shape, "grad")


def names_by_key(model: ToyMoE) -> dict[Key, str]:
    """Coordinates -> the model's ``named_parameters()`` name: the global names, for a model built whole."""
    names = {id(p): n for n, p in model.named_parameters()}
    return {key: names[id(param)] for param, key in model.catalog}


def adam(params: list[nn.Parameter]) -> torch.optim.Adam:
    return torch.optim.Adam(params, lr=0.01, betas=(0.8, 0.9), foreach=False)

"""Toy models for checking grad statistics on a real backend.

Used by ``pgregistry verify`` and ``scripts/gpu_check.py``.

Two models: :func:`dense_and_expert`, one replicated dense scalar and one expert scalar (on a TP =
EP = world, expert TP 1 grid it exposes expert grads filtered with the dense TP group, Megatron-LM
PR 6470), and a model with every kind of parameter, one unsharded float64 "truth" and its shards on
any layout. The test suite builds its models and draws its gradients here too, but computes its
oracles itself (``tests/fixtures/unsharded_oracle.py``), never from this module: what lives here is
the model's definition and its data, not what the right answer is.

The unsharded model is a list of :class:`Spec` (name, shape, how real layers shard it). Its
gradients (:func:`full_grads`) are drawn from one ``torch.Generator`` with one seed,
:data:`GRADS_SEED`, so every rank (and the parent test) reproduces them independently.
:func:`local_model` builds one rank's parameters the way real layers shard them:

* column-parallel weights and biases split dim 0 over TP, row-parallel weights split dim 1;
  GTP-remat weights are split again, dim 0 of the TP shard, over the GTP-remat axis;
* routed experts are split over EP (each rank holds ``E / ep`` whole experts, renumbered locally),
  then over expert TP like dense layers, then over expert GTP-remat;
* per-expert LoRA factors are distinct per expert but not sharded over expert TP; a LoRA factor
  shared by all experts is replicated across EP;
* pipeline stages hold different layers: the embedding on the first stage, the final norm and (tied)
  output on the last; with pp > 1 the last stage holds a ``shared`` copy of the embedding shard, as
  tied embeddings do;
* everything else is replicated across TP, GTP, CP and DP.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch
from torch import nn

from pgregistry.layout import ParallelLayout
from pgregistry.params import (
    mark_expert,
    mark_expert_module,
    mark_expert_replicated,
    mark_gtp_sharded,
    mark_shared,
    mark_tensor_parallel,
)

__all__ = [
    "DENSE",
    "EXPERT",
    "EXPERTS",
    "EXPERT_SHARED",
    "GRADS_SEED",
    "GradKind",
    "ParamKind",
    "ZEROED",
    "Shard",
    "Spec",
    "dense_and_expert",
    "full_grads",
    "local_model",
    "model_specs",
    "set_grads",
    "set_main_grads",
    "shards_of",
]

HIDDEN, FFN, VOCAB, EXPERTS, RANK, LAYERS = 8, 16, 16, 8, 2, 2


class ParamKind(enum.StrEnum):
    """Whether a parameter is dense, a routed expert's, or a factor shared by all experts.

    How a :class:`Spec` shards over the expert axes (:func:`shards_of`): a routed expert's over EP,
    then expert TP and expert GTP-remat; a shared factor replicated across EP; a dense one over the
    dense axes."""

    DENSE = "dense"
    EXPERT = "expert"
    EXPERT_SHARED = "expert_shared"


DENSE, EXPERT, EXPERT_SHARED = ParamKind.DENSE, ParamKind.EXPERT, ParamKind.EXPERT_SHARED


class GradKind(enum.StrEnum):
    """The gradients :func:`full_grads` draws: all ones, all zeros, or seeded random values."""

    ONES = "ones"
    ZEROS = "zeros"
    RANDOM = "random"


@dataclass(frozen=True)
class Spec:
    """One parameter of the unsharded model."""

    name: str
    shape: tuple[int, ...]
    layer: int | str  # a layer index, or "first" / "last" (pipeline edge stages)
    tp_dim: int | None = None
    gtp: bool = False
    kind: ParamKind = ParamKind.DENSE
    expert: int | None = None  # global expert index of a routed-expert parameter


def dense_and_expert(*, device: torch.device | str = "cpu") -> nn.Module:
    """A dense and an expert scalar, whose grads' norm tells the TP groups apart.

    ``model.dense``, a replicated bf16 scalar, and ``model.experts.weight``, a bf16 scalar of a
    marked expert module, both 1. With TP = EP = W and expert TP 1 the unsharded model has 1 + W
    elements: all grads 1 give norm sqrt(1 + W), all grads 0 a zero count of 1 + W; filtering the
    expert grad with the dense TP group gives sqrt(2) and 2."""
    model = nn.Module()
    model.dense = nn.Parameter(torch.ones(1, dtype=torch.bfloat16, device=device))
    model.experts = mark_expert_module(nn.Module())
    model.experts.weight = mark_expert(
        nn.Parameter(torch.ones(1, dtype=torch.bfloat16, device=device))
    )
    return model


def model_specs() -> list[Spec]:
    """The unsharded model: embedding, dense, MoE layer, final norm (output tied to embedding)."""
    h, f = HIDDEN, FFN
    specs = [Spec("embedding.word", (VOCAB, h), "first", tp_dim=0)]
    for layer in range(LAYERS):
        p = f"layers.{layer}"
        specs += [
            Spec(f"{p}.input_norm", (h,), layer),
            Spec(f"{p}.qkv.weight", (3 * h, h), layer, tp_dim=0, gtp=True),
            Spec(f"{p}.qkv.bias", (3 * h,), layer, tp_dim=0),
            Spec(f"{p}.proj.weight", (h, h), layer, tp_dim=1, gtp=True),
            Spec(f"{p}.proj.bias", (h,), layer),
        ]
        if layer == 0:  # a dense MLP: this stage holds no expert at pp > 1
            specs += [
                Spec(f"{p}.mlp.fc1", (f, h), layer, tp_dim=0, gtp=True),
                Spec(f"{p}.mlp.fc2", (h, f), layer, tp_dim=1, gtp=True),
            ]
            continue
        specs.append(Spec(f"{p}.mlp.router", (EXPERTS, h), layer))
        for e in range(EXPERTS):
            q = f"{p}.mlp.experts.{e}"
            specs += [
                Spec(f"{q}.fc1", (f, h), layer, tp_dim=0, gtp=True, kind=EXPERT, expert=e),
                Spec(f"{q}.fc2", (h, f), layer, tp_dim=1, gtp=True, kind=EXPERT, expert=e),
                Spec(f"{q}.lora_a", (RANK, h), layer, kind=EXPERT, expert=e),
            ]
        specs.append(Spec(f"{p}.mlp.experts.shared_lora", (RANK, h), layer, kind=EXPERT_SHARED))
    specs.append(Spec("final_norm", (h,), "last"))
    return specs


ZEROED = "layers.0.proj.bias"
"""A parameter whose whole gradient is zero in the ``random`` gradients.

A tensor with no non-zero element.
"""

GRADS_SEED = 20_261_130
"""The one seed of the ``random`` gradients."""


def full_grads(kind: GradKind | str = GradKind.RANDOM) -> dict[str, torch.Tensor]:
    """Every parameter's unsharded gradient in float64: ``ones``, ``zeros``, or ``random``.

    ``random`` has about 30% of the elements zero, the whole of :data:`ZEROED` zero; values are
    float32-representable, so float32 shards of them are exact."""
    if kind not in set(GradKind):
        raise ValueError(f"unknown gradient kind {kind!r}: one of {', '.join(GradKind)}")
    shapes = {spec.name: spec.shape for spec in model_specs()}
    if kind != GradKind.RANDOM:
        return {
            name: torch.full(shape, float(kind == GradKind.ONES), dtype=torch.float64)
            for name, shape in shapes.items()
        }
    generator = torch.Generator().manual_seed(GRADS_SEED)
    grads = {}
    for name, shape in shapes.items():
        values = torch.randn(shape, generator=generator, dtype=torch.float32)
        values[torch.rand(shape, generator=generator) < 0.3] = 0.0
        grads[name] = values.to(torch.float64)
    grads[ZEROED].zero_()
    return grads


# ----------------------------------------------------------------------------------------- sharding


@dataclass(frozen=True)
class Shard:
    """Where one local parameter comes from: its unsharded name and the slices taken from it."""

    local_name: str
    full_name: str
    cuts: tuple[tuple[int, int, int], ...]  # (dim, parts, index), applied in order
    spec: Spec
    shared_copy: bool = False

    def take(self, full: torch.Tensor) -> torch.Tensor:
        out = full
        for dim, parts, index in self.cuts:
            out = out.chunk(parts, dim=dim)[index]
        return out


def shards_of(layout: ParallelLayout, rank: int) -> list[Shard]:
    """The parameters ``rank`` holds under ``layout``, in a deterministic order."""
    c = layout.coords(rank)
    sizes = layout.axis_sizes()
    first, last = c["pp"] == 0, c["pp"] == sizes["pp"] - 1
    local_experts = EXPERTS // sizes["ep"]
    out: list[Shard] = []
    for spec in model_specs():
        if spec.layer == "first" and not first or spec.layer == "last" and not last:
            continue
        if isinstance(spec.layer, int) and spec.layer * sizes["pp"] // LAYERS != c["pp"]:
            continue
        local_name = spec.name
        cuts: list[tuple[int, int, int]] = []
        if spec.kind == EXPERT:
            assert spec.expert is not None
            if spec.expert // local_experts != c["ep"]:
                continue
            local_name = spec.name.replace(
                f"experts.{spec.expert}.", f"experts.{spec.expert % local_experts}."
            )
            tp, gtp = ("expt_tp", sizes["expt_tp"]), ("expt_gtp_remat", sizes["expt_gtp_remat"])
        else:
            tp, gtp = ("tp", sizes["tp"]), ("gtp_remat", sizes["gtp_remat"])
        if spec.tp_dim is not None:
            cuts.append((spec.tp_dim, tp[1], c[tp[0]]))
        if spec.gtp:
            cuts.append((0, gtp[1], c[gtp[0]]))
        out.append(Shard(local_name, spec.name, tuple(cuts), spec))
    if sizes["pp"] > 1 and last:
        embedding = next(s for s in model_specs() if s.name == "embedding.word")
        out.append(
            Shard(
                "output.weight",
                "embedding.word",
                ((0, sizes["tp"], c["tp"]),),
                embedding,
                shared_copy=True,
            )
        )
    return out


def _mark_roles(param: nn.Parameter, shard: Shard) -> None:
    spec = shard.spec
    if spec.tp_dim is not None:
        mark_tensor_parallel(param, spec.tp_dim)
    if spec.gtp:
        mark_gtp_sharded(param)
    if spec.kind == EXPERT:
        mark_expert(param)
    elif spec.kind == EXPERT_SHARED:
        mark_expert_replicated(param)
    if shard.shared_copy:
        mark_shared(param)


def local_model(
    layout: ParallelLayout,
    rank: int,
    grads: dict[str, torch.Tensor],
    *,
    device: torch.device | str = "cpu",
) -> tuple[nn.Module, list[Shard]]:
    """This rank's model on ``device``, roles marked and float32 grads set.

    Its nested modules are named like the unsharded model's."""
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
        local = shard.take(grads[shard.full_name])
        param = nn.Parameter(torch.zeros(local.shape, dtype=torch.float32, device=device))
        _mark_roles(param, shard)
        param.grad = local.to(device=device, dtype=torch.float32).clone()
        module.register_parameter(leaf, param)
    return root, shards


def set_grads(
    model: nn.Module,
    shards: list[Shard],
    grads: dict[str, torch.Tensor],
    *,
    device: torch.device | str = "cpu",
) -> None:
    """Overwrite the local grads of ``model`` with shards of ``grads``."""
    params = dict(model.named_parameters())
    for shard in shards:
        local = shard.take(grads[shard.full_name])
        params[shard.local_name].grad = local.to(device=device, dtype=torch.float32).clone()


def set_main_grads(
    model: nn.Module, shards: list[Shard], grads: dict[str, torch.Tensor], layout: ParallelLayout
) -> None:
    """Write into each parameter's ``main_grad`` the raw per-rank grads that sync to ``grads``.

    ``main_grad`` is its view of an optimizer's grad buffer; the raw per-rank grads are those that
    the optimizer's ``sync_grads`` turns into this rank's shards of ``grads`` when every
    data-parallel replica holds the same: expert grads are divided by the ``dp_cp`` size and summed
    over ``expt_dp``, so they are written times ``dp_cp / expt_dp`` (a power of two in every layout
    used, so exact)."""
    expert_scale = layout.dp * layout.cp / layout.expt_dp
    params = dict(model.named_parameters())
    for shard in shards:
        scale = expert_scale if shard.spec.kind == EXPERT else 1.0
        main_grad = params[shard.local_name].main_grad  # type: ignore[attr-defined]
        main_grad.copy_(shard.take(grads[shard.full_name]) * scale)

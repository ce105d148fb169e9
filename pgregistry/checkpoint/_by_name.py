"""A rank's parameters and optimizer state keyed by global parameter name, and loading them back.

Every parameter and its optimizer state are keyed by the parameter's global name
(:func:`pgregistry.experts.named_global_parameters`): flat keys ``model/<name>`` and
``optimizer/<name>/<state key>``, which both storage back-ends (:mod:`~pgregistry.checkpoint._rank_files`,
:mod:`~pgregistry.checkpoint._distributed`) write. Each tensor has one writer: for a dense parameter, data-parallel
(``dp_cp``) rank 0 of its replicas; for an expert parameter, expert-data-parallel (``expt_dp``) rank 0.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final, TypeAlias

import attrs
import torch
from torch import nn

from pgregistry._resolve import normalise, resolve
from pgregistry.checkpoint._agreement import agreed
from pgregistry.collection import GroupName, group_rank, group_size
from pgregistry.experts import is_expert_key
from pgregistry.experts._names import GlobalNamer, NamingOptions, checked_naming, global_names
from pgregistry.optim._param_state import ParamState, ParamStateOptimizer, as_param_state_optimizer

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["load_optimizer_state_by_name", "state_by_name"]

Optimizer: TypeAlias = torch.optim.Optimizer | ParamStateOptimizer
"""What the checkpoint functions accept: a ``torch.optim.Optimizer``, or any optimizer pgregistry builds (each is a
:class:`~pgregistry.optim.ParamStateOptimizer`: mixed-precision, sharded or chained)."""

MODEL_PREFIX: Final = "model/"

OPTIMIZER_PREFIX: Final = "optimizer/"

_SHARDED_AXES: Final[tuple[GroupName, ...]] = ("tp", "expt_tp", "gtp_remat", "expt_gtp_remat")
_CHECKPOINT_FALLBACK: Final[tuple[GroupName, ...]] = ("ep", "pp", "dp_cp", "expt_dp", *_SHARDED_AXES)
"""The fields a checkpoint reads: from the global grid, with a warning, when the collection leaves them UNSET."""


@attrs.frozen(slots=True)
class RankModel:
    """One rank's view: its parameters by global name, and which of them it writes."""

    params: dict[str, nn.Parameter]
    writes_dense: bool
    writes_experts: bool

    def writes(self, name: str) -> bool:
        return self.writes_experts if is_expert_key(name) else self.writes_dense


def rank_model(
    model_chunks: nn.Module | Sequence[nn.Module], owner: str, **naming: Unpack[NamingOptions]
) -> RankModel:
    """The door of the checkpoint entry points: this rank's parameters by global name and what it writes, with the
    collection resolved once; ``ValueError`` for a sharded TP/GTP axis or two parameters of one global name
    (``owner`` names the caller in errors and fallback warnings)."""
    checked_naming(naming, owner)
    chunks = normalise(model_chunks).chunks
    if not chunks:
        raise TypeError(f"{owner} expects a model or model chunks, got {type(model_chunks).__name__}")
    collection = resolve(naming.get("pg_collection"), chunks, owner=owner, fallback=_CHECKPOINT_FALLBACK)
    sharded = [name for name in _SHARDED_AXES if group_size(collection.get(name)) > 1]
    if sharded:
        raise ValueError(
            f"{owner} stores whole tensors, but the model's {', '.join(sharded)} axis has more than one rank; "
            "tensor-parallel and GTP-remat shards are not resharded by pgregistry.checkpoint"
        )
    params: dict[str, nn.Parameter] = {}
    namer = GlobalNamer(
        chunks, lambda: collection, num_experts=naming.get("num_experts"), layer_offsets=naming.get("layer_offsets")
    )
    for name, param in global_names(namer):
        if name in params:
            raise ValueError(f"two parameters of the model have the global name {name!r}")
        params[name] = param
    return RankModel(
        params, group_rank(collection.get("dp_cp")) == 0, group_rank(collection.get("expt_dp")) == 0
    )


def agreed_rank_model(
    model_chunks: nn.Module | Sequence[nn.Module], owner: str, naming: NamingOptions
) -> RankModel:
    """:func:`rank_model` in a collective save or load: raising on every rank when it raises on any, since a rank
    whose model cannot be named must not leave the others waiting in the save's or load's collectives."""
    return agreed(
        lambda: rank_model(model_chunks, owner, **naming),
        ValueError(f"{owner}: another rank's model cannot be checkpointed (see its error)"),
    )


def _named_state(optimizer: Optimizer, model: RankModel) -> list[tuple[str, ParamState]]:
    """``(global name, whole state)`` of every parameter ``optimizer`` updates (collective for a sharded one)."""
    by_id = {id(param): name for name, param in model.params.items()}
    out: list[tuple[str, ParamState]] = []
    for param, state in as_param_state_optimizer(optimizer).param_state().items():
        if id(param) not in by_id:
            raise ValueError(f"the optimizer holds a parameter of shape {tuple(param.shape)} not in the model")
        out.append((by_id[id(param)], state))
    return out


def flat_state(model: RankModel, optimizer: Optimizer | None, *, primary_only: bool) -> dict[str, Any]:
    """The flat ``model/<name>`` and ``optimizer/<name>/<state key>`` entries both storage back-ends write
    (``primary_only``: only what this rank writes, so each tensor is stored once over all ranks)."""
    flat: dict[str, Any] = {}
    for name, param in model.params.items():
        if not primary_only or model.writes(name):
            flat[MODEL_PREFIX + name] = param.detach()
    if optimizer is not None:
        for name, state in _named_state(optimizer, model):
            if primary_only and not model.writes(name):
                continue
            for key, value in state.items():
                flat[f"{OPTIMIZER_PREFIX}{name}/{key}"] = value.detach() if isinstance(value, torch.Tensor) else value
    return flat


def split_optimizer_key(key: str) -> tuple[str, str]:
    """``(parameter name, state key)`` of a flat ``optimizer/<name>/<state key>`` key."""
    name, state_key = key[len(OPTIMIZER_PREFIX) :].rsplit("/", 1)
    return name, state_key


def param_name_of_key(key: str) -> str | None:
    """The parameter a flat key stores (``model/<name>``, ``optimizer/<name>/<state key>``); None for another key."""
    if key.startswith(MODEL_PREFIX):
        return key[len(MODEL_PREFIX) :]
    if key.startswith(OPTIMIZER_PREFIX) and "/" in key[len(OPTIMIZER_PREFIX) :]:
        return split_optimizer_key(key)[0]
    return None


def _nested(flat: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """``{"model": {name: tensor}, "optimizer": {name: {state key: value}}}`` from flat checkpoint keys."""
    out: dict[str, dict[str, Any]] = {"model": {}, "optimizer": {}}
    for key, value in flat.items():
        if key.startswith(MODEL_PREFIX):
            out["model"][key[len(MODEL_PREFIX) :]] = value
        elif key.startswith(OPTIMIZER_PREFIX):
            name, state_key = split_optimizer_key(key)
            out["optimizer"].setdefault(name, {})[state_key] = value
    return out


def state_by_name(
    model_chunks: nn.Module | Sequence[nn.Module],
    optimizer: Optimizer | None = None,
    *,
    primary_only: bool = False,
    **naming: Unpack[NamingOptions],
) -> dict[str, dict[str, Any]]:
    """This rank's parameters and optimizer state by global name: ``{"model": {name: tensor},
    "optimizer": {name: {state key: value}}}`` (tensors alias the live ones).

    ``primary_only`` keeps only what this rank writes (one replica of each tensor). ``naming``: ``pg_collection``,
    ``num_experts``, ``layer_offsets`` (:class:`~pgregistry.experts._names.NamingOptions`).
    """
    model = rank_model(model_chunks, "state_by_name", **naming)
    return _nested(flat_state(model, optimizer, primary_only=primary_only))


def apply_flat_state(model: RankModel, optimizer: Optimizer | None, lookup: Mapping[str, Any]) -> None:
    """Copy every parameter (all required) and optimizer state (where present) from flat ``lookup``."""
    nested = _nested(lookup)
    missing = [name for name in model.params if name not in nested["model"]]
    if missing:
        shown = ", ".join(repr(n) for n in missing[:5])
        raise ValueError(f"the checkpoint lacks {len(missing)} of this rank's parameters, e.g. {shown}")
    mismatched = shape_mismatches(model, lookup)
    if mismatched:
        raise ValueError(mismatched[0])
    with torch.no_grad():
        for name, param in model.params.items():
            param.copy_(nested["model"][name])
    if optimizer is not None:
        _load_optimizer(optimizer, model, nested["optimizer"])


def shape_mismatches(model: RankModel, lookup: Mapping[str, Any]) -> list[str]:
    """A message for each parameter of ``model`` whose ``model/<name>`` entry in flat ``lookup`` has another shape
    (checked before anything is copied, so a mismatch is never a partial load)."""
    problems = []
    for name, param in model.params.items():
        source = lookup.get(MODEL_PREFIX + name)
        if source is not None and tuple(source.shape) != tuple(param.shape):
            problems.append(
                f"parameter {name!r} has shape {tuple(param.shape)} but the checkpoint holds {tuple(source.shape)}"
            )
    return problems


def load_optimizer_state_by_name(
    optimizer: Optimizer,
    model_chunks: nn.Module | Sequence[nn.Module],
    state: Mapping[str, Mapping[str, Any]],
    **naming: Unpack[NamingOptions],
) -> None:
    """Load optimizer ``state`` keyed by global name (``{name: {state key: value}}``, as in the ``"optimizer"``
    part of :func:`state_by_name`, saved under any layout) into ``optimizer``.

    Parameters without an entry get an empty state (as before their first step). The values are copied and go
    through the inner ``load_state_dict``, which casts floating state to each parameter's dtype and device. Load
    the model parameters first: a main copy without a saved ``main_param`` is taken from its parameter.
    """
    model = rank_model(model_chunks, "load_optimizer_state_by_name", **naming)
    _load_optimizer(optimizer, model, state)


def _load_optimizer(optimizer: Optimizer, model: RankModel, state: Mapping[str, Mapping[str, Any]]) -> None:
    by_param: dict[torch.Tensor, Mapping[str, Any]] = {
        param: state[name] for name, param in model.params.items() if state.get(name)
    }
    as_param_state_optimizer(optimizer).load_param_state(by_param)

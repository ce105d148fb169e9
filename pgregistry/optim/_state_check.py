"""The strict check of an optimizer's ``load_state_dict``: the whole given state against what the
optimizer holds, decided before anything is copied, so that a refused load leaves the optimizer
exactly as it was.

Every pgregistry optimizer (:class:`~pgregistry.optim.FlatStep`, mixed-precision, sharded, chained;
the optimizers of :class:`~pgregistry.modules.MultiModuleOptimizer`) lists the faults of a state
dict first, all of them (a chained optimizer every child's), and loads only when there are none, as
the checkpoint loaders do (:mod:`pgregistry.checkpoint._strict`): entries missing or extra (main
copies, shard pieces, the state of a parameter), and saved tensors of another shape or dtype than
the ones they would be copied into. A refusal is one ``ValueError`` giving the count and the first
few faults. The check is local: it reads no tensor's values beyond a per-parameter value (``step``)
and runs no collective; the ranks of the optimizer's instance (its replicas and its statistics
groups: :meth:`~pgregistry.optim.FlatOptimizer.load_groups`) then agree on it
(:func:`refuse_agreed`, one small all-reduce), so that every rank refuses or none does: a replica
never loads what another refused (their states would differ from then on), and a sharded load's
all-gather never waits for a rank that refused. The same holds for a load of whole parameter state
(``load_param_state``, :func:`inner_param_state_faults`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any, Final, Protocol

import torch
import torch.distributed as dist

from pgregistry._runtime.agreement import raise_own_or_peers_fault, ranks_label

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = [
    "ChecksItsStateDict",
    "first_few_quoted",
    "inner_param_state_faults",
    "inner_state_faults",
    "missing_and_extra",
    "not_a_dict_of",
    "param_state_key_faults",
    "refuse_agreed",
    "refuse_faults",
    "tensor_faults",
]

_SHOWN: Final = 3
"""How many faults a refusal quotes."""


def refuse_faults(subject: str, faults: Sequence[str]) -> None:
    """``ValueError`` from ``subject`` giving the count and the first few ``faults``, if any.

    ``subject`` is the method refusing. In a distributed world the message names this rank, which
    the other ranks' refusals name too (:func:`refuse_agreed`); nothing when there are no faults."""
    refusal = _refusal_of(subject, faults)
    if refusal is not None:
        raise refusal


def refuse_agreed(
    subject: str, faults: Sequence[str], groups: Sequence[ProcessGroup | None]
) -> None:
    """:func:`refuse_faults` on every rank of ``groups`` alike, before any of them loads.

    One MAX all-reduce of a flag per rank over each group of more than one rank (``None``: an axis
    that is off; :func:`~pgregistry._runtime.agreement.faulty_ranks`), then the ranks with
    ``faults`` raise them, naming themselves, and the others raise naming those ranks; nothing when
    no rank has any. Collective: every rank of ``groups`` calls it, before any of them loads."""
    raise_own_or_peers_fault(_refusal_of(subject, faults), partial(_peers_refusal, subject), groups)


def _refusal_of(subject: str, faults: Sequence[str]) -> ValueError | None:
    """The error :func:`refuse_faults` raises for ``faults``, naming this rank; ``None`` if none."""
    if not faults:
        return None
    shown = "; ".join(faults[:_SHOWN]) + ("; ..." if len(faults) > _SHOWN else "")
    where = f" on rank {dist.get_rank()}" if dist.is_available() and dist.is_initialized() else ""
    return ValueError(
        f"{subject}{where}: the state given does not fit this optimizer "
        f"({len(faults)} fault(s): {shown}); nothing was loaded (load state "
        "saved by an optimizer over the same parameters, dtypes and layout)"
    )


def _peers_refusal(subject: str, faulty: list[int]) -> ValueError:
    """The refusal of a rank whose state fits, naming the ranks ``faulty`` whose state did not."""
    its = "its error" if len(faulty) == 1 else "their errors"
    return ValueError(
        f"{subject}: the state given to {ranks_label(faulty)} does not "
        f"fit its optimizer (see {its}); nothing was loaded on any rank"
    )


def not_a_dict_of(
    what: str, value: Any, keys: Sequence[str], *, written_by: str | None = None
) -> list[str]:
    """Why ``value`` (``what``) is no mapping holding ``keys``, or nothing when it is one.

    The fault names the layout expected, ``{'key': ..., ...}`` with ``keys`` in their order, and
    the method ``written_by`` that writes it."""
    if isinstance(value, Mapping) and set(keys) <= set(value):
        return []
    layout = ", ".join(f"{key!r}: ..." for key in keys)
    output = f" ({written_by} output)" if written_by else ""
    return [f"{what} is no {{{layout}}} dict{output}"]


def missing_and_extra(what: str, saved: Iterable[str], expected: Iterable[str]) -> list[str]:
    """The names of ``expected`` that ``saved`` lacks and those it adds, counted, a few quoted."""
    saved, expected = set(saved), set(expected)
    faults = []
    for verb, names in (("lacks", expected - saved), ("holds unexpected", saved - expected)):
        if names:
            faults.append(f"it {verb} {len(names)} {what}, e.g. {first_few_quoted(names)}")
    return faults


def first_few_quoted(names: Iterable[str], shown: int = _SHOWN) -> str:
    """The first ``shown`` of ``names`` in sorted order, quoted.

    ``, ...`` follows them when there are more."""
    listed = sorted(names)
    return ", ".join(map(repr, listed[:shown])) + (", ..." if len(listed) > shown else "")


def param_state_key_faults(state: Any) -> list[str]:
    """Why ``state`` is no parameter -> state mapping (``param_state()`` output), or nothing.

    A ``load_param_state`` reads the state of each of its parameters with ``state.get(param)``: a
    dict keyed by names would load nothing, silently."""
    if not isinstance(state, Mapping):
        return [f"it is a {type(state).__name__}, not a mapping of parameter -> state"]
    named = [key for key in state if not isinstance(key, torch.Tensor)]
    if named:
        return [
            f"it is keyed by {len(named)} key(s) that are no parameter, e.g. {named[0]!r} "
            f"({type(named[0]).__name__}): key it by the model's parameters (param_state() "
            "output), or load state by name with pgregistry.checkpoint.load_optimizer_state_by_name"
        ]
    return []


def tensor_faults(what: str, value: Any, like: torch.Tensor, *, cast: bool = False) -> list[str]:
    """Why ``value`` (saved as ``what``) cannot be copied into ``like`` unchanged.

    No tensor, another shape or (unless ``cast``: the load casts) another dtype."""
    if not isinstance(value, torch.Tensor):
        return [f"{what} is a {type(value).__name__}, not a tensor"]
    if value.shape != like.shape:
        return [f"{what} has shape {tuple(value.shape)}, this optimizer's {tuple(like.shape)}"]
    if not cast and value.dtype != like.dtype:
        return [f"{what} is {value.dtype}, this optimizer's {like.dtype}"]
    return []


class ChecksItsStateDict(Protocol):
    """What the check needs of an inner optimizer that is no ``torch.optim.Optimizer``.

    That is a :class:`~pgregistry.optim.FlatStep`: the faults of a state dict by its own rules. A
    protocol, so this module needs nothing of the flat step, which itself refuses a load through
    :func:`refuse_faults`."""

    def state_dict_faults(self, state_dict: Mapping[str, Any]) -> list[str]: ...


def inner_state_faults(
    inner: torch.optim.Optimizer | ChecksItsStateDict,
    state_dict: Any,
    tensors: Sequence[torch.Tensor],
    names: Sequence[str],
) -> list[str]:
    """The faults of ``state_dict`` for ``inner`` (a flat step, or a torch optimizer).

    ``inner`` steps ``tensors`` (named ``names``) in its state dict's order. The faults: param
    groups of another size, state of no listed parameter, state for some parameters only, and
    elementwise state (a tensor of one dimension or more) of another shape or dtype than its
    tensor's."""
    if faults := not_a_dict_of("its inner state", state_dict, ("state", "param_groups")):
        return faults
    sizes = [len(group["params"]) for group in state_dict["param_groups"]]
    if not isinstance(
        inner, torch.optim.Optimizer
    ):  # a flat step, whose rules (one group of them) are its own
        faults = inner.state_dict_faults(state_dict)
        if faults:
            return faults
    elif sizes != (held := [len(group["params"]) for group in inner.param_groups]):
        return [f"its param groups hold {sizes} parameters, this optimizer's {held}"]
    ids = [pid for group in state_dict["param_groups"] for pid in group["params"]]
    state = state_dict["state"]
    foreign = [str(pid) for pid in state if pid not in ids]
    faults = []
    if foreign:
        faults.append(
            f"it holds state for {len(foreign)} ids no param "
            f"group lists, e.g. {first_few_quoted(foreign)}"
        )
    lacking = [name for pid, name in zip(ids, names, strict=True) if not state.get(pid)]
    if (
        state and lacking
    ):  # saved after a step: every parameter has state (each has a grad in the buffer)
        faults.append(
            f"it lacks the state of {len(lacking)} parameters, e.g. {first_few_quoted(lacking)}"
        )
    return faults + _elementwise_faults(state, ids, tensors, names, cast=False)


def inner_param_state_faults(
    inner: torch.optim.Optimizer | ChecksItsStateDict,
    state_dict: Any,
    tensors: Sequence[torch.Tensor],
    names: Sequence[str],
) -> list[str]:
    """The faults of whole parameter state ``state_dict`` for ``inner``, as a load of it sees them.

    ``state_dict`` is :func:`~pgregistry.optim._param_state.inner_state_dict` of whole parameter
    state; ``inner`` steps ``tensors`` (named ``names``). The faults: a flat step's own rules
    (:meth:`~pgregistry.optim.FlatStep.state_dict_faults`), and elementwise state (a tensor of one
    dimension or more) of another shape than its tensor's. Not its dtype (the load casts), nor state
    saved for some parameters only (``strict=False`` of a checkpoint gives the others none)."""
    if not isinstance(inner, torch.optim.Optimizer):
        faults = inner.state_dict_faults(state_dict)
        if faults:
            return faults
    ids = [pid for group in state_dict["param_groups"] for pid in group["params"]]
    return _elementwise_faults(state_dict["state"], ids, tensors, names, cast=True)


def _elementwise_faults(
    state: Mapping[Any, Any],
    ids: Sequence[Any],
    tensors: Sequence[torch.Tensor],
    names: Sequence[str],
    *,
    cast: bool,
) -> list[str]:
    """The faults of each parameter's elementwise state against its tensor.

    Elementwise state is a tensor of one dimension or more; its faults are another shape, and
    another dtype unless ``cast`` (a load that casts)."""
    return [
        fault
        for pid, tensor, name in zip(ids, tensors, names, strict=True)
        for key, value in (state.get(pid) or {}).items()
        if isinstance(value, torch.Tensor) and value.dim() > 0
        for fault in tensor_faults(f"state {key!r} of {name}", value, tensor, cast=cast)
    ]

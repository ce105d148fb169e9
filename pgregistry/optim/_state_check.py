"""The strict check of an optimizer's ``load_state_dict``: the whole given state against what the optimizer holds,
decided before anything is copied, so that a refused load leaves the optimizer exactly as it was.

Every pgregistry optimizer (:class:`~pgregistry.optim.FlatStep`, mixed-precision, sharded, chained; the
optimizers of :class:`~pgregistry.modules.MultiModuleOptimizer`) lists the faults of a state dict first, all of
them (a chained optimizer every child's), and loads only when there are none, as the checkpoint loaders do
(:mod:`pgregistry.checkpoint._strict`): entries missing or extra (main copies, shard pieces, the state of a
parameter), and saved tensors of another shape or dtype than the ones they would be copied into. A refusal is one
``ValueError`` giving the count and the first few faults. The check is local: it reads no tensor's values beyond
a per-parameter value (``step``) and runs no collective; only a load that is collective anyway (a sharded
optimizer's, whose all-gather a refusing rank would leave the others waiting in) agrees on it first
(:func:`agreed_faults`), so that every rank refuses or none does.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final

import torch
import torch.distributed as dist

from pgregistry.collection import group_size
from pgregistry.grad_stats import backend_device

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from pgregistry.optim._flat_step import FlatStep

__all__ = ["agreed_faults", "inner_state_faults", "missing_and_extra", "refuse_faults", "tensor_faults"]

_SHOWN: Final = 3
"""How many faults a refusal quotes."""


def refuse_faults(subject: str, faults: Sequence[str]) -> None:
    """``ValueError`` from ``subject`` (the method refusing) giving the count and the first few ``faults``; nothing
    when there are none."""
    if not faults:
        return
    shown = "; ".join(faults[:_SHOWN]) + ("; ..." if len(faults) > _SHOWN else "")
    raise ValueError(
        f"{subject}: the state dict does not fit this optimizer ({len(faults)} fault(s): {shown}); nothing was "
        "loaded (load state saved by an optimizer over the same parameters, dtypes and layout)"
    )


def agreed_faults(faults: list[str], groups: Sequence[ProcessGroup | None]) -> list[str]:
    """``faults``, or (when another rank of ``groups`` found some and this one none) one saying so: one MAX
    all-reduce of a flag per group of more than one rank (``None``: an axis that is off)."""
    flag = 0 if not faults else 1
    for group in groups:
        if group is not None and group_size(group) > 1:
            reduced = torch.tensor([flag], device=backend_device(group))
            dist.all_reduce(reduced, op=dist.ReduceOp.MAX, group=group)
            flag = int(reduced.item())
    if flag and not faults:
        return ["another rank's state does not fit its optimizer (see the error there); every rank refuses alike"]
    return faults


def missing_and_extra(what: str, saved: Iterable[str], expected: Iterable[str]) -> list[str]:
    """The names of ``expected`` that ``saved`` lacks and those it holds besides, counted and a few quoted."""
    saved, expected = set(saved), set(expected)
    faults = []
    for verb, names in (("lacks", expected - saved), ("holds unexpected", saved - expected)):
        if names:
            faults.append(f"it {verb} {len(names)} {what}, e.g. {_some(names)}")
    return faults


def _some(names: Iterable[str]) -> str:
    """The first few of ``names`` in sorted order, quoted."""
    listed = sorted(names)
    return ", ".join(repr(name) for name in listed[:_SHOWN]) + (", ..." if len(listed) > _SHOWN else "")


def tensor_faults(what: str, value: Any, like: torch.Tensor) -> list[str]:
    """Why ``value`` (saved as ``what``) cannot be copied into ``like`` unchanged: no tensor, another shape or
    another dtype."""
    if not isinstance(value, torch.Tensor):
        return [f"{what} is a {type(value).__name__}, not a tensor"]
    if value.shape != like.shape:
        return [f"{what} has shape {tuple(value.shape)}, this optimizer's {tuple(like.shape)}"]
    if value.dtype != like.dtype:
        return [f"{what} is {value.dtype}, this optimizer's {like.dtype}"]
    return []


def inner_state_faults(
    inner: torch.optim.Optimizer | FlatStep, state_dict: Any, tensors: Sequence[torch.Tensor], names: Sequence[str]
) -> list[str]:
    """The faults of ``state_dict`` for ``inner`` (a flat step, or a torch optimizer), which steps ``tensors``
    (named ``names``) in its state dict's order: param groups of another size, state of no listed parameter, state
    for some parameters only, and elementwise state (a tensor of one dimension or more) of another shape or dtype
    than its tensor's."""
    if not isinstance(state_dict, Mapping) or not {"state", "param_groups"} <= set(state_dict):
        return ["its inner state is no {'state': ..., 'param_groups': ...} dict"]
    sizes = [len(group["params"]) for group in state_dict["param_groups"]]
    if not isinstance(inner, torch.optim.Optimizer):  # a flat step, whose rules (one group of them) are its own
        faults = inner.state_dict_faults(state_dict)
        if faults:
            return faults
    elif sizes != (held := [len(group["params"]) for group in inner.param_groups]):
        return [f"its param groups hold {sizes} parameters, this optimizer's {held}"]
    ids = [pid for group in state_dict["param_groups"] for pid in group["params"]]
    state = state_dict["state"]
    foreign = [str(pid) for pid in state if pid not in ids]
    faults = [f"it holds state for {len(foreign)} ids no param group lists, e.g. {_some(foreign)}"] if foreign else []
    lacking = [name for pid, name in zip(ids, names, strict=True) if not state.get(pid)]
    if state and lacking:  # saved after a step: every parameter has state (each has a grad in the buffer)
        faults.append(f"it lacks the state of {len(lacking)} parameters, e.g. {_some(lacking)}")
    for pid, tensor, name in zip(ids, tensors, names, strict=True):
        for key, value in (state.get(pid) or {}).items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                faults.extend(tensor_faults(f"state {key!r} of {name}", value, tensor))
    return faults

"""The strict verdict of a load: what a checkpoint stores against what the loading ranks hold,
decided on every rank before anything is copied.

Both storage back-ends (:mod:`~pgregistry.checkpoint._rank_files`,
:mod:`~pgregistry.checkpoint._distributed`) describe each stored entry by its shape and dtype
(:class:`Stored`, read from a memory-mapped file or from DCP's metadata, no tensor read) and hand
the description to :func:`refuse_misfits`, so every loader refuses the same things alike, naming
them (the count and a few names):

* a parameter of a rank's model that the checkpoint lacks, or stores in another shape (in both
  modes); in another dtype (strict: ``strict=False`` casts on copy);
* with an optimizer given (strict): a parameter the optimizer updates whose optimizer state was not
  saved (a checkpoint saved without an optimizer would otherwise load and leave the optimizer's
  fresh state), and saved optimizer state of a parameter the optimizer does not update;
* (strict) a stored key of a parameter no rank's model holds, or a key that is no parameter: a
  2-layer checkpoint loaded into a 1-layer model, 8 experts into a model of 4.

The verdict is two all-reduces over the ranks of the load: every rank raises (its own error, or one
saying which check another rank failed and naming that rank: one more all-reduce, on a refusal only)
or none does, and none has copied anything yet. Optimizer state saved for a parameter is loaded only
when an optimizer is given: loading the parameters alone out of a full checkpoint is no error. The
values of the optimizer state are checked against the optimizer itself (a misshaped ``exp_avg``)
once they are read, still before anything is copied
(:func:`~pgregistry.checkpoint._by_name.prepare_flat_state_load`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

import attrs
import torch

from pgregistry._runtime.flags import require_flag
from pgregistry.checkpoint._agreement import Scope, digest_of, max_over_ranks, raise_on_every_rank
from pgregistry.checkpoint._by_name import (
    MODEL_PREFIX,
    OPTIMIZED_PREFIX,
    OPTIMIZER_PREFIX,
    Optimizer,
    RankModel,
    param_name_of_key,
)
from pgregistry.optim._base import FlatOptimizer
from pgregistry.optim._chained import ChainedOptimizer
from pgregistry.optim._param_state import as_param_state_optimizer
from pgregistry.optim._state_check import first_few_quoted

__all__ = ["Stored", "check_strict", "refuse_misfits"]

_SHOWN: Final = 5
"""How many names a refusal quotes."""

_NON_STRICT = "pass strict=False to load a subset on purpose"


@attrs.frozen(slots=True)
class Stored:
    """What a load knows of a stored entry before reading it: shape, dtype (``None``: no tensor)."""

    shape: tuple[int, ...] | None = None
    dtype: torch.dtype | None = None

    @classmethod
    def of(cls, value: Any) -> Stored:
        if isinstance(value, torch.Tensor):
            return cls(tuple(value.shape), value.dtype)
        return cls()


def check_strict(strict: object, owner: str) -> None:
    """``TypeError`` unless ``strict`` is ``True`` or ``False``.

    ``strict=None`` (or ``0``) read as false loaded a subset without a word; checked before any
    collective."""
    require_flag(strict, f"{owner}: strict")


def refuse_misfits(
    source: str,
    stored: Mapping[str, Stored],
    model: RankModel,
    optimizer: Optimizer | None,
    strict: bool,
    scope: Scope,
    *,
    parameters: bool = True,
) -> None:
    """``ValueError`` on every rank of ``scope`` unless ``stored`` loads into every rank's model.

    ``stored`` is the entries of ``source`` ("the checkpoint <directory>"), by flat key; they must
    load into every rank's ``model`` (and ``optimizer``) as the module docstring says.
    ``parameters=False``: ``stored`` holds optimizer state only (no parameter is loaded).

    Collective: one all-reduce of a digest of the stored keys (ranks that read different checkpoints
    are refused) and of this rank's faults, then (``strict``) one of a flag per stored key: whether
    this rank holds its parameter."""
    keys = sorted(stored)
    names = [param_name_of_key(key) for key in keys]
    held = set(model.params)
    lacking = _describe_missing(model, stored) if parameters else ""
    misfits = _describe_misfits(model, stored, strict) if parameters else ""
    optimizer_faults = (
        _optimizer_faults(model, stored, optimizer) if strict and optimizer is not None else ""
    )
    digest = digest_of(keys)
    largest, negated_smallest, any_lacking, any_misfit, any_optimizer_fault = max_over_ranks(
        [digest, -digest, int(bool(lacking)), int(bool(misfits)), int(bool(optimizer_faults))],
        scope,
    )
    if (
        largest != -negated_smallest
    ):  # before the flags per key: the ranks' key lists may differ in length
        raise ValueError(
            f"ranks read different checkpoints: every rank must load the same one ({source})"
        )
    for found, own, elsewhere in (
        (any_lacking, lacking, f"{source} lacks parameters of another rank's model"),
        (any_misfit, misfits, f"{source} does not fit another rank's model"),
        (any_optimizer_fault, optimizer_faults, f"{source} does not fit another rank's optimizer"),
    ):
        if found:  # alike on every rank: one more all-reduce names the ranks that found it
            raise_on_every_rank(ValueError(own) if own else None, ValueError(elsewhere), scope)
    if not strict:
        return
    union = max_over_ranks([int(name in held) for name in names], scope)
    unexpected = [key for key, used in zip(keys, union, strict=True) if not used]
    if unexpected:
        raise ValueError(
            f"{source} holds {len(unexpected)} keys no rank's model has, "
            f"e.g. {first_few_quoted(unexpected, _SHOWN)} (another model, "
            f"more layers or more experts than this model's?); {_NON_STRICT}"
        )


def _describe_missing(model: RankModel, stored: Mapping[str, Stored]) -> str:
    missing = [name for name in model.params if MODEL_PREFIX + name not in stored]
    if not missing:
        return ""
    shown = first_few_quoted(missing, _SHOWN)
    return (
        f"the checkpoint lacks {len(missing)} of this rank's parameters, e.g. {shown}"
        f"{_wrapper_hint(missing, stored)}"
    )


def _wrapper_hint(missing: list[str], stored: Mapping[str, Stored]) -> str:
    """Where the checkpoint holds a missing parameter with one segment more or less, say so.

    A model saved through a wrapper (DDP's ``module.``, ``torch.compile``'s ``_orig_mod.``,
    activation checkpointing's ``_checkpoint_wrapped_module.`` inside a layer) and loaded without
    it, or the other way round, lacks every wrapped parameter by name: the message named none of
    the stored keys."""
    held_names = [key[len(MODEL_PREFIX) :] for key in stored if key.startswith(MODEL_PREFIX)]
    held = set(held_names)
    shorter = {variant: name for name in held_names for variant in _one_segment_fewer(name)}
    for name in missing[:_SHOWN]:
        match = shorter.get(name) or next(
            (variant for variant in _one_segment_fewer(name) if variant in held), None
        )
        if match is not None:
            return (
                f" (it holds {match!r}: saved through a wrapper (DDP's module., torch.compile's "
                "_orig_mod., activation checkpointing's _checkpoint_wrapped_module.) and loaded "
                "without it, or the other way round? Save and load the model wrapped alike)"
            )
    return ""


def _one_segment_fewer(name: str) -> list[str]:
    """``name`` with each of its dotted segments left out in turn (``a.b``: ``b``, then ``a``)."""
    segments = name.split(".")
    if len(segments) < 2:
        return []
    return [".".join(segments[:i] + segments[i + 1 :]) for i in range(len(segments))]


def _describe_misfits(model: RankModel, stored: Mapping[str, Stored], strict: bool) -> str:
    """This rank's parameters stored in another shape or not as a tensor.

    With ``strict``, also those stored in another dtype.
    """
    problems = []
    for name, param in model.params.items():
        entry = stored.get(MODEL_PREFIX + name)
        whole = model.whole_shape(name)
        if entry is None:
            continue
        if entry.shape is None:
            problems.append(f"parameter {name!r} is stored as no tensor")
        elif entry.shape != whole:
            problems.append(
                f"parameter {name!r} has shape {whole} but the checkpoint holds {entry.shape}"
            )
        elif strict and entry.dtype != param.dtype:
            problems.append(
                f"parameter {name!r} is {param.dtype} but the checkpoint holds {entry.dtype} (make "
                f"the model {entry.dtype} before loading, or pass strict=False to cast on copy)"
            )
    if len(problems) <= 1:
        return "".join(problems)
    return (
        f"{problems[0]} (and {len(problems) - 1} more parameters "
        f"of this rank do not fit, e.g. {problems[1]})"
    )


def _optimizer_faults(model: RankModel, stored: Mapping[str, Stored], optimizer: Optimizer) -> str:
    """The mismatches between the parameters ``optimizer`` updates and those with saved state.

    Parameters of this rank that ``optimizer`` updates but whose optimizer state the checkpoint did
    not save, and parameters whose state it saved but that ``optimizer`` does not update."""
    saved = {
        param_name_of_key(key)
        for key in stored
        if key.startswith((OPTIMIZED_PREFIX, OPTIMIZER_PREFIX))
    }
    updated_ids = {id(param) for param in params_updated_by(optimizer)}
    updated = [name for name, param in model.params.items() if id(param) in updated_ids]
    unsaved = [name for name in updated if name not in saved]
    foreign = [
        name
        for name, param in model.params.items()
        if name in saved and id(param) not in updated_ids
    ]
    if unsaved and len(unsaved) == len(updated) and not saved:
        return (
            "the checkpoint holds no optimizer state: it was saved without an optimizer; load "
            "it with optimizer=None, or pass strict=False to keep the optimizer's fresh state"
        )
    if unsaved:
        return (
            f"the checkpoint holds no optimizer state for {len(unsaved)} of the parameters this "
            f"rank's optimizer updates, e.g. {first_few_quoted(unsaved, _SHOWN)} (saved with an "
            "optimizer over other parameters?); pass strict=False to keep their fresh state"
        )
    if foreign:
        return (
            f"the checkpoint holds optimizer state for {len(foreign)} parameters this rank's "
            f"optimizer does not update, e.g. {first_few_quoted(foreign, _SHOWN)}; {_NON_STRICT}"
        )
    return ""


def params_updated_by(optimizer: Optimizer) -> list[torch.Tensor]:
    """The model parameters ``optimizer`` updates.

    A pgregistry optimizer's own list: no state is gathered.
    """
    if isinstance(optimizer, ChainedOptimizer):
        return [
            param for child in optimizer.chained_optimizers for param in params_updated_by(child)
        ]
    if isinstance(optimizer, FlatOptimizer):
        return list(optimizer.params)
    if isinstance(optimizer, torch.optim.Optimizer):
        return [param for group in optimizer.param_groups for param in group["params"]]
    return list(as_param_state_optimizer(optimizer).param_state())

"""Optimizer state given by global name (the ``"optimizer"`` part of :func:`~pgregistry.checkpoint.state_by_name`)
loaded into an optimizer, strict as every checkpoint loader (:mod:`~pgregistry.checkpoint._strict`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from torch import nn

from pgregistry.checkpoint._agreement import run_agreed_step
from pgregistry.checkpoint._by_name import (
    OPTIMIZED_PREFIX,
    OPTIMIZER_PREFIX,
    Optimizer,
    agree_on_rank_model,
    checkpoint_scope,
    prepare_optimizer_load,
)
from pgregistry.checkpoint._strict import Stored, refuse_misfits
from pgregistry.experts._names import NamingOptions

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["load_optimizer_state_by_name"]


def load_optimizer_state_by_name(
    optimizer: Optimizer,
    model_chunks: nn.Module | Sequence[nn.Module],
    state: Mapping[str, Mapping[str, Any]],
    *,
    strict: bool = True,
    **naming: Unpack[NamingOptions],
) -> None:
    """Load optimizer ``state`` keyed by global name into ``optimizer``.

    ``state`` is ``{name: {state key: value}}``, as in the ``"optimizer"`` part of
    :func:`state_by_name`, saved under any layout.

    Collective over the ranks of the model's collection (the world, or a module's span), as the checkpoint loaders
    are: ``ValueError`` on every rank, before anything loads, when ``state`` is not such a mapping on some rank,
    or (``strict``, the default) when it has no entry for a parameter the optimizer updates (an entry may be
    empty: :func:`state_by_name` gives one for every parameter the optimizer updated), holds state of a parameter
    of this rank's model the optimizer does not update, or names a parameter no rank's model holds (``state`` may
    hold every rank's: each takes its own). ``strict=False`` gives parameters without an entry an empty state (as
    before their first step) and ignores the rest. Also ``ValueError`` on every rank, before any rank loads
    anything, when a rank's state does not fit its optimizer (an ``exp_avg`` of another shape than its parameter,
    a main copy of another shape), naming that rank. The values are copied and go through the inner
    ``load_state_dict``, which casts floating state to each parameter's dtype and device. Load the model
    parameters first: a main copy without a saved ``main_param`` is taken from its parameter.
    """
    owner = "load_optimizer_state_by_name"
    scope = checkpoint_scope(model_chunks, naming)
    model = agree_on_rank_model(model_chunks, owner, naming, scope)
    stored = run_agreed_step(
        lambda: _describe_state(state),
        ValueError(f"{owner}: another rank's state is not keyed by parameter name"),
        scope,
    )
    refuse_misfits("the optimizer state given", stored, model, optimizer, strict, scope, parameters=False)
    prepare_optimizer_load(optimizer, model, state, scope, owner)()


def _describe_state(state: Mapping[str, Mapping[str, Any]]) -> dict[str, Stored]:
    """The flat keys of ``state`` (a parameter's entry and its state keys), as a checkpoint stores them."""
    if not isinstance(state, Mapping):
        raise TypeError(
            f"load_optimizer_state_by_name takes {{name: {{state key: value}}}}, got {type(state).__name__}"
        )
    flat: dict[str, Stored] = {}
    for name, entries in state.items():
        if not isinstance(name, str) or not isinstance(entries, Mapping):
            raise TypeError(
                f"load_optimizer_state_by_name: the entry {name!r} is a {type(entries).__name__}; each parameter's "
                "state is a mapping of state key -> value"
            )
        flat[OPTIMIZED_PREFIX + name] = Stored()
        for key, value in entries.items():
            flat[f"{OPTIMIZER_PREFIX}{name}/{key}"] = Stored.of(value)
    return flat

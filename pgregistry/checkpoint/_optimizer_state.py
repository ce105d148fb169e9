"""Optimizer state given by global name (the ``"optimizer"`` part of
:func:`~pgregistry.checkpoint.state_by_name`) loaded into an optimizer, strict as every checkpoint
loader (:mod:`~pgregistry.checkpoint._strict`)."""

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
from pgregistry.checkpoint._strict import Stored, check_strict, refuse_misfits
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

    Collective over the ranks of the model's collection (the world, or a module's span), as the
    checkpoint loaders are; every check runs on every rank before any rank loads anything. The
    values are copied and go through the inner ``load_state_dict``, which casts floating state to
    each parameter's dtype and device. Load the model parameters first: a main copy without a saved
    ``main_param`` is taken from its parameter.

    Args:
        optimizer: the optimizer to load into.
        model_chunks: its model, or the model's pipeline chunks, on any layout.
        state: ``{name: {state key: value}}``, as in the ``"optimizer"`` part of
            :func:`state_by_name`, saved under any layout; it may hold every rank's (each takes its
            own).
        strict: refuse a missing entry for a parameter the optimizer updates (an entry may be
            empty), state of a parameter of this rank's model the optimizer does not update, and a
            name no rank's model holds (default); ``False`` gives parameters without an entry an
            empty state (as before their first step) and ignores the rest.
        **naming: ``pg_collection``, ``num_experts``, ``layer_offsets``
            (:class:`~pgregistry.experts._names.NamingOptions`).

    Raises:
        ValueError: on every rank: ``state`` not such a mapping on some rank; with ``strict``, the
            entries above; a rank's state that does not fit its optimizer (an ``exp_avg`` of another
            shape than its parameter, a main copy of another shape), naming that rank.

    Example:
        On every rank of a 2-rank world (as :func:`pgregistry.testing.run_world` starts it), Adam's
        state after a step under one layout loaded into an optimizer under another:

        >>> import torch
        >>> from pgregistry import ParallelLayout, attach, build, build_optimizer
        >>> from pgregistry.checkpoint import state_by_name
        >>> def model_and_optimizer(layout, name):
        ...     model = torch.nn.Linear(2, 1, bias=False)
        ...     attach(model, build(layout, name=name))  # the collection the names are read on
        ...     return model, build_optimizer(model, optimizer="adam")
        >>> model, optimizer = model_and_optimizer(ParallelLayout(num_ranks=2), "old")
        >>> model(torch.tensor([[3.0, 4.0]])).sum().backward()  # the weight's grad is the input
        >>> optimizer.step()
        >>> saved = state_by_name(model, optimizer)["optimizer"]  # under the old layout
        >>> new_model, new_optimizer = model_and_optimizer(ParallelLayout(num_ranks=2, tp=2), "new")
        >>> load_optimizer_state_by_name(new_optimizer, new_model, saved)
        >>> new_optimizer.param_state()[new_model.weight]["exp_avg"]  # (1 - 0.9) x the grad
        tensor([[0.3000, 0.4000]])
    """
    owner = "load_optimizer_state_by_name"
    check_strict(strict, owner)
    scope = checkpoint_scope(model_chunks, naming)
    model = agree_on_rank_model(model_chunks, owner, naming, scope)
    stored = run_agreed_step(
        lambda: _describe_state(state),
        ValueError(f"{owner}: another rank's state is not keyed by parameter name"),
        scope,
    )
    refuse_misfits(
        "the optimizer state given", stored, model, optimizer, strict, scope, parameters=False
    )
    prepare_optimizer_load(optimizer, model, state, scope, owner)()


def _describe_state(state: Mapping[str, Mapping[str, Any]]) -> dict[str, Stored]:
    """The flat keys of ``state`` (a parameter's entry, state keys), as checkpoints store them."""
    if not isinstance(state, Mapping):
        raise TypeError(
            "load_optimizer_state_by_name takes {name: "
            f"{{state key: value}}}}, got {type(state).__name__}"
        )
    flat: dict[str, Stored] = {}
    for name, entries in state.items():
        if not isinstance(name, str) or not isinstance(entries, Mapping):
            raise TypeError(
                f"load_optimizer_state_by_name: the entry {name!r} is a {type(entries).__name__}; "
                "each parameter's state is a mapping of state key -> value"
            )
        flat[OPTIMIZED_PREFIX + name] = Stored()
        for key, value in entries.items():
            flat[f"{OPTIMIZER_PREFIX}{name}/{key}"] = Stored.of(value)
    return flat

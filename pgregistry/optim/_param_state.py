"""One optimizer interface for checkpoints: each model parameter's whole state, keyed by parameter.

:class:`ParamStateOptimizer` is what :mod:`pgregistry.checkpoint` reads and writes, so every
optimizer saves and loads through the same functions: a ``torch.optim.Optimizer`` (through
:class:`TorchOptimizerState`), and the pgregistry optimizers
:func:`~pgregistry.optim.build_optimizer` returns (mixed-precision, sharded, chained), which
implement it themselves. The state of a parameter is whole whatever the optimizer's layout: a
mixed-precision optimizer adds its float32 main copy (``main_param``), a sharded one gathers its
pieces from the ranks of its shard group (collective). A checkpoint therefore holds no layout, and
loads under another one.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, TypeAlias, runtime_checkable

import torch

__all__ = [
    "MAIN_PARAM",
    "ParamState",
    "ParamStateOptimizer",
    "TorchOptimizerState",
    "as_param_state_optimizer",
    "inner_state_dict",
    "load_inner_state",
    "param_state_faults",
]

ParamState: TypeAlias = dict[str, Any]
"""One parameter's optimizer state: state key -> tensor or value.

Adam's are ``step``, ``exp_avg`` and ``exp_avg_sq``.
"""

MAIN_PARAM = "main_param"
"""The state key of a mixed-precision optimizer's main copy of a lower-precision parameter."""


@runtime_checkable
class ParamStateOptimizer(Protocol):
    """An optimizer whose state the checkpoint functions can read and write, parameter by parameter.

    The one interface :mod:`pgregistry.checkpoint` saves and loads through, whatever the optimizer
    shards or flattens: each model parameter's whole state, keyed by the parameter. pgregistry's
    optimizers implement it; :func:`as_param_state_optimizer` wraps a ``torch.optim.Optimizer``.
    A runtime-checkable protocol: ``isinstance`` tells whether an object has both methods.

    Example:
        >>> import torch
        >>> param = torch.nn.Parameter(torch.zeros(2))
        >>> param.grad = torch.tensor([3.0, 4.0])
        >>> optimizer = torch.optim.Adam([param])
        >>> optimizer.step()
        >>> state = as_param_state_optimizer(optimizer).param_state()  # {param: {"exp_avg": ...}}
        >>> state[param]["exp_avg"]  # (1 - 0.9) * grad
        tensor([0.3000, 0.4000])
        >>> other = as_param_state_optimizer(torch.optim.Adam([param]))
        >>> other.load_param_state(state)  # after the model's parameters are loaded
        >>> isinstance(other, ParamStateOptimizer), other.param_state()[param]["exp_avg"]
        (True, tensor([0.3000, 0.4000]))
    """

    def param_state(self) -> dict[torch.Tensor, ParamState]:
        """Model parameter -> its whole state (empty before the first step), for each it updates.

        Collective for a sharded optimizer: every rank of its groups must call it.

        Returns:
            Each parameter -> its state by key (``exp_avg``, ``step``, ``main_param``...), whole
            and shaped like the parameter whatever the optimizer shards.
        """
        ...

    def load_param_state(self, state: Mapping[torch.Tensor, Mapping[str, Any]]) -> None:
        """Restore each parameter's whole state from ``state``, as :meth:`param_state` returns it.

        A parameter without an entry gets an empty state. Call it after the model parameters are
        loaded: a main copy without a saved ``main_param`` is taken from its parameter. Collective
        for a sharded optimizer.

        Args:
            state: parameter -> its state, from :meth:`param_state` of any optimizer over the same
                parameters (another layout, sharding or instance count too).

        Raises:
            ValueError: pgregistry's optimizers: state they cannot load (a tensor of another shape,
                a state a flat step cannot hold), on every rank alike, before anything changes.
        """
        ...


class TorchOptimizerState:
    """:class:`ParamStateOptimizer` over a ``torch.optim.Optimizer``.

    Its ``state`` is keyed by parameter.
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer

    def _inner_params(self) -> list[torch.Tensor]:
        return [param for group in self.optimizer.param_groups for param in group["params"]]

    def param_state(self) -> dict[torch.Tensor, ParamState]:
        return {param: dict(self.optimizer.state.get(param, {})) for param in self._inner_params()}

    def load_param_state(self, state: Mapping[torch.Tensor, Mapping[str, Any]]) -> None:
        load_inner_state(self.optimizer, self._inner_params(), state)

    def param_state_faults(self, state: Mapping[torch.Tensor, Mapping[str, Any]]) -> list[str]:
        """None: torch's ``load_state_dict`` refuses nothing of a state dict numbered like its own.

        It casts, and an optimizer of another rule may keep state of any shape."""
        return []


class StateDictOptimizer(Protocol):
    """What :func:`load_inner_state` needs: an optimizer whose state dict numbers the main params.

    A ``torch.optim.Optimizer``, or a pgregistry flat step
    (:class:`~pgregistry.optim._flat_step.FlatStep`), whose state dict numbers the main params
    alike."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


def load_inner_state(
    optimizer: StateDictOptimizer,
    keys: list[torch.Tensor],
    state: Mapping[torch.Tensor, Mapping[str, Any]],
    *,
    rename: Mapping[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Load ``state`` into ``optimizer`` through ``load_state_dict``.

    ``load_state_dict`` casts floating state to each tensor's dtype and device; it gets
    :func:`inner_state_dict`'s state dict, its values copied."""
    optimizer.load_state_dict(inner_state_dict(optimizer, keys, state, rename=rename, copied=True))


def inner_state_dict(
    optimizer: StateDictOptimizer,
    keys: list[torch.Tensor],
    state: Mapping[torch.Tensor, Mapping[str, Any]],
    *,
    rename: Mapping[torch.Tensor, torch.Tensor] | None = None,
    copied: bool = False,
) -> dict[str, Any]:
    """The state dict of ``optimizer`` holding ``state``, as :func:`load_inner_state` loads it.

    A check reads it first (``copied=False``: the values themselves). ``keys`` are the tensors
    ``optimizer`` steps, in ``param_groups`` order; ``rename`` maps one to the key of its entry in
    ``state`` (a main copy to its model parameter). ``main_param`` is left out."""
    current = optimizer.state_dict()
    ids = [pid for group in current["param_groups"] for pid in group["params"]]
    current["state"] = {}
    for pid, tensor in zip(ids, keys, strict=True):
        entry = state.get((rename or {}).get(tensor, tensor), {})
        values = {
            key: _clone_if_tensor(value) if copied else value
            for key, value in entry.items()
            if key != MAIN_PARAM
        }
        if values:
            current["state"][pid] = values
    return current


def _clone_if_tensor(value: Any) -> Any:
    return value.clone() if isinstance(value, torch.Tensor) else value


def param_state_faults(
    optimizer: ParamStateOptimizer, state: Mapping[torch.Tensor, Mapping[str, Any]]
) -> list[str]:
    """Every reason ``optimizer``'s ``load_param_state`` would refuse ``state``.

    Found without changing anything: its ``param_state_faults`` (every pgregistry optimizer has
    one), else none (an optimizer of another library, whose load is its own). A collective load
    agrees on them before any rank loads (:mod:`pgregistry.checkpoint`)."""
    check = getattr(optimizer, "param_state_faults", None)
    return list(check(state)) if check is not None else []


def as_param_state_optimizer(
    optimizer: torch.optim.Optimizer | ParamStateOptimizer,
) -> ParamStateOptimizer:
    """``optimizer`` as a :class:`ParamStateOptimizer`.

    A torch.optim optimizer is wrapped; one with ``param_state()`` and ``load_param_state()``
    (pgregistry's) is returned as it is.

    Args:
        optimizer: a ``torch.optim.Optimizer`` or a :class:`ParamStateOptimizer`.

    Returns:
        The optimizer, as the one interface the checkpoints read and write.

    Raises:
        TypeError: ``optimizer`` is neither (its type named).

    Example:
        >>> import torch
        >>> weight = torch.nn.Parameter(torch.ones(2))
        >>> sgd = torch.optim.SGD([weight], lr=0.1, momentum=0.9)
        >>> weight.grad = torch.ones(2)
        >>> sgd.step()
        >>> as_param_state_optimizer(sgd).param_state()[weight]  # keyed by the parameter itself
        {'momentum_buffer': tensor([1., 1.])}
    """
    if isinstance(optimizer, ParamStateOptimizer):
        return optimizer
    if isinstance(optimizer, torch.optim.Optimizer):
        return TorchOptimizerState(optimizer)
    raise TypeError(
        "the checkpoint functions take a torch.optim.Optimizer or an optimizer "
        "with param_state() and load_param_state() "
        f"(pgregistry.optim.ParamStateOptimizer), got {type(optimizer).__name__}"
    )

"""A chained optimizer: a child per parameter kind (dense, routed experts), one set of grad stats.

The global norm must count every child's grads, each with its own groups. Every child adds its parts
to one :class:`~pgregistry.grad_stats._reductions.Shares` and the one reducer reduces them: one
all-reduce per distinct group (one in all when every child reduces over the same group: a sharded
optimizer's instance, or ``mp`` and ``tp_ep_pp_with_egtp_remat`` holding the same ranks), both
statistics in it when both are wanted. Nothing combines the children's finished norms. Clipping
scales every child's grads by the one coefficient of the total norm, decided job-wide.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from pgregistry.optim._base import FlatOptimizer, OptimizerStatistics
from pgregistry.optim._param_state import ParamState
from pgregistry.optim._state_check import param_state_key_faults, refuse_agreed

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["ChainedOptimizer"]


class ChainedOptimizer(OptimizerStatistics):
    """Runs ``children`` (e.g. a dense and an expert optimizer) as one optimizer.

    See the module docstring: one step, one set of statistics (the children's shares through one
    reducer), one state dict.

    Args:
        children: the child optimizers.

    Raises:
        ValueError: no child.

    Raises:
        ValueError: no children; a child twice, or a parameter in two children (named).
        TypeError: a child that is no pgregistry flat optimizer.

    Example:
        On every rank of a 2-rank world (as :func:`pgregistry.testing.run_world` starts it):

        >>> import torch
        >>> from pgregistry import ParallelLayout, build
        >>> from pgregistry.optim import MixedPrecisionOptimizer, inner_factory
        >>> from pgregistry.optim import setup_process_groups_for_optimizer
        >>> from pgregistry.params import mark_expert
        >>> dense_params = [torch.nn.Parameter(torch.zeros(2))]
        >>> expert_params = [mark_expert(torch.nn.Parameter(torch.zeros(2)))]
        >>> groups = setup_process_groups_for_optimizer(build(ParallelLayout(num_ranks=2)))
        >>> inner = inner_factory("sgd", lr=0.5)
        >>> dense = MixedPrecisionOptimizer(dense_params, groups, inner=inner)
        >>> experts = MixedPrecisionOptimizer(expert_params, groups, inner=inner, expert=True)
        >>> optimizer = ChainedOptimizer([dense, experts])
        >>> (dense_params[0].sum() + expert_params[0].sum()).backward()  # grads of ones
        >>> optimizer.step()  # both children step
        >>> dense_params[0].detach(), expert_params[0].detach()
        (tensor([-0.5000, -0.5000]), tensor([-0.5000, -0.5000]))
    """

    def __init__(self, children: Sequence[FlatOptimizer]) -> None:
        children = list(children)
        if not children:
            raise ValueError("ChainedOptimizer needs at least one child optimizer")
        for index, child in enumerate(children):
            if not isinstance(child, FlatOptimizer):
                raise TypeError(
                    f"child {index} is a {type(child).__name__}; ChainedOptimizer chains "
                    "pgregistry's flat optimizers (MixedPrecisionOptimizer, ShardedOptimizer)"
                )
        # A child twice, or a parameter in two children, would be counted twice in the norm
        # (sqrt(2) times it) and stepped twice.
        owner: dict[int, int] = {}
        for index, child in enumerate(children):
            again = [j for j, earlier in enumerate(children[:index]) if earlier is child]
            if again:
                raise ValueError(
                    f"child {index} is child {again[0]} again: each child is chained once (its "
                    "grads would be counted twice in the norm and stepped twice)"
                )
            for param in child.params:
                first = owner.setdefault(id(param), index)
                if first != index:
                    raise ValueError(
                        f"{child.param_name(param)} is a parameter of children {first} and "
                        f"{index}: each parameter belongs to one child (the child built last took "
                        "its data and grad; the other steps a stale copy)"
                    )
        self.chained_optimizers: list[FlatOptimizer] = children
        """The children, in order (Megatron-Core's attribute name)."""

    def stats_reduce_groups(self) -> tuple[ProcessGroup | None, ...]:
        """The distinct groups the children's statistics reduce over.

        Returns:
            Each group once, in the order of the children and of their own groups.
        """
        groups: list[ProcessGroup | None] = []
        for child in self.chained_optimizers:
            groups.extend(
                g for g in child.stats_reduce_groups() if not any(g is seen for seen in groups)
            )
        return tuple(groups)

    def stats_optimizers(self) -> Sequence[FlatOptimizer]:
        """The children: the statistics read, and clipping scales, the grads of every one.

        Returns:
            :attr:`chained_optimizers` itself.
        """
        return self.chained_optimizers

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """Every child's inner param groups."""
        return [group for child in self.chained_optimizers for group in child.param_groups]

    def sync_grads(self) -> None:
        """Average every child's grads over its data-parallel group."""
        for child in self.chained_optimizers:
            child.sync_grads()

    def step(self) -> None:
        """Step every child, in order."""
        for child in self.chained_optimizers:
            child.step()

    def zero_grad(self) -> None:
        """Zero the grads of every child."""
        for child in self.chained_optimizers:
            child.zero_grad()

    def state_dict(self) -> dict[str, Any]:
        """``{"children": [child state dicts]}``.

        Returns:
            Each child's :meth:`~pgregistry.optim.FlatOptimizer.state_dict`, in child order.
        """
        return {"children": [child.state_dict() for child in self.chained_optimizers]}

    def state_dict_faults(self, state_dict: Any) -> list[str]:
        """Every reason :meth:`load_state_dict` would refuse ``state_dict``, by child.

        Local (no collective); changes nothing.

        Args:
            state_dict: a candidate for :meth:`load_state_dict`, of any type.

        Returns:
            Every child's :meth:`~pgregistry.optim.FlatOptimizer.state_dict_faults`, each prefixed
            with the child's index; or one fault for no ``{"children": [...]}`` dict, or a count
            of children that differs; empty when it loads.
        """
        children = state_dict.get("children") if isinstance(state_dict, Mapping) else None
        if not isinstance(children, Sequence):
            return ["it is no {'children': [...]} dict (ChainedOptimizer.state_dict output)"]
        if len(children) != len(self.chained_optimizers):
            return [
                f"it holds {len(children)} child optimizers, "
                f"this one has {len(self.chained_optimizers)}"
            ]
        return [
            f"child {index}: {fault}"
            for index, (child, child_state) in enumerate(
                zip(self.chained_optimizers, children, strict=True)
            )
            for fault in child.state_dict_faults(child_state)
        ]

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output into every child, every child checked before any loads.

        Strict: a fault in any child's state (:meth:`state_dict_faults`) is a ``ValueError`` and
        leaves every child as it was (a later child's refusal used to leave the first ones loaded).
        The check is local; where a child's load is collective (a sharded child's all-gather) the
        ranks agree on it first over the children's
        :meth:`~pgregistry.optim.FlatOptimizer.load_groups`, so every rank refuses alike.

        Args:
            state_dict: what :meth:`state_dict` returned on a chained optimizer of the same
                children.

        Raises:
            ValueError: some rank found faults in some child's state: the count and a few of them,
                each naming its child.
        """
        refuse_agreed(
            "ChainedOptimizer.load_state_dict",
            self.state_dict_faults(state_dict),
            self.load_groups(),
        )
        for child, child_state in zip(self.chained_optimizers, state_dict["children"], strict=True):
            child._load_checked_state_dict(child_state)

    def load_groups(self) -> tuple[ProcessGroup | None, ...]:
        """Every child's :meth:`~pgregistry.optim.FlatOptimizer.load_groups`, each group once.

        Returns:
            The groups, in the order of the children.
        """
        groups: list[ProcessGroup | None] = []
        for child in self.chained_optimizers:
            groups.extend(g for g in child.load_groups() if not any(g is seen for seen in groups))
        return tuple(groups)

    def param_state(self) -> dict[torch.Tensor, ParamState]:
        """Every child's :meth:`~pgregistry.optim.FlatOptimizer.param_state`.

        Collective where a child's is.

        Returns:
            One mapping: every child's parameters -> their state (the children hold distinct
            parameters).
        """
        merged: dict[torch.Tensor, ParamState] = {}
        for child in self.chained_optimizers:
            merged.update(child.param_state())
        return merged

    def param_state_faults(self, state: Mapping[torch.Tensor, Mapping[str, Any]]) -> list[str]:
        """Every child's :meth:`~pgregistry.optim.FlatOptimizer.param_state_faults`.

        Local (no collective); changes nothing.

        Args:
            state: a candidate for :meth:`load_param_state`.

        Returns:
            The children's faults, each prefixed with its child's index; empty when it loads.
        """
        return [
            f"child {index}: {fault}"
            for index, child in enumerate(self.chained_optimizers)
            for fault in child.param_state_faults(state)
        ]

    def load_param_state(self, state: Mapping[torch.Tensor, Mapping[str, Any]]) -> None:
        """Each child restores the state of its own parameters from ``state``.

        Strict as :meth:`load_state_dict`: every child is checked, and the ranks of
        :meth:`load_groups` agree, before any child loads.

        Args:
            state: model parameter -> its state, as :meth:`param_state` gives it (of any layout).

        Raises:
            ValueError: some rank found faults in some child's part (or ``state`` is no mapping
                keyed by parameters), on every rank alike; no child has loaded then.
        """
        refuse_agreed(
            "ChainedOptimizer.load_param_state",
            param_state_key_faults(state) or self.param_state_faults(state),
            self.load_groups(),
        )
        for child in self.chained_optimizers:
            child._load_checked_param_state(state)

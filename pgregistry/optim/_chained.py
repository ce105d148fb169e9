"""A chained optimizer: one child per parameter kind (dense, routed experts), one set of grad statistics.

The global norm must count every child's grads, each with its own groups. When every child reduces over the same
single group (a sharded optimizer's instance, or ``mp`` and ``tp_ep_pp_with_egtp_remat`` holding the same ranks),
the children's
filtered local terms are concatenated into one :func:`~pgregistry.grad_stats.norm_of_grads` call: one all-reduce.
Otherwise each child reduces over its own groups and the child norms combine as ``(sum n_i^p)^(1/p)`` (max for
the inf-norm). The zero count follows the same rule (a sum). Clipping scales every child's grads by the one
coefficient of the total norm.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from pgregistry._grad_buffer import GroupKey, reduce_norm_terms, reduce_zero_counts
from pgregistry.grad_stats import clip_grads_
from pgregistry.optim._base import FlatOptimizer, combine_norms
from pgregistry.optim._param_state import ParamState

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["ChainedOptimizer"]


class ChainedOptimizer:
    """Runs ``children`` (e.g. a dense and an expert optimizer) as one optimizer; see the module docstring."""

    def __init__(self, children: Sequence[FlatOptimizer]) -> None:
        if not children:
            raise ValueError("ChainedOptimizer needs at least one child optimizer")
        self.chained_optimizers: list[FlatOptimizer] = list(children)
        """The children, in order (Megatron-Core's attribute name)."""

    def stats_reduce_groups(self) -> tuple[ProcessGroup | None, ...]:
        """The distinct groups the children's statistics reduce over."""
        groups: list[ProcessGroup | None] = []
        for child in self.chained_optimizers:
            groups.extend(g for g in child.stats_reduce_groups() if not any(g is seen for seen in groups))
        return tuple(groups)

    def shares_stats_group(self) -> bool:
        """Whether every child reduces its statistics over one and the same group."""
        return len(self.stats_reduce_groups()) == 1

    def _merged(self, parts: Sequence[dict[GroupKey, list[torch.Tensor]]]) -> dict[GroupKey, list[torch.Tensor]]:
        merged: dict[GroupKey, list[torch.Tensor]] = {}
        for part in parts:
            for group, terms in part.items():
                merged.setdefault(group, []).extend(terms)
        return merged

    def get_grad_norm(self, norm_type: float = 2.0) -> torch.Tensor:
        """The global grad norm over every child (0-dim float32, no host sync)."""
        if self.shares_stats_group():
            terms = self._merged([child.local_norm_terms(norm_type) for child in self.chained_optimizers])
            return reduce_norm_terms(terms, norm_type)
        return combine_norms([child.get_grad_norm(norm_type) for child in self.chained_optimizers], norm_type)

    def count_zeros(self) -> torch.Tensor:
        """The global zero count over every child, each with its own groups (0-dim int64)."""
        if self.shares_stats_group():
            counts = self._merged([child.local_zero_counts() for child in self.chained_optimizers])
            return reduce_zero_counts(counts, device=self.chained_optimizers[0].buffer.data.device)
        return torch.stack([child.count_zeros() for child in self.chained_optimizers]).sum()

    def get_grad_norm_and_zeros(self, norm_type: float = 2.0) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`get_grad_norm` and :meth:`count_zeros` together, each child reading its grads once (on CUDA, for
        the 2-norm)."""
        if self.shares_stats_group():
            parts = [child.local_statistics(norm_type) for child in self.chained_optimizers]
            terms, counts = self._merged([t for t, _ in parts]), self._merged([c for _, c in parts])
            device = self.chained_optimizers[0].buffer.data.device
            return reduce_norm_terms(terms, norm_type), reduce_zero_counts(counts, device=device)
        stats = [child.get_grad_norm_and_zeros(norm_type) for child in self.chained_optimizers]
        return combine_norms([n for n, _ in stats], norm_type), torch.stack([z for _, z in stats]).sum()

    def clip_grad_norm(
        self, max_norm: float, norm_type: float = 2.0, *, error_if_nonfinite: bool = False
    ) -> torch.Tensor:
        """Scale every child's grads by ``max_norm / (norm + 1e-6)`` when below 1; return the total norm.

        A NaN or infinite norm scales nothing, or raises with ``error_if_nonfinite``."""
        total = self.get_grad_norm(norm_type)
        grads = [g for child in self.chained_optimizers for g in child.grads_to_clip()]
        clip_grads_(grads, max_norm, total, error_if_nonfinite=error_if_nonfinite)
        return total

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """Every child's inner param groups."""
        return [group for child in self.chained_optimizers for group in child.param_groups]

    def sync_grads(self) -> None:
        """Average every child's grads over its data-parallel group."""
        for child in self.chained_optimizers:
            child.sync_grads()

    def step(self) -> None:
        for child in self.chained_optimizers:
            child.step()

    def zero_grad(self) -> None:
        for child in self.chained_optimizers:
            child.zero_grad()

    def state_dict(self) -> dict[str, Any]:
        """``{"children": [child state dicts]}``."""
        return {"children": [child.state_dict() for child in self.chained_optimizers]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        children = state_dict["children"]
        if len(children) != len(self.chained_optimizers):
            raise ValueError(
                f"the state dict holds {len(children)} child optimizers, this one has {len(self.chained_optimizers)}"
            )
        for child, child_state in zip(self.chained_optimizers, children, strict=True):
            child.load_state_dict(child_state)

    def param_state(self) -> dict[torch.Tensor, ParamState]:
        """Every child's :meth:`~pgregistry.optim.FlatOptimizer.param_state` (collective where a child's is)."""
        merged: dict[torch.Tensor, ParamState] = {}
        for child in self.chained_optimizers:
            merged.update(child.param_state())
        return merged

    def load_param_state(self, state: Mapping[torch.Tensor, Mapping[str, Any]]) -> None:
        """Each child restores the state of its own parameters from ``state``."""
        for child in self.chained_optimizers:
            child.load_param_state(state)

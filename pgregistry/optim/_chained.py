"""A chained optimizer: one child per parameter kind (dense, routed experts), one set of grad statistics.

The global norm must count every child's grads, each with its own groups. Every child adds its parts to one
:class:`~pgregistry.grad_stats._reductions.Shares` and the one reducer reduces them: one all-reduce per distinct
group (one in all when every child reduces over the same group: a sharded optimizer's instance, or ``mp`` and
``tp_ep_pp_with_egtp_remat`` holding the same ranks), both statistics in it when both are wanted. Nothing combines
the children's finished norms. Clipping scales every child's grads by the one coefficient of the total norm, decided
job-wide.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from pgregistry.grad_stats._reductions import Reduced, Shares, Wanted, reduce_shares
from pgregistry.optim._base import FlatOptimizer, clip_grads_of
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

    def statistics(self, wanted: Wanted) -> Reduced:
        """The statistics over every child: their parts in one set of shares, reduced once."""
        shares = Shares(wanted, self.chained_optimizers[0].buffer.data.device)
        for child in self.chained_optimizers:
            child.local_shares(shares)
        return reduce_shares(shares)

    def get_grad_norm(self, norm_type: float = 2.0) -> torch.Tensor:
        """The global grad norm over every child (0-dim float32, no host sync)."""
        return self.statistics(Wanted.of(norm_type, zeros=False)).norm

    def count_zeros(self) -> torch.Tensor:
        """The global zero count over every child, each with its own groups (0-dim int64)."""
        zeros = self.statistics(Wanted.of(None, zeros=True)).zeros
        assert zeros is not None
        return zeros

    def get_grad_norm_and_zeros(self, norm_type: float = 2.0) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`get_grad_norm` and :meth:`count_zeros` together, each child reading its grads once (on CUDA, for
        the 2-norm), one all-reduce per group."""
        reduced = self.statistics(Wanted.of(norm_type, zeros=True))
        assert reduced.zeros is not None
        return reduced.norm, reduced.zeros

    def clip_grad_norm(
        self, max_norm: float, norm_type: float = 2.0, *, error_if_nonfinite: bool = False
    ) -> torch.Tensor:
        """Scale every child's grads by ``max_norm / (norm + 1e-6)`` when below 1; return the total norm.

        Decided job-wide: a NaN or infinite norm anywhere scales nothing on any rank, or raises on every rank with
        ``error_if_nonfinite``."""
        return clip_grads_of(self.chained_optimizers, max_norm, norm_type, error_if_nonfinite)

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

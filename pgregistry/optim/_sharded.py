"""A sharded (distributed) optimizer.

Main params and optimizer state are partitioned over the data-parallel group.

Like Megatron-Core's distributed optimizer. The model parameters and their grads each live in one
flat buffer with the same layout, padded to equal shards over the sharding group (``dp_cp`` for
dense parameters, ``expt_dp`` for experts; one optimizer instance). A step is: reduce-scatter the
grads (one collective, divided by the ``dp_cp`` size as in :mod:`pgregistry.optim._base`; each rank
keeps its shard), step float32 main copies of the shard's pieces, write them into the parameter
buffer, all-gather it (one collective). The main copies are views of one flat float32 tensor, the
shard's (:attr:`ShardedOptimizer.main_shard`): with an elementwise rule the step is one update over
it (:mod:`pgregistry.optim._flat_step`) and the write-back one copy, on CUDA both in one kernel
(:mod:`pgregistry.optim._fused_step`).

Statistics: shards are disjoint across the sharding group and the duplicate filters drop TP/GTP
duplicates, so the norm and zero count are summed over the whole instance (``intra_dist_opt``). The
pieces are classified by their own roles, copied with :func:`pgregistry.params.copy_param_roles`.

The inner update rule must be elementwise (Adam, AdamW, SGD): it sees only pieces of parameters.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import attrs
import torch
import torch.distributed as dist

from pgregistry.collection import group_size
from pgregistry.optim._base import FlatOptimizer, InnerFactory, ParamNameFn, require_group
from pgregistry.optim._copies import Copy
from pgregistry.optim._flat_step import FlatStep
from pgregistry.optim._grad_buffer import GradBuffer, class_spans, reduce_scatter_grads_
from pgregistry.optim._param_state import MAIN_PARAM, ParamState, inner_state_dict, load_inner_state
from pgregistry.optim._setup import OptimizerProcessGroups
from pgregistry.optim._state_check import (
    inner_param_state_faults,
    inner_state_faults,
    missing_and_extra,
    not_a_dict_of,
    tensor_faults,
)
from pgregistry.params import copy_param_roles

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["ShardedOptimizer"]

_OTHER_LAYOUT = (
    "to load state saved under another layout, save and load it with "
    "pgregistry.checkpoint.save_optimizer_shards and load_optimizer_shards"
)


@attrs.frozen(slots=True, eq=False)
class _Piece:
    """The part ``[start, stop)`` of the buffers in this rank's shard belonging to ``param``."""

    param: torch.Tensor
    main: torch.Tensor
    start: int
    stop: int
    offset: int
    """Where the piece starts inside the flattened parameter."""


class ShardedOptimizer(FlatOptimizer):
    """Steps this rank's shard of ``params`` with ``inner``; see the module docstring.

    Parameters must share one dtype (they are gathered through one buffer).

    Args:
        params: the model parameters, all dense or all routed experts (``expert``).
        process_groups: the groups it runs on (``intra_dist_opt`` set), as for
            :class:`~pgregistry.optim.MixedPrecisionOptimizer`.
        inner: the update rule over the shard's main copies, as for
            :class:`~pgregistry.optim.MixedPrecisionOptimizer`.
        expert: whether ``params`` are routed-expert parameters.
        main_dtype: the dtype of the shard's main copies and of the grads (``None``: the parameters'
            dtype).
        param_name_fn: keys the state dict, so a caller can key it by global, expert-aware names.

    Raises:
        ValueError: ``inter_dist_opt`` spanning several distributed-optimizer instances (one is
            supported); ``intra_dist_opt`` unset; parameters of several dtypes (give each dtype its
            own optimizer); a ``main_dtype`` that would round a parameter (float32 main copies of
            float64 parameters).

    Example:
        On every rank of a 2-rank world (as :func:`pgregistry.testing.run_world` starts it):

        >>> import torch
        >>> from pgregistry import ParallelLayout, build
        >>> model = torch.nn.Linear(2, 1, bias=False)
        >>> _ = torch.nn.init.zeros_(model.weight)
        >>> model.weight.grad = torch.tensor([[3.0, 4.0]])
        >>> from pgregistry.optim import inner_factory, setup_process_groups_for_optimizer
        >>> pg, params = build(ParallelLayout(num_ranks=2)), model.parameters()
        >>> groups = setup_process_groups_for_optimizer(pg, model, use_distributed_optimizer=True)
        >>> optimizer = ShardedOptimizer(params, groups, inner=inner_factory("adam", lr=1e-3))
        >>> optimizer.step()  # each rank steps its shard; the step is gathered back
        >>> model.weight.detach()
        tensor([[-0.0010, -0.0010]])
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor],
        process_groups: OptimizerProcessGroups,
        *,
        inner: InnerFactory,
        expert: bool = False,
        main_dtype: torch.dtype | None = torch.float32,
        param_name_fn: ParamNameFn | None = None,
    ) -> None:
        super().__init__(
            params, process_groups, expert=expert, param_name_fn=param_name_fn, inner=inner
        )
        groups = self.process_groups
        if group_size(groups.inter_dist_opt) > 1:
            raise ValueError(
                "inter_dist_opt spans several distributed-optimizer instances; "
                "ShardedOptimizer supports one instance (set inter_dist_opt to None)"
            )
        self.shard_group = groups.intra_expt_dp if expert else groups.intra_dp_cp
        """Main params, state and grads are sharded over this group.

        ``expt_dp`` or ``dp_cp`` of one instance.
        """
        norm_group = require_group(groups, "intra_dist_opt")
        dtypes = {p.dtype for p in self.params}
        if len(dtypes) > 1:
            raise ValueError(
                f"ShardedOptimizer gathers its parameters through one buffer, but they mix "
                f"{sorted(map(str, dtypes))}; give each dtype its own optimizer"
            )
        param_dtype = next(iter(dtypes), main_dtype or torch.float32)
        main_dtype = main_dtype or param_dtype
        self._check_main_dtype(main_dtype)
        device = self._buffer_device()
        self.buffer = GradBuffer(
            self.params,
            self.stats_groups,
            dtype=main_dtype,
            device=device,
            shard_multiple=group_size(self.shard_group),
        )
        self._attach_grads(self.params, self.buffer.views)
        self.param_data = torch.zeros(self.buffer.numel, dtype=param_dtype, device=device)
        """Every parameter's data (each ``param.data`` is a view), laid out like the grad buffer."""
        for param, offset in zip(self.params, self.buffer.offsets, strict=True):
            self._move_data(
                param, self.param_data[offset : offset + param.numel()].view(param.shape)
            )
        self.shard = self.buffer.shard_range(self.shard_group)
        """``[start, stop)`` of this rank's shard in both buffers."""
        start, stop = self.shard
        self.main_shard = torch.nn.Parameter(self.param_data[start:stop].to(main_dtype, copy=True))
        """The main copy of this rank's shard of :attr:`param_data`.

        Its ``.grad`` is the shard of the grads.
        """
        self.main_shard.grad = self.buffer.data[start:stop]
        self._pieces = self._make_pieces()
        entries = [(piece.main, piece.start, piece.stop) for piece in self._pieces]
        self._set_stats(class_spans(entries, self.stats_groups, reduce_over=norm_group), norm_group)
        mains = [piece.main for piece in self._pieces]
        shard_copy = Copy(
            start=0, out=self.param_data[start:stop]
        )  # the shard's padding is zero in both buffers
        self._make_inner(
            inner,
            self.main_shard,
            mains,
            [piece.start - start for piece in self._pieces],
            [shard_copy],
        )

    def _make_pieces(self) -> list[_Piece]:
        """Each parameter's part of the shard, with its main copy.

        The main copy is a view of :attr:`main_shard` carrying the parameter's roles."""
        start, stop = self.shard
        pieces = []
        for param, offset in zip(self.params, self.buffer.offsets, strict=True):
            lo, hi = max(offset, start), min(offset + param.numel(), stop)
            if lo >= hi:
                continue
            main = copy_param_roles(
                param, torch.nn.Parameter(self.main_shard.detach()[lo - start : hi - start])
            )
            main.grad = self.buffer.data[lo:hi]
            pieces.append(_Piece(param=param, main=main, start=lo, stop=hi, offset=lo - offset))
        return sorted(pieces, key=lambda piece: piece.start)

    def grads_to_clip(self) -> list[torch.Tensor]:
        """This rank's shard of the grad buffer, the grads :meth:`step` reads.

        Returns:
            One tensor: the shard's view of the grad buffer.
        """
        start, stop = self.shard
        return [self.buffer.data[start:stop]]

    def sync_grads(self) -> None:
        """Reduce-scatter the grads, divided by :attr:`grad_divisor`, over :attr:`shard_group`.

        One collective; this rank keeps its shard."""
        self._check_attached()
        reduce_scatter_grads_(self.buffer, self.shard_group, divide_by=self.grad_divisor)

    @torch.no_grad()
    def step(self) -> None:
        """Step the shard's main copies, write them into the parameter buffer and all-gather it.

        A flat step writes them into the buffer itself, on CUDA in its kernel."""
        self._check_attached(first_only=True)
        if self.inner is not None:
            self.inner.step()
        if isinstance(self.inner, FlatStep):
            self._all_gather_params()
        else:
            self._publish_shard()

    def _publish_shard(self) -> None:
        """Write the shard's main copies into the parameter buffer and all-gather it."""
        start, stop = self.shard
        if self._pieces:  # one copy: the shard's padding is zero in both buffers
            self.param_data[start:stop].copy_(self.main_shard.detach())
        self._all_gather_params()

    def _all_gather_params(self) -> None:
        start, stop = self.shard
        if group_size(self.shard_group) > 1 and self.buffer.numel:
            all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
            all_gather(self.param_data, self.param_data[start:stop], group=self.shard_group)

    def state_dict(self) -> dict[str, Any]:
        """This rank's shard as a state dict.

        ``{"param_groups": ..., "shards": {name: {"offset", "numel", "main", "state"}}}``.

        ``name`` is ``param_name_fn(param)``; ``offset`` and ``numel`` locate the piece in the
        flattened parameter. Tensors are references, not copies.

        Returns:
            The inner update rule's param groups, and each piece of a parameter this rank's shard
            holds: where it lies, its main copy and its elementwise state.
        """
        inner = (
            self.inner.state_dict() if self.inner is not None else {"state": {}, "param_groups": []}
        )
        shards = {
            self.param_name(piece.param): {
                "offset": piece.offset,
                "numel": piece.stop - piece.start,
                "main": piece.main.detach(),
                "state": inner["state"].get(index, {}),
            }
            for index, piece in enumerate(self._pieces)
        }
        return {"param_groups": inner["param_groups"], "shards": shards}

    def load_groups(self) -> tuple[ProcessGroup | None, ...]:
        """The whole instance (``intra_dist_opt``, the group of the statistics).

        Every rank of it refuses a load when one does (one small all-reduce), instead of leaving the
        others waiting in the load's all-gather.

        Returns:
            One group: the statistics group, which holds every rank of the instance.
        """
        return self.stats_reduce_groups()[:1]

    def state_dict_faults(self, state_dict: Any) -> list[str]:
        """Every reason :meth:`load_state_dict` would refuse ``state_dict`` on this rank.

        Local: :meth:`load_state_dict` agrees on them over :meth:`load_groups`.

        Args:
            state_dict: a candidate for :meth:`load_state_dict` on this rank, of any type.

        Returns:
            One line per fault: this rank's pieces missing, extra, cut elsewhere or of another
            shape or dtype, and the inner state's faults
            (:func:`~pgregistry.optim._state_check.inner_state_faults`); empty when it loads.
        """
        if faults := not_a_dict_of(
            "it", state_dict, ("shards", "param_groups"), written_by="ShardedOptimizer.state_dict"
        ):
            return faults
        shards = state_dict["shards"]
        names = [self.param_name(piece.param) for piece in self._pieces]
        faults = missing_and_extra("pieces", shards, names)  # another layout
        misfits: list[str] = []
        for name, piece in zip(names, self._pieces, strict=True):
            entry = shards.get(name)
            if entry is None:
                continue
            if (entry.get("offset"), entry.get("numel")) != (
                piece.offset,
                piece.stop - piece.start,
            ):
                faults.append(
                    f"{name}: saved piece [{entry.get('offset')}, +{entry.get('numel')}) "
                    f"differs from this rank's [{piece.offset}, +{piece.stop - piece.start})"
                )
            else:
                misfits.extend(
                    tensor_faults(
                        f"the main copy in the piece of {name!r}", entry.get("main"), piece.main
                    )
                )
        if faults:  # the advice in the first fault, which a refusal always quotes
            return [f"shards do not match: {faults[0]} ({_OTHER_LAYOUT})", *faults[1:], *misfits]
        faults = misfits
        if self.inner is not None:
            state = {
                index: shards[name].get("state")
                for index, name in enumerate(names)
                if shards[name].get("state")
            }
            inner = {"state": state, "param_groups": state_dict["param_groups"]}
            faults.extend(
                inner_state_faults(self.inner, inner, [piece.main for piece in self._pieces], names)
            )
        return faults

    @torch.no_grad()
    def _load_checked_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore checked :meth:`state_dict` output saved with the same sharding.

        Collective over :attr:`shard_group` (the restored shards are all-gathered into the model).
        State saved under another layout (EP, PP or data-parallel size) is cut for this one by
        :func:`pgregistry.checkpoint.load_optimizer_shards`."""
        shards = state_dict["shards"]
        names = [self.param_name(piece.param) for piece in self._pieces]
        for name, piece in zip(names, self._pieces, strict=True):
            piece.main.copy_(shards[name]["main"])
        if self.inner is not None:
            state = {
                index: shards[name]["state"]
                for index, name in enumerate(names)
                if shards[name]["state"]
            }
            self.inner.load_state_dict({"state": state, "param_groups": state_dict["param_groups"]})
        self._publish_shard()

    # ---------------------------------------------------------------------------------- whole state

    def param_state(self) -> dict[torch.Tensor, ParamState]:
        """Model parameter -> its whole state, gathered from every rank of :attr:`shard_group`.

        Collective, from the pieces on every rank: one all-gather of the state's description, one
        all-reduce per elementwise state key and one for the main copies. Elementwise state (Adam's
        moments) comes back shaped like the parameter; other values (Adam's ``step``) are those of
        any piece. ``main_param`` is present when the main copies' dtype differs from the
        parameters'.

        Returns:
            Every parameter of the optimizer -> its whole state, on every rank of the shard group.

        Raises:
            ValueError: an elementwise state key held in several dtypes across the pieces.
        """
        inner = self.inner.state if self.inner is not None else {}
        index = {id(param): i for i, param in enumerate(self.params)}
        described: dict[
            int, dict[str, Any]
        ] = {}  # parameter index -> key -> dtype (elementwise) or value
        for piece in self._pieces:
            mine = described.setdefault(index[id(piece.param)], {})
            for key, value in inner.get(piece.main, {}).items():
                mine[key] = value.dtype if _is_elementwise(value, piece.main) else value
        everyone = [described]
        if group_size(self.shard_group) > 1:
            everyone = [{} for _ in range(group_size(self.shard_group))]
            dist.all_gather_object(everyone, described, group=self.shard_group)
        merged: dict[int, dict[str, Any]] = {}
        for rank_described in everyone:
            for i, keys in rank_described.items():
                merged.setdefault(i, {}).update(keys)
        flat_dtypes: dict[str, torch.dtype] = {}
        for keys in merged.values():
            for key, value in keys.items():
                if isinstance(value, torch.dtype) and flat_dtypes.setdefault(key, value) != value:
                    raise ValueError(
                        f"optimizer state {key!r} has several dtypes ({value}, {flat_dtypes[key]})"
                    )
        flats = {
            key: self._gather_from_every_rank(
                [inner.get(piece.main, {}).get(key) for piece in self._pieces], dtype
            )
            for key, dtype in sorted(flat_dtypes.items())
        }
        mains = self._gather_from_every_rank(
            [piece.main for piece in self._pieces], self.buffer.data.dtype
        )
        out: dict[torch.Tensor, ParamState] = {}
        for i, (param, offset) in enumerate(zip(self.params, self.buffer.offsets, strict=True)):
            whole = slice(offset, offset + param.numel())
            state: ParamState = {
                key: flats[key][whole].view(param.shape)
                if isinstance(value, torch.dtype)
                else value
                for key, value in merged.get(i, {}).items()
            }
            if mains.dtype != param.dtype:
                state[MAIN_PARAM] = mains[whole].view(param.shape)
            out[param] = state
        return out

    def _gather_from_every_rank(
        self, values: Sequence[torch.Tensor | None], dtype: torch.dtype
    ) -> torch.Tensor:
        """A flat tensor laid out like the buffers, holding every rank's ``values``.

        One per piece, or None.
        """
        flat = torch.zeros(self.buffer.numel, dtype=dtype, device=self.buffer.data.device)
        for piece, value in zip(self._pieces, values, strict=True):
            if value is not None:
                flat[piece.start : piece.stop] = value.detach().reshape(-1)
        if group_size(self.shard_group) > 1:
            dist.all_reduce(
                flat, group=self.shard_group
            )  # pieces are disjoint: the sum is each rank's piece
        return flat

    def param_state_faults(self, state: Mapping[torch.Tensor, Mapping[str, Any]]) -> list[str]:
        """Every reason :meth:`load_param_state` would refuse ``state`` on this rank.

        Local: :meth:`load_param_state` agrees on them over :meth:`load_groups`.

        Args:
            state: a candidate for :meth:`~pgregistry.optim.FlatOptimizer.load_param_state`.

        Returns:
            One line per fault: saved main copies of another shape than their parameter's (or no
            tensor), and the faults of the inner state cut for this rank's pieces
            (:func:`~pgregistry.optim._state_check.inner_param_state_faults`); empty when it loads.
        """
        faults = [
            fault
            for piece in self._pieces
            if (saved := state.get(piece.param, {}).get(MAIN_PARAM)) is not None
            for fault in tensor_faults(
                f"main copy {self.param_name(piece.param)!r}", saved, piece.param, cast=True
            )
        ]
        if self.inner is not None:
            mains = [piece.main for piece in self._pieces]
            inner = inner_state_dict(self.inner, mains, self._state_of_pieces(state))
            names = [self.param_name(piece.param) for piece in self._pieces]
            faults.extend(inner_param_state_faults(self.inner, inner, mains, names))
        return faults

    @torch.no_grad()
    def _load_checked_param_state(self, state: Mapping[torch.Tensor, Mapping[str, Any]]) -> None:
        """Restore this rank's pieces of whole :meth:`param_state` output of any layout.

        The pieces are cut from it, restored, and the parameters gathered (collective over
        :attr:`shard_group`). A main copy without a saved ``main_param`` is taken from its
        parameter, so load the parameters first."""
        for piece in self._pieces:
            saved = state.get(piece.param, {}).get(MAIN_PARAM, piece.param)
            piece.main.copy_(
                saved.reshape(-1)[piece.offset : piece.offset + piece.stop - piece.start]
            )
        if self.inner is not None:
            load_inner_state(
                self.inner, [piece.main for piece in self._pieces], self._state_of_pieces(state)
            )
        self._publish_shard()

    def _state_of_pieces(
        self, state: Mapping[torch.Tensor, Mapping[str, Any]]
    ) -> dict[torch.Tensor, ParamState]:
        """The state of each of this rank's pieces, keyed by its main copy.

        Elementwise values of the whole parameter cut for the piece, others as they are;
        ``main_param`` left out."""
        pieces: dict[torch.Tensor, ParamState] = {}
        for piece in self._pieces:
            cut = slice(piece.offset, piece.offset + piece.stop - piece.start)
            pieces[piece.main] = {
                key: value.reshape(-1)[cut] if _whole_elementwise(value, piece.param) else value
                for key, value in state.get(piece.param, {}).items()
                if key != MAIN_PARAM
            }
        return pieces


def _is_elementwise(value: object, main: torch.Tensor) -> bool:
    """Whether a piece's state ``value`` has one element per piece element (Adam's moments)."""
    return isinstance(value, torch.Tensor) and value.shape == main.shape


def _whole_elementwise(value: object, param: torch.Tensor) -> bool:
    """Whether a whole parameter's state ``value`` has one element per element of the parameter."""
    return isinstance(value, torch.Tensor) and value.shape == param.shape and value.dim() > 0

"""A mixed-precision optimizer: low-precision params, fp32 main copies, fp32 grads in one buffer.

Each bf16/fp16 parameter gets a float32 main copy made with
:func:`pgregistry.params.copy_param_roles`, so its roles (``allreduce=False`` above all) survive:
the statistics classify the main copies, and Megatron-LM PR 6470's bug was a main copy without
``allreduce=False``, which turned every expert into a dense parameter counted on dense-TP rank 0
only. Parameters already in the main dtype are their own main copy. With ``main_dtype=None`` there
are no copies: the optimizer steps the model parameters in their own dtype (plain full- or
low-precision training).

Every main param is a view of one flat tensor laid out like the grad buffer
(:attr:`MixedPrecisionOptimizer.main_data`; parameters in the main dtype get their data moved
there), so an elementwise rule steps it as one tensor (:mod:`pgregistry.optim._flat_step`), and the
lower-precision parameters' data is packed per dtype in the same order, so the rounded copy back is
one copy per run of consecutive parameters of one dtype, not one per parameter; with a flat step on
CUDA, it is written by the step's own kernel (:mod:`pgregistry.optim._fused_step`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from pgregistry.optim._base import FlatOptimizer, InnerFactory, ParamNameFn
from pgregistry.optim._copies import Copy, write_copies
from pgregistry.optim._flat_step import FlatStep
from pgregistry.optim._grad_buffer import GradBuffer, all_reduce_grads_
from pgregistry.optim._options import option_error
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

__all__ = ["MixedPrecisionOptimizer"]


class MixedPrecisionOptimizer(FlatOptimizer):
    """Steps float32 main copies of ``params`` with ``inner`` and writes them back to the model.

    Args:
        params: the model parameters, all dense or all routed experts (``expert``).
        process_groups: the groups it runs on, from
            :func:`~pgregistry.optim._setup.setup_process_groups_for_optimizer` (``build_optimizer``
            makes them once for all its children).
        inner: the update rule over the main params: an
            :class:`~pgregistry.optim._flat_step.ElementwiseRule` (``inner_factory("adam",
            lr=1e-3)``) steps them as one flat tensor; any other factory, e.g.
            ``functools.partial(torch.optim.Adam, lr=1e-3)``, gets the per-parameter main params.
        expert: whether ``params`` are routed-expert parameters (grads summed over ``expt_dp``,
            counted with the expert TP group, statistics over ``tp_ep_pp_with_egtp_remat``) or dense
            ones (``dp_cp``, TP group, ``mp``); both are divided by the ``dp_cp`` size (see
            :mod:`pgregistry.optim._base`).
        main_dtype: dtype of the main copies and grads; ``None`` steps the parameters themselves.
            It must hold every parameter's dtype (float32 main copies of float64 parameters are
            refused: they would round them).
        bucket_numel: grads are all-reduced in buckets of at most this many elements (default: one
            bucket).
        param_name_fn: names parameters in state dicts and errors.

    Raises:
        ValueError: what :class:`~pgregistry.optim.FlatOptimizer` refuses; a ``main_dtype`` that
            does not hold a parameter's dtype; ``main_dtype=None`` over parameters of several
            dtypes; a ``bucket_numel`` that is not positive.
        TypeError: what :class:`~pgregistry.optim.FlatOptimizer` refuses; a ``main_dtype`` that is
            no floating dtype; a ``bucket_numel`` that is no whole number.

    Example:
        On every rank of a 2-rank world (as :func:`pgregistry.testing.run_world` starts it):

        >>> import torch
        >>> from pgregistry import ParallelLayout, build
        >>> model = torch.nn.Linear(2, 1, bias=False)
        >>> _ = torch.nn.init.zeros_(model.weight)
        >>> model.weight.grad = torch.tensor([[3.0, 4.0]])
        >>> from pgregistry.optim import inner_factory, setup_process_groups_for_optimizer
        >>> groups = setup_process_groups_for_optimizer(build(ParallelLayout(num_ranks=2)))
        >>> optimizer = MixedPrecisionOptimizer(
        ...     model.parameters(), groups, inner=inner_factory("adamw", lr=1e-4)
        ... )
        >>> optimizer.step()
        >>> model.weight.detach()
        tensor([[-1.0000e-04, -1.0000e-04]])
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor],
        process_groups: OptimizerProcessGroups,
        *,
        inner: InnerFactory,
        expert: bool = False,
        main_dtype: torch.dtype | None = torch.float32,
        bucket_numel: int | None = None,
        param_name_fn: ParamNameFn | None = None,
    ) -> None:
        super().__init__(
            params, process_groups, expert=expert, param_name_fn=param_name_fn, inner=inner
        )
        self.grad_sync_group = self.process_groups.expt_dp if expert else self.process_groups.dp_cp
        """Grads are summed over this group (after division by :attr:`grad_divisor`): ``expt_dp``
        for experts, ``dp_cp`` for dense parameters."""
        bucket_fault = option_error("bucket_numel", bucket_numel)
        if bucket_fault is not None:
            raise bucket_fault
        self.bucket_numel = bucket_numel
        dtypes = {p.dtype for p in self.params}
        if main_dtype is None and len(dtypes) > 1:
            raise ValueError(
                "main_dtype=None steps the parameters in their own dtype, but they mix "
                f"{sorted(map(str, dtypes))}; give each dtype its own optimizer or set main_dtype"
            )
        buffer_dtype = main_dtype or next(iter(dtypes), torch.float32)
        self._check_main_dtype(buffer_dtype)
        device = self._buffer_device()
        # Main copies exist before their storage: the buffer classifies them (their roles are what
        # the optimizer counts) and lays them out; each then becomes its view of the flat main
        # buffer.
        self.main_params: list[torch.Tensor] = [
            p
            if p.dtype == buffer_dtype
            else copy_param_roles(p, torch.nn.Parameter(_stand_in_for(p, buffer_dtype)))
            for p in self.params
        ]
        """What ``inner`` steps: the float32 copy of each lower-precision parameter, else the
        parameter; each a view of :attr:`main_data`."""
        self.buffer = GradBuffer(
            self.main_params, self.stats_groups, dtype=buffer_dtype, device=device
        )
        self.main_data = torch.nn.Parameter(torch.zeros_like(self.buffer.data))
        """Every main param, laid out like the grad buffer (whose data is its ``.grad``)."""
        self.main_data.grad = self.buffer.data
        for param, main, offset in zip(
            self.params, self.main_params, self.buffer.offsets, strict=True
        ):
            view = self.main_data.detach()[offset : offset + param.numel()].view(param.shape)
            if main is param:
                self._move_data(param, view)
            else:
                with torch.no_grad():
                    view.copy_(param)
                main.data = view
        self._copies = _pack_low_precision(
            self.params, self.main_params, self.buffer.offsets, self._move_data
        )
        for param, main, view in zip(self.params, self.main_params, self.buffer.views, strict=True):
            if main is not param:
                main.grad = view
        self._attach_grads(self.params, self.buffer.views)
        groups = self.stats_groups
        self._set_stats(self.buffer.spans, groups.expert_reduce if expert else groups.dense_reduce)
        self._make_inner(inner, self.main_data, self.main_params, self.buffer.offsets, self._copies)

    def sync_grads(self) -> None:
        """All-reduce the grads, divided by :attr:`grad_divisor`, over :attr:`grad_sync_group`.

        One collective per bucket."""
        self._check_attached()
        all_reduce_grads_(
            self.buffer,
            self.grad_sync_group,
            divide_by=self.grad_divisor,
            bucket_numel=self.bucket_numel,
        )

    @torch.no_grad()
    def step(self) -> None:
        """Step the main params and copy them (rounded) into the model parameters.

        A flat step writes the copies itself (on CUDA in its kernel); after any other inner
        optimizer, one copy per run."""
        self._check_attached(first_only=True)
        if self.inner is not None:
            self.inner.step()
        if not isinstance(self.inner, FlatStep):
            self._copy_main_to_model()

    def _copy_main_to_model(self) -> None:
        write_copies(self.main_data, self._copies)

    def _params_and_main_copies(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(model parameter, main copy) of each lower-precision parameter, in parameter order."""
        return [(p, m) for p, m in zip(self.params, self.main_params, strict=True) if m is not p]

    def state_dict(self) -> dict[str, Any]:
        """``{"inner": inner state dict or None, "main_params": {name: main copy}}``.

        References, not copies.

        Returns:
            The inner update rule's state dict (``None`` where this rank steps nothing) and each
            lower-precision parameter's main copy under :meth:`param_name`.
        """
        return {
            "inner": self.inner.state_dict() if self.inner is not None else None,
            "main_params": {
                self.param_name(p): m.detach() for p, m in self._params_and_main_copies()
            },
        }

    def state_dict_faults(self, state_dict: Any) -> list[str]:
        """Every reason :meth:`load_state_dict` would refuse ``state_dict``.

        Local (no collective); changes nothing.

        Args:
            state_dict: a candidate for :meth:`load_state_dict`, of any type.

        Returns:
            One line per fault: main copies missing, extra or of another shape or dtype, and the
            inner state's faults (:func:`~pgregistry.optim._state_check.inner_state_faults`);
            empty when it loads.
        """
        if faults := not_a_dict_of(
            "it",
            state_dict,
            ("inner", "main_params"),
            written_by="MixedPrecisionOptimizer.state_dict",
        ):
            return faults
        saved = state_dict["main_params"]
        names = {self.param_name(p): m for p, m in self._params_and_main_copies()}
        faults = missing_and_extra("main copies", saved, names)
        for name, main in names.items():
            if name in saved:
                faults.extend(tensor_faults(f"main copy {name!r}", saved[name], main))
        if (state_dict["inner"] is None) != (self.inner is None):
            faults.append(
                "it was saved by an optimizer with a different "
                "set of parameters (inner state on one side)"
            )
        elif self.inner is not None:
            model_name = {
                id(main): self.param_name(p)
                for p, main in zip(self.params, self.main_params, strict=True)
            }
            tensors = self._inner_tensors()
            faults.extend(
                inner_state_faults(
                    self.inner, state_dict["inner"], tensors, [model_name[id(t)] for t in tensors]
                )
            )
        return faults

    @torch.no_grad()
    def _load_checked_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore checked :meth:`state_dict` output; copy the restored main params to the model."""
        saved = state_dict["main_params"]
        names = {self.param_name(p): m for p, m in self._params_and_main_copies()}
        for name, main in names.items():
            main.copy_(saved[name])
        if self.inner is not None:
            self.inner.load_state_dict(state_dict["inner"])
        self._copy_main_to_model()

    def param_state(self) -> dict[torch.Tensor, ParamState]:
        """Model parameter -> its inner state, plus its main copy (``main_param``) if it has one.

        Returns:
            Every parameter -> a new dict of its state (references to the tensors, not copies).
        """
        inner = self.inner.state if self.inner is not None else {}
        out: dict[torch.Tensor, ParamState] = {}
        for param, main in zip(self.params, self.main_params, strict=True):
            entry = dict(inner.get(main, {}))
            if main is not param:
                entry[MAIN_PARAM] = main.detach()
            out[param] = entry
        return out

    def load_groups(self) -> tuple[ProcessGroup | None, ...]:
        """The replicas (:attr:`grad_sync_group`) and stats groups: every rank of the instance.

        Returns:
            The groups, each once, the replicas' group first.
        """
        groups: list[ProcessGroup | None] = []
        for group in (self.grad_sync_group, *self.stats_reduce_groups()):
            if not any(group is seen for seen in groups):
                groups.append(group)
        return tuple(groups)

    def param_state_faults(self, state: Mapping[torch.Tensor, Mapping[str, Any]]) -> list[str]:
        """Every reason :meth:`load_param_state` would refuse ``state``.

        Local (no collective); changes nothing.

        Args:
            state: a candidate for :meth:`~pgregistry.optim.FlatOptimizer.load_param_state`.

        Returns:
            One line per fault: saved main copies of another shape than their parameter's (or no
            tensor), and the inner state's faults
            (:func:`~pgregistry.optim._state_check.inner_param_state_faults`); empty when it loads.
        """
        faults = [
            fault
            for param, main in self._params_and_main_copies()
            if (saved := state.get(param, {}).get(MAIN_PARAM)) is not None
            for fault in tensor_faults(
                f"main copy {self.param_name(param)!r}", saved, main, cast=True
            )
        ]
        if self.inner is not None:
            tensors = self._inner_tensors()
            model_param = dict(zip(self.main_params, self.params, strict=True))
            inner = inner_state_dict(self.inner, tensors, state, rename=model_param)
            names = [self.param_name(model_param[tensor]) for tensor in tensors]
            faults.extend(inner_param_state_faults(self.inner, inner, tensors, names))
        return faults

    @torch.no_grad()
    def _load_checked_param_state(self, state: Mapping[torch.Tensor, Mapping[str, Any]]) -> None:
        """Restore :meth:`param_state` output.

        A main copy without a saved ``main_param`` is its parameter's value.
        """
        for param, main in self._params_and_main_copies():
            main.copy_(state.get(param, {}).get(MAIN_PARAM, param))
        if self.inner is not None:
            model_param = dict(zip(self.main_params, self.params, strict=True))
            load_inner_state(self.inner, self._inner_tensors(), state, rename=model_param)
        self._copy_main_to_model()


def _stand_in_for(param: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A tensor of ``param``'s shape and device that holds no memory (one element, expanded)."""
    return torch.empty((), dtype=dtype, device=param.device).expand(param.shape)


def _pack_low_precision(
    params: Sequence[torch.Tensor],
    mains: Sequence[torch.Tensor],
    offsets: Sequence[int],
    move_data: Callable[[torch.Tensor, torch.Tensor], None],
) -> list[Copy]:
    """Move the data of every parameter with a main copy into one flat tensor per (dtype, device).

    Moved with ``move_data``, in the order of the main buffer, so that the copy back is one copy per
    run of consecutive parameters of one kind (one per dtype for a model of bf16 parameters) instead
    of one per parameter: each run's packed data receives its main copies' span of the flat main
    buffer, padding between them included."""
    runs: list[
        tuple[tuple[torch.dtype, torch.device], int, int, list[tuple[torch.Tensor, int]]]
    ] = []
    open_run = False
    for offset, param, main in sorted(
        zip(offsets, params, mains, strict=True), key=lambda entry: entry[0]
    ):
        if main is param:
            open_run = False
            continue
        key = (param.dtype, param.device)
        if open_run and runs[-1][0] == key:
            runs[-1] = (key, runs[-1][1], offset + param.numel(), runs[-1][3])
        else:
            runs.append((key, offset, offset + param.numel(), []))
        runs[-1][3].append((param, offset))
        open_run = True
    lengths: dict[tuple[torch.dtype, torch.device], int] = {}
    for key, start, stop, _ in runs:
        lengths[key] = lengths.get(key, 0) + stop - start
    packed = {
        key: torch.zeros(length, dtype=key[0], device=key[1]) for key, length in lengths.items()
    }
    cursor = dict.fromkeys(lengths, 0)
    out = []
    for key, start, stop, members in runs:
        model = packed[key][cursor[key] : cursor[key] + stop - start]
        cursor[key] += stop - start
        for param, offset in members:
            move_data(
                param, model[offset - start : offset - start + param.numel()].view(param.shape)
            )
        out.append(Copy(start=start, out=model))
    return out

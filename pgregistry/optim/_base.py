"""What every pgregistry optimizer shares: grads in a
:class:`~pgregistry.optim._grad_buffer.GradBuffer`, statistics over its spans, clipping, and the
wiring of model parameters to the buffer.

An optimizer here holds the parameters of one kind, dense or routed-expert (the builder splits them
and chains the two), because the two kinds differ in every group they use: grads are synchronised
over ``dp_cp`` or ``expt_dp``, counted with the dense or the expert TP group, and their statistics
summed over ``mp`` or ``tp_ep_pp_with_egtp_remat`` (the whole instance, ``intra_dist_opt``, for a
sharded optimizer).

Grad synchronisation follows Megatron-Core (``average_in_collective=False``): each data-parallel
rank's loss is the mean over its own tokens, and the global loss the mean over the ``dp_cp`` ranks.
Dense grads are therefore divided by the ``dp_cp`` size and summed over ``dp_cp`` (an average).
Expert grads are divided by the ``dp_cp`` size too, and summed over ``expt_dp``: an expert already
holds the grads of every token its EP group routed to it, which come from ``dp_cp / expt_dp``
data-parallel ranks, so averaging over ``expt_dp`` instead would scale them by ``dp_cp / expt_dp``.

Statistics are computed from the *role tensors* the optimizer steps (mixed-precision main copies,
shard pieces), classified once at construction, and go through the grad statistics' one reduction
path: an optimizer adds its spans' parts to a :class:`~pgregistry.grad_stats._reductions.Shares` (a
chained optimizer's children add to the same one) and the one reducer reduces them; clipping decides
job-wide, as the functional API does. Those copies carry their roles only through
:func:`pgregistry.params.copy_param_roles`; Megatron-LM PR 6470's bug was a copy that lost
``allreduce=False``.

Grads reach the buffer without a second copy. A parameter whose dtype is the buffer's gets
``param.grad`` set to its buffer view, and autograd accumulates into it in place; a low-precision
parameter of a mixed-precision optimizer gets ``param.main_grad`` (its float32 view) and a
post-accumulate hook that adds each new ``.grad`` into it and frees it. ``param.main_grad`` is set
in both cases. Zero grads with :meth:`FlatOptimizer.zero_grad`: ``model.zero_grad()`` sets ``.grad``
to ``None`` and detaches it from the buffer, which :meth:`FlatOptimizer.sync_grads` detects and
refuses (every parameter looked at), and the statistics and the step too (the first parameter of
each kind: a loop without ``sync_grads`` read a norm of 0 and stepped nothing). A ``.grad`` assigned
by hand to a low-precision parameter never reaches the hook, so it is refused alike (it was left
out of the norm and the step).
"""

from __future__ import annotations

import abc
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeAlias

import torch
from torch.utils.weak import WeakIdKeyDictionary

from pgregistry._runtime.flags import require_flag
from pgregistry._runtime.meta_tensors import meta_tensor_error
from pgregistry._runtime.overlapping_tensors import first_overlap
from pgregistry.collection import UNSET, group_size
from pgregistry.grad_stats import backend_device
from pgregistry.grad_stats._arguments import Given, arguments_of_call
from pgregistry.grad_stats._dtensors import is_dtensor
from pgregistry.grad_stats._functional import clipping_after, verdict_groups
from pgregistry.grad_stats._lists import scale_grads_
from pgregistry.grad_stats._reductions import (
    GroupKey,
    Reduced,
    Shares,
    Wanted,
    reduce_shares,
)
from pgregistry.optim._flat_step import FLAT_DTYPES, Copy, ElementwiseRule, FlatStep
from pgregistry.optim._grad_buffer import GradBuffer, Span, span_shares
from pgregistry.optim._grad_statistics import GradStatistics
from pgregistry.optim._param_state import ParamState
from pgregistry.optim._setup import OptimizerProcessGroups
from pgregistry.optim._state_check import param_state_key_faults, refuse_agreed
from pgregistry.params import is_expert_param

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from pgregistry.grad_stats import StatsGroups

__all__ = [
    "FlatOptimizer",
    "Inner",
    "InnerFactory",
    "OptimizerStatistics",
    "ParamNameFn",
    "backend_device",
    "require_group",
]

InnerFactory: TypeAlias = Callable[[list[torch.Tensor]], torch.optim.Optimizer]
"""Builds the inner update rule over the tensors to step, e.g. ``functools.partial(torch.optim.Adam,
lr=1e-3)``. An :class:`~pgregistry.optim._flat_step.ElementwiseRule` (what ``inner_factory``
returns) steps the flat main buffer as one tensor; any other factory gets one tensor per main
param."""

Inner: TypeAlias = "torch.optim.Optimizer | FlatStep"
"""What steps the main params: a :class:`~pgregistry.optim._flat_step.FlatStep` over the flat main
buffer, or the factory's optimizer over the per-parameter main params."""

ParamNameFn: TypeAlias = Callable[[torch.Tensor], str]
"""Names a model parameter (state-dict keys, error messages), e.g. a global, expert-aware name."""


class OptimizerStatistics(GradStatistics):
    """The grad statistics and clipping of an optimizer, under Megatron-Core's method names.

    The local shares of the flat optimizers it steps (itself, or a chained optimizer's children) go
    in one set of shares, reduced once. The norm and the zero count are :class:`GradStatistics`'
    over the model the optimizer covers."""

    @abc.abstractmethod
    def stats_optimizers(self) -> Sequence[FlatOptimizer]:
        """The flat optimizers whose grads the statistics read and clipping scales."""

    def statistics(self, wanted: Wanted, given: Given | None = None) -> Reduced:
        """The grad statistics of the model the optimizer covers, through the one reducer."""
        return statistics_of(self.stats_optimizers(), wanted, given=given)

    get_grad_norm = GradStatistics._grad_norm
    count_zeros = GradStatistics._count_zeros
    get_grad_norm_and_zeros = GradStatistics._norm_and_zeros

    def clip_grad_norm(
        self, max_norm: float, norm_type: float = 2.0, *, error_if_nonfinite: bool = False
    ) -> torch.Tensor:
        """Scale the grads by ``max_norm / (norm + 1e-6)`` when below 1; return the unclipped norm.

        Decided job-wide (:func:`clip_grads_of`): a NaN or infinite norm anywhere scales nothing on
        any rank, or raises on every rank with ``error_if_nonfinite``."""
        return clip_grads_of(self.stats_optimizers(), max_norm, norm_type, error_if_nonfinite)


class FlatOptimizer(OptimizerStatistics):
    """Base of the optimizers over a flat grad buffer, mixed-precision and sharded.

    That is, of :class:`~pgregistry.optim.MixedPrecisionOptimizer` and
    :class:`~pgregistry.optim.ShardedOptimizer`.

    What the two share: the checked parameter list, their names in messages, the groups, and the
    grad statistics over the flat buffer. Subclasses set :attr:`buffer`, :attr:`inner` (``None``
    when this rank steps nothing) and, with :meth:`_set_stats`, the statistics spans and the group
    they reduce over, and implement :meth:`sync_grads`, :meth:`step`, :meth:`state_dict`,
    :meth:`state_dict_faults` and :meth:`_load_checked_state_dict`. Not made directly.

    Args:
        params: The model parameters to update: floating-point tensors, each listed once, all
            dense or all routed experts.
        process_groups: What :func:`~pgregistry.optim.setup_process_groups_for_optimizer`
            returned.
        expert: Whether ``params`` are routed-expert parameters.
        param_name_fn: Names a parameter in messages (``None``: ``param[i]``, its position).
        inner: The factory of the update rule (checked here, used by the subclass).

    Raises:
        ValueError: A parameter listed twice; a parameter of the other kind than ``expert`` says
            (named; give each kind its own optimizer, as ``build_optimizer`` does); a frozen one
            (``requires_grad=False``, named); parameters on several devices; two parameters
            whose memory overlaps (tied by storage, named); a ``param_name_fn`` giving two
            parameters one name.
        TypeError: A parameter that is not a floating-point tensor (named), or groups not made by
            ``setup_process_groups_for_optimizer``; ``params`` a tensor or module (not an iterable
            of parameters), ``expert`` no bool, ``inner`` not callable.

    An optimizer built later over one of its parameters takes that parameter's grads into its own
    buffer (a rebuild does, on purpose): from then on this one's statistics, clipping,
    ``sync_grads``, ``step`` and ``zero_grad`` raise ``RuntimeError`` naming the parameter; its
    ``state_dict`` still reads (to carry the state over).

    Example:
        On a rank of a gloo world (one rank, as :func:`pgregistry.testing.run_world` starts it):

        >>> import torch
        >>> from pgregistry import ParallelLayout, build
        >>> from pgregistry.optim import MixedPrecisionOptimizer, inner_factory
        >>> from pgregistry.optim import setup_process_groups_for_optimizer
        >>> groups = setup_process_groups_for_optimizer(build(ParallelLayout(num_ranks=1)))
        >>> model = torch.nn.Linear(2, 1)
        >>> sgd = inner_factory("sgd", lr=0.1)
        >>> optimizer = MixedPrecisionOptimizer(model.parameters(), groups, inner=sgd)
        >>> isinstance(optimizer, FlatOptimizer)
        True
        >>> model(torch.ones(1, 2)).sum().backward()  # grads: (1, 1) for the weight, 1 for the bias
        >>> optimizer.sync_grads()
        >>> optimizer.clip_grad_norm(1.0)  # the norm before clipping: sqrt(3)
        tensor(1.7321)
        >>> optimizer.step()
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor],
        process_groups: OptimizerProcessGroups,
        *,
        expert: bool,
        param_name_fn: ParamNameFn | None,
        inner: InnerFactory,
    ) -> None:
        if isinstance(params, (torch.Tensor, torch.nn.Module)):
            # Iterating a tensor gives its rows (views the optimizer would step instead of it).
            raise TypeError(
                f"params must be an iterable of parameters, got a {type(params).__name__}: pass "
                "list(model.parameters()), or [tensor] for one tensor"
            )
        require_flag(expert, "expert")
        if not callable(inner):
            raise TypeError(
                f"inner must be a factory of the update rule over the tensors to step "
                f"(inner_factory('adam', lr=1e-3), functools.partial(torch.optim.Adam, lr=1e-3)), "
                f"got {inner!r} ({type(inner).__name__})"
            )
        self.params: list[torch.Tensor] = list(params)
        """The parameters this optimizer updates (one kind: all dense or all routed experts)."""
        self.expert = expert
        positions = {id(p): i for i, p in enumerate(self.params)}
        self._name_fn: ParamNameFn = param_name_fn or (lambda p: f"param[{positions[id(p)]}]")
        if len(positions) != len(self.params):
            raise ValueError("a parameter is listed twice")
        for param in self.params:
            if not isinstance(param, torch.Tensor) or not param.is_floating_point():
                raise TypeError(f"{self.param_name(param)} is not a floating-point tensor")
            if is_dtensor(param):  # its storage is no memory a flat buffer can take
                raise TypeError(
                    f"{self.param_name(param)} is a DTensor (sharded by fully_shard or "
                    "distribute_tensor): this optimizer keeps plain tensors in flat buffers. Step "
                    "such a model with a torch optimizer (torch.optim.AdamW(model.parameters()))"
                )
            if not param.requires_grad:
                # torch's optimizers skip a parameter whose .grad is None; a flat step updates
                # every element of its buffer, so weight decay or momentum would move it.
                raise ValueError(
                    f"{self.param_name(param)} has requires_grad=False: this optimizer steps every "
                    "parameter it is given (weight decay and momentum would change a frozen one); "
                    "give it the trainable parameters only (build_optimizer does)"
                )
            if is_expert_param(param) != expert:
                kind = "a routed-expert" if is_expert_param(param) else "a dense"
                raise ValueError(
                    f"{self.param_name(param)} is {kind} parameter but this "
                    f"optimizer was built with expert={expert}; give dense and "
                    "expert parameters to separate optimizers (build_optimizer does)"
                )
        devices = {param.device for param in self.params}
        if len(devices) > 1:
            raise ValueError(
                f"the parameters lie on {len(devices)} devices ({sorted(map(str, devices))}), "
                "and an optimizer's flat buffers on one: move the model to one device first, or "
                "give each device's parameters their own optimizer"
            )
        if devices == {torch.device("meta")}:  # flat buffers of no values: a step would do nothing
            raise meta_tensor_error(
                f"parameter {self.param_name(self.params[0])!r}", "building the optimizer"
            )
        _refuse_shared_memory(self.params, self.param_name)
        if param_name_fn is not None:
            _refuse_one_name_for_two(self.params, param_name_fn)
        if not isinstance(process_groups, OptimizerProcessGroups):
            raise TypeError(
                f"{type(self).__name__} takes the groups "
                "setup_process_groups_for_optimizer(pg_collection) "
                f"returns, got {type(process_groups).__name__}"
            )
        self.process_groups = process_groups
        """The validated groups this optimizer runs on."""
        self.stats_groups: StatsGroups = process_groups.stats
        """Which rank counts a grad and where the counted grads are summed."""
        self.buffer: GradBuffer
        self.inner: Inner | None = None
        self._stat_spans: tuple[Span, ...] = ()
        self._reduce_keys: tuple[GroupKey, ...] = ()
        self._direct: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._moved: list[tuple[torch.Tensor, int]] = []
        self._hooked: list[torch.Tensor] = []
        self._hooks: dict[int, torch.utils.hooks.RemovableHandle] = {}
        self._taken_over: str | None = None

    # --------------------------------------------------------------------------------------- naming

    def param_name(self, param: torch.Tensor) -> str:
        """The caller's name for ``param`` (``param_name_fn``), else its position.

        Args:
            param: one of the optimizer's parameters.

        Returns:
            What ``param_name_fn`` gives, else ``"param[i]"``, ``i`` its position in ``params``.
        """
        return self._name_fn(param)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The inner optimizer's param groups (set ``lr`` there); empty if this rank steps none."""
        return self.inner.param_groups if self.inner is not None else []

    # --------------------------------------------------------------------------------------- wiring

    def _attach_grads(self, params: Sequence[torch.Tensor], views: Sequence[torch.Tensor]) -> None:
        """Make each view the only home of its parameter's grad.

        ``.grad`` in place, or ``.main_grad`` and a hook.
        """
        for param, view in zip(params, views, strict=True):
            _take_grad_home(param, self)
            param.main_grad = view  # type: ignore[attr-defined]
            if param.dtype == view.dtype:
                if param.grad is not None:
                    view.copy_(param.grad)
                param.grad = view
                self._direct.append((param, view))
                continue
            if param.grad is not None:
                view.copy_(param.grad)
                param.grad = None
            self._hooks[id(param)] = param.register_post_accumulate_grad_hook(
                _accumulate_into(view)
            )
            self._hooked.append(param)

    def _give_up_grad_home(self, param: torch.Tensor) -> None:
        """A later optimizer took ``param``'s grad: drop this one's hook on it, and refuse use.

        Its buffer would read zero grads (a norm of 0) and step nothing, and its hook would take
        the grad before the later optimizer's (which then failed in the backward pass)."""
        hook = self._hooks.pop(id(param), None)
        if hook is not None:
            hook.remove()
        if self._taken_over is None:
            self._taken_over = self.param_name(param)

    def _check_not_taken_over(self) -> None:
        """Refuse use once a later optimizer took a parameter's grad (see _give_up_grad_home)."""
        if self._taken_over is not None:
            raise RuntimeError(
                f"{self._taken_over} of this {type(self).__name__} was given to another "
                "optimizer built after it, whose grad buffer now receives its grads: this one "
                "would read zero grads (a norm of 0) and step nothing. Use the newer optimizer "
                "(new.load_state_dict(old.state_dict()) carries the state over), or give each "
                "parameter to one optimizer only"
            )

    def _move_data(self, param: torch.Tensor, view: torch.Tensor) -> None:
        """Copy ``param`` into ``view`` and make ``view`` its data.

        ``view`` is part of one of this optimizer's flat buffers, so one kernel steps or writes
        every parameter; :meth:`_check_attached` refuses a parameter whose data was replaced since
        (the optimizer would go on updating the buffer, not the parameter)."""
        with torch.no_grad():
            view.copy_(param)
        param.data = view
        self._moved.append((param, view.data_ptr()))

    def _check_attached(self, *, first_only: bool = False) -> None:
        """Refuse grads detached from the grad buffer.

        Also a ``.grad`` assigned by hand to a parameter whose grad a hook takes (a low-precision
        one of a mixed-precision optimizer: the hook never sees it, and the buffer would read
        without it), parameters whose data left this optimizer's buffers, or whose grads a later
        optimizer took. ``first_only``: look at the first parameter of each kind alone, a constant
        cost for the statistics and the step (``model.zero_grad()`` and ``module.to()`` detach
        every parameter, the first too; grads assigned by hand are assigned to every one, the
        first too); :meth:`sync_grads` looks at every one.
        """
        self._check_not_taken_over()
        direct = self._direct[:1] if first_only else self._direct
        moved = self._moved[:1] if first_only else self._moved
        for param, view in direct:
            if param.grad is not view:
                raise RuntimeError(
                    f"{self.param_name(param)}.grad is no longer a view of the "
                    "optimizer's grad buffer (set to None by model.zero_grad() "
                    "or assigned?); zero grads with optimizer.zero_grad()"
                )
        hooked = self._hooked[:1] if first_only else self._hooked
        for param in hooked:
            if param.grad is not None:  # the hook takes every grad backward accumulates
                raise RuntimeError(
                    f"{self.param_name(param)}.grad is set, but this optimizer takes a "
                    f"{param.dtype} parameter's grad into its float32 buffer when backward "
                    "accumulates it (a hook), which a .grad assigned by hand never reaches: it "
                    "would be left out of the norm and the step. Add it to "
                    f"{self.param_name(param)}.main_grad (its view of the buffer) instead, or "
                    "compute it with backward()"
                )
        for param, address in moved:
            if param.data_ptr() != address:
                raise RuntimeError(
                    f"{self.param_name(param)}.data is no longer the optimizer's view of "
                    "it (replaced after the optimizer was built, e.g. by module.to() or "
                    "param.data = ...); the optimizer would update its buffer, not the "
                    "parameter: build the optimizer after moving the model"
                )

    def _check_main_dtype(self, main_dtype: torch.dtype) -> None:
        """Refuse main copies of ``main_dtype`` that would round a parameter.

        A float64 parameter under float32 main copies (``build_optimizer``'s default mixed
        precision) would be stepped, and written back, as float32: its value rounded, silently."""
        if not isinstance(main_dtype, torch.dtype) or not main_dtype.is_floating_point:
            raise TypeError(
                f"main_dtype must be a floating-point torch.dtype (torch.float32) or None, got "
                f"{main_dtype!r}"
            )
        for param in self.params:
            if torch.promote_types(param.dtype, main_dtype) != main_dtype:
                raise ValueError(
                    f"{self.param_name(param)} is {param.dtype}, which main copies of "
                    f"{main_dtype} would round: give a main_dtype that holds {param.dtype}, or "
                    "main_dtype=None (build_optimizer's mixed_precision=False) for a model of "
                    "that dtype"
                )

    def _buffer_device(self) -> torch.device:
        """Where the buffer lives: the parameters' device.

        With no parameters, the one the backend reduces on.
        """
        return self.params[0].device if self.params else backend_device(None)

    def _make_inner(
        self,
        factory: InnerFactory,
        flat: torch.Tensor,
        mains: Sequence[torch.Tensor],
        starts: Sequence[int],
        copies: Sequence[Copy],
    ) -> None:
        """The inner optimizer stepping ``mains`` (views of ``flat`` at ``starts``), or ``None``.

        ``flat.grad`` is their grads' flat span. They are stepped as one tensor with an elementwise
        rule over float32/float64, which also writes ``copies`` (in its kernel on CUDA), one by one
        otherwise (the caller writes the copies); ``None`` when there are none."""
        if not mains:
            self.inner = None
        elif isinstance(factory, ElementwiseRule) and flat.dtype in FLAT_DTYPES:
            self.inner = FlatStep(factory, flat, mains, starts, copies)
        else:
            self.inner = factory(list(mains))

    def _inner_tensors(self) -> list[torch.Tensor]:
        """The tensors :attr:`inner`'s state dict numbers, in its order.

        A flat step's main params, else the tensors of the inner optimizer's param groups."""
        if self.inner is None:
            return []
        if isinstance(self.inner, FlatStep):
            return list(self.inner.mains)
        return [tensor for group in self.inner.param_groups for tensor in group["params"]]

    # ----------------------------------------------------------------------------------- statistics

    def _set_stats(self, spans: tuple[Span, ...], group: ProcessGroup | None) -> None:
        """Statistics run over ``spans`` of the buffer, reduced over ``group``.

        ``group`` is always reduced, even with nothing counted here, so every rank of it issues the
        same collectives."""
        self._stat_spans = spans
        keys: list[GroupKey] = [group]
        for span in spans:
            if not any(span.group is key for key in keys):
                keys.append(span.group)
        self._reduce_keys = tuple(keys)

    def stats_reduce_groups(self) -> tuple[ProcessGroup | None, ...]:
        """The groups this optimizer's statistics reduce over.

        Returns:
            Each group once, the statistics group first, in the order the reduction visits them.
        """
        return self._reduce_keys

    def local_shares(self, shares: Shares) -> None:
        """Add this optimizer's groups and its spans' parts to ``shares``.

        Every group is added, even one with nothing counted here.

        Args:
            shares: the shares one reduction fills (a chained optimizer's children share one).

        Raises:
            RuntimeError: a later optimizer took a parameter's grad, or grads left the buffer (its
                spans would read zeros, or stale grads), naming the parameter.
        """
        self._check_attached(first_only=True)
        for key in self._reduce_keys:
            shares.add(key)
        span_shares(self.buffer.data, self._stat_spans, shares)

    def grads_to_clip(self) -> list[torch.Tensor]:
        """The grads :meth:`step` reads (whole buffer or this rank's shard), duplicates included.

        Returns:
            The tensors clipping scales: here the whole grad buffer, one tensor.
        """
        return [self.buffer.data]

    def stats_optimizers(self) -> Sequence[FlatOptimizer]:
        """This optimizer alone.

        Returns:
            ``[self]``.
        """
        return [self]

    # ---------------------------------------------------------------------------------------- steps

    def zero_grad(self) -> None:
        """Zero every grad at once (the buffer); grads stay views of it."""
        self._check_not_taken_over()
        self.buffer.data.zero_()

    @property
    def grad_divisor(self) -> int:
        """What grads are divided by before they are summed over the data-parallel group.

        The ``dp_cp`` size of one instance, for dense and expert grads alike: see the module
        docstring."""
        return group_size(self.process_groups.intra_dp_cp)

    @abc.abstractmethod
    def sync_grads(self) -> None:
        """Reduce the grads over the data-parallel group, divided by :attr:`grad_divisor`.

        The group is ``expt_dp`` for experts, ``dp_cp`` otherwise."""

    @abc.abstractmethod
    def step(self) -> None:
        """Apply the inner update rule and write the result to the model parameters."""

    @abc.abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """The optimizer state (inner state and main copies), keyed by parameter name.

        Returns:
            What :meth:`load_state_dict` takes back on an optimizer of the same layout and names.
        """

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output (same layout, same names).

        Strict: the ranks of :meth:`load_groups` agree on the :meth:`state_dict_faults` first
        (:mod:`pgregistry.optim._state_check`), so every rank of the instance refuses alike or none
        does, and a refused load changes nothing. Collective over :meth:`load_groups`.

        Args:
            state_dict: what :meth:`state_dict` returned on an optimizer of the same layout.

        Raises:
            ValueError: some rank of the instance found faults: the count and a few of them.
        """
        refuse_agreed(
            f"{type(self).__name__}.load_state_dict",
            self.state_dict_faults(state_dict),
            self.load_groups(),
        )
        self._load_checked_state_dict(state_dict)

    @abc.abstractmethod
    def load_groups(self) -> tuple[ProcessGroup | None, ...]:
        """The groups whose ranks agree on the faults of a load before any of them loads.

        One small all-reduce over each: together they hold every rank of this optimizer's instance,
        replicas included, so a state refused on one rank is refused on all of them, never loaded by
        its replicas alone.

        Returns:
            The groups, each once (``None``: an axis that is off).
        """

    @abc.abstractmethod
    def state_dict_faults(self, state_dict: Any) -> list[str]:
        """Every reason :meth:`load_state_dict` would refuse ``state_dict`` (empty: it loads).

        Local (no collective); changes nothing.

        Args:
            state_dict: a candidate for :meth:`load_state_dict`, of any type.

        Returns:
            One line per fault: missing or extra entries, saved tensors of another shape or dtype;
            empty when it loads.
        """

    @abc.abstractmethod
    def _load_checked_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load ``state_dict``, which has no :meth:`state_dict_faults`."""

    @abc.abstractmethod
    def param_state(self) -> dict[torch.Tensor, ParamState]:
        """Model parameter -> its whole optimizer state.

        See :class:`~pgregistry.optim.ParamStateOptimizer`.

        Returns:
            Each model parameter -> its state (its main copy where there is one, and the update
            rule's state), whole even where the optimizer shards it.
        """

    def load_param_state(self, state: Mapping[torch.Tensor, Mapping[str, Any]]) -> None:
        """Restore :meth:`param_state` output of any layout.

        Saved under any layout: see :class:`~pgregistry.optim.ParamStateOptimizer`. Strict as
        :meth:`load_state_dict`, and collective over :meth:`load_groups` as it is.

        Args:
            state: model parameter -> its state, as :meth:`param_state` gives it.

        Raises:
            ValueError: some rank of the instance found :meth:`param_state_faults` (or ``state``
                is no mapping keyed by parameters), on every rank of :meth:`load_groups` before
                any rank changes anything.
        """
        refuse_agreed(
            f"{type(self).__name__}.load_param_state",
            param_state_key_faults(state) or self.param_state_faults(state),
            self.load_groups(),
        )
        self._load_checked_param_state(state)

    @abc.abstractmethod
    def param_state_faults(self, state: Mapping[torch.Tensor, Mapping[str, Any]]) -> list[str]:
        """Every reason :meth:`load_param_state` would refuse ``state``, or load it wrong.

        Local (no collective); changes nothing.

        Args:
            state: a candidate for :meth:`load_param_state`.

        Returns:
            One line per fault: a main copy or elementwise state of another shape than its
            tensor's, state a flat step cannot hold; empty when it loads.
        """

    @abc.abstractmethod
    def _load_checked_param_state(self, state: Mapping[torch.Tensor, Mapping[str, Any]]) -> None:
        """Load ``state``, which has no :meth:`param_state_faults`."""


def _refuse_shared_memory(params: Sequence[torch.Tensor], name_of: ParamNameFn) -> None:
    """``ValueError`` naming two parameters whose memory overlaps (weights tied by storage).

    Two ``Parameter`` objects over one tensor (``nn.Parameter(embedding.weight.detach())``) are one
    weight to torch's optimizers, which step it in place through both. A flat optimizer copies each
    parameter into its own place of its buffers and makes that its data: the two were untied without
    a word, and each then moved by its own grad alone. Parameters that are disjoint views of one
    storage (those of an optimizer built before) are fine (:func:`first_overlap`)."""
    overlap = first_overlap(params)
    if overlap is not None:
        first, second = (params[i] for i in overlap)
        raise ValueError(
            f"{name_of(first)} and {name_of(second)} share memory (views of one tensor, as "
            "nn.Parameter(other.detach()) makes): the optimizer keeps each in its own place of a "
            "flat buffer, which would untie them, each then stepped by its own grad alone; tie "
            "them as one Parameter (module.b = module.a, listed once)"
        )


def _refuse_one_name_for_two(params: Sequence[torch.Tensor], name_of: ParamNameFn) -> None:
    """``ValueError`` when ``name_of`` gives two parameters one name.

    State dicts are keyed by these names: a ``param_name_fn`` giving every ``Linear`` the name
    ``'weight'`` saved one parameter's main copy and state for both, and loaded it into both,
    without a word."""
    holders: dict[str, int] = {}
    for index, param in enumerate(params):
        name = name_of(param)
        first = holders.setdefault(name, index)
        if first != index:
            raise ValueError(
                f"param_name_fn names param[{first}] and param[{index}] both {name!r}: the "
                "optimizer's state dict is keyed by these names, so it would hold one of the two "
                "for both (and load it into both); give each parameter its own name "
                "(pgregistry.experts.global_param_name_fn does)"
            )


_GRAD_HOMES: WeakIdKeyDictionary = WeakIdKeyDictionary()
"""Parameter -> a weak reference to the flat optimizer whose grad buffer holds its grad."""


def _take_grad_home(param: torch.Tensor, optimizer: FlatOptimizer) -> None:
    """Record ``optimizer`` as the home of ``param``'s grad; an earlier live one gives it up.

    Building a second optimizer over a parameter moves its grad into the new buffer (a rebuild does
    so on purpose, as after a recovery before :func:`~pgregistry.recovery.carry_optimizer_state`),
    so the earlier one must not be used any more. Kept beside the parameter, not on it: a weak
    reference on the parameter would not pickle with ``torch.save(model)``, and one copied by
    ``copy.deepcopy`` would name the original's optimizer."""
    earlier_ref = _GRAD_HOMES.get(param)
    earlier = earlier_ref() if earlier_ref is not None else None
    if earlier is not None and earlier is not optimizer:
        earlier._give_up_grad_home(param)
    _GRAD_HOMES[param] = weakref.ref(optimizer)


def _accumulate_into(view: torch.Tensor) -> Callable[[torch.Tensor], None]:
    def add_grad_into_view(param: torch.Tensor) -> None:
        view.add_(param.grad)  # type: ignore[arg-type]
        param.grad = None

    return add_grad_into_view


def statistics_of(
    optimizers: Sequence[FlatOptimizer],
    wanted: Wanted,
    *,
    verdict: Sequence[ProcessGroup | None] = (),
    given: Given | None = None,
) -> Reduced:
    """The statistics of ``optimizers``' grads: every one's local shares in one set, reduced once.

    ``verdict`` and ``given``: see :func:`~pgregistry.grad_stats._reductions.reduce_shares`."""

    def read_shares(wanted: Wanted) -> Shares:
        shares = Shares(wanted, optimizers[0].buffer.data.device)
        for optimizer in optimizers:
            optimizer.local_shares(shares)
        return shares

    return reduce_shares(read_shares(wanted), verdict=verdict, reread=read_shares, given=given)


def clip_grads_of(
    optimizers: Sequence[FlatOptimizer],
    max_norm: object,
    norm_type: object,
    error_if_nonfinite: object,
) -> torch.Tensor:
    """Clip the grads of ``optimizers`` from their one norm; return the norm before clipping.

    ``optimizers`` is one optimizer, or a chained optimizer's children. Their shares are reduced
    together with the job-wide verdict over ``intra_dist_opt``
    (:func:`~pgregistry.grad_stats._functional.verdict_groups`), then every grad is scaled by the
    one coefficient. The arguments ride in that verdict, as the functional clip's do
    (:mod:`~pgregistry.grad_stats._arguments`): one refused on this rank is raised after the
    reduction, which it joined, so no peer is left waiting in it; ranks given different values
    scale nothing (the norm NaN on every rank) and raise where the verdict is read without a device
    sync."""
    owner = "clip_grad_norm"
    given = arguments_of_call(norm_type, max_norm, clip=True, error_if_nonfinite=error_if_nonfinite)
    verdict = verdict_groups(optimizers[0].stats_groups.collection, owner)
    wanted = Wanted(given.p, zeros=False)
    reduced = statistics_of(optimizers, wanted, verdict=verdict, given=given)
    clipping = clipping_after(reduced, given, owner, max_norm, error_if_nonfinite)
    grads = [grad for optimizer in optimizers for grad in optimizer.grads_to_clip()]
    scale_grads_(grads, clipping)
    return reduced.clip_norm


def require_group(groups: OptimizerProcessGroups, name: str) -> ProcessGroup | None:
    """``groups.<name>``: a group, or ``None`` when the axis is off.

    An unset one is refused with a ``ValueError``.
    """
    value = getattr(groups, name)
    if value is UNSET:
        raise ValueError(
            f"the optimizer needs process group {name!r}, which is not set in the collection"
        )
    return value

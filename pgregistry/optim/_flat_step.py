"""Stepping a flat main buffer as one tensor, with the optimizer state presented per parameter.

A step over thousands of separate tensors is bound by host work and kernel launches: torch's Adam
over 20,000 float32 masters spends most of its time in Python and in per-tensor bookkeeping,
whatever the bytes. The optimizers here keep every main param as a view of one flat buffer laid out
like the grad buffer, so an *elementwise* update rule (every element updated from that element's own
parameter, grad and state: Adam, AdamW, SGD) can step the whole buffer as one tensor: a handful of
kernels (one with ``fused=True`` on CUDA) whatever the parameter count, and on CPU the same bits as
a step per parameter (the ops are elementwise).

Only float32 and float64 main params are stepped flat: torch's CPU kernels round bf16 and fp16
differently in the last elements of a tensor (a scalar loop) than inside it (a vector loop), so a
flat step over bf16 main params (``main_dtype=None`` over a bf16 model) would not give the bits of a
step per parameter; those stay per tensor.

Padding between and after the parameters (grad-buffer alignment) is stepped too: its param, grad and
state are zero, and an elementwise rule keeps them zero.

A flat step also writes the flat tensor's *copies* (:class:`~pgregistry.optim._copies.Copy`: the
low-precision model parameters of a mixed-precision optimizer, packed per dtype run; a sharded
optimizer's parameter shard). On CUDA, over float32, with a rule whose implementation
``ElementwiseRule`` chooses, the step and the copies are one kernel
(:mod:`pgregistry.optim._fused_step`: 30 bytes a parameter for AdamW into bf16, where torch's fused
AdamW and a copy move 34); elsewhere, and for whatever that kernel does not take, torch's step then
one ``_foreach_copy_`` (on CPU the bits of a step per parameter and its copies, as before).

:class:`FlatStep` keeps the state dict in the per-parameter form a step over separate tensors has
(parameter index -> state, moments shaped like the parameter), so checkpoints,
:mod:`pgregistry.checkpoint`'s resharding and the per-parameter names are unchanged.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import torch

from pgregistry.grad_stats._arguments import real_number
from pgregistry.optim._copies import Copy, write_copies
from pgregistry.optim._fused_step import FusedStep, kernel_can_step
from pgregistry.optim._options import option_error
from pgregistry.optim._state_check import refuse_faults

__all__ = ["FLAT_DTYPES", "ElementwiseRule", "FlatStep", "PER_PARAMETER_KEYS"]

FLAT_DTYPES = (torch.float32, torch.float64)
"""Main-param dtypes stepped flat (see the module docstring for why not bf16 and fp16)."""

PER_PARAMETER_KEYS = frozenset({"step"})
"""State keys torch's optimizers keep once per parameter (not per element): the step count."""


def _as_dict(value: Mapping[str, Any]) -> dict[str, Any]:
    return dict(value)


@attrs.frozen(slots=True)
class ElementwiseRule:
    """An elementwise torch update rule and its hyperparameters.

    Called over the tensors to step, like any :data:`~pgregistry.optim.InnerFactory`, it returns a
    torch optimizer over them.

    Passing one (``inner_factory`` returns one) lets the optimizers step their flat main buffer as
    one tensor (:class:`FlatStep`) when it is float32 or float64; any other factory steps one tensor
    per parameter. The rule must update each element from that element alone and keep no
    per-parameter state other than :data:`PER_PARAMETER_KEYS`. On CUDA the rule runs fused (one
    kernel) unless ``hyperparameters`` choose ``fused`` or ``foreach`` themselves: torch's fused
    optimizer, or pgregistry's kernel for a flat float32 step
    (:mod:`~pgregistry.optim._fused_step`).

    Args:
        optimizer_class: The torch optimizer whose update is the rule (``torch.optim.AdamW``,
            ``torch.optim.SGD``, ...).
        hyperparameters: Its keywords besides the parameters (copied into a ``dict``).

    Example:
        On every rank of a 2-rank world (as :func:`pgregistry.testing.run_world` starts it):

        >>> import torch
        >>> from pgregistry import ParallelLayout, build, build_optimizer
        >>> rule = ElementwiseRule(torch.optim.AdamW, {"lr": 1e-4, "weight_decay": 0.1})
        >>> model, pg_collection = torch.nn.Linear(2, 1), build(ParallelLayout(num_ranks=2))
        >>> optimizer = build_optimizer(model, pg_collection, optimizer=rule)  # steps flat
        >>> type(rule([torch.zeros(2, requires_grad=True)]))  # an AdamW over that tensor
        <class 'torch.optim.adamw.AdamW'>
    """

    optimizer_class: type[torch.optim.Optimizer]
    hyperparameters: Mapping[str, Any] = attrs.field(factory=dict, converter=_as_dict)

    @property
    def chooses_implementation(self) -> bool:
        """Whether the rule, not its hyperparameters, picks the implementation.

        It does when no ``fused`` or ``foreach`` is given: a caller who names torch's implementation
        gets it."""
        return "fused" not in self.hyperparameters and "foreach" not in self.hyperparameters

    def __call__(self, tensors: list[torch.Tensor]) -> torch.optim.Optimizer:
        kwargs = dict(self.hyperparameters)
        if tensors and all(t.is_cuda for t in tensors) and self.chooses_implementation:
            kwargs["fused"] = True
        return self.optimizer_class(tensors, **kwargs)


@attrs.frozen(slots=True)
class _Slot:
    """Where parameter ``index``'s main param lies in the flat tensor, and its shape."""

    start: int
    shape: tuple[int, ...]

    @property
    def stop(self) -> int:
        return self.start + math.prod(self.shape)


class FlatStep:
    """Steps ``flat`` by ``rule``, writes ``copies``; the state reads as if each main stepped alone.

    ``flat.grad`` is the flat grad buffer; each of ``mains`` is the view ``flat[start : start +
    numel].view(shape)``, ``start`` from ``starts``.

    One optimizer call over the whole buffer instead of one per parameter, with a checkpoint that
    still numbers the state per parameter, as torch would. The interface is the part of
    ``torch.optim.Optimizer`` the pgregistry optimizers use: :meth:`step`, :attr:`param_groups`,
    :attr:`state`, :meth:`state_dict`, :meth:`load_state_dict`.

    Args:
        rule: The elementwise update (see :class:`ElementwiseRule`).
        flat: The flat main tensor, stepped in place; its ``.grad`` the flat grad.
        mains: The main params, views of ``flat``, in the order the state dict numbers them.
        starts: Each main param's first element in ``flat``.
        copies: What to write after each step (lower-precision model params).

    Raises:
        ValueError: A main param or a copy outside ``flat`` (its range named), a main param that is
            not the view of ``flat`` at its start, or a copy's target not a contiguous 1-d tensor.
        TypeError: ``rule`` no :class:`ElementwiseRule`.

    Example:
        >>> import torch
        >>> flat = torch.zeros(5)
        >>> flat.grad = torch.ones(5)
        >>> mains = [flat[0:2].view(2), flat[2:5].view(3)]
        >>> rule = ElementwiseRule(torch.optim.SGD, {"lr": 0.5})
        >>> FlatStep(rule, flat, mains, starts=[0, 2]).step()
        >>> mains[1]
        tensor([-0.5000, -0.5000, -0.5000])
    """

    def __init__(
        self,
        rule: ElementwiseRule,
        flat: torch.Tensor,
        mains: Sequence[torch.Tensor],
        starts: Sequence[int],
        copies: Sequence[Copy] = (),
    ) -> None:
        if not isinstance(rule, ElementwiseRule):
            raise TypeError(
                f"rule must be an ElementwiseRule (inner_factory returns one), got "
                f"{type(rule).__name__}"
            )
        self.rule = rule
        """The update rule; its hyperparameters are what a loaded param group must hold."""
        self.flat = flat
        self.mains: tuple[torch.Tensor, ...] = tuple(mains)
        """The main params, in the order the state dict numbers them."""
        self.optimizer: torch.optim.Optimizer = rule([flat])
        """The torch optimizer over the one flat tensor (it holds the state, on either path)."""
        self._slots = tuple(
            _Slot(start, tuple(main.shape)) for main, start in zip(mains, starts, strict=True)
        )
        for index, (main, slot) in enumerate(zip(self.mains, self._slots, strict=True)):
            if slot.start < 0 or slot.stop > flat.numel():
                raise ValueError(
                    f"a main param [{slot.start}, {slot.stop}) lies outside the flat tensor"
                )
            at = flat.data_ptr() + slot.start * flat.element_size()
            if main.numel() and (main.data_ptr() != at or not main.is_contiguous()):
                # The state dict slices the flat state at ``starts``: another place would give
                # each parameter another one's state.
                raise ValueError(
                    f"main param {index} is not the view flat[{slot.start}:{slot.stop}] its start "
                    "says: give each main param's own first element in starts"
                )
        self.copies: tuple[Copy, ...] = tuple(copies)
        """What :meth:`step` writes after stepping."""
        for copy in self.copies:
            stop = copy.start + copy.out.numel()
            if copy.out.dim() != 1 or not copy.out.is_contiguous():
                raise ValueError(
                    f"a copy's target must be a contiguous 1-d tensor, not {tuple(copy.out.shape)}"
                )
            if copy.start < 0 or stop > flat.numel():
                raise ValueError(f"a copy [{copy.start}, {stop}) lies outside the flat tensor")
        fused = rule.chooses_implementation and kernel_can_step(flat)
        self._fused = FusedStep(flat, self.copies) if fused else None
        """The one-kernel step and copies on CUDA, where it applies.

        See :mod:`~pgregistry.optim._fused_step`.
        """

    @property
    def state(self) -> dict[torch.Tensor, dict[str, Any]]:
        """Main param -> its state, like torch's ``Optimizer.state``; empty before the first step.

        Elementwise values are views of the flat state."""
        flat_state = self.optimizer.state.get(self.flat)
        if not flat_state:
            return {}
        return {
            main: self._slice_state(flat_state, slot)
            for main, slot in zip(self.mains, self._slots, strict=True)
        }

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The param groups of the torch optimizer stepping ``flat`` (set ``lr`` there)."""
        return self.optimizer.param_groups

    def step(self) -> None:
        """Step, then write the copies.

        One kernel where the fused step takes this rule and state (the copies it leaves after it),
        else torch's step and every copy."""
        if self._fused is not None and self._fused.step(self.optimizer):
            write_copies(self.flat, self._fused.unfused)
            return
        self.optimizer.step()
        write_copies(self.flat, self.copies)

    def state_dict(self) -> dict[str, Any]:
        """The state dict, numbered like a torch step over the main params.

        ``{"state": {index: {key: value}}, "param_groups": [...]}``: elementwise state is a view
        shaped like its parameter, per-parameter state (``step``) shared.

        Returns:
            What a torch optimizer of the same rule over the main params would return, so either
            loads the other's.
        """
        inner = self.optimizer.state_dict()
        flat_state = inner["state"].get(0)
        state = {}
        if flat_state is not None:
            state = {
                index: self._slice_state(flat_state, slot) for index, slot in enumerate(self._slots)
            }
        groups = [
            {**group, "params": list(range(len(self._slots)))} for group in inner["param_groups"]
        ]
        return {"state": state, "param_groups": groups}

    def _slice_state(self, flat_state: Mapping[str, Any], slot: _Slot) -> dict[str, Any]:
        return {
            key: value[slot.start : slot.stop].view(slot.shape)
            if self._is_elementwise(value)
            else value
            for key, value in flat_state.items()
        }

    def _is_elementwise(self, value: Any) -> bool:
        return isinstance(value, torch.Tensor) and value.shape == self.flat.shape

    def state_dict_faults(self, state_dict: Mapping[str, Any]) -> list[str]:
        """What keeps :meth:`load_state_dict` from holding ``state_dict`` (empty: it loads).

        Found without copying anything. Local; changes nothing.

        Args:
            state_dict: a candidate for :meth:`load_state_dict`.

        Returns:
            One line per fault: not one param group of the main params; state keys that differ
            between parameters (none for all is fine); several values of a per-parameter key;
            elementwise state without its parameter's number of elements; a hyperparameter of the
            rule missing from the param group (saved by another rule) or out of its range. Empty
            when it loads.
        """
        groups = state_dict["param_groups"]
        if len(groups) != 1 or len(groups[0]["params"]) != len(self._slots):
            sizes = [len(group["params"]) for group in groups]
            return [
                f"the state dict holds param groups of {sizes} parameters; this "
                f"optimizer steps one group of {len(self._slots)} parameters"
            ]
        group_faults = self._param_group_faults(groups[0])
        if group_faults:
            return group_faults
        per_param = [state_dict["state"].get(pid) or {} for pid in groups[0]["params"]]
        if not any(per_param):
            return []
        keys = set(per_param[0])
        faults = [
            f"parameter {index} has optimizer state {sorted(entry)}, parameter 0 has "
            f"{sorted(keys)}: a flat step needs the same state for every parameter"
            for index, entry in enumerate(per_param)
            if set(entry) != keys
        ]
        for key in sorted(keys if not faults else ()):
            values = [entry[key] for entry in per_param]
            if key in PER_PARAMETER_KEYS:
                if _step_count(values[0]) is None:
                    faults.append(
                        f"optimizer state {key!r} of parameter 0 is {values[0]!r}, not a count of "
                        "steps (a number, 0 or more and finite)"
                    )
                    continue
                faults.extend(
                    f"optimizer state {key!r} differs between parameter 0 and parameter "
                    f"{index}: a flat step keeps one value for every parameter"
                    for index, value in enumerate(values[1:], start=1)
                    if not _same_value(values[0], value)
                )
                continue
            if not isinstance(values[0], torch.Tensor):
                faults.append(
                    f"optimizer state {key!r} of parameter 0 is "
                    f"a {type(values[0]).__name__}, not a tensor"
                )
                continue
            faults.extend(
                f"optimizer state {key!r} of parameter {index} does not have the parameter's "
                f"{slot.stop - slot.start} elements"
                for index, (value, slot) in enumerate(zip(values, self._slots, strict=True))
                if not isinstance(value, torch.Tensor) or value.numel() != slot.stop - slot.start
            )
        return faults

    def _param_group_faults(self, group: Mapping[str, Any]) -> list[str]:
        """Why the saved param ``group`` cannot drive this rule (empty: it can).

        A hyperparameter of the rule missing (state saved by another rule: Adam's group has no
        ``momentum``), or a number out of its range (a NaN ``lr`` would make every parameter NaN at
        the next step)."""
        missing = sorted(set(self.rule.hyperparameters) - set(group))
        if missing:
            return [
                f"its param group lacks {missing}, hyperparameters of this optimizer's "
                f"{self.rule.optimizer_class.__name__} (state saved by another update rule?)"
            ]
        return [
            f"its param group's {fault}"
            for key in sorted(set(group) & set(self.rule.hyperparameters))
            if (fault := option_error(key, group[key])) is not None
        ]

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` output, or a per-tensor optimizer's of the same main params.

        The elementwise state of each parameter is copied into one flat tensor per key, the padding
        zero. Local: no collective.

        Args:
            state_dict: :meth:`state_dict` output, or a torch optimizer's over the same main
                params.

        Raises:
            ValueError: the :meth:`state_dict_faults`, before anything changes.
        """
        refuse_faults("FlatStep.load_state_dict", self.state_dict_faults(state_dict))
        groups = state_dict["param_groups"]
        per_param = [state_dict["state"].get(pid) or {} for pid in groups[0]["params"]]
        state = {0: self._join_states(per_param)} if any(per_param) else {}
        self.optimizer.load_state_dict(
            {"state": state, "param_groups": [{**groups[0], "params": [0]}]}
        )

    def _join_states(self, per_param: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        """The flat state of ``per_param`` (checked by :meth:`state_dict_faults`)."""
        joined: dict[str, Any] = {}
        for key in sorted(per_param[0]):
            values = [entry[key] for entry in per_param]
            if key in PER_PARAMETER_KEYS:
                joined[key] = (
                    values[0].clone() if isinstance(values[0], torch.Tensor) else values[0]
                )
                continue
            flat = torch.zeros(self.flat.shape, dtype=values[0].dtype, device=self.flat.device)
            for value, slot in zip(values, self._slots, strict=True):
                flat[slot.start : slot.stop].copy_(value.reshape(-1))
            joined[key] = flat
        return joined


def _step_count(value: Any) -> float | None:
    """``value`` as a count of steps (a real number, 0 or more and finite), else ``None``."""
    number = real_number(value)
    return number if number is not None and 0 <= number < math.inf else None


def _same_value(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        both = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
        return both and a.shape == b.shape and bool(torch.equal(a, b))
    return bool(a == b)

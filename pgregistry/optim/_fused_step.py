"""The optimizer step of a flat float32 main buffer as one CUDA kernel.

The rounded copy into the model is part of it.

A mixed-precision AdamW step must read the main params, grads and both moments (16 bytes a
parameter) and write the params, the moments and the bf16 copy (14 bytes): 30 bytes. torch's fused
AdamW over the flat buffer moves the first 28, then the copy reads the main params a second time: 34
bytes and two kernels over the whole buffer. One Triton kernel
(:mod:`pgregistry.optim._triton_step`) does both, each byte read once and written once.

What it runs: the rule of a ``torch.optim.Adam``, ``AdamW`` or ``SGD`` (exactly these classes, not
subclasses) over one param group holding the flat tensor, with float hyperparameters: weight decay
(coupled for Adam and SGD, decoupled for AdamW), ``amsgrad``, ``maximize``, momentum, dampening and
Nesterov. Anything else (``capturable``, ``differentiable``, a tensor ``lr``, a grad scaler's
``grad_scale`` or ``found_inf``, state of another dtype or shape) makes :meth:`FusedStep.step`
return ``False`` before touching anything, and the caller runs torch's step: never a silently
different rule. The arithmetic is torch's single-tensor rule in float32 (see the kernel module);
results agree with a float64 evaluation of the rule to rounding, not bit for bit with torch's
kernels.

The state is the one torch's fused optimizer keeps, created as it creates it (``step`` a 0-dim
float32 tensor on the device, incremented there before the kernel reads it, so there is no host
sync; moments shaped like the flat tensor), in the torch optimizer's own ``state``: state dicts,
checkpoints and a torch step in between are unchanged.

Copies: a flat tensor's copies (:class:`~pgregistry.optim._copies.Copy`) are written by the kernel
when their dtype is the one most of them share, they lie on the flat tensor's device, and no block
of ``BLOCK`` elements would write two of them (the kernel reads one copy row per block). A
mixed-precision optimizer over a bf16 model (one copy) and a sharded optimizer (one copy: its shard)
qualify whole. In a model mixing dtypes, copies of a minority dtype, and a copy starting in the
block where the previous one ends (an fp32 parameter of fewer than ``BLOCK`` elements between two
bf16 runs), are left in :attr:`FusedStep.unfused` for the caller's copy after the kernel. The kernel
writes through each copy's own offsets (a row per block: where the block's elements go in the copy's
target), so the target's packing and padding need not match the main buffer's; blocks going whole to
a 16-byte aligned place are written in vectors, a copy's edges element by element.

Optional like :mod:`pgregistry.grad_stats._fused`: triton is imported inside a function, and
:func:`can_run_fused_step` is False off CUDA, without triton, or where the kernel's first launch on
a device (once per device and process) fails; then the caller keeps torch's step.
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Mapping, Sequence
from types import ModuleType
from typing import Any

import attrs
import torch

from pgregistry._runtime.optional_kernels import (
    cuda_index,
    launch_on,
    optional_kernels,
    probe_kernel,
)
from pgregistry.optim._copies import Copy

__all__ = [
    "BLOCK",
    "COPY_DTYPES",
    "ITERS",
    "VEC",
    "WARPS",
    "FusedStep",
    "kernel_can_step",
    "can_run_fused_step",
]

BLOCK = 1024
"""Elements a program steps per iteration: a block, with one copy row."""

ITERS = 16
"""Iterations per program: a program steps ``BLOCK * ITERS`` consecutive elements (its per-program
float64 work, the bias corrections, spread over them)."""

WARPS = 4
"""Warps per program.

``BLOCK / (32 * WARPS)`` elements per thread and iteration: two 16-byte vectors of float32.
"""

VEC = 4
"""float32 elements in 16 bytes: the flat length must be a multiple of it.

Every load and store is a vector.
"""

COPY_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""Dtypes the kernel writes copies in."""

_RULES = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)


@functools.cache
def _import_kernels() -> ModuleType | None:
    return optional_kernels("pgregistry.optim._triton_step")


def can_run_fused_step(device: torch.device) -> bool:
    """Whether the kernel runs on ``device``: CUDA, triton importable, and a first launch passed.

    The first launch (once per device and process) must have compiled and given the exact result of
    a small Adam step (see :mod:`pgregistry._runtime.optional_kernels`)."""
    if device.type != "cuda" or _import_kernels() is None:
        return False
    return _works_on(cuda_index(device))


_PROBE_WANT = (
    (0.5, 1.5, 0.5, 1.5, 0.5, 1.5, 0.5, 1.5),
    (0.5, 1.5, 0.5, 1.5, 0.5, 1.5, 0.5, 1.5),
    1.0,
)


@functools.cache
def _works_on(index: int) -> bool:
    return probe_kernel(
        index,
        _probe_every_launch,
        _PROBE_WANT,
        event="fused_optimizer_step_unavailable",
        kernel="the fused optimizer step kernel",
    )


def _probe_every_launch(device: torch.device) -> tuple[tuple[float, ...], tuple[float, ...], float]:
    """One exactly known Adam step of ones with grads ±4 and ±2, copied to bf16.

    Betas 0.5 and 0.75, eps 0, lr 0.5: step size 1, every value exact; every param moves by 0.5
    against its grad."""
    flat = torch.nn.Parameter(torch.ones(8, device=device))
    flat.grad = torch.tensor([4.0, -4.0, 2.0, -2.0] * 2, device=device)
    out = torch.zeros(8, dtype=torch.bfloat16, device=device)
    adam = torch.optim.Adam([flat], lr=0.5, betas=(0.5, 0.75), eps=0.0)
    if not FusedStep(flat, [Copy(0, out)]).step(adam):
        raise RuntimeError("the probe's Adam was refused")
    return tuple(flat.tolist()), tuple(out.float().tolist()), float(adam.state[flat]["step"])


def kernel_can_step(flat: torch.Tensor) -> bool:
    """Whether the kernel can step ``flat``.

    It must be contiguous float32 of a positive multiple of :data:`VEC` elements, on a device where
    :func:`can_run_fused_step`."""
    return (
        flat.dtype == torch.float32
        and flat.is_contiguous()
        and flat.numel() > 0
        and flat.numel() % VEC == 0
        and can_run_fused_step(flat.device)
    )


@attrs.frozen(slots=True, eq=False)
class _CopyPlan:
    """The copies the kernel writes (``written``), addressed through ``table``, and those it leaves.

    ``written`` is addressed from ``out`` through ``table`` (one ``[out_first, lo, hi]`` row per
    block, on the device; ``None`` for both when it writes none)."""

    out: torch.Tensor | None
    table: torch.Tensor | None
    written: tuple[Copy, ...]
    unfused: tuple[Copy, ...]


def _plan_copies(flat: torch.Tensor, copies: Sequence[Copy], block: int) -> _CopyPlan:
    """Which of ``copies`` the kernel writes and its table, one row per ``block`` elements.

    See the module docstring. Built once: the copies' places never change (the optimizers refuse a
    parameter whose data moved)."""
    candidates = [
        c
        for c in copies
        if c.out.numel() and c.out.device == flat.device and c.out.dtype in COPY_DTYPES
    ]
    if not candidates:
        return _CopyPlan(None, None, (), tuple(copies))
    totals: dict[torch.dtype, int] = {}
    for copy in candidates:
        totals[copy.out.dtype] = totals.get(copy.out.dtype, 0) + copy.out.numel()
    dtype = max(totals, key=lambda d: totals[d])
    chosen = sorted((c for c in candidates if c.out.dtype == dtype), key=lambda c: c.start)
    base = min((c.out for c in chosen), key=torch.Tensor.data_ptr)
    n = flat.numel()
    table = torch.zeros(-(-n // block), 3, dtype=torch.int64)
    written: list[Copy] = []
    claimed = -1  # the last block a written copy uses
    for copy in chosen:
        first, last = copy.start // block, (copy.start + copy.out.numel() - 1) // block
        offset, misaligned = divmod(copy.out.data_ptr() - base.data_ptr(), dtype.itemsize)
        if first <= claimed or misaligned:
            continue
        starts = torch.arange(first, last + 1, dtype=torch.int64) * block
        table[first : last + 1, 0] = offset + starts - copy.start
        table[first : last + 1, 1] = torch.clamp(copy.start - starts, min=0)
        sizes = (n - starts).clamp(max=block)
        table[first : last + 1, 2] = torch.minimum(copy.start + copy.out.numel() - starts, sizes)
        claimed = last
        written.append(copy)
    unfused = tuple(c for c in copies if not any(c is w for w in written))
    return _CopyPlan(base, table.to(flat.device), tuple(written), unfused)


def _as_float32_pair(value: float) -> tuple[float, float]:
    """``value`` as two float32 (its float32 rounding, the rest) the kernel adds in float64."""
    high: float = struct.unpack("f", struct.pack("f", value))[0]
    return high, value - high


def _are_plain_numbers(*values: object) -> bool:
    """Whether ``values`` are plain numbers, which the kernel takes as arguments.

    A tensor ``lr`` or betas keep torch's step."""
    return all(isinstance(value, (int, float)) for value in values)


class FusedStep:
    """Steps ``flat`` with the rule of a torch optimizer over it, in one kernel, and writes copies.

    ``flat`` is a contiguous float32 tensor whose ``.grad`` is its float32 grad. It writes the
    ``copies`` it can (:attr:`unfused`: the others).

    ``block``, ``iters`` and ``warps`` shape the programs (tests use small ones to get many programs
    and blocks over few elements; ``benchmarks/optimizer_step.py --configs`` times others).
    """

    def __init__(
        self,
        flat: torch.Tensor,
        copies: Sequence[Copy],
        *,
        block: int = BLOCK,
        iters: int = ITERS,
        warps: int = WARPS,
    ) -> None:
        self.flat = flat
        self._block, self._iters, self._warps = block, iters, warps
        self._programs = -(-flat.numel() // (block * iters))
        self._plan = _plan_copies(flat, copies, block)

    @property
    def unfused(self) -> tuple[Copy, ...]:
        """The copies the kernel does not write, for the caller to write after :meth:`step`."""
        return self._plan.unfused

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """One step of ``optimizer``'s rule in one kernel, copies written; ``False`` if it can't.

        The rule is the optimizer's param group and state. ``False``, with nothing touched, where
        the rule or its state is not one the kernel runs (the caller steps with torch)."""
        grad = self.flat.grad
        if grad is None or not self._can_run_kernel(optimizer, grad):
            return False
        group = optimizer.param_groups[0]
        if isinstance(optimizer, torch.optim.SGD):
            return self._step_sgd(optimizer, group, grad)
        return self._step_adam(optimizer, group, grad)

    def _can_run_kernel(self, optimizer: torch.optim.Optimizer, grad: torch.Tensor) -> bool:
        """Whether ``optimizer`` is one rule over this flat tensor alone that the kernel runs.

        With a grad the kernel reads, no grad scaler and none of the options the kernel does not
        have."""
        groups = optimizer.param_groups
        return (
            type(optimizer) in _RULES
            and len(groups) == 1
            and len(groups[0]["params"]) == 1
            and groups[0]["params"][0] is self.flat
            and not groups[0].get("differentiable", False)
            and not groups[0].get("capturable", False)
            and getattr(optimizer, "grad_scale", None) is None
            and getattr(optimizer, "found_inf", None) is None
            and self._fits_flat(grad)
        )

    def _fits_flat(self, tensor: object) -> bool:
        """Whether ``tensor`` is laid out like the flat tensor.

        State and grads the kernel reads by its offsets must be.
        """
        flat = self.flat
        return (
            isinstance(tensor, torch.Tensor)
            and tensor.dtype == flat.dtype
            and tensor.shape == flat.shape
            and tensor.device == flat.device
            and tensor.is_contiguous()
        )

    def _step_adam(
        self, optimizer: torch.optim.Optimizer, group: Mapping[str, Any], grad: torch.Tensor
    ) -> bool:
        if not _are_plain_numbers(
            group["lr"], *group["betas"], group["eps"], group["weight_decay"]
        ):
            return False
        amsgrad = bool(group["amsgrad"])
        state = optimizer.state[self.flat]
        if not state:  # as torch's Adam creates it, fused
            state["step"] = torch.zeros((), dtype=torch.float32, device=self.flat.device)
            state["exp_avg"] = torch.zeros_like(self.flat, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(self.flat, memory_format=torch.preserve_format)
            if amsgrad:
                state["max_exp_avg_sq"] = torch.zeros_like(
                    self.flat, memory_format=torch.preserve_format
                )
        moments = (
            ("exp_avg", "exp_avg_sq", "max_exp_avg_sq") if amsgrad else ("exp_avg", "exp_avg_sq")
        )
        step = state.get("step")
        if not all(self._fits_flat(state.get(key)) for key in moments) or not _device_count(
            step, self.flat.device
        ):
            return False
        step.add_(1)
        lr, weight_decay = float(group["lr"]), float(group["weight_decay"])
        decoupled = (
            bool(group.get("decoupled_weight_decay", False)) or type(optimizer) is torch.optim.AdamW
        )
        tensors = [state[key] for key in moments]
        self._launch_kernel(
            "adam_kernel",
            [self.flat, grad, tensors[0], tensors[1], tensors[-1], step],
            [
                lr,
                float(group["eps"]),
                weight_decay,
                *_as_float32_pair(group["betas"][0]),
                *_as_float32_pair(group["betas"][1]),
            ],
            dict(
                AMSGRAD=amsgrad,
                MAXIMIZE=bool(group["maximize"]),
                DECAY=weight_decay != 0,
                DECOUPLED=decoupled,
            ),
            written=[self.flat, *tensors],
        )
        return True

    def _step_sgd(
        self, optimizer: torch.optim.Optimizer, group: Mapping[str, Any], grad: torch.Tensor
    ) -> bool:
        if not _are_plain_numbers(
            group["lr"], group["weight_decay"], group["momentum"], group["dampening"]
        ):
            return False
        momentum, weight_decay = float(group["momentum"]), float(group["weight_decay"])
        buffer: Any = None
        if momentum != 0:  # torch's SGD keeps state only with momentum
            buffer = optimizer.state[self.flat].get("momentum_buffer")
            if buffer is not None and not self._fits_flat(buffer):
                return False
        first = momentum != 0 and buffer is None
        if first:
            buffer = torch.empty_like(self.flat, memory_format=torch.preserve_format)
        self._launch_kernel(
            "sgd_kernel",
            [self.flat, grad, self.flat if buffer is None else buffer],
            [float(group["lr"]), weight_decay, momentum, 1.0 - float(group["dampening"])],
            dict(
                MOMENTUM=momentum != 0,
                FIRST=first,
                NESTEROV=bool(group["nesterov"]),
                MAXIMIZE=bool(group["maximize"]),
                DECAY=weight_decay != 0,
            ),
            written=[self.flat] if buffer is None else [self.flat, buffer],
        )
        if first:
            optimizer.state[self.flat]["momentum_buffer"] = buffer
        return True

    def _launch_kernel(
        self,
        kernel: str,
        tensors: list[torch.Tensor],
        scalars: list[float],
        flags: dict[str, bool],
        *,
        written: list[torch.Tensor],
    ) -> None:
        """Launch ``kernel`` and tell autograd what it changed in place, as a torch step would.

        Over ``tensors`` (then the copy target, the table, the length), ``scalars`` and ``flags``;
        ``written`` and the copies' target are marked changed in place."""
        kernels = _import_kernels()
        if kernels is None:
            raise RuntimeError(
                "the fused optimizer step needs triton, which is not importable here"
            )
        plan = self._plan
        copy = plan.out is not None
        args = [t.detach() for t in tensors]
        args += [
            plan.out if plan.out is not None else args[0],
            plan.table if plan.table is not None else args[0],
        ]
        with launch_on(self.flat.device):
            getattr(kernels, kernel)[(self._programs,)](
                *args,
                self.flat.numel(),
                *scalars,
                **flags,
                COPY=copy,
                BLOCK=self._block,
                ITERS=self._iters,
                VEC=VEC,
                num_warps=self._warps,
            )
        for tensor in [*written, *(c.out for c in plan.written)]:
            torch.autograd.graph.increment_version(tensor)


def _device_count(step: object, device: torch.device) -> bool:
    """Whether ``step`` is a step count the kernel reads.

    A one-element float32 tensor on ``device`` (torch's fused optimizers keep it so)."""
    return (
        isinstance(step, torch.Tensor)
        and step.dtype == torch.float32
        and step.numel() == 1
        and step.device == device
    )

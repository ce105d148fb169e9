"""What pgregistry's optional Triton kernels share: importing a kernel module only where triton is,
proving a kernel on a device once before trusting it there, and launching on a tensor's own GPU
through the kernel's compiled launcher once triton has compiled it for arguments of that kind.

Triton ships with torch's CUDA wheels but compiles each kernel with the machine's C compiler and
CUDA toolchain the first time it runs, so being importable does not mean working. Each kernel's
callers ask once per device and process: a probe launches the kernel on a few values whose result is
known exactly; a launch that raises (no compiler, a driver too old) logs a warning and keeps the
callers on their torch path, and a launch that gives the wrong result raises, since a kernel that
computes wrongly must not run quietly. Off CUDA the kernels run only under triton's interpreter
(``TRITON_INTERPRET=1``, in tests). torch is imported inside the functions: ``import pgregistry``
loads no torch.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Hashable, Mapping, Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = ["cuda_index", "launch_kernel", "optional_kernels", "probe_kernel"]


def optional_kernels(module: str) -> ModuleType | None:
    """The kernel module ``module`` (it imports triton), or ``None`` without triton."""
    try:
        return importlib.import_module(module)
    except ImportError:  # no triton: the callers' torch path
        return None


def cuda_index(device: torch.device) -> int:
    """The index of CUDA ``device`` (the current GPU when it names none)."""
    import torch

    return device.index if device.index is not None else torch.cuda.current_device()


def probe_kernel(
    index: int, probe: Callable[[torch.device], object], want: object, *, event: str, kernel: str
) -> bool:
    """Whether ``probe`` (a launch of ``kernel`` on GPU ``index``) runs and returns ``want``.

    ``False`` with a warning ``event`` where it raises; a ``RuntimeError`` where it returns anything
    else. Callers cache the answer per device."""
    import torch

    from pgregistry._runtime.logger import get_logger

    device = torch.device("cuda", index)
    try:
        got = probe(device)
    except Exception as error:  # a compiler or driver failure: keep the torch path, and say so
        get_logger(__name__).warning(event, device=str(device), error=repr(error))
        return False
    if got != want:
        raise RuntimeError(f"{kernel} gave {got} on {device}, not {want}")
    return True


def _current_gpu_set_to(device: torch.device) -> contextlib.AbstractContextManager[object]:
    """Launch on ``device``'s GPU (triton uses the current one); off CUDA (interpreter) nothing."""
    import torch

    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


_COMPILED: dict[Hashable, Any] = {}
"""Each kernel's compiled form by :func:`_launch_key`: what triton's ``kernel[grid](...)`` returned
the first time it compiled (or found) the kernel for arguments of that kind."""


def launch_kernel(
    kernel: Any,
    programs: int,
    device: torch.device,
    args: Sequence[object],
    constants: Mapping[str, object],
    *,
    num_warps: int,
) -> None:
    """Launch triton ``kernel`` on ``programs`` programs of ``device``'s GPU.

    ``args`` are the kernel's runtime arguments in order (tensors, ints, floats), ``constants`` its
    ``tl.constexpr`` parameters after them, in the signature's order. The first launch for
    arguments of a kind goes through triton's ``kernel[grid](...)``, which binds the arguments,
    specializes, compiles or finds the kernel in its cache and launches it: 40 to 60 µs of host time
    on an H100 machine for a kernel of a dozen arguments (docs/performance.md), as much as a whole
    read of 100 MB. Later launches of that kind call the compiled launcher directly, which is what
    ``kernel[grid](...)`` ends in. The kind (:func:`_launch_key`) holds every fact triton
    specializes a kernel on, at least as finely as triton does, so the same compiled kernel runs.
    Where triton's launch hooks are set (a profiler's), or off CUDA (triton's interpreter), every
    launch goes through ``kernel[grid](...)``."""
    if device.type != "cuda" or _launch_hooks_set():
        with _current_gpu_set_to(device):
            kernel[(programs,)](*args, **constants, num_warps=num_warps)
        return
    key = _launch_key(kernel, device, args, constants, num_warps)
    compiled = _COMPILED.get(key)
    with _current_gpu_set_to(device):
        if compiled is None:
            _COMPILED[key] = _first_launch(kernel, programs, args, constants, num_warps)
            return
        compiled.run(
            programs,
            1,
            1,
            _current_stream(device),
            compiled.function,
            compiled.packed_metadata,
            None,  # launch metadata: made for launch hooks only, and none is set
            None,
            None,
            *args,
            *constants.values(),
        )


def _first_launch(
    kernel: Any,
    programs: int,
    args: Sequence[object],
    constants: Mapping[str, object],
    num_warps: int,
) -> Any:
    """Launch through ``kernel[grid](...)`` and return the compiled kernel it launched.

    Refuses ``constants`` out of the signature's order: the compiled launcher takes every argument
    by position."""
    names = list(kernel.arg_names)
    if names != [*names[: len(args)], *constants]:
        raise ValueError(
            f"{kernel.__name__}'s parameters are {names}; launch_kernel() was given "
            f"{len(args)} arguments and then the constants {list(constants)}: give them in the "
            "signature's order"
        )
    return kernel[(programs,)](*args, **constants, num_warps=num_warps)


def _launch_key(
    kernel: object,
    device: torch.device,
    args: Sequence[object],
    constants: Mapping[str, object],
    num_warps: int,
) -> Hashable:
    """What decides which compiled kernel triton launches for these arguments.

    Triton specializes a tensor on its dtype and whether its address is a multiple of 16, an int on
    whether it is 1, whether it is a multiple of 16 and which integer type holds it; a float is a
    float. Each constant is part of the kernel."""
    return (
        kernel,
        cuda_index(device),
        num_warps,
        tuple(map(_argument_kind, args)),
        tuple(constants.values()),
    )


def _argument_kind(value: object) -> Hashable:
    """:func:`_launch_key`'s part for one runtime argument."""
    import torch

    if isinstance(value, torch.Tensor):
        return (value.dtype, value.data_ptr() % 16 == 0)
    if isinstance(value, bool):
        return (bool, value)
    if isinstance(value, int):
        return (int, value == 1, value % 16 == 0, _integer_type(value))
    if isinstance(value, float):
        return float
    raise TypeError(
        f"launch_kernel() takes tensors, ints and floats as runtime arguments, not {value!r}"
    )


def _integer_type(value: int) -> str:
    """The integer type triton gives ``value``: int32, uint64 beyond int64, else int64."""
    if -(2**31) <= value < 2**31:
        return "i32"
    return "u64" if value >= 2**63 else "i64"


def _current_stream(device: torch.device) -> int:
    """The raw CUDA stream current on ``device``: where triton's own launch puts the kernel."""
    from triton.runtime import driver

    stream: int = driver.active.get_current_stream(cuda_index(device))
    return stream


def _launch_hooks_set() -> bool:
    """Whether triton's launch hooks are set: they see every launch, so launch through triton.

    A hook is a chain of callables (triton 3.4 on: set when it holds one) or a callable."""
    import triton

    runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
    if runtime is None:  # triton before its knobs: the hooks were the compiled kernel's
        from triton.compiler import CompiledKernel

        runtime = CompiledKernel
    hooks = [getattr(runtime, f"launch_{end}_hook", None) for end in ("enter", "exit")]
    return any(hook is not None and getattr(hook, "calls", True) for hook in hooks)

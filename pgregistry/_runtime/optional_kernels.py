"""What pgregistry's optional Triton kernels share: importing a kernel module only where triton is,
proving a kernel on a device once before trusting it there, and launching on a tensor's own GPU.

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
from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["cuda_index", "launch_on", "optional_kernels", "probe_kernel"]


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


def launch_on(device: torch.device) -> contextlib.AbstractContextManager[object]:
    """Launch on ``device``'s GPU (triton uses the current one); off CUDA (interpreter) nothing."""
    import torch

    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()

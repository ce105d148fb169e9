"""One-read grad statistics on CUDA: the sum of squares (2-norm) and the zero count of contiguous grads in one
pass, over one flat span or over any number of separate tensors in one launch.

torch reads a tensor once per statistic, and its multi-tensor ops are bound by per-tensor host work: on an H200
(docs/measurements/grad_stats_h200.txt) the list path's norm (``_foreach_norm``) over 20,000 tensors holding 2 GiB
took 52 ms and its zero count 303 ms (``_foreach_norm(ord=0)`` has no multi-tensor kernel: one launch per tensor).
The Triton kernel of :mod:`pgregistry.grad_stats._triton_kernels` reads every element once and writes per-block partials
(float32 sums of ``BLOCK * ITERS`` squares at most, int32 zero counts), summed here in float64 and int64: the
count is exact. Separate tensors are read through a table of their addresses and sizes built on the host (pinned,
copied without a host sync), one launch per (device, dtype).

Optional by design: triton (shipped with torch's CUDA wheels) is imported inside a function, and
:func:`fused_stats_available` is False off CUDA or without it; callers then keep their torch path (the CPU path is
the torch one). Only float32, bfloat16 and float16 contiguous tensors are read here; float64 grads, which
accumulate in float64, and other norms keep the torch path.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Sequence
from types import ModuleType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = [
    "BLOCK",
    "ITERS",
    "fused_stats_available",
    "one_read_applies",
    "readable",
    "span_squares_and_zeros",
    "squares_and_zeros",
]

BLOCK = 1024
"""Elements one program loads per iteration (a vector of loads per thread)."""

ITERS = 16
"""Iterations per program: a program reads ``BLOCK * ITERS`` consecutive elements (64 KiB of float32)."""


@functools.cache
def _kernels() -> ModuleType | None:
    try:
        import pgregistry.grad_stats._triton_kernels as kernels
    except ImportError:  # no triton: the callers' torch path
        return None
    return kernels


def fused_stats_available(device: torch.device) -> bool:
    """Whether the one-read kernel runs on ``device``: CUDA, triton importable, and a first launch there (once per
    device and process) that compiled and gave the exact statistics of a small tensor. Triton compiles with the
    machine's C compiler and CUDA toolchain; where that fails, a warning names the error and the torch path runs."""
    if device.type != "cuda" or _kernels() is None:
        return False
    import torch

    return _works_on(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _works_on(index: int) -> bool:
    import torch

    from pgregistry._logging import get_logger

    device = torch.device("cuda", index)
    try:
        probe = torch.tensor([0.0, 3.0, -0.0, 4.0], device=device)
        squares, zeros = span_squares_and_zeros(probe)
        table_squares, table_zeros = squares_and_zeros([probe[:2], probe[2:]])
        results = (float(squares), int(zeros), float(table_squares), int(table_zeros))
    except Exception as error:  # a compiler or driver failure: keep torch's reductions, and say so
        get_logger(__name__).warning("one_read_stats_unavailable", device=str(device), error=repr(error))
        return False
    if results != (25.0, 2, 25.0, 2):
        raise RuntimeError(f"the one-read grad statistics kernel gave {results} on {device}, not (25, 2, 25, 2)")
    return True


def _readable_dtype(dtype: torch.dtype) -> bool:
    import torch

    return dtype in (torch.float32, torch.bfloat16, torch.float16)


def readable(tensor: torch.Tensor) -> bool:
    """Whether the kernels read ``tensor``: contiguous float32, bfloat16 or float16."""
    return _readable_dtype(tensor.dtype) and tensor.is_contiguous()


def one_read_applies(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether contiguous grads of ``dtype`` on ``device`` are read by the kernels (CUDA, triton, a dtype they
    read)."""
    return _readable_dtype(dtype) and fused_stats_available(device)


def _loaded() -> ModuleType:
    kernels = _kernels()
    if kernels is None:
        raise RuntimeError("the one-read grad statistics need triton, which is not importable here")
    return kernels


def _finish(squares: torch.Tensor, zeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    import torch

    return squares.sum(dtype=torch.float64), zeros.sum(dtype=torch.int64)


def span_squares_and_zeros(
    view: torch.Tensor, *, block: int = BLOCK, iters: int = ITERS
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum of squares (0-dim float64) and number of zeros (0-dim int64) of a contiguous tensor, in one read."""
    import torch

    if not readable(view):
        raise ValueError(f"the one-read kernels read contiguous float32/bf16/fp16 tensors, not {view.dtype}")
    chunk = block * iters
    programs = -(-view.numel() // chunk)
    squares = torch.zeros(max(programs, 1), dtype=torch.float32, device=view.device)
    zeros = torch.zeros(max(programs, 1), dtype=torch.int32, device=view.device)
    if programs:
        with _on(view.device):
            _loaded().squares_and_zeros_kernel[(programs,)](
                view, view.numel(), view, view, view, view, squares, zeros,
                TABLE=False, DTYPE=_triton_dtype(view.dtype), BLOCK=block, ITERS=iters,
            )
    return _finish(squares, zeros)


def squares_and_zeros(
    tensors: Sequence[torch.Tensor],
    *,
    checked: bool = False,
    block: int = BLOCK,
    iters: int = ITERS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum of squares (0-dim float64) and number of zeros (0-dim int64) over ``tensors`` (contiguous, one device
    and dtype), in one read and one launch whatever their number.

    The kernel reads ``numel`` elements of the given dtype from each tensor's address, so every tensor is checked
    for that first, unless ``checked=True``: the caller has grouped ``tensors`` by (device, dtype) and kept only
    contiguous ones (:mod:`pgregistry.grad_stats.reductions` does, in the pass that groups them), which spares a
    second pass over thousands of tensors.
    """
    import torch

    kernels = _loaded()
    if not tensors:
        raise ValueError("squares_and_zeros needs at least one tensor")
    device, dtype = tensors[0].device, tensors[0].dtype
    if not _readable_dtype(dtype):
        raise ValueError(f"the one-read kernels read float32/bf16/fp16 tensors, not {dtype}")
    for index, tensor in enumerate(() if checked else tensors):
        if not tensor.is_contiguous() or tensor.device != device or tensor.dtype != dtype:
            raise ValueError(
                f"tensor {index} ({tensor.dtype} on {tensor.device}, contiguous={tensor.is_contiguous()}) differs "
                f"from tensor 0 ({dtype} on {device}) or is not contiguous: pass contiguous tensors of one kind"
            )
    chunk = block * iters
    located = torch.tensor([(t.data_ptr(), t.numel()) for t in tensors], dtype=torch.int64).t()
    addresses, numels = located[0], located[1]
    chunks = (numels + chunk - 1) // chunk
    total = int(chunks.sum())
    squares = torch.zeros(max(total, 1), dtype=torch.float32, device=device)
    zeros = torch.zeros(max(total, 1), dtype=torch.int32, device=device)
    if total:
        block_tensor = torch.repeat_interleave(torch.arange(len(tensors)), chunks)
        first = torch.cumsum(chunks, 0) - chunks
        block_start = (torch.arange(total) - torch.repeat_interleave(first, chunks)) * chunk
        host = torch.cat([addresses, numels, block_tensor, block_start])
        if device.type == "cuda":  # pinned, so the copy waits for nothing queued on the stream
            table = host.pin_memory().to(device, non_blocking=True)
        else:
            table = host
        count = len(tensors)
        parts = table.split([count, count, total, total])
        with _on(device):
            kernels.squares_and_zeros_kernel[(total,)](
                tensors[0], 0, *parts, squares, zeros, TABLE=True, DTYPE=_triton_dtype(dtype), BLOCK=block, ITERS=iters
            )
    return _finish(squares, zeros)


def _on(device: torch.device) -> contextlib.AbstractContextManager[object]:
    """Launch on ``device``'s GPU (triton launches on the current one); off CUDA (the interpreter) nothing."""
    import torch

    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _triton_dtype(dtype: torch.dtype) -> object:
    import torch
    import triton.language as tl

    return {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}[dtype]

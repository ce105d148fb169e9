"""One-read grad statistics on CUDA: the sum of squares (2-norm) and the zero count of contiguous
grads in one pass, over one flat span or over any number of separate tensors in one launch; and
clipping's scaling over the same launch table, skipped on the device when the coefficient is 1.

torch reads a tensor once per statistic, and its multi-tensor ops are bound by per-tensor host work:
on an H200 (docs/measurements/grad_stats_h200.txt) ``get_total_norm`` over 20,000 float32 tensors
holding 2 GiB took 105 ms and a ``count_nonzero`` loop 500 ms (``_foreach_norm(ord=0)`` has no
multi-tensor kernel either: one launch per tensor). The Triton kernel of
:mod:`pgregistry.grad_stats._triton_kernels` reads every element once, in 16-byte vector loads
wherever the data is 16-byte aligned, and writes per-block partials (float64 sums of ``BLOCK *
ITERS`` squares at most, each element cast to float64 before it is squared, and zero counts, as
float64 pairs), summed here in float64 in one reduction: the count is exact, and no square or sum
over- or underflows (the 2-norm is exact with no host read:
:attr:`~pgregistry.grad_stats._reductions.Wanted.exact_in_one_reduction`). Separate tensors are read
through a table of each program's tensor, first element and length, and each tensor's offset from
the kernel's base, one launch per (device, dtype); the table depends only on the tensors' sizes and
the offsets on their addresses, so each is built once (vectorised on the host, pinned, copied
without a host sync) and kept on the device, and grads that moved need new offsets only. The host
work per call is then a few passes over the tensors at C speed (addresses, sizes), not Python work
per tensor.

Optional by design: triton (shipped with torch's CUDA wheels) is imported inside a function, and
:func:`can_run_fused_stats` is False off CUDA or without it; callers then keep their torch path (the
CPU path is the torch one). Only float32, bfloat16 and float16 contiguous tensors are read here;
float64 grads, which accumulate in float64, and other norms keep the torch path.
"""

from __future__ import annotations

import functools
import math
import struct
from array import array
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any, Final, TypeVar

import attrs

from pgregistry._runtime.optional_kernels import (
    cuda_index,
    launch_on,
    optional_kernels,
    probe_kernel,
)

if TYPE_CHECKING:
    import torch

T = TypeVar("T")

__all__ = [
    "BLOCK",
    "ITERS",
    "WARPS",
    "Launch",
    "Finished",
    "clip_over_",
    "finish_rows",
    "float64_bits",
    "can_run_fused_stats",
    "iterations_for",
    "launch_of",
    "one_read_applies",
    "read_over",
    "is_kernel_readable",
    "scale_",
    "scale_over_",
    "span_squares_and_zeros",
    "squares_and_zeros",
]

BLOCK = 1024
"""Elements one program loads per iteration (a vector of loads per thread)."""

ITERS: Final = {4: 8, 2: 32}
"""Iterations per program by element size: a program reads ``BLOCK * ITERS`` consecutive elements,
32 KiB of float32 (8 iterations of two 16-byte vectors a thread) or 64 KiB of bf16 / fp16 (32 of
one). Measured on an H200 over 2 GiB in 2,000 and 20,000 tensors (``benchmarks/grad_stats.py
--configs``, docs/performance.md): the table read 10-13% faster for float32 and 10-17% for bf16 than
16 iterations for both; the scale kernel, over the same table, within 3%.
"""

WARPS = 4
"""Warps per program (``BLOCK / (32 * WARPS)`` elements per thread and iteration: two 16-byte
vectors of float32, one of bf16)."""


@functools.cache
def _import_kernels() -> ModuleType | None:
    return optional_kernels("pgregistry.grad_stats._triton_kernels")


def can_run_fused_stats(device: torch.device) -> bool:
    """Whether the one-read kernel runs on ``device``: CUDA, triton, and a first launch that passed.

    Triton must be importable, and the first launch there (once per device and process) must have
    compiled and given the exact statistics of a small tensor. Triton compiles with the machine's C
    compiler and CUDA toolchain; where that fails, a warning names the error and the torch path
    runs."""
    if device.type != "cuda" or _import_kernels() is None:
        return False
    return _works_on(cuda_index(device))


@functools.cache
def _works_on(index: int) -> bool:
    kernel = "the one-read grad statistics kernel"
    want = (25.0, 2, 25.0, 2, [0.0, 1.5, -0.0, 2.0])
    return probe_kernel(
        index, _probe_every_launch, want, event="one_read_stats_unavailable", kernel=kernel
    )


def _probe_every_launch(device: torch.device) -> tuple[float, int, float, int, list[float]]:
    """Every launch (a span, a table, scaling, clipping from a norm) over ``[0, 3, -0, 4]``.

    Expected: squares 25, zeros 2, halved values (a NaN norm scales nothing)."""
    import torch

    probe = torch.tensor([0.0, 3.0, -0.0, 4.0], device=device)
    pieces = [probe[:2], probe[2:]]
    squares, zeros = span_squares_and_zeros(probe)
    table_squares, table_zeros = squares_and_zeros(pieces)
    scale_(pieces, torch.tensor(0.5, device=device))
    scale_(pieces, torch.tensor(1.0, device=device))
    clip_over_(
        pieces, launch_of(pieces), 1.0, torch.tensor(math.nan, dtype=torch.float64, device=device)
    )  # no scale
    return float(squares), int(zeros), float(table_squares), int(table_zeros), probe.tolist()


def _readable_dtype(dtype: torch.dtype) -> bool:
    import torch

    return dtype in (torch.float32, torch.bfloat16, torch.float16)


def is_kernel_readable(tensor: torch.Tensor) -> bool:
    """Whether the kernels read ``tensor``: contiguous float32, bfloat16 or float16."""
    return _readable_dtype(tensor.dtype) and tensor.is_contiguous()


def one_read_applies(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether contiguous grads of ``dtype`` on ``device`` are read by the kernels.

    That takes CUDA, triton, and a dtype they read."""
    return _readable_dtype(dtype) and can_run_fused_stats(device)


def _require_kernels() -> ModuleType:
    kernels = _import_kernels()
    if kernels is None:
        raise RuntimeError("the one-read grad statistics need triton, which is not importable here")
    return kernels


def iterations_for(dtype: torch.dtype) -> int:
    """:data:`ITERS` for ``dtype`` (a dtype the kernels read)."""
    return ITERS[dtype.itemsize]


def _vector_width(dtype: torch.dtype) -> int:
    """Elements in 16 bytes of ``dtype``: the width of the kernel's vector loads."""
    return 16 // dtype.itemsize


def _launch_squares_and_zeros(
    x: torch.Tensor,
    n: int,
    tables: tuple[torch.Tensor, torch.Tensor] | None,
    programs: int,
    block: int,
    iters: int,
) -> torch.Tensor:
    """One launch of ``programs`` programs (at least one): its pairs summed.

    The pairs are ``[sum of squares, zeros]`` (float64); ``tables`` a launch's program table and
    offsets, ``None`` for one contiguous tensor ``x`` of ``n`` elements.
    """
    import torch

    pairs = torch.empty((programs, 2), dtype=torch.float64, device=x.device)
    table, offsets = (x, x) if tables is None else tables
    with launch_on(x.device):
        _require_kernels().squares_and_zeros_kernel[(programs,)](
            x,
            n,
            table,
            offsets,
            pairs,
            TABLE=tables is not None,
            BLOCK=block,
            ITERS=iters,
            VEC=_vector_width(x.dtype),
            num_warps=WARPS,
        )
    return pairs.sum(0)


def _zero_pair(device: torch.device) -> torch.Tensor:
    import torch

    return torch.zeros(2, dtype=torch.float64, device=device)


def _split_pair(pair: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A pair as the sum of squares (0-dim float64) and the zero count (0-dim int64)."""
    import torch

    return pair[0], pair[1].to(torch.int64)


def span_squares_and_zeros(
    view: torch.Tensor, *, block: int = BLOCK, iters: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum of squares and number of zeros of a contiguous tensor, in one read.

    The sum is 0-dim float64, the count 0-dim int64; ``iters`` is :func:`iterations_for` of its
    dtype unless given."""
    if not is_kernel_readable(view):
        raise ValueError(
            f"the one-read kernels read contiguous float32/bf16/fp16 tensors, not {view.dtype}"
        )
    iters = iterations_for(view.dtype) if iters is None else iters
    programs = -(-view.numel() // (block * iters))
    if not programs:
        return _split_pair(_zero_pair(view.device))
    return _split_pair(_launch_squares_and_zeros(view, view.numel(), None, programs, block, iters))


def squares_and_zeros(
    tensors: Sequence[torch.Tensor],
    *,
    checked: bool = False,
    block: int = BLOCK,
    iters: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum of squares and number of zeros over ``tensors``, in one read and one launch.

    ``tensors`` are contiguous, of one device and dtype, any number of them; the sum is 0-dim
    float64, the count 0-dim int64.

    The kernel reads ``numel`` elements of the given dtype from each tensor's address, so every
    tensor is checked for that first, unless ``checked=True``: the caller has grouped ``tensors`` by
    (device, dtype) and kept only contiguous ones. The launch table comes from :func:`launch_of`.
    """
    _check_readable(tensors, checked)
    if len(tensors) == 1:
        return span_squares_and_zeros(tensors[0], block=block, iters=iters)
    return _split_pair(read_over(tensors, launch_of(tensors, block=block, iters=iters)))


def read_over(tensors: Sequence[torch.Tensor], launch: Launch) -> torch.Tensor:
    """The sum of squares and the zero count of ``tensors`` through ``launch``, one float64 pair.

    ``launch`` is made for their addresses and sizes (a caller that keeps it checks them; nothing is
    checked here). The pair ``[squares, zeros]`` is a part of the reductions as it is
    (:func:`~pgregistry.grad_stats._reductions.make_part`), no operation to make it."""
    if launch.table is None:
        return _zero_pair(tensors[0].device)
    return _launch_squares_and_zeros(
        tensors[launch.base],
        0,
        (launch.table, launch.offsets),
        launch.table.shape[0],
        launch.block,
        launch.iters,
    )


def scale_(
    tensors: Sequence[torch.Tensor],
    coeff: torch.Tensor,
    *,
    checked: bool = False,
    block: int = BLOCK,
    iters: int | None = None,
) -> None:
    """Multiply ``tensors`` in place by ``coeff`` where it is below 1, in one launch.

    ``tensors`` as for :func:`squares_and_zeros`, ``coeff`` a 0-dim tensor; the launch is over the
    statistics' launch table. Where ``coeff`` is 1 every program returns at once, so clipping that
    does not scale reads and writes nothing, and nothing waits on the host.

    The coefficient is first rounded to the tensors' dtype (on the device, through float32, as
    torch's ``.to`` of a float64 tensor), then each product is computed in float32 and rounded:
    torch's ``_foreach_mul_`` / ``mul_`` with a 0-dim CUDA coefficient casts it to the tensors'
    dtype (the common dtype) before multiplying, and the unfused path passes it so, so every path
    gives torch's bits."""
    _check_readable(tensors, checked)
    scale_over_(tensors, launch_of(tensors, block=block, iters=iters), coeff)


def scale_over_(tensors: Sequence[torch.Tensor], launch: Launch, coeff: torch.Tensor) -> None:
    """:func:`scale_` of ``tensors`` through ``launch`` (as :func:`read_over`)."""
    import torch

    _scale_launch(tensors, launch, coeff.to(device=tensors[0].device, dtype=torch.float64), None)


def clip_over_(
    tensors: Sequence[torch.Tensor], launch: Launch, max_norm: float, norm64: torch.Tensor
) -> None:
    """Clip ``tensors`` through ``launch`` by the coefficient of ``max_norm`` over ``norm64``.

    ``launch`` as for :func:`read_over`; ``norm64`` is the total norm (0-dim float64 on their
    device). Each program computes the coefficient on the device with the bits of
    :func:`~pgregistry.grad_stats._reductions.clip_coefficient`: no operation to make it, none to
    round it."""
    _scale_launch(tensors, launch, norm64, max_norm)


def _scale_launch(
    tensors: Sequence[torch.Tensor], launch: Launch, value: torch.Tensor, max_norm: float | None
) -> None:
    """The scale kernel over ``launch``, by a coefficient or by clipping's coefficient.

    By the coefficient ``value`` (``max_norm`` ``None``), else by clipping's coefficient of
    ``max_norm`` over the norm ``value``."""
    if launch.table is None:
        return
    with launch_on(tensors[0].device):
        _require_kernels().scale_kernel[(launch.table.shape[0],)](
            tensors[launch.base],
            0,
            launch.table,
            launch.offsets,
            value,
            float64_bits(max_norm or 0.0),
            _epsilon_bits(),
            FROM_NORM=max_norm is not None,
            TABLE=True,
            BLOCK=launch.block,
            ITERS=launch.iters,
            VEC=_vector_width(tensors[0].dtype),
            num_warps=WARPS,
        )


@attrs.frozen(slots=True)
class Finished:
    """What :func:`finish_rows` made: each 0-dim, ``None`` where not asked for."""

    norm64: torch.Tensor | None
    zeros: torch.Tensor | None
    narrow: torch.Tensor | None
    """The norm in float32."""
    clip_narrow: torch.Tensor | None
    """The norm in float32 as a clip returns it (the largest float32 for a finite norm beyond)."""


def finish_rows(
    rows: Sequence[torch.Tensor],
    flags: torch.Tensor | None,
    *,
    norm: bool,
    zeros: bool,
    narrow: bool,
    scale: float,
    ranks: int = 0,
) -> Finished:
    """The 2-norm and the zero count of one or two reduced rows, in one launch.

    ``rows`` are contiguous float64 rows of :mod:`pgregistry.grad_stats._reductions` (``[middle,
    zeros, large, small]`` with ``norm``, at least ``[share, zeros]`` without), one or two, on one
    device; ``flags`` the verdict's ``[NaN, inf]`` counts (two contiguous float64 elements) or
    ``None``; ``scale`` the range columns' scale (a power of two); ``ranks``, where positive, says
    the flags are followed by the call's arguments in the summed form of
    :func:`~pgregistry.grad_stats._arguments.agreement_columns` over that many ranks (the norm NaN
    where they disagree, as :meth:`~pgregistry.grad_stats._arguments.Agreement.disagrees`). The
    reductions' own operations
    on 0-dim tensors, 20 to 30 launches of a few bytes each (0.19 ms of host time on an H100
    machine), made one (:func:`~pgregistry.grad_stats._triton_kernels.finish_kernel`)."""
    import torch

    device = rows[0].device
    norm64 = torch.empty((), dtype=torch.float64, device=device) if norm else None
    count = torch.empty((), dtype=torch.int64, device=device) if zeros else None
    narrowed = torch.empty((), dtype=torch.float32, device=device) if norm and narrow else None
    clipped = torch.empty((), dtype=torch.float32, device=device) if norm and narrow else None
    first = rows[0]
    with launch_on(device):
        _require_kernels().finish_kernel[(1,)](
            first,
            rows[-1],
            first if flags is None else flags,
            first if norm64 is None else norm64,
            first if count is None else count,
            first if narrowed is None else narrowed,
            first if clipped is None else clipped,
            float64_bits(scale),
            ranks,
            TWO_ROWS=len(rows) == 2,
            NORM=norm,
            ZEROS=zeros,
            FLAGS=flags is not None,
            AGREE=flags is not None and ranks > 0,
            NARROW=narrowed is not None,
            BYTES=_agreement_bytes(),
            BYTES_BLOCK=1 << (_agreement_bytes() - 1).bit_length(),
        )
    return Finished(norm64, count, narrowed, clipped)


@functools.cache
def _agreement_bytes() -> int:
    """The bytes of the summed form of the call's arguments, each a column.

    The count lives with the arguments, which import torch."""
    from pgregistry.grad_stats._arguments import AGREEMENT_BYTES

    return AGREEMENT_BYTES


@functools.cache
def _epsilon_bits() -> int:
    """The bits of clipping's epsilon, made once.

    The constant lives with the clip's arguments, which import torch.
    """
    from pgregistry.grad_stats._arguments import CLIP_EPSILON

    return float64_bits(CLIP_EPSILON)


def float64_bits(value: float) -> int:
    """Float64 ``value``'s bits as a signed int: how a float64 reaches a triton kernel exactly."""
    bits: int = struct.unpack("<q", struct.pack("<d", value))[0]
    return bits


def _check_readable(tensors: Sequence[torch.Tensor], checked: bool) -> None:
    """``ValueError`` unless ``tensors`` are one readable kind, each contiguous.

    ``checked``: the caller knows they are.
    """
    if not tensors:
        raise ValueError("the one-read kernels need at least one tensor")
    device, dtype = tensors[0].device, tensors[0].dtype
    if not _readable_dtype(dtype):
        raise ValueError(f"the one-read kernels read float32/bf16/fp16 tensors, not {dtype}")
    for index, tensor in enumerate(() if checked else tensors):
        if not tensor.is_contiguous() or tensor.device != device or tensor.dtype != dtype:
            raise ValueError(
                f"tensor {index} ({tensor.dtype} on {tensor.device}, "
                f"contiguous={tensor.is_contiguous()}) differs from tensor 0 ({dtype} "
                f"on {device}) or is not contiguous: pass contiguous tensors of one kind"
            )


@attrs.frozen(slots=True)
class Launch:
    """The programs of one launch over a list of tensors.

    The index of the tensor the kernel addresses every tensor from (its base: the first that holds
    elements), the table of each program's tensor, first element in it and element count (``None``:
    no elements), each tensor's offset from the base in elements, and the ``block`` and ``iters``
    the table was cut for. The table depends on the tensors' sizes only, the offsets on their
    addresses: tensors of the same sizes at other addresses (new grads, ``set_to_none``) share the
    table and need new offsets only, one small copy."""

    base: int
    table: torch.Tensor | None
    offsets: torch.Tensor
    block: int
    iters: int


def launch_of(
    tensors: Sequence[torch.Tensor], *, block: int = BLOCK, iters: int | None = None
) -> Launch:
    """The launch over ``tensors`` (one device and dtype), its table and offsets on the device.

    Each is a function of the tensors' sizes (the table) or of their addresses and sizes (the
    offsets) only: built once per distinct (device, dtype, sizes) and (device, dtype, addresses,
    sizes), vectorised on the host, pinned and copied without a host sync, and kept on the device
    (:class:`_Tables`), so a step whose grads keep their storage sends nothing to the device, and
    one whose grads moved sends their offsets; a caller that keeps the launch itself
    (:mod:`pgregistry.grad_stats._local`'s kept plans) skips even the lookup."""
    import torch

    addresses = array("q", list(map(torch.Tensor.data_ptr, tensors)))
    numels = array("q", list(map(torch.Tensor.numel, tensors)))
    device, dtype = tensors[0].device, tensors[0].dtype
    iters = iterations_for(dtype) if iters is None else iters
    sizes = numels.tobytes()
    table_key = (device, block, iters, sizes)
    table = _TABLES.get(table_key)
    if table is None:
        table = _TABLES.put(table_key, _program_table(numels, device, block * iters))
    offsets_key = (device, dtype, addresses.tobytes() + sizes)
    based = _OFFSETS.get(offsets_key)
    if based is None:
        based = _OFFSETS.put(offsets_key, _base_and_offsets(addresses, numels, dtype, device))
    return Launch(based[0], table, based[1], block, iters)


def _program_table(numels: array[int], device: torch.device, chunk: int) -> torch.Tensor | None:
    """Each program's ``[tensor, first element in it, elements]`` over tensors of ``numels``.

    At most ``chunk`` elements a program; ``None`` where the tensors hold none. Vectorised: no
    Python work per tensor or program."""
    import torch

    sizes = torch.frombuffer(numels, dtype=torch.int64)
    chunks = (sizes + chunk - 1) // chunk
    total = int(chunks.sum())
    if not total:
        return None
    # each program's tensor: tensor i repeated once per program of it, in one pass (a binary search
    # of each program among the tensors' ends made the table 1.1-1.6x slower at 40,000 programs)
    tensor = torch.repeat_interleave(torch.arange(len(sizes)), chunks, output_size=total)
    firsts = torch.cumsum(chunks, 0) - chunks  # each tensor's first program
    skipped = (torch.arange(total) - firsts[tensor]) * chunk  # its elements before this program's
    count = torch.clamp(sizes[tensor] - skipped, max=chunk)
    return _on_device(torch.stack([tensor, skipped, count], dim=1), device)


def _base_and_offsets(
    addresses: array[int], numels: array[int], dtype: torch.dtype, device: torch.device
) -> tuple[int, torch.Tensor]:
    """The kernel's base tensor and each tensor's offset from it, in elements.

    The base is the first tensor that holds elements at a 16-byte aligned address, else the first
    that holds elements: triton specializes a kernel on its pointer's alignment, and the kernels'
    16-byte vector loads need an aligned base (a misaligned view first in the list would read every
    tensor element by element). A tensor without elements may have no address and gets offset 0
    (no program reads it). ``ValueError`` for a tensor whose distance from the base is no whole
    number of elements. Vectorised: no Python work per tensor."""
    import torch

    start = torch.frombuffer(addresses, dtype=torch.int64)
    present = torch.frombuffer(numels, dtype=torch.int64) > 0
    preference = present.to(torch.int8) * 2 + (present & (start % 16 == 0)).to(torch.int8)
    base = int(torch.argmax(preference))  # the first of the most preferred
    distance = torch.where(present, start - start[base], 0)
    misaligned = torch.nonzero(distance % dtype.itemsize).flatten()
    if misaligned.numel():
        index = int(misaligned[0])
        raise ValueError(
            f"tensor {index} starts {int(distance[index])} bytes from tensor {base}, not a whole "
            f"number of {dtype} elements: the one-read kernel addresses every tensor from one"
        )
    return base, _on_device(distance // dtype.itemsize, device)


def _on_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host`` on ``device``: on CUDA pinned first, so the copy waits for nothing queued."""
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host


class _Tables:
    """The last few program tables (or offsets) by what they are computed from, most recent last.

    A hit needs the same key, from which the value is computed, so it is never stale; a few entries
    cover the lists of one step (dense and expert grads, float32 and bf16)."""

    def __init__(self, size: int) -> None:
        self._size = size
        self._tables: OrderedDict[Hashable, Any] = OrderedDict()

    def get(self, key: Hashable) -> Any:
        value = self._tables.get(key)
        if value is not None:
            self._tables.move_to_end(key)
        return value

    def put(self, key: Hashable, value: T) -> T:
        self._tables[key] = value
        while len(self._tables) > self._size:
            self._tables.popitem(last=False)
        return value


_TABLES = _Tables(8)
"""Program tables by (device, block, iters, sizes)."""
_OFFSETS = _Tables(8)
"""Bases and offsets by (device, dtype, addresses and sizes)."""

"""The Triton kernels of the one-read grad statistics and of clipping,
:mod:`pgregistry.grad_stats._fused` (imports triton: import this module only inside a function,
after checking that triton is importable).

Each program reads at most ``BLOCK * ITERS`` consecutive elements and writes one float64 pair: the
sum of their squares (each element cast to float64 before it is squared, at most ``ITERS`` additions
per lane, then a tree over the block: a float32, bf16 or fp16 square lies within ``[2**-298,
2**256]``, so no square or sum over- or underflows and the norm needs no second look; the float64
arithmetic is meant to hide behind a memory-bound read: ``benchmarks/grad_stats.py``) and the number
of exact zeros (``x == 0``: ``-0.0`` counts, NaN does not, as ``count_nonzero``; exact in float64).
The caller sums the pairs in float64, one reduction for both statistics.

Loads are 16-byte vectors wherever the compiler can prove it: a program whose first element is a
multiple of ``VEC`` elements (16 bytes) from a 16-byte aligned ``x_ptr`` reads its elements up to
the last multiple of ``VEC`` with vector loads (the bound ``(count // VEC) * VEC`` is provably a
multiple of ``VEC``, so the mask is uniform over each vector) and the few elements after it with one
short masked load; any other program reads element by element.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["finish_kernel", "scale_kernel", "squares_and_zeros_kernel"]


@triton.jit
def squares_and_zeros_kernel(
    x_ptr,
    n,
    table_ptr,
    offsets_ptr,
    pairs_ptr,
    TABLE: tl.constexpr,  # noqa: N803
    BLOCK: tl.constexpr,  # noqa: N803
    ITERS: tl.constexpr,  # noqa: N803
    VEC: tl.constexpr,  # noqa: N803
):
    """Program ``p`` writes the sum of squares and the zero count of the elements it reads.

    Without ``TABLE``, program ``p`` reads elements ``[p * BLOCK * ITERS, (p + 1) * BLOCK * ITERS)``
    of the contiguous tensor ``x_ptr`` of ``n`` elements. With ``TABLE``, it reads part of tensor
    ``t = table[p, 0]``: ``table[p, 2]`` elements (at most ``BLOCK * ITERS``) from its element
    ``table[p, 1]``, tensor ``t`` starting ``offsets[t]`` elements after ``x_ptr`` (before it where
    negative; ``table`` int64 ``[programs, 3]``, ``offsets`` int64 ``[tensors]``): any number of
    tensors of one dtype in one launch, each addressed from ``x_ptr``. The table depends on the
    tensors' sizes only, the offsets on their addresses, so tensors that moved need new offsets
    only. Program ``p`` writes ``pairs[p] = (sum of squares, zeros)`` (float64, shape ``[programs,
    2]``)."""
    pid = tl.program_id(0)
    start, count = _program_extent(pid, n, table_ptr, offsets_ptr, TABLE, BLOCK, ITERS)
    if start % VEC == 0:
        first = x_ptr + (start // VEC) * VEC  # a multiple of VEC the compiler can see
        body = (count // VEC) * VEC
        squares, zeros = _sum_squares_and_zeros(first, body, BLOCK, ITERS)
        tail_squares, tail_zeros = _sum_squares_and_zeros(
            first + body, count - body, VEC, 1
        )  # fewer than VEC elements
        squares += tail_squares
        zeros += tail_zeros
    else:
        squares, zeros = _sum_squares_and_zeros(x_ptr + start, count, BLOCK, ITERS)
    tl.store(pairs_ptr + 2 * pid, squares.to(tl.float64))
    tl.store(pairs_ptr + 2 * pid + 1, zeros.to(tl.float64))


@triton.jit
def _program_extent(
    pid, n, table_ptr, offsets_ptr, TABLE: tl.constexpr, BLOCK: tl.constexpr, ITERS: tl.constexpr
):  # noqa: N803
    """Program ``pid``'s first element (after ``x_ptr``) and element count.

    Its row of the table and its tensor's offset, or its ``BLOCK * ITERS`` elements of one
    contiguous tensor of ``n``."""
    if TABLE:
        row = table_ptr + 3 * pid.to(tl.int64)
        start = tl.load(offsets_ptr + tl.load(row)) + tl.load(row + 1)
        count = tl.load(row + 2)
    else:
        start = pid.to(tl.int64) * (BLOCK * ITERS)
        count = tl.minimum(n - start, BLOCK * ITERS)
    return start, count


@triton.jit
def _sum_squares_and_zeros(first, count, BLOCK: tl.constexpr, ITERS: tl.constexpr):  # noqa: N803
    """The float64 sum of squares and the int32 zero count of ``count`` elements from ``first``.

    ``count`` is at most ``BLOCK * ITERS``: ``ITERS`` loads of ``BLOCK`` lanes, then a tree over the
    lanes."""
    lanes = tl.arange(0, BLOCK)
    squares = tl.zeros([BLOCK], dtype=tl.float64)
    zeros = tl.zeros([BLOCK], dtype=tl.int32)
    for i in tl.static_range(ITERS):
        offsets = i * BLOCK + lanes
        inside = offsets < count
        x = tl.load(first + offsets, mask=inside, other=0.0, eviction_policy="evict_first").to(
            tl.float64
        )
        squares += x * x
        zeros += ((x == 0.0) & inside).to(tl.int32)
    return tl.sum(squares, axis=0), tl.sum(zeros, axis=0)


@triton.jit(do_not_specialize=["max_norm_bits", "epsilon_bits"])
def scale_kernel(
    x_ptr,
    n,
    table_ptr,
    offsets_ptr,
    value_ptr,
    max_norm_bits,
    epsilon_bits,
    FROM_NORM: tl.constexpr,  # noqa: N803
    TABLE: tl.constexpr,  # noqa: N803
    BLOCK: tl.constexpr,  # noqa: N803
    ITERS: tl.constexpr,  # noqa: N803
    VEC: tl.constexpr,  # noqa: N803
):
    """Multiply in place the elements program ``p`` reads in :func:`squares_and_zeros_kernel`.

    The same grid and table, by a coefficient: the float64 ``value_ptr[0]``, or with ``FROM_NORM``
    clipping's coefficient of the float64 total norm ``value_ptr[0]`` (:func:`_clip_coefficient`).
    The coefficient is rounded to the tensor's dtype through float32 (as torch's ``.to(dtype)`` of a
    float64 tensor), each product computed in float32 and rounded to the dtype (as torch's
    ``mul_``); nothing at all where the rounded coefficient is not below 1 (clipping that does not
    scale, decided on the device: no host sync, no pass over the grads)."""
    pid = tl.program_id(0)
    value = tl.load(value_ptr)
    if FROM_NORM:
        value = _clip_coefficient(value, max_norm_bits, epsilon_bits)
    coeff = value.to(tl.float32).to(x_ptr.dtype.element_ty).to(tl.float32)
    if coeff < 1.0:
        start, count = _program_extent(pid, n, table_ptr, offsets_ptr, TABLE, BLOCK, ITERS)
        if start % VEC == 0:
            first = x_ptr + (start // VEC) * VEC
            body = (count // VEC) * VEC
            _scale_span(first, body, coeff, BLOCK, ITERS)
            _scale_span(first + body, count - body, coeff, VEC, 1)
        else:
            _scale_span(x_ptr + start, count, coeff, BLOCK, ITERS)


@triton.jit
def _clip_coefficient(norm, max_norm_bits, epsilon_bits):
    """``max_norm / (norm + epsilon)`` clamped at 1, and 1 for a NaN or infinite norm, in float64.

    With torch's operations of :func:`~pgregistry.grad_stats._reductions.clip_coefficient` (an
    addition, a reciprocal, a product), so the bits are the same. ``max_norm`` and ``epsilon`` come
    as the bits of their float64 values (:func:`~pgregistry.grad_stats._fused.float64_bits`): triton
    types a Python float argument as float32."""
    max_norm = max_norm_bits.to(tl.int64).to(
        tl.float64, bitcast=True
    )  # bits below 2**31 come as int32
    epsilon = epsilon_bits.to(tl.int64).to(tl.float64, bitcast=True)
    coefficient = tl.minimum(max_norm * (1.0 / (norm + epsilon)), 1.0)
    return tl.where(
        norm < float("inf"), coefficient, 1.0
    )  # a norm is never negative: NaN and inf fail here


@triton.jit
def _scale_span(first, count, coeff, BLOCK: tl.constexpr, ITERS: tl.constexpr):  # noqa: N803
    lanes = tl.arange(0, BLOCK)
    for i in tl.static_range(ITERS):
        offsets = i * BLOCK + lanes
        inside = offsets < count
        x = tl.load(first + offsets, mask=inside, other=0.0)
        tl.store(first + offsets, (x.to(tl.float32) * coeff).to(x.dtype), mask=inside)


@triton.jit(do_not_specialize=["scale_bits", "ranks"])
def finish_kernel(
    first_row_ptr,
    second_row_ptr,
    flags_ptr,
    norm_ptr,
    zeros_ptr,
    narrow_ptr,
    clip_narrow_ptr,
    scale_bits,
    ranks,
    TWO_ROWS: tl.constexpr,  # noqa: N803
    NORM: tl.constexpr,  # noqa: N803
    ZEROS: tl.constexpr,  # noqa: N803
    FLAGS: tl.constexpr,  # noqa: N803
    AGREE: tl.constexpr,  # noqa: N803
    NARROW: tl.constexpr,  # noqa: N803
    BYTES: tl.constexpr,  # noqa: N803
    BYTES_BLOCK: tl.constexpr,  # noqa: N803
):
    """One program: the reduced rows of a 2-norm or zero-count call made its results.

    The rows are float64 ``[middle, zeros, large, small]`` (``NORM``, the 2-norm's squares by range)
    or ``[0, zeros]`` (the zero count alone); with ``TWO_ROWS`` the second row's columns are added
    to the first's (one addition each, as torch's sum of two). ``FLAGS``: ``flags_ptr`` holds the
    verdict's ``[NaN, inf]`` counts, with ``AGREE`` followed by the call's arguments summed over
    ``ranks`` ranks (``[refused, BYTES byte sums, BYTES sums of squares]``, read in a block of
    ``BYTES_BLOCK``, a power of two: the norm NaN and the zero count -1 where one was refused or a
    byte's ``ranks * squares != sums**2``, as ``Agreement.disagrees``). It writes the
    2-norm (float64; the range columns combined as
    :func:`~pgregistry.grad_stats._reductions._two_norm_from_ranges` does, ``S`` given as the bits
    of its float64 value, then the flags), with ``NARROW`` that norm in float32 and the clip's
    float32 norm (the largest float32 where the float64 norm is finite beyond float32's range), and
    with ``ZEROS`` the zero count (int64; the column holds whole numbers). Every operation is
    torch's on a 0-dim float64 tensor: a float64 ``sqrt`` is correctly rounded (PTX has no
    approximate one; ``sqrt_rn`` takes float32 only), divisions by powers of two are exact, so the
    bits are the torch path's (``scripts/gpu_check.py`` compares them on the device)."""
    if AGREE:
        refused = tl.load(flags_ptr + 2)
        byte = tl.arange(0, BYTES_BLOCK)
        inside = byte < BYTES  # max_norm's and norm_type's float64 bytes, the flag, the statistic
        sums = tl.load(flags_ptr + 3 + byte, mask=inside, other=0.0).to(tl.int64)
        squares = tl.load(flags_ptr + 3 + BYTES + byte, mask=inside, other=0.0)
        squares = squares.to(tl.int64)
        differ = tl.sum((squares * ranks != sums * sums).to(tl.int32), axis=0)
        disagree = (refused > 0) | (differ > 0)
    if ZEROS:
        zeros = tl.load(first_row_ptr + 1)
        if TWO_ROWS:
            zeros += tl.load(second_row_ptr + 1)
        if AGREE:
            zeros = tl.where(disagree, -1.0, zeros)
        tl.store(zeros_ptr, zeros.to(tl.int64))
    if NORM:
        middle = tl.load(first_row_ptr)
        large = tl.load(first_row_ptr + 2)
        small = tl.load(first_row_ptr + 3)
        if TWO_ROWS:
            middle += tl.load(second_row_ptr)
            large += tl.load(second_row_ptr + 2)
            small += tl.load(second_row_ptr + 3)
        scale = scale_bits.to(tl.int64).to(tl.float64, bitcast=True)
        exact = tl.where(
            large > 0,
            tl.sqrt(large + middle / scale / scale) * scale,
            tl.where(middle > 0, tl.sqrt(middle + small / scale / scale), tl.sqrt(small) / scale),
        )
        every = middle + large + small
        finite = (every == every) & (tl.abs(every) != float("inf"))
        norm = tl.where(finite, exact, every)
        if FLAGS:
            nan = tl.load(flags_ptr)
            inf = tl.load(flags_ptr + 1)
            norm = tl.where(nan > 0, float("nan"), tl.where(inf > 0, float("inf"), norm))
        if AGREE:
            norm = tl.where(disagree, float("nan"), norm)
        tl.store(norm_ptr, norm)
        if NARROW:
            tl.store(narrow_ptr, norm.to(tl.float32))
            largest = 3.4028234663852886e38  # float32's largest: exact as a float32 constant
            clipped = tl.where(norm > largest, largest, norm)  # NaN and -inf kept; inf below
            tl.store(clip_narrow_ptr, tl.where(norm == float("inf"), norm, clipped).to(tl.float32))

"""The Triton kernel of the one-read grad statistics of :mod:`pgregistry.grad_stats.fused` (imports triton: import
this module only inside a function, after checking that triton is importable).

Each program reads ``BLOCK * ITERS`` consecutive elements of one tensor and writes two partials: the sum of their
squares (float32: at most ``ITERS`` additions per lane, then a tree over the block) and the number of exact zeros
(``x == 0``: ``-0.0`` counts, NaN does not, as ``count_nonzero``). The caller sums the partials in float64 / int64.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["squares_and_zeros_kernel"]


@triton.jit
def squares_and_zeros_kernel(
    x_ptr,
    n,
    addresses_ptr,
    numels_ptr,
    block_tensor_ptr,
    block_start_ptr,
    squares_ptr,
    zeros_ptr,
    TABLE: tl.constexpr,  # noqa: N803
    DTYPE: tl.constexpr,  # noqa: N803
    BLOCK: tl.constexpr,  # noqa: N803
    ITERS: tl.constexpr,  # noqa: N803
):
    """Without ``TABLE``, program ``p`` reads elements ``[p * BLOCK * ITERS, (p + 1) * BLOCK * ITERS)`` of the
    contiguous tensor ``x_ptr`` of ``n`` elements. With ``TABLE``, it reads ``BLOCK * ITERS`` elements of tensor
    ``t = block_tensor[p]`` (``DTYPE``, at address ``addresses[t]``, ``numels[t]`` elements) from element
    ``block_start[p]``: any number of tensors in one launch."""
    pid = tl.program_id(0)
    if TABLE:
        tensor = tl.load(block_tensor_ptr + pid)
        start = tl.load(block_start_ptr + pid)
        n = tl.load(numels_ptr + tensor)
        x_ptr = tl.load(addresses_ptr + tensor).to(tl.pointer_type(DTYPE))
    else:
        start = pid.to(tl.int64) * (BLOCK * ITERS)
    lanes = tl.arange(0, BLOCK)
    squares = tl.zeros([BLOCK], dtype=tl.float32)
    zeros = tl.zeros([BLOCK], dtype=tl.int32)
    for i in tl.static_range(ITERS):
        offsets = start + i * BLOCK + lanes
        inside = offsets < n
        x = tl.load(x_ptr + offsets, mask=inside, other=0.0, eviction_policy="evict_first").to(tl.float32)
        squares += x * x
        zeros += ((x == 0.0) & inside).to(tl.int32)
    tl.store(squares_ptr + pid, tl.sum(squares, axis=0))
    tl.store(zeros_ptr + pid, tl.sum(zeros, axis=0))

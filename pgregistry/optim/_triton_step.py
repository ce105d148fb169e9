"""The Triton kernels of the one-kernel optimizer step of :mod:`pgregistry.optim._fused_step`
(imports triton: import this module only inside a function, after checking that triton is
importable).

Program ``p`` steps elements ``[p * BLOCK * ITERS, (p + 1) * BLOCK * ITERS)`` of a flat float32
tensor of ``n`` elements (the last program fewer; ``n`` is a multiple of ``VEC``), its grads and its
state, ``BLOCK`` elements an iteration: each element read once and written once, in 16-byte vectors
(every bound is a multiple of ``VEC`` the compiler can see). The per-program work that does not
depend on the element (the bias corrections, in float64) is spread over ``BLOCK * ITERS`` elements.
With ``COPY`` it also writes the stepped values, rounded to nearest-even in ``out_ptr``'s dtype,
through row ``b`` of ``table_ptr`` for the ``b``-th block of ``BLOCK`` elements (int64 ``[out_first,
lo, hi]``: the block's elements ``[lo, hi)`` go to ``out_ptr[out_first + i]``): in vectors where the
block's elements all go to a 16-byte aligned place, element by element at the edges of a copy.

The arithmetic is torch's single-tensor rule (``torch/optim/adam.py``, ``sgd.py``) in float32, with
IEEE-rounded division and square root (``div_rn``, ``sqrt_rn``; triton's ``/`` and ``sqrt`` on
float32 are approximations), except that Adam multiplies by ``1 / sqrt(1 - beta2 ** step)`` where
torch divides by its inverse (one rounding more, one division a parameter less). The step count is
read from the device (torch's fused optimizers keep it there, so there is no host sync) and the bias
corrections ``1 - beta ** step`` are computed in float64 from betas passed in two float32 halves (a
float32 beta2 of 0.999 would be 1.3e-5 off in ``1 - beta2``); the powers are repeated squarings,
multiplications only.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["adam_kernel", "sgd_kernel"]


@triton.jit
def _program_chunk(n, BLOCK: tl.constexpr, ITERS: tl.constexpr, VEC: tl.constexpr):  # noqa: N803
    """This program's first element and count (a multiple of ``VEC``, visibly to the compiler)."""
    start = tl.program_id(0).to(tl.int64) * (BLOCK * ITERS)
    count = tl.minimum(n - start, BLOCK * ITERS)
    return start, (count // VEC) * VEC


@triton.jit
def _block_offsets(start, count, i, BLOCK: tl.constexpr):  # noqa: N803
    """Block ``i`` of the program's ``count`` elements from ``start``.

    Returns the elements' offsets in the flat tensor, their lanes, which lie inside the program, and
    how many do."""
    lanes = tl.arange(0, BLOCK)
    size = tl.minimum(count - i * BLOCK, BLOCK)
    return start + i * BLOCK + lanes, lanes, lanes < size, size


@triton.jit
def _load_once(ptr, at, inside):
    """The elements ``at`` of ``ptr`` (read once: not kept in L1)."""
    return tl.load(ptr + at, mask=inside, eviction_policy="evict_first")


@triton.jit
def _store_copy(
    out_ptr,
    table_ptr,
    block,
    lanes,
    inside,
    size,
    value,
    VEC: tl.constexpr,  # noqa: N803
):
    """Write ``value`` rounded to ``out_ptr``'s dtype where the block's row says.

    ``value`` is the ``lanes`` of block number ``block``, ``size`` of them inside. One vector store
    when the whole block goes to a 16-byte aligned place, else masked stores of ``[lo, hi)``."""
    row = table_ptr + 3 * block
    out_first, lo, hi = tl.load(row), tl.load(row + 1), tl.load(row + 2)
    value = value.to(out_ptr.dtype.element_ty)
    if (lo == 0) & (hi == size) & (out_first % VEC == 0):
        tl.store(out_ptr + (out_first // VEC) * VEC + lanes, value, mask=inside)
    elif lo < hi:
        tl.store(out_ptr + out_first + lanes, value, mask=inside & (lanes >= lo) & (lanes < hi))


@triton.jit
def _integer_power(base, exponent):
    """``base ** exponent`` in float64 for an integer ``exponent`` in ``[0, 2**31)``.

    The exponent is the step count. By repeated squaring: a few float64 roundings, no transcendental
    function."""
    result = base * 0.0 + 1.0
    for _ in tl.static_range(31):
        result = tl.where((exponent & 1) == 1, result * base, result)
        base = base * base
        exponent = exponent >> 1
    return result


@triton.jit
def _float64_from_halves(high, low):
    """A float64 passed as two float32 (``high`` its rounding, ``low`` the rest): 48 bits of it."""
    return tl.cast(high, tl.float64) + tl.cast(low, tl.float64)


@triton.jit
def adam_kernel(
    param_ptr,
    grad_ptr,
    exp_avg_ptr,
    exp_avg_sq_ptr,
    max_exp_avg_sq_ptr,
    step_ptr,
    out_ptr,
    table_ptr,
    n,
    lr,
    eps,
    weight_decay,
    beta1_high,
    beta1_low,
    beta2_high,
    beta2_low,
    AMSGRAD: tl.constexpr,  # noqa: N803
    MAXIMIZE: tl.constexpr,  # noqa: N803
    DECAY: tl.constexpr,  # noqa: N803
    DECOUPLED: tl.constexpr,  # noqa: N803
    COPY: tl.constexpr,  # noqa: N803
    BLOCK: tl.constexpr,  # noqa: N803
    ITERS: tl.constexpr,  # noqa: N803
    VEC: tl.constexpr,  # noqa: N803
):
    """Adam (``DECOUPLED``: AdamW) with the step count already incremented at ``step_ptr``.

    ``m += (1 - b1) (g - m)``, ``v = b2 v + (1 - b2) g g``, ``p -= lr / (1 - b1^t) * m / (sqrt(v) /
    sqrt(1 - b2^t) + eps)``, ``g`` negated with ``MAXIMIZE``, plus ``weight_decay * p`` with
    ``DECAY`` (or ``p *= 1 - lr * weight_decay`` with ``DECOUPLED``), ``v`` replaced by its running
    maximum in the denominator with ``AMSGRAD``."""
    start, count = _program_chunk(n, BLOCK, ITERS, VEC)
    step = tl.load(step_ptr).to(tl.int32)
    beta1 = _float64_from_halves(beta1_high, beta1_low)
    beta2 = _float64_from_halves(beta2_high, beta2_low)
    step_size = tl.div_rn(
        tl.cast(lr, tl.float32), (1.0 - _integer_power(beta1, step)).to(tl.float32)
    )
    inverse_root = tl.div_rn(
        1.0, tl.sqrt_rn((1.0 - _integer_power(beta2, step)).to(tl.float32))
    )  # 1 / sqrt(1 - b2^t)
    rest1 = (1.0 - beta1).to(tl.float32)
    rest2 = (1.0 - beta2).to(tl.float32)
    keep = (1.0 - tl.cast(lr, tl.float64) * tl.cast(weight_decay, tl.float64)).to(tl.float32)
    for i in range(0, tl.cdiv(count, BLOCK)):
        at, lanes, inside, size = _block_offsets(start, count, i, BLOCK)
        param = _load_once(param_ptr, at, inside)
        grad = _load_once(grad_ptr, at, inside)
        exp_avg = _load_once(exp_avg_ptr, at, inside)
        exp_avg_sq = _load_once(exp_avg_sq_ptr, at, inside)
        if MAXIMIZE:
            grad = -grad
        if DECAY:
            if DECOUPLED:
                param = param * keep
            else:
                grad = grad + weight_decay * param
        exp_avg = exp_avg + rest1 * (grad - exp_avg)
        exp_avg_sq = exp_avg_sq * beta2_high + rest2 * (grad * grad)
        second = exp_avg_sq
        if AMSGRAD:
            most = _load_once(max_exp_avg_sq_ptr, at, inside)
            second = tl.maximum(most, exp_avg_sq, propagate_nan=tl.PropagateNan.ALL)
            tl.store(max_exp_avg_sq_ptr + at, second, mask=inside)
        denom = tl.sqrt_rn(second) * inverse_root + eps
        param = param - step_size * tl.div_rn(exp_avg, denom)
        tl.store(param_ptr + at, param, mask=inside)
        tl.store(exp_avg_ptr + at, exp_avg, mask=inside)
        tl.store(exp_avg_sq_ptr + at, exp_avg_sq, mask=inside)
        if COPY:
            _store_copy(out_ptr, table_ptr, start // BLOCK + i, lanes, inside, size, param, VEC)


@triton.jit
def sgd_kernel(
    param_ptr,
    grad_ptr,
    momentum_buffer_ptr,
    out_ptr,
    table_ptr,
    n,
    lr,
    weight_decay,
    momentum,
    undamped,
    MOMENTUM: tl.constexpr,  # noqa: N803
    FIRST: tl.constexpr,  # noqa: N803
    NESTEROV: tl.constexpr,  # noqa: N803
    MAXIMIZE: tl.constexpr,  # noqa: N803
    DECAY: tl.constexpr,  # noqa: N803
    COPY: tl.constexpr,  # noqa: N803
    BLOCK: tl.constexpr,  # noqa: N803
    ITERS: tl.constexpr,  # noqa: N803
    VEC: tl.constexpr,  # noqa: N803
):
    """SGD, with weight decay, momentum and Nesterov as the flags choose.

    ``g`` negated with ``MAXIMIZE``, plus ``weight_decay * p`` with ``DECAY``; with ``MOMENTUM`` the
    buffer ``b = momentum * b + undamped * g`` (``undamped = 1 - dampening``; ``b = g`` on the
    ``FIRST`` step) replaces ``g`` (``g + momentum * b`` with ``NESTEROV``); then ``p -= lr *
    g``."""
    start, count = _program_chunk(n, BLOCK, ITERS, VEC)
    for i in range(0, tl.cdiv(count, BLOCK)):
        at, lanes, inside, size = _block_offsets(start, count, i, BLOCK)
        param = _load_once(param_ptr, at, inside)
        grad = _load_once(grad_ptr, at, inside)
        if MAXIMIZE:
            grad = -grad
        if DECAY:
            grad = grad + weight_decay * param
        if MOMENTUM:
            if FIRST:
                buffer = grad
            else:
                buffer = _load_once(momentum_buffer_ptr, at, inside)
                buffer = buffer * momentum + undamped * grad
            tl.store(momentum_buffer_ptr + at, buffer, mask=inside)
            if NESTEROV:
                grad = grad + momentum * buffer
            else:
                grad = buffer
        param = param - lr * grad
        tl.store(param_ptr + at, param, mask=inside)
        if COPY:
            _store_copy(out_ptr, table_ptr, start // BLOCK + i, lanes, inside, size, param, VEC)

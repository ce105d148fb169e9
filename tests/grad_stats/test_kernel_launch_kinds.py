"""The direct launch of a compiled Triton kernel (``pgregistry._runtime.optional_kernels.launch_kernel``) keys each
compiled kernel by the kind of its arguments. Two argument lists of one kind must get the same compiled kernel from
triton itself: checked here against triton's own specialization of every value of a set that covers what it specializes
on (a tensor's dtype and 16-byte alignment, an int of 1, a multiple of 16, each integer type, a bool, a float). Off a
GPU only the kinds can be checked; ``scripts/gpu_check.py``'s ``direct_launch_checks`` launches them."""

from __future__ import annotations

import itertools

import pytest
import torch

from pgregistry._runtime import optional_kernels

specialization = pytest.importorskip("triton.runtime.jit")
backends = pytest.importorskip("triton.backends.compiler")

BUFFER = torch.zeros(64)
VALUES: list[object] = [
    BUFFER,
    BUFFER[4:],  # 16 bytes on: aligned too
    BUFFER[1:],
    BUFFER[3:],
    BUFFER.to(torch.bfloat16),
    BUFFER.to(torch.bfloat16)[1:],
    BUFFER.to(torch.float64),
    0,
    1,
    2,
    15,
    16,
    -16,
    -5,
    2**31 - 1,
    2**31,
    2**31 + 16,
    -(2**31),
    -(2**31) - 1,
    2**63,
    2**63 + 1,
    True,
    False,
    1.0,
    1.5,
]


def _triton_specialization(value: object) -> object:
    native = getattr(specialization, "native_specialize_impl", None)
    if native is None:
        pytest.skip("this triton has no native_specialize_impl to compare with")
    return native(backends.BaseBackend, value, False, True, True)


def test_arguments_of_one_kind_get_one_specialization_from_triton() -> None:
    kinds = {id(value): optional_kernels._argument_kind(value) for value in VALUES}
    merged = [
        (a, b)
        for a, b in itertools.combinations(VALUES, 2)
        if kinds[id(a)] == kinds[id(b)] and _triton_specialization(a) != _triton_specialization(b)
    ]
    assert not merged, f"one kind, two compiled kernels: {merged}"


def test_a_value_triton_cannot_take_is_refused_by_name() -> None:
    with pytest.raises(TypeError, match="not None"):
        optional_kernels._argument_kind(None)


def test_constants_out_of_the_signatures_order_are_refused() -> None:
    """The compiled launcher takes every argument by position, so constants given out of order would land in
    another parameter's place: refused before any launch (the kernel is never compiled here)."""
    triton = pytest.importorskip("triton")
    language = pytest.importorskip("triton.language")

    @triton.jit
    def kernel(x_ptr, n, FIRST: language.constexpr, SECOND: language.constexpr):  # noqa: N803
        pass

    with pytest.raises(ValueError, match=r"FIRST.*SECOND|signature's order"):
        optional_kernels._first_launch(kernel, 1, (BUFFER, 3), {"SECOND": 1, "FIRST": 2}, 4)

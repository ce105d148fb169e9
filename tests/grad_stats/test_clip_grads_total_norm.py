"""``clip_grads_`` checks the ``total_norm`` it is given, so a value that is no norm never scales the grads.

Found by a hostile-input audit: a negative ``total_norm`` made the coefficient negative and flipped every grad's
sign (``clip_grads_(grads, 1.0, -5.0)`` returned -0.2 and left ``-0.6, -0.8`` where ``3, 4`` were); a string, ``None``
or a tensor of two elements failed inside torch naming no argument, a ``[1]``-shaped tensor failed in the kernel,
``True`` was taken as 1 and a complex norm lost its imaginary part with a warning.
"""

from __future__ import annotations

import re

import pytest
import torch

from pgregistry.grad_stats import CLIP_EPSILON, clip_grads_


def _grads() -> list[torch.Tensor]:
    return [torch.tensor([3.0, 4.0]), torch.tensor([1.0, -2.0, 0.0], dtype=torch.float64)]


@pytest.mark.parametrize("total_norm", [-5.0, -1, torch.tensor(-5.0), torch.tensor([-5.0])])
def test_a_negative_total_norm_is_refused_and_leaves_the_grads(total_norm: object) -> None:
    grads = _grads()
    with pytest.raises(ValueError, match=re.escape(f"total_norm must be a norm: 0 or more (NaN or inf: the grads are "
                                                   f"left unscaled), got {total_norm!r}")):
        clip_grads_(grads, 1.0, total_norm)  # type: ignore[arg-type]
    assert [grad.tolist() for grad in grads] == [grad.tolist() for grad in _grads()]


@pytest.mark.parametrize("total_norm", ["5", None, True, torch.tensor([5.0, 50.0]), torch.tensor(5 + 0j),
                                        torch.tensor(True), [5.0]])
def test_a_total_norm_of_no_real_number_is_named_with_its_type(total_norm: object) -> None:
    grads = _grads()
    with pytest.raises(TypeError, match=re.escape(f"total_norm must be a real number or a one-element real tensor, "
                                                  f"got {total_norm!r} ({type(total_norm).__name__})")):
        clip_grads_(grads, 1.0, total_norm)  # type: ignore[arg-type]
    assert [grad.tolist() for grad in grads] == [grad.tolist() for grad in _grads()]


@pytest.mark.parametrize("total_norm", [5.0, 5, torch.tensor(5.0), torch.tensor([5.0]), torch.tensor([[0.5]]), 0.0])
def test_a_good_total_norm_scales_as_the_float64_oracle(total_norm: object) -> None:
    norm = float(torch.as_tensor(total_norm, dtype=torch.float64).reshape(()))
    coefficient = min(1.0, 1.0 / (norm + CLIP_EPSILON))
    grads = _grads()
    clip_grads_(grads, 1.0, total_norm)  # type: ignore[arg-type]
    for grad, before in zip(grads, _grads(), strict=True):
        torch.testing.assert_close(grad, (before.double() * coefficient).to(before.dtype))


def test_a_negative_norm_read_on_the_device_leaves_the_grads_unscaled() -> None:
    """A tensor off the CPU is not read back to check its sign: the coefficient refuses it on the device (1, as for
    NaN), instead of a negative coefficient."""
    from pgregistry.grad_stats._reductions import clip_coefficient

    for norm in (-5.0, -CLIP_EPSILON / 2, float("nan"), float("inf")):
        assert float(clip_coefficient(1.0, torch.tensor(norm, dtype=torch.float64))) == 1.0, norm
    assert float(clip_coefficient(1.0, torch.tensor(4.0, dtype=torch.float64))) == 1.0 / (4.0 + CLIP_EPSILON)


@pytest.mark.parametrize("grads", [[torch.ones(2), None], [torch.ones(2), 1.0]])
def test_a_grad_that_is_no_tensor_is_named_by_its_position(grads: list[object]) -> None:
    """``clip_grads_([None], ...)`` raised ``AttributeError: 'NoneType' object has no attribute 'device'`` (a
    parameter's unset ``.grad`` passed along)."""
    with pytest.raises(TypeError, match=re.escape(f"grads[1] is {grads[1]!r} ({type(grads[1]).__name__}), not a "
                                                  "tensor: pass the grads that are set (skip a parameter whose .grad "
                                                  "is None)")):
        clip_grads_(grads, 1.0, 5.0)  # type: ignore[arg-type]
    assert grads[0].tolist() == [1.0, 1.0]  # type: ignore[union-attr]

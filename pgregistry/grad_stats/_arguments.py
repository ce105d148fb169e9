"""The arguments every clip and norm entry point takes, checked by one set of functions:
``max_norm`` and ``norm_type``.

Every public path (:func:`~pgregistry.grad_stats.clip_grad_norm_`,
:func:`~pgregistry.grad_stats.clip_grads_`, a pgregistry optimizer's ``clip_grad_norm``,
:class:`~pgregistry.modules.MultiModuleOptimizer`) refuses a bad value before any collective, naming
the argument and the value: a string such as ``'1'`` would otherwise reach a comparison with a
number and raise Python's bare ``TypeError``, or (``float('2')``) be taken silently. The ``*_error``
forms return the fault instead of raising it, for callers that agree on it across ranks first.
"""

from __future__ import annotations

import math
import numbers

import torch

__all__ = [
    "CLIP_EPSILON",
    "check_max_norm",
    "norm_type_as_float",
    "max_norm_error",
    "max_norm_scalar",
    "norm_type_error",
    "real_number",
    "total_norm_as_tensor",
]


CLIP_EPSILON = 1e-6
"""Added to the total norm before dividing, as Megatron-Core does.

``coeff = max_norm / (norm + 1e-6)``.
"""


def real_number(value: object) -> float | None:
    """``value`` as a float when it is a real number, not a bool; else ``None``.

    A real number is a Python or NumPy number, or a one-element real tensor."""
    if isinstance(value, torch.Tensor):
        return float(value.item()) if _one_real_element(value) else None
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return float(value)
    return None


def _one_real_element(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` holds one real number: one element, neither complex nor bool."""
    return tensor.numel() == 1 and not tensor.is_complex() and tensor.dtype != torch.bool


def norm_type_error(norm_type: object) -> Exception | None:
    """Why ``norm_type`` is no norm type, or ``None``.

    ``TypeError`` for no real number (a string, a bool), ``ValueError`` unless positive (inf is the
    max-norm; NaN is none)."""
    p = real_number(norm_type)
    if p is None:
        return TypeError(
            "norm_type must be a positive number or inf, "
            f"got {norm_type!r} ({type(norm_type).__name__})"
        )
    return None if p > 0 else ValueError(f"norm_type must be positive (or inf), got {norm_type!r}")


def max_norm_error(max_norm: object) -> Exception | None:
    """Why ``max_norm`` cannot be clipped to, or ``None``.

    ``TypeError`` for no real number (a string such as ``'1.0'``, a bool, ``None``), ``ValueError``
    unless positive and finite (0, negative, NaN, inf)."""
    number = real_number(max_norm)
    if number is None:
        kind = type(max_norm).__name__
        return TypeError(
            f"max_norm must be a positive, finite number (a float), got {max_norm!r} ({kind})"
        )
    if number > 0 and math.isfinite(number):
        return None
    return ValueError(f"max_norm must be a positive, finite number, got {max_norm!r}")


def check_max_norm(max_norm: object) -> None:
    """Raise :func:`max_norm_error`'s fault, if any."""
    error = max_norm_error(max_norm)
    if error is not None:
        raise error


def max_norm_scalar(max_norm: float) -> float:
    """A checked ``max_norm``, a one-element tensor of any shape made 0-dim (its fault raised).

    A ``[1]``-shaped ``max_norm`` would make the coefficient ``[1]``-shaped, which the scaling
    kernels refuse after the norm's reduction; a 0-dim tensor stays on its device (no host sync)."""
    check_max_norm(max_norm)
    return max_norm.reshape(()) if isinstance(max_norm, torch.Tensor) else max_norm


def norm_type_as_float(norm_type: object) -> float:
    """``norm_type`` as a float; raise :func:`norm_type_error`'s fault, if any."""
    error = norm_type_error(norm_type)
    if error is not None:
        raise error
    return float(norm_type)  # type: ignore[arg-type]  # a real number: norm_type_error found none


def total_norm_as_tensor(total_norm: object, device: torch.device | None) -> torch.Tensor:
    """A given ``total_norm`` as a 0-dim float64 tensor on ``device`` (its own, for a tensor).

    ``TypeError`` for no real number or one-element real tensor (a string, ``None``, a bool, a
    complex or two-element tensor); ``ValueError`` for a negative one, whose coefficient would flip
    every grad's sign. A tensor off the CPU is not read back (no host sync): its sign is checked on
    the device by :func:`~pgregistry.grad_stats._reductions.clip_coefficient`. NaN and inf pass:
    they mean "leave the grads unscaled"."""
    if isinstance(total_norm, torch.Tensor):
        if _one_real_element(total_norm):
            norm = total_norm.detach().reshape(()).to(torch.float64)
            if norm.device.type == "cpu":  # a device's is checked there (no host sync)
                _refuse_negative(total_norm, float(norm))
            return norm
    else:
        number = real_number(total_norm)
        if number is not None:
            _refuse_negative(total_norm, number)
            return torch.tensor(number, dtype=torch.float64, device=device)
    raise TypeError(
        "total_norm must be a real number or a one-element real tensor, "
        f"got {total_norm!r} ({type(total_norm).__name__})"
    )


def _refuse_negative(total_norm: object, value: float) -> None:
    if value < 0:
        raise ValueError(
            "total_norm must be a norm: 0 or more (NaN or inf: the grads are left unscaled), "
            f"got {total_norm!r}"
        )

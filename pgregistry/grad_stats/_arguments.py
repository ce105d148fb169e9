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
    "check_max_norm",
    "norm_type_as_float",
    "max_norm_error",
    "norm_type_error",
    "real_number",
]


def real_number(value: object) -> float | None:
    """``value`` as a float when it is a real number, not a bool; else ``None``.

    A real number is a Python or NumPy number, or a one-element real tensor."""
    if isinstance(value, torch.Tensor):
        real = value.numel() == 1 and not value.is_complex() and value.dtype != torch.bool
        return float(value.item()) if real else None
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return float(value)
    return None


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


def norm_type_as_float(norm_type: object) -> float:
    """``norm_type`` as a float; raise :func:`norm_type_error`'s fault, if any."""
    error = norm_type_error(norm_type)
    if error is not None:
        raise error
    return float(norm_type)  # type: ignore[arg-type]  # a real number: norm_type_error found none

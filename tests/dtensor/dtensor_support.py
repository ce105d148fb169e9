"""Shared pieces of the DTensor tests: a small dense model and its float64 oracle (plain torch autograd on the
unsharded model, no pgregistry code), and a helper that records a call's error text."""

from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

MAX_NORM = 0.5


def dense_model() -> nn.Sequential:
    """The same weights on every rank (seeded); a ReLU and a one-sample batch give grads with exact zeros. The last
    layer's 7 rows shard unevenly over 2 ranks."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 7))


def batch() -> torch.Tensor:
    return torch.randn(1, 8, generator=torch.Generator().manual_seed(1))


def oracle(model: nn.Module) -> dict[str, Any]:
    """Norms, zero count and clipped grads of ``model`` (unsharded), in float64; call before sharding it."""
    full = copy.deepcopy(model).double()
    full(batch().double()).square().sum().backward()
    grads = {name: p.grad.detach().clone() for name, p in full.named_parameters() if p.grad is not None}
    flat = torch.cat([g.reshape(-1) for g in grads.values()])
    norm = float(flat.norm())
    coeff = min(1.0, MAX_NORM / (norm + 1e-6))
    return {
        "norm": norm,
        "inf": float(flat.abs().max()),
        "zeros": int((flat == 0).sum()),
        "clipped": {name: g * coeff for name, g in grads.items()},
    }


def backward(model: nn.Module) -> None:
    with warnings.catch_warnings():
        # torch's FSDP2 warns that a root module returning a view would lose its pre-backward hook to an in-place
        # op on the output; this output is only used out of place. The suite runs with warnings as errors.
        warnings.filterwarnings("ignore", "FSDP2-wrapped module .* returned a view tensor", UserWarning)
        model(batch()).square().sum().backward()


def full_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    """Each grad as a full float64 tensor (a DTensor gathered by torch itself; this is the test, not the code)."""
    out = {}
    for name, param in model.named_parameters():
        grad = param.grad
        if grad is not None:
            out[name] = (grad.full_tensor() if hasattr(grad, "full_tensor") else grad).detach().double()
    return out


def close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=2e-6, abs_tol=1e-9)


def error_of(call: Callable[[], Any]) -> str:
    try:
        call()
    except (ValueError, TypeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"

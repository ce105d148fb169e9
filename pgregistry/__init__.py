"""pgregistry: explicit, typed process-group collections for distributed PyTorch training.

Importing the package does not import torch, so ``python -W
error::pgregistry.ProcessGroupFallbackWarning`` (which imports it at interpreter start) stays cheap.
Names that need torch are loaded on first access. Once torch is imported too (before or after this
package), :mod:`pgregistry.params` installs its parameter-registration hooks
(:mod:`pgregistry._runtime.role_hooks`), so parameter roles never depend on import order.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from pgregistry._runtime import role_hooks
from pgregistry.attachments import attach, collection_of
from pgregistry.collection import NOT_MEMBER, UNSET, ProcessGroupCollection
from pgregistry.fallback import ProcessGroupFallbackWarning
from pgregistry.layout import ParallelLayout

if TYPE_CHECKING:
    from pgregistry.audit import audit_grad_replication
    from pgregistry.experts import get_ep_rank_and_size, globalize_expert_keys, localize_expert_keys
    from pgregistry.grad_stats import clip_grad_norm_, count_zeros, grad_norm, grad_norm_and_zeros
    from pgregistry.optim import build_optimizer
    from pgregistry.registry import build
    from pgregistry.rng import model_parallel_manual_seed

# Public name -> module that defines it; imported on first access (these modules import torch).
_LAZY: dict[str, str] = {
    "build": "pgregistry.registry",
    "globalize_expert_keys": "pgregistry.experts",
    "localize_expert_keys": "pgregistry.experts",
    "get_ep_rank_and_size": "pgregistry.experts",
    "model_parallel_manual_seed": "pgregistry.rng",
    "grad_norm": "pgregistry.grad_stats",
    "grad_norm_and_zeros": "pgregistry.grad_stats",
    "count_zeros": "pgregistry.grad_stats",
    "clip_grad_norm_": "pgregistry.grad_stats",
    "audit_grad_replication": "pgregistry.audit",
    "build_optimizer": "pgregistry.optim",
}

__all__ = [
    "NOT_MEMBER",
    "UNSET",
    "ParallelLayout",
    "ProcessGroupCollection",
    "ProcessGroupFallbackWarning",
    "attach",
    "audit_grad_replication",
    "build",
    "build_optimizer",
    "clip_grad_norm_",
    "collection_of",
    "count_zeros",
    "get_ep_rank_and_size",
    "globalize_expert_keys",
    "grad_norm",
    "grad_norm_and_zeros",
    "localize_expert_keys",
    "model_parallel_manual_seed",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'pgregistry' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


role_hooks.install()

"""The unclassified-expert check.

A parameter of a marked expert module must say whether it is replicated across EP.

A missing classification is an error, never a default (xorl: per-expert LoRA factors defaulted to
EP-replicated, the norm low by 1/sqrt(ep); ``docs/known_bugs.md``). The check must not depend on how
the parameters are passed: a model or its chunks are walked module by module
(:func:`~pgregistry.params.is_expert_module`); bare tensors are recognised by their own
``in_expert_module`` mark.
"""

from __future__ import annotations

from pgregistry._runtime.resolve import Params
from pgregistry.collection import ProcessGroupCollection, group_size
from pgregistry.params import is_expert_module, is_expert_param

__all__ = ["holds_experts", "require_classified_experts", "expert_params_without_allreduce"]


def expert_params_without_allreduce(params: Params) -> list[str]:
    """Names of the parameters of a marked expert module that carry no ``allreduce`` attribute."""
    if not params.chunks:
        return [
            name
            for name, param in params.named
            if getattr(param, "in_expert_module", False) and not hasattr(param, "allreduce")
        ]
    names: dict[int, str] = {}
    for index, chunk in enumerate(params.chunks):
        chunk_prefix = f"chunk{index}." if len(params.chunks) > 1 else ""
        for prefix, module in chunk.named_modules():
            if not is_expert_module(module):
                continue
            for name, param in module.named_parameters(prefix=prefix):
                if not hasattr(param, "allreduce"):
                    names.setdefault(id(param), chunk_prefix + name)
    return list(names.values())


def holds_experts(params: Params) -> bool:
    """Whether ``params`` hold an expert parameter, or a marked expert module's unclassified one.

    The latter may be an expert: this is what makes a collection's expert fields needed. Local: the
    ranks that must decide alike agree the answer
    (:func:`pgregistry._runtime.agreement.any_rank_has`)."""
    return any(is_expert_param(param) for _, param in params.named) or bool(
        expert_params_without_allreduce(params)
    )


def require_classified_experts(params: Params, collection: ProcessGroupCollection) -> None:
    """``ValueError`` naming every unclassified expert parameter of ``params``, when EP is on.

    With the collection's EP axis off the question does not arise. ``collection`` is resolved, with
    ``ep`` set."""
    if group_size(collection.get("ep")) <= 1:
        return
    missing = expert_params_without_allreduce(params)
    if missing:
        raise ValueError(
            f"{len(missing)} parameter(s) of a marked expert module carry no EP "
            f"classification: {', '.join(missing)}. Mark each with mark_expert "
            "(distinct per EP rank) or mark_expert_replicated (replicated across EP); "
            "a default would silently miscount the grad norm (docs/known_bugs.md)."
        )

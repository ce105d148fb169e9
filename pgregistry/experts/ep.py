"""The expert-parallel rank and size of this process, from a collection or from the one attached to a model.

Each model reads its own collection, so models on different grids in one process get their own EP layout. An
omitted collection is resolved by :func:`pgregistry.resolver.resolve_collection` (attached to the model through
its ``.module`` wrappers and the same on every chunk, else the global grid with a warning, else an error), never
read as "EP off": on an EP 4 grid that gave every rank's experts the same global names.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from pgregistry.collection import ProcessGroupCollection, group_rank, group_size
from pgregistry.fallback import resolve_process_groups
from pgregistry.resolver import resolve_collection, wrapper_chain

if TYPE_CHECKING:
    from torch import nn

__all__ = ["get_ep_rank_and_size", "get_model_ep_rank_and_size"]


def get_ep_rank_and_size(pg_collection: ProcessGroupCollection | None) -> tuple[int, int]:
    """``(ep_rank, ep_size)`` from the collection's ``ep`` group; ``ep`` set to ``None`` (EP off) is ``(0, 1)``.

    No collection is the global grid, with a :class:`~pgregistry.fallback.ProcessGroupFallbackWarning`, and
    ``RuntimeError`` without one (:func:`~pgregistry.resolver.resolve_collection`). An UNSET ``ep`` also reads the
    global grid and warns.
    """
    owner = "get_ep_rank_and_size"
    return ep_of(resolve_collection(pg_collection, owner=owner), owner)


def get_model_ep_rank_and_size(model_or_chunks: nn.Module | Sequence[nn.Module]) -> tuple[int, int]:
    """``(ep_rank, ep_size)`` from the collection attached to the model (:func:`pgregistry.registry.attach`).

    The collection is resolved by :func:`~pgregistry.resolver.resolve_collection`: attached to the model (through
    wrappers, the same on every chunk), else the global grid with a fallback warning.
    """
    owner = "get_model_ep_rank_and_size"
    return ep_of(resolve_collection(None, model_or_chunks, owner=owner), owner)


def ep_of(collection: ProcessGroupCollection, owner: str) -> tuple[int, int]:
    """Rank and size in the collection's ``ep`` group (the global grid's, with a warning, when not set)."""
    group = resolve_process_groups(collection, ("ep",), owner=owner)["ep"]
    return group_rank(group), group_size(group)


def as_chunks(model_or_chunks: nn.Module | Sequence[nn.Module]) -> list[nn.Module]:
    """A model or a sequence of model chunks, as a list of chunks."""
    if isinstance(model_or_chunks, Sequence):
        return list(model_or_chunks)
    return [model_or_chunks]


def chain_attribute(module: nn.Module, name: str) -> Any:
    """The first non-None ``name`` attribute of ``module`` or a module it wraps (DDP, FSDP, ...); else None."""
    for inner in wrapper_chain(module):
        value = getattr(inner, name, None)
        if value is not None:
            return value
    return None

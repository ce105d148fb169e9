"""The expert-parallel rank and size of this process, from a collection or from the one attached to a model.

Each model reads its own collection, so models on different grids in one process get their own EP layout. A model
is looked through its wrappers (``.module`` attributes: DDP, mixed-precision wrappers) and over all its chunks.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from pgregistry.collection import ProcessGroupCollection, group_rank, group_size
from pgregistry.fallback import resolve_process_groups

if TYPE_CHECKING:
    from torch import nn

__all__ = ["get_ep_rank_and_size", "get_model_ep_rank_and_size", "model_collection"]


def get_ep_rank_and_size(pg_collection: ProcessGroupCollection | None) -> tuple[int, int]:
    """``(ep_rank, ep_size)`` from the collection's ``ep`` group.

    No collection, or ``ep`` set to ``None`` (EP off), is ``(0, 1)``. An UNSET ``ep`` reads the global grid with a
    :class:`~pgregistry.fallback.ProcessGroupFallbackWarning`.
    """
    if pg_collection is None:
        return 0, 1
    return _ep_of(pg_collection, "get_ep_rank_and_size")


def get_model_ep_rank_and_size(model_or_chunks: nn.Module | Sequence[nn.Module]) -> tuple[int, int]:
    """``(ep_rank, ep_size)`` from the collection attached to the model (:func:`pgregistry.registry.attach`).

    Each model reads its own collection, so models on different grids in one process get their own EP layout. A
    model without an attached collection reads the global grid with a fallback warning.
    """
    return _ep_of(model_collection(model_or_chunks), "get_model_ep_rank_and_size")


def _ep_of(collection: ProcessGroupCollection | None, owner: str) -> tuple[int, int]:
    """Rank and size in the collection's ``ep`` group (the global grid's, with a warning, when not set)."""
    group = resolve_process_groups(collection, ("ep",), owner=owner)["ep"]
    return group_rank(group), group_size(group)


def model_collection(model_or_chunks: nn.Module | Sequence[nn.Module]) -> ProcessGroupCollection | None:
    """The collection attached to a model or its chunks (or to a module they wrap), or ``None``.

    Wrappers are looked through via their ``module`` attribute (DDP, mixed-precision wrappers). Chunks carrying
    different collections raise ``ValueError``.
    """
    from pgregistry import registry

    found: ProcessGroupCollection | None = None
    for chunk in _as_chunks(model_or_chunks):
        for module in _wrapper_chain(chunk):
            collection = registry.collection_of(module, None)
            if collection is None:
                continue
            if found is not None and collection != found:
                raise ValueError("the model chunks carry different process-group collections; attach one to all")
            found = collection
            break
    return found


def _as_chunks(model_or_chunks: nn.Module | Sequence[nn.Module]) -> list[nn.Module]:
    if isinstance(model_or_chunks, Sequence):
        return list(model_or_chunks)
    return [model_or_chunks]


def _wrapper_chain(module: nn.Module) -> Iterator[nn.Module]:
    """``module``, then what it wraps through ``.module`` attributes (DDP and mixed-precision wrappers)."""
    seen: set[int] = set()
    current: Any = module
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = getattr(current, "module", None)


def _chain_attribute(module: nn.Module, name: str) -> Any:
    for inner in _wrapper_chain(module):
        value = getattr(inner, name, None)
        if value is not None:
            return value
    return None

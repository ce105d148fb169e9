"""The one answer to "which collection?" for every entry point that may be handed none.

An entry point that takes ``pg_collection=None`` (grad statistics, the optimizer builder, expert ranks and names,
checkpoints, RNG seeding) resolves it here, always in this order:

1. the collection passed explicitly;
2. else the collection attached to the model (:func:`pgregistry.registry.attach`), looked up through ``.module``
   wrappers (DDP, mixed-precision wrappers); every model chunk must carry the same one, else ``ValueError``
   naming the chunks that disagree;
3. else the global grid (:func:`pgregistry.registry.initialize_global_grid`), with a
   :class:`~pgregistry.fallback.ProcessGroupFallbackWarning` naming the entry point;
4. else ``RuntimeError`` naming the entry point.

No entry point reads "no collection" as a default layout (such as "expert parallelism off"): on an EP 4 grid that
gave every rank EP rank 0 of 1, so every rank's experts got the same global names and overwrote each other in a
checkpoint. Fields left :data:`~pgregistry.collection.UNSET` in a resolved collection are a separate, per-group
question, answered by :func:`pgregistry.fallback.resolve_process_groups`.

This module imports no torch at load.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from pgregistry.collection import ProcessGroupCollection
from pgregistry.fallback import global_grid_for

if TYPE_CHECKING:
    from torch import nn

__all__ = ["attached_collection", "resolve_collection", "wrapper_chain"]

def wrapper_chain(module: nn.Module) -> Iterator[nn.Module]:
    """``module``, then what it wraps through ``.module`` attributes (DDP and mixed-precision wrappers)."""
    seen: set[int] = set()
    current: object = module
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current  # type: ignore[misc]  # a module, or what a wrapper's .module holds
        current = getattr(current, "module", None)


def _chunks(model: nn.Module | Sequence[nn.Module]) -> list[nn.Module]:
    return list(model) if isinstance(model, Sequence) else [model]


def attached_collection(model: nn.Module | Sequence[nn.Module]) -> ProcessGroupCollection | None:
    """The collection attached to ``model`` (a model or its chunks, each possibly wrapped), or ``None``.

    Each chunk's collection is the first one attached along its wrapper chain. ``ValueError`` naming the chunks
    when they disagree, including when some carry a collection and others none.
    """
    from pgregistry import registry

    per_chunk: list[ProcessGroupCollection | None] = []
    for chunk in _chunks(model):
        found = None
        for module in wrapper_chain(chunk):
            found = registry.collection_of(module, None)
            if found is not None:
                break
        per_chunk.append(found)
    first = per_chunk[0] if per_chunk else None
    for index, collection in enumerate(per_chunk[1:], start=1):
        if collection != first:
            raise ValueError(
                f"model chunks 0 and {index} carry different process-group collections ({_describe(first)} and "
                f"{_describe(collection)}); attach one collection to every chunk (pgregistry.registry.attach)"
            )
    return first


def _describe(collection: ProcessGroupCollection | None) -> str:
    return "none attached" if collection is None else repr(collection)


def resolve_collection(
    pg_collection: ProcessGroupCollection | None,
    model: nn.Module | Sequence[nn.Module] | None = None,
    *,
    owner: str,
) -> ProcessGroupCollection:
    """The collection ``owner`` runs on: ``pg_collection``, else ``model``'s attached one, else the global grid
    (with a warning), else ``RuntimeError``; see the module docstring.

    ``TypeError`` when ``pg_collection`` is neither a collection nor ``None``.
    """
    if pg_collection is not None:
        if not isinstance(pg_collection, ProcessGroupCollection):
            raise TypeError(
                f"{owner} expects pg_collection to be a ProcessGroupCollection or None, got "
                f"{type(pg_collection).__name__}"
            )
        return pg_collection
    if model is not None:
        attached = attached_collection(model)
        if attached is not None:
            return attached
    return global_grid_for(owner, model_given=model is not None, stacklevel=3)

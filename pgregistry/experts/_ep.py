"""The expert-parallel rank and size of this process, from a collection.

Each model reads its own collection, so models on different grids in one process get their own EP
layout. An omitted collection is the global grid, with a warning, never "EP off": on an EP 4 grid
that gave every rank's experts the same global names.
"""

from __future__ import annotations

from pgregistry._runtime.resolve import resolve_pg_collection
from pgregistry.collection import ProcessGroupCollection, group_rank, group_size

__all__ = ["get_ep_rank_and_size"]


def get_ep_rank_and_size(pg_collection: ProcessGroupCollection | None = None) -> tuple[int, int]:
    """``(ep_rank, ep_size)`` from the collection's ``ep`` group; ``None`` (EP off) is ``(0, 1)``.

    Args:
        pg_collection: the collection (default: the global grid, with a
            :class:`~pgregistry.fallback.ProcessGroupFallbackWarning`; an UNSET ``ep`` also reads
            the global grid and warns). For a model's own grid pass
            ``pgregistry.collection_of(model)``.

    Returns:
        This rank's index in the EP group and the group's size.

    Raises:
        RuntimeError: no collection given and no global grid.
        TypeError: ``pg_collection`` neither a collection nor ``None``.
        ValueError: a collection this rank is not a member of, or destroyed.

    Example:
        On every rank of a 4-rank world (as :func:`pgregistry.testing.run_world` starts it), a model
        of 8 experts, 2 on each rank:

        >>> import torch
        >>> from pgregistry import ParallelLayout, attach, build, collection_of
        >>> model, num_experts = torch.nn.Linear(2, 2), 8
        >>> attach(model, build(ParallelLayout(num_ranks=4, ep=4, expt_tp=1)))
        >>> ep_rank, ep_size = get_ep_rank_and_size(collection_of(model))
        >>> first_expert = ep_rank * num_experts // ep_size
        >>> ep_size, first_expert == 2 * torch.distributed.get_rank()
        (4, True)
    """
    collection = resolve_pg_collection(
        pg_collection, owner="get_ep_rank_and_size", fallback=("ep",)
    )
    return ep_rank_and_size(collection)


def ep_rank_and_size(collection: ProcessGroupCollection) -> tuple[int, int]:
    """Rank and size in a resolved collection's ``ep`` group."""
    group = collection.get("ep")
    return group_rank(group), group_size(group)

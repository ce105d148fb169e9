"""The global grid: one collection a process may declare for code given none (the deprecated path).

Migrating code bases start here: :func:`initialize_global_grid` builds a layout as the process-wide
default, and every entry point that is given no collection (nor a model with one attached) runs on
it, with a :class:`~pgregistry.fallback.ProcessGroupFallbackWarning` naming the entry point, until
the call sites pass collections. Nothing else reads it: the entry points resolve their collection
once, at the door, and only there.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, TypeVar, overload

from pgregistry.collection import ProcessGroupCollection

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from pgregistry.layout import ParallelLayout
    from pgregistry.registry import BuildOptions

__all__ = ["global_collection", "initialize_global_grid"]

D = TypeVar("D")
_RAISE: Any = object()
_grid: ProcessGroupCollection | None = None


def initialize_global_grid(
    layout: ParallelLayout, **build_options: Unpack[BuildOptions]
) -> ProcessGroupCollection:
    """Build ``layout`` as the global grid (:func:`pgregistry.registry.build`, name ``"global"``).

    For code not migrated yet: the fallback path reads it, with a warning. Collective over the
    world.

    Args:
        layout: the job's layout.
        **build_options: ``backend`` and ``timeout`` (:class:`~pgregistry.registry.BuildOptions`).

    Returns:
        The global grid's collection.

    Raises:
        RuntimeError: a global grid exists whose groups :func:`pgregistry.registry.destroy` has not
            destroyed.

    Example:
        On every rank of a 2-rank world (as :func:`pgregistry.testing.run_world` starts it):

        >>> import warnings
        >>> import torch
        >>> from pgregistry import ParallelLayout, grad_norm
        >>> _ = initialize_global_grid(ParallelLayout(num_ranks=2, tp=2), timeout=60)
        >>> weight = torch.nn.Parameter(torch.zeros(2))
        >>> weight.grad = torch.tensor([3.0, 4.0])
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     norm = grad_norm([weight])  # none given or attached: the global grid's
        >>> norm
        tensor(5.)
        >>> print(caught[0].message)
        grad_norm was not given a ProcessGroupCollection ... the global grid; pass ...
    """
    from pgregistry import registry

    global _grid
    if _grid is not None and not _grid.is_destroyed:
        raise RuntimeError(
            "the global grid is already initialised; call pgregistry.registry.destroy() first"
        )
    _grid = registry.build(layout, name="global", **build_options)
    return _grid


@overload
def global_collection() -> ProcessGroupCollection: ...


@overload
def global_collection(default: D) -> ProcessGroupCollection | D: ...


def global_collection(default: object = _RAISE) -> object:
    """The global grid's collection, or ``default`` where none is initialised.

    Only the doors read it (code given no collection); library code takes a collection instead.

    Args:
        default: returned when none is initialised (or it was destroyed).

    Returns:
        The collection :func:`initialize_global_grid` built, else ``default``.

    Raises:
        RuntimeError: none is initialised (or it was destroyed) and no ``default`` is given; the
            message says which and how to initialise one.

    Example:
        On every rank of a 2-rank world:

        >>> from pgregistry import ParallelLayout
        >>> from pgregistry.collection import group_size
        >>> from pgregistry.registry import destroy
        >>> _ = initialize_global_grid(ParallelLayout(num_ranks=2, tp=2))
        >>> group_size(global_collection().get("tp"))  # this rank's tp group: both ranks
        2
        >>> destroy()
        >>> print(global_collection(None))  # the grid was destroyed
        None
    """
    if _grid is None or _grid.is_destroyed:
        if default is _RAISE:
            state = (
                "not initialised" if _grid is None else "destroyed (pgregistry.registry.destroy)"
            )
            raise RuntimeError(
                f"the global grid is {state}: initialise it with "
                "pgregistry.global_grid.initialize_global_grid(layout)"
            )
        return default
    return _grid

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

    Example::

        initialize_global_grid(ParallelLayout(num_ranks=8, tp=2), timeout=60)  # on every rank
        grad_norm(model)  # none given or attached: the global grid's, with the fallback warning
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

    Example::

        initialize_global_grid(ParallelLayout(num_ranks=8, tp=2))
        global_collection().get("tp")  # this rank's tp group
        pgregistry.registry.destroy()
        global_collection(None)  # None: the grid was destroyed
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

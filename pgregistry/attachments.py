"""Which collection a model runs on: :func:`attach` records it, :func:`collection_of` finds it.

A model knows its own grid, so entry points given the model need no ``pg_collection`` argument (and
one given anyway must agree with it). The collection is found through ``.module`` wrappers (DDP,
mixed-precision wrappers), ``torch.compile``'s and activation checkpointing's, and must be the same
on every chunk of a pipelined model.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, Final, TypeVar, overload

from pgregistry.collection import ProcessGroupCollection

if TYPE_CHECKING:
    from torch import nn

__all__ = ["attach", "collection_of"]

D = TypeVar("D")
_RAISE: Any = object()
_attached: weakref.WeakKeyDictionary[Any, ProcessGroupCollection] = weakref.WeakKeyDictionary()


def attach(model: nn.Module | Sequence[nn.Module], collection: ProcessGroupCollection) -> None:
    """Record that ``model`` runs on ``collection``.

    Every entry point given the model and no ``pg_collection`` then runs on it
    (:func:`collection_of`).

    Args:
        model: a model, or a list of model chunks (each chunk is attached).
        collection: the collection it runs on.

    Raises:
        TypeError: ``collection`` is not a :class:`~pgregistry.collection.ProcessGroupCollection`;
            ``model`` (or a chunk) is no module (a tensor: nothing would ever look it up).
        ValueError: ``model`` is an empty list of chunks.

    Attaching a module again replaces its collection (a layout rebuilt, or shrunk after a failure).

    Example:
        On every rank of a 2-rank world (as :func:`pgregistry.testing.run_world` starts it):

        >>> import warnings
        >>> import torch
        >>> from pgregistry import ParallelLayout, ProcessGroupFallbackWarning, build, grad_norm
        >>> model = torch.nn.Linear(2, 1, bias=False)
        >>> model.weight.grad = torch.tensor([[3.0, 4.0]])
        >>> attach(model, build(ParallelLayout(num_ranks=2, tp=2)))
        >>> with warnings.catch_warnings():
        ...     warnings.simplefilter("error", ProcessGroupFallbackWarning)
        ...     grad_norm(model)  # on the attached collection, no fallback warning
        tensor(5.)
    """
    if not isinstance(collection, ProcessGroupCollection):
        raise TypeError(f"attach expects a ProcessGroupCollection, got {type(collection).__name__}")
    from torch.nn import Module  # not at import: pgregistry loads no torch

    chunks = _as_chunks(model)
    # Nothing would be recorded, and every entry point would fall back without a word.
    if not chunks:
        raise ValueError(
            f"attach was given an empty {type(model).__name__} of model chunks: nothing to attach "
            "the collection to; pass the model, or its chunks"
        )
    for index, chunk in enumerate(chunks):
        # A tensor is never looked up (entry points given tensors take pg_collection), so a
        # collection attached to one would be ignored without a word.
        if not isinstance(chunk, Module):
            where = "model" if chunk is model else f"model chunk {index}"
            raise TypeError(
                f"attach records the collection of a module: {where} is a "
                f"{type(chunk).__name__}; attach it to the model (or its chunks), and pass "
                "pg_collection= where you pass tensors"
            )
    for chunk in chunks:
        _attached[chunk] = collection


@overload
def collection_of(model: nn.Module | Sequence[nn.Module]) -> ProcessGroupCollection: ...


@overload
def collection_of(
    model: nn.Module | Sequence[nn.Module], default: D
) -> ProcessGroupCollection | D: ...


def collection_of(model: nn.Module | Sequence[nn.Module], default: object = _RAISE) -> object:
    """The collection attached to ``model`` (a model or its chunks, each possibly wrapped).

    Each chunk's collection is the first one attached (:func:`attach`) along its wrapper chain.

    Args:
        model: a model, or a list of model chunks.
        default: returned when no collection is attached (else ``LookupError``).

    Returns:
        The attached collection (one for every chunk), else ``default``.

    Raises:
        ValueError: naming the chunks, when they disagree, including when some carry a collection
            and others none.
        LookupError: none is attached and no ``default`` is given.

    Example:
        >>> import torch
        >>> from pgregistry.collection import ProcessGroupCollection
        >>> model, collection = torch.nn.Linear(2, 2), ProcessGroupCollection(tp=None)
        >>> attach(model, collection)
        >>> collection_of(model) is collection, collection_of([model, model]) is collection
        (True, True)
        >>> collection_of(torch.nn.Linear(2, 2), None) is None
        True
    """
    per_chunk: list[ProcessGroupCollection | None] = []
    for chunk in _as_chunks(model):
        found = next((_attached[m] for m in wrapper_chain(chunk) if m in _attached), None)
        per_chunk.append(found)
    first = per_chunk[0] if per_chunk else None
    for index, collection in enumerate(per_chunk[1:], start=1):
        if collection != first:
            raise ValueError(
                f"model chunks 0 and {index} carry different process-group collections "
                f"({_describe_attached(first)} and {_describe_attached(collection)}); "
                "attach one collection to every chunk (pgregistry.attach)"
            )
    if first is None:
        if default is _RAISE:
            raise LookupError(
                f"no ProcessGroupCollection is attached to this {type(model).__name__}; call "
                "pgregistry.attach(model, collection)"
            )
        return default
    return first


_WRAPPED_SLOTS: Final = ("_orig_mod", "_checkpoint_wrapped_module")
"""Where torch's wrappers hold the module they wrap.

``torch.compile``'s ``OptimizedModule``, and the activation-checkpointing wrappers
(``checkpoint_wrapper``, ``offload_wrapper``)."""


def wrapper_chain(module: nn.Module) -> Iterator[nn.Module]:
    """``module``, then what it wraps, each in turn.

    Through torch's wrappers (:data:`_WRAPPED_SLOTS`, read from the wrapper's own modules), then
    ``.module`` attributes (DDP, mixed-precision wrappers). torch's wrappers answer ``.module`` from
    inside the module they wrap, so the chain stopped at them: a model attached and then compiled
    (or wrapped for activation checkpointing) fell back to the global grid ("nor a model with one
    attached"), a TP model's norm summed over another grid.

    Args:
        module: a model, possibly wrapped (several times).

    Yields:
        ``module``, then each module it wraps, innermost last; each once, so a wrapper whose
        ``.module`` leads back to itself ends the chain.

    Example:
        >>> import torch
        >>> class Wrapper(torch.nn.Module):  # DDP's shape: the model it wraps is its .module
        ...     def __init__(self, module: torch.nn.Module) -> None:
        ...         super().__init__()
        ...         self.module = module
        >>> [type(m).__name__ for m in wrapper_chain(Wrapper(Wrapper(torch.nn.Linear(2, 2))))]
        ['Wrapper', 'Wrapper', 'Linear']
    """
    seen: set[int] = set()
    current: object = module
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current  # type: ignore[misc]  # a module, or what a wrapper's .module holds
        children = getattr(current, "__dict__", {}).get("_modules", {})
        wrapped = next((children[slot] for slot in _WRAPPED_SLOTS if slot in children), None)
        current = wrapped if wrapped is not None else getattr(current, "module", None)


def _as_chunks(model: nn.Module | Sequence[nn.Module]) -> list[nn.Module]:
    return list(model) if isinstance(model, Sequence) else [model]


def _describe_attached(collection: ProcessGroupCollection | None) -> str:
    return "none attached" if collection is None else collection.describe()

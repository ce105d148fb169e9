"""The door of every entry point: what it was given (one normaliser) and which collection it runs on
(one resolution).

An entry point that takes a model or parameters and ``pg_collection=None`` (grad statistics, the
optimizer builder, expert ranks and names, checkpoints, RNG seeding) calls :func:`normalise_params`
and :func:`resolve_pg_collection` once and passes what they return down; nothing below the door
resolves again. The collection is, in this order:

1. the collection passed explicitly (refused when the model carries another one: which would win is
   a guess);
2. else the collection attached to the model (:func:`pgregistry.attach`), found through ``.module``
   wrappers and the same on every chunk;
3. else the global grid (:mod:`pgregistry.global_grid`), with a
   :class:`~pgregistry.fallback.ProcessGroupFallbackWarning` naming the entry point;
4. else ``RuntimeError`` naming the entry point.

No entry point reads "no collection" as a default layout (such as "expert parallelism off"): on an
EP 4 grid that gave every rank EP rank 0 of 1, so every rank's experts got the same global names and
overwrote each other in a checkpoint. The resolved collection must be usable: this rank must be a
member of its layout, and its groups must not have been destroyed. The fields an entry point may
read from the global grid when they are :data:`~pgregistry.collection.UNSET` (``fallback``) are
filled here too, each with a warning, unless the collection's own composite groups leave them one
rank (then they are ``None``, nothing read); a field filled from the global grid never contradicts
one the collection sets (``ValueError`` naming both). Every other field it needs must be set.
"""

from __future__ import annotations

import reprlib
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeAlias

import attrs

from pgregistry.attachments import collection_of
from pgregistry.collection import GroupName, ProcessGroupCollection, group_size, implied_size
from pgregistry.fallback import warn_fallback
from pgregistry.global_grid import global_collection

if TYPE_CHECKING:
    import torch
    from torch import nn
    from torch.distributed import ProcessGroup

__all__ = [
    "Params",
    "ParamsLike",
    "Source",
    "check_usable",
    "fill_unset_fields",
    "grid_reads",
    "normalise_model",
    "normalise_params",
    "params_of_source",
    "require_module",
    "resolve_pg_collection",
    "source_of",
]

ParamsLike: TypeAlias = (
    "nn.Module | torch.Tensor | Mapping[str, torch.Tensor] | "
    "Iterable[torch.Tensor] | Iterable[nn.Module]"
)
"""What the entry points accept: a model, model chunks (a list, tuple or generator of modules), a
name -> parameter mapping, one tensor, or an iterable of tensors."""


@attrs.frozen(slots=True)
class Params:
    """What an entry point was given, normalised once.

    The model chunks (empty when given tensors) and every parameter once (by identity), named, in a
    deterministic order."""

    chunks: tuple[nn.Module, ...]
    named: tuple[tuple[str, torch.Tensor], ...]


@attrs.frozen(slots=True)
class Source:
    """What an entry point was given, taken apart without walking it, for :func:`params_of_source`.

    The model chunks, or the tensors (``None`` for chunks), and the items as given (a one-shot
    iterable read into a list once)."""

    chunks: tuple[nn.Module, ...]
    tensors: list[Any] | None
    given: Any


def source_of(model_or_params: ParamsLike) -> Source:
    """:class:`Source` of a model, model chunks, a mapping, one tensor or an iterable of tensors.

    Model chunks are any iterable of modules, generators included; ``TypeError`` naming the position
    and type of an item of them that is no module. A few ``isinstance`` checks, no walk (a kept
    classification checks what it was made from against this, each call)."""
    import torch
    from torch import nn

    if isinstance(model_or_params, nn.Module):
        return Source((model_or_params,), None, model_or_params)
    if isinstance(model_or_params, torch.Tensor):
        return Source((), [model_or_params], model_or_params)
    if isinstance(model_or_params, Mapping):
        return Source((), list(model_or_params.values()), model_or_params)
    if not isinstance(model_or_params, Iterable):  # else list() says "'NoneType' ... not iterable"
        raise TypeError(
            "expected a model, model chunks, a name -> parameter mapping, a tensor or an iterable "
            f"of tensors, got {model_or_params!r} ({type(model_or_params).__name__})"
        )
    items = list(model_or_params)
    if items and isinstance(items[0], nn.Module):
        # Model chunks: an item that is no module is named here, not the first chunk as "param[0]".
        for position, item in enumerate(items):
            if not isinstance(item, nn.Module):
                raise TypeError(
                    f"model chunk {position} is {reprlib.repr(item)} ({type(item).__name__}), "
                    "not a module: pass model chunks (modules only), or tensors"
                )
        return Source(tuple(items), None, items)
    return Source((), items, items)


def normalise_params(model_or_params: ParamsLike) -> Params:
    """The one normaliser of models, chunks, mappings, tensors and iterables of tensors.

    Chunks are any iterable of modules, generators included. :func:`params_of_source` of its
    :func:`source_of`."""
    return params_of_source(source_of(model_or_params))


def normalise_model(model_chunks: ParamsLike, owner: str) -> Params:
    """:func:`normalise_params` of a model or model chunks, for the entry points needing modules.

    ``TypeError`` naming ``owner`` for anything else (tensors, a mapping)."""
    params = normalise_params(model_chunks)
    if not params.chunks:
        raise TypeError(
            f"{owner} expects a model or model chunks, got {type(model_chunks).__name__}"
        )
    return params


def require_module(model: object, owner: str) -> None:
    """``TypeError`` naming ``owner`` unless ``model`` is an ``nn.Module``, for the expert markers.

    A ``Parameter`` is refused too: it has no ``modules()`` to walk; the error says how to mark
    one."""
    from torch import nn

    if not isinstance(model, nn.Module):
        raise TypeError(
            f"{owner} takes the model (an nn.Module), but was given a "
            f"{type(model).__name__}; mark one parameter with pgregistry.params.mark_expert"
        )


def params_of_source(source: Source) -> Params:
    """The parameters of ``source``, named.

    A model's named as ``named_parameters`` names them (prefixed ``chunk<i>.`` when there are
    several chunks), each with the roles of the parameter it replaced when it is the same parameter
    (:func:`~pgregistry.params.restore_param_roles`); a mapping gives its items; tensors are named
    ``param[<i>]``. ``TypeError`` naming an item that is not a tensor."""
    import torch

    from pgregistry.params import restore_param_roles

    pairs: Iterable[tuple[str, object]]
    if source.chunks:
        restore_param_roles(source.chunks)
        prefix = len(source.chunks) > 1
        pairs = [
            (f"chunk{i}.{name}" if prefix else name, param)
            for i, chunk in enumerate(source.chunks)
            for name, param in chunk.named_parameters()
        ]
    elif isinstance(source.given, Mapping):
        pairs = list(source.given.items())
    else:
        assert source.tensors is not None
        pairs = [(f"param[{i}]", item) for i, item in enumerate(source.tensors)]
    named: list[tuple[str, torch.Tensor]] = []
    seen: set[int] = set()
    for name, param in pairs:
        if not isinstance(param, torch.Tensor):
            raise TypeError(
                f"{name} is a {type(param).__name__}, not a tensor or parameter{_hint_for(param)}"
            )
        if id(param) not in seen:
            seen.add(id(param))
            named.append((name, param))
    return Params(source.chunks, tuple(named))


def _hint_for(item: object) -> str:
    """What to pass instead of ``item`` when it is a ``(name, tensor)`` pair (named_parameters)."""
    import torch

    if isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], torch.Tensor):
        return (
            f" (a (name, tensor) pair: {item[0]!r}): pass dict(model.named_parameters()), the "
            "model, or model.parameters()"
        )
    return ""


def resolve_pg_collection(
    pg_collection: ProcessGroupCollection | None,
    chunks: Sequence[nn.Module] = (),
    *,
    owner: str,
    fallback: Iterable[GroupName] = (),
) -> ProcessGroupCollection:
    """The collection ``owner`` runs on (see the module docstring), checked usable, filled.

    The UNSET fields of ``fallback`` are filled by :func:`fill_unset_fields` (from the global grid,
    each with a warning, where the collection does not fix them; ``RuntimeError`` when there is none
    to read).

    ``TypeError`` when ``pg_collection`` is neither a collection nor ``None``; ``ValueError`` when
    it disagrees with the collection attached to ``chunks``, when this rank is not a member of it,
    or when it was destroyed.
    """
    attached = collection_of(chunks, None) if chunks else None
    if pg_collection is not None:
        if not isinstance(pg_collection, ProcessGroupCollection):
            raise TypeError(
                f"{owner} expects pg_collection to be a ProcessGroupCollection or None, got "
                f"{type(pg_collection).__name__}"
            )
        if attached is not None and attached != pg_collection:
            raise ValueError(
                f"{owner} was given {pg_collection.describe()} but the model "
                f"carries {attached.describe()}, attached with pgregistry.attach: "
                "pass the attached one (or none), or attach the one you mean"
            )
        collection = pg_collection
    elif attached is not None:
        collection = attached
    else:
        collection = _global_grid_for(owner, model_given=bool(chunks))
    collection = check_usable(collection, owner)
    return fill_unset_fields(collection, fallback, owner)


def check_usable(collection: ProcessGroupCollection, owner: str) -> ProcessGroupCollection:
    """``collection``, refused when this rank cannot use it.

    ``ValueError`` when this rank is not a member of its layout or its groups were destroyed
    (:func:`pgregistry.registry.destroy`); ``TypeError`` when it is not a collection. For entry
    points that take a collection only, never ``None``."""
    if not isinstance(collection, ProcessGroupCollection):
        kind = type(collection)
        got = f"{kind.__module__}.{kind.__qualname__}"
        raise TypeError(f"{owner} expects a pgregistry ProcessGroupCollection, got {got}")
    if collection.is_destroyed:
        raise ValueError(
            f"{owner} was given {collection.describe()}, whose groups "
            "pgregistry.registry.destroy() destroyed; build the layout again"
        )
    if not collection.is_member:
        import torch.distributed as dist

        layout = collection.layout
        assert layout is not None  # only a built collection can be outside its layout
        first, stop = layout.rank_range()
        raise ValueError(
            f"{owner} was given {collection.describe()}, which spans ranks {first}-{stop - 1}; "
            f"this rank ({dist.get_rank()}) is not one of them and must not compute with it: give "
            "the collection of a module this rank runs, or skip the module here (pg.is_member)"
        )
    return collection


def _global_grid() -> ProcessGroupCollection | None:
    """The global grid, or ``None``: pgregistry's one read of it (the allowlist keeps it so)."""
    return global_collection(None)


def _global_grid_for(owner: str, *, model_given: bool) -> ProcessGroupCollection:
    grid = _global_grid()
    if grid is None:
        source = "and the model has no collection attached " if model_given else ""
        raise RuntimeError(
            f"{owner} was not given a ProcessGroupCollection {source}and no "
            "global grid is initialised; pass pg_collection, attach one to "
            "the model (pgregistry.attach) or initialise the global grid"
        )
    warn_fallback(owner, "pg_collection")
    return grid


def fill_unset_fields(
    collection: ProcessGroupCollection,
    names: Iterable[GroupName],
    owner: str,
    *,
    unneeded: Iterable[GroupName] = (),
) -> ProcessGroupCollection:
    """``collection`` with its UNSET fields among ``names`` filled.

    For an entry point that decides what its model needs after :func:`resolve_pg_collection`
    (``fallback=()``), as ``build_optimizer`` does.

    A field the collection's own composite groups leave one rank
    (:func:`~pgregistry.collection.implied_size`: ``tp_ep_pp=None`` leaves ``expt_tp`` and ``ep``
    off) is ``None``, nothing read. A field among ``unneeded`` (the expert axes of a model without
    experts) is ``None`` too, unless the composites say it spans several ranks. Any other is read
    from the global grid, with a warning (``RuntimeError`` when there is none), and must agree with
    the collection: ``ValueError`` naming the field and the composite it contradicts, or the check
    that failed.
    """
    missing = [name for name in dict.fromkeys((*names, *unneeded)) if not collection.is_set(name)]
    if not missing:
        return collection
    read = grid_reads(collection, missing, unneeded)
    filled: dict[str, ProcessGroup | None] = {name: None for name in missing if name not in read}
    grid = _global_grid() if read else None
    for name in read:
        warn_fallback(owner, name)
        if grid is None:
            raise RuntimeError(
                f"{owner} needs process group {name!r}: it was not given one and no global "
                "grid is initialised (pgregistry.global_grid.initialize_global_grid); "
                "pass a ProcessGroupCollection that sets it"
            )
        if not grid.is_set(name):
            raise RuntimeError(
                f"{owner} needs process group {name!r}, which the global grid does not define"
            )
        group = grid.get(name)
        implied = implied_size(collection, name)
        if implied is not None and group_size(group) != implied[0]:
            size, composite = implied
            raise ValueError(
                f"{owner} needs process group {name!r}, which the collection leaves "
                f"unset; the global grid's {name!r} spans {group_size(group)} rank(s), "
                f"but the collection's {composite!r} leaves it {size}: the global grid is "
                f"another layout than the collection's, so pass {name} in the collection"
            )
        filled[name] = group
    try:
        return collection.evolve(**filled)
    except ValueError as exc:
        raise ValueError(
            f"{owner} filled the unset process group(s) {read} from the global grid, "
            f"which contradicts the collection ({exc}); pass them in the collection"
        ) from exc


def grid_reads(
    collection: ProcessGroupCollection,
    names: Iterable[GroupName],
    unneeded: Iterable[GroupName] = (),
) -> list[GroupName]:
    """The fields among ``names`` that :func:`fill_unset_fields` reads from the global grid.

    UNSET, not left one rank by the collection's composite groups, and not ``unneeded`` unless the
    composites say they span several ranks."""
    skipped = set(unneeded)
    reads = []
    for name in dict.fromkeys(names):
        if collection.is_set(name):
            continue
        implied = implied_size(collection, name)
        if (implied is not None and implied[0] == 1) or (implied is None and name in skipped):
            continue
        reads.append(name)
    return reads

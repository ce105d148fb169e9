"""The collections of a job's modules: :class:`MultiModuleCollection` and :func:`build_modules`.

A job that runs several modules (a vision encoder and a language model, an RL actor and its critic)
gives each its own layout, on ranks of its own or colocated with others. Megatron-Core's
``MultiModuleProcessGroupCollection`` holds, on each rank, the collections of the modules that rank
runs. This one is job-wide: every rank holds every module's collection, a rank outside a module
holding one that refuses to be used. That is what a job-wide statistic needs: a rank must know every
module to take part in the reduction over modules, even for the modules it lacks.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from datetime import timedelta
from types import MappingProxyType

from pgregistry._runtime.communicators import span_text
from pgregistry.collection import ProcessGroupCollection
from pgregistry.layout import ParallelLayout

__all__ = [
    "MODULES_ADVICE",
    "MultiModuleCollection",
    "build_modules",
    "require_multi_module_collection",
]

MODULES_ADVICE = "every rank must pass the same modules, in the same order, and the same options"
"""What a disagreement about a job's modules asks of the ranks."""


class MultiModuleCollection(Mapping[str, ProcessGroupCollection]):
    """Module name -> the collection it runs on, for every module of the job; a read-only mapping.

    For a job whose modules (a vision encoder and a language model, say) each run on their own
    ranks with their own layout: every rank holds the whole table, so the job-wide statistics and
    the optimizer's checks know every module's span, its own or not. Every collection must be
    built (:func:`pgregistry.build`) for that reason.

    Args:
        modules: Module name -> its built collection, in the same order on every rank.
        language_model: The language model's name among them (Megatron-Core's
            ``language_model_module_name``), or ``None``.
        disjoint: Declares that no two modules share a rank; checked.

    Raises:
        ValueError: No modules; a name that is not a non-empty string; a collection assembled by
            hand; a ``language_model`` that names no module; modules declared disjoint whose
            spans share ranks (each naming the culprit).
        TypeError: A value that is not a collection (named).

    Example:
        On every rank of a 4-rank world (as :func:`pgregistry.testing.run_world` starts it):

        >>> import torch
        >>> from pgregistry import ParallelLayout, build
        >>> vision = build(ParallelLayout(num_ranks=2, tp=2), name="vision")
        >>> language = build(ParallelLayout(num_ranks=2, rank_offset=2, tp=2), name="language")
        >>> modules = MultiModuleCollection(
        ...     {"vision": vision, "language": language}, language_model="language", disjoint=True
        ... )
        >>> modules.here() == (("vision",) if torch.distributed.get_rank() < 2 else ("language",))
        True
    """

    __slots__ = ("_modules", "_language_model", "_disjoint")

    def __init__(
        self,
        modules: Mapping[str, ProcessGroupCollection],
        *,
        language_model: str | None = None,
        disjoint: bool = False,
    ) -> None:
        if not modules:
            raise ValueError("a MultiModuleCollection needs at least one module")
        for name, collection in modules.items():
            _check_module(name, collection)
        _check_language_model(language_model, list(modules))
        if disjoint:
            _check_disjoint({name: c.layout for name, c in modules.items() if c.layout is not None})
        self._modules = MappingProxyType(dict(modules))
        self._language_model = language_model
        self._disjoint = disjoint

    @property
    def language_model(self) -> str | None:
        """The language model's module name, or ``None``."""
        return self._language_model

    @property
    def disjoint(self) -> bool:
        """Whether the modules were declared (and checked) to share no rank."""
        return self._disjoint

    def language_model_collection(self) -> ProcessGroupCollection:
        """The language model's collection; ``ValueError`` if no module is the language model.

        Returns:
            The collection of the module named ``language_model`` when the job was declared (on a
            rank outside that module, its non-member collection).

        Raises:
            ValueError: no module was named the language model (``language_model=None``).
        """
        if self._language_model is None:
            raise ValueError(
                f"no module of {list(self._modules)} is named "
                "the language model (language_model=None)"
            )
        return self._modules[self._language_model]

    def here(self) -> tuple[str, ...]:
        """The names of the modules this rank runs (whose span holds it), in declaration order.

        Returns:
            The names; empty on a rank that runs no module.
        """
        return tuple(name for name, collection in self._modules.items() if collection.is_member)

    def layouts(self) -> dict[str, ParallelLayout]:
        """Module name -> its layout, on every rank (a rank outside a module knows its span too).

        Returns:
            Every module, in declaration order -> its :class:`~pgregistry.layout.ParallelLayout`.
        """
        return {name: _layout_of(collection) for name, collection in self._modules.items()}

    def __getitem__(self, name: str) -> ProcessGroupCollection:
        try:
            return self._modules[name]
        except KeyError:
            raise KeyError(f"no module {name!r}; the modules are {list(self._modules)}") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._modules)

    def __len__(self) -> int:
        return len(self._modules)

    def __repr__(self) -> str:
        spans = ", ".join(
            f"{name}: ranks {span_text(_layout_of(c))}" for name, c in self._modules.items()
        )
        extras = (
            f", language_model={self._language_model!r}" if self._language_model is not None else ""
        )
        extras += ", disjoint=True" if self._disjoint else ""
        return f"MultiModuleCollection({{{spans}}}{extras})"


def build_modules(
    layouts: Mapping[str, ParallelLayout],
    *,
    language_model: str | None = None,
    disjoint: bool = False,
    backend: str | None = None,
    timeout: timedelta | float | None = None,
) -> MultiModuleCollection:
    """Build every module's layout under its name into one :class:`MultiModuleCollection`.

    Collective over the world: every rank calls it with the same arguments, a rank outside a module
    included. The ranks first agree on the whole request (module names, layouts, ``language_model``,
    ``disjoint``, options), so that a rank that declares another span raises on every rank instead
    of leaving the others in a collective; ``timeout`` bounds that agreement too (a rank that never
    calls it is named within that time).

    Args:
        layouts: module name -> its layout (a span of the world each). A mapping: a list of ``(name,
            layout)`` pairs is refused rather than read as one, as ``dict(pairs)`` would silently
            keep the last of two equal names.
        language_model: the module that is the language model (Megatron-Core's MIMO), or ``None``.
        disjoint: the modules' spans must not overlap.
        backend: :func:`pgregistry.build`'s, checked alike.
        timeout: :func:`pgregistry.build`'s, checked alike.

    Returns:
        The job's :class:`MultiModuleCollection`: every module's collection on every rank (one that
        refuses every use outside the module's span).

    Raises:
        TypeError: on every rank, ``layouts`` not a mapping, or a module's layout not a
            :class:`~pgregistry.layout.ParallelLayout`.
        ValueError: on every rank: no module; ``language_model`` naming none of them; a bad module
            name; ranks that asked for different modules, layouts or options (each named); modules
            declared disjoint whose spans overlap (before any group is created); a bad ``backend``
            or ``timeout``.

    Example:
        On every rank of a 4-rank world (as :func:`pgregistry.testing.run_world` starts it):

        >>> from pgregistry import ParallelLayout
        >>> modules = build_modules(
        ...     {"encoder": ParallelLayout(num_ranks=2, tp=2),
        ...      "llm": ParallelLayout(num_ranks=2, tp=2, rank_offset=2)},
        ...     language_model="llm", disjoint=True,
        ... )
        >>> [modules[name].layout.rank_range() for name in ("encoder", "llm")]
        [(0, 2), (2, 4)]
    """
    from pgregistry import registry
    from pgregistry._runtime.agreement import check_agreement, combine_faults, require_distributed
    from pgregistry._runtime.attendance import require_attendance
    from pgregistry._runtime.group_cache import check_group_options

    require_distributed("build_modules")
    options, described_options, fault = check_group_options(backend, timeout)
    if isinstance(layouts, Mapping):
        request = {f"module {name!r}": repr(layout) for name, layout in layouts.items()}
    else:
        request = {"modules": repr(layouts)}
        fault = combine_faults(
            fault,
            TypeError(
                "build_modules takes a mapping from module name to its "
                "ParallelLayout ({'encoder': ParallelLayout(...), 'language': "
                "ParallelLayout(...)}, in the modules' order), got a "
                f"{type(layouts).__name__}; for (name, layout) pairs pass dict(pairs)"
            ),
        )
    request.update(
        language_model=repr(language_model), disjoint=repr(disjoint), **described_options
    )
    with require_attendance("pgregistry.modules.build_modules", options.timeout, MODULES_ADVICE):
        check_agreement(
            "the modules to build", request, fault, advice=MODULES_ADVICE, timeout=options.timeout
        )
    assert isinstance(layouts, Mapping)  # agreed: every rank raised above otherwise
    if not layouts:
        raise ValueError("build_modules needs at least one module")
    for name, layout in layouts.items():
        _check_name(name)
        if not isinstance(layout, ParallelLayout):
            raise TypeError(
                f"module {name!r}: build_modules expects a "
                f"ParallelLayout, got {type(layout).__name__}"
            )
    if disjoint:
        _check_disjoint(layouts)
    _check_language_model(language_model, list(layouts))
    collections = {
        name: registry.build(layout, name=name, backend=backend, timeout=timeout)
        for name, layout in layouts.items()
    }
    return MultiModuleCollection(collections, language_model=language_model, disjoint=disjoint)


def require_multi_module_collection(modules: object, owner: str) -> None:
    """``TypeError`` naming ``owner`` unless ``modules`` is a :class:`MultiModuleCollection`.

    The first check of every entry point over the job's modules, before any collective (one
    module's own collection given instead is the likely slip)."""
    if not isinstance(modules, MultiModuleCollection):
        raise TypeError(
            f"{owner} takes the job's MultiModuleCollection, got {type(modules).__name__}"
        )


def _check_language_model(language_model: str | None, names: list[str]) -> None:
    """``ValueError`` unless ``language_model`` is ``None`` or one of the modules ``names``."""
    if language_model is not None and language_model not in names:
        raise ValueError(
            f"language_model {language_model!r} is none of the "
            f"modules {names}; name one of them or None"
        )


def _check_name(name: object) -> None:
    if not isinstance(name, str) or not name:
        raise ValueError(f"a module name must be a non-empty string, got {name!r}")


def _check_module(name: str, collection: object) -> None:
    _check_name(name)
    if not isinstance(collection, ProcessGroupCollection):
        kind = type(collection).__name__
        raise TypeError(
            f"module {name!r}: expected a pgregistry ProcessGroupCollection, got {kind}"
        )
    if collection.layout is None:
        raise ValueError(
            f"module {name!r} has a collection assembled by hand: a "
            "rank outside the module could not know its span. Build it "
            "with pgregistry.build(layout, name=...) (or build_modules)"
        )


def _layout_of(collection: ProcessGroupCollection) -> ParallelLayout:
    layout = collection.layout
    assert layout is not None  # checked when the MultiModuleCollection was made
    return layout


def _check_disjoint(layouts: Mapping[str, ParallelLayout]) -> None:
    """``ValueError`` naming the first two modules whose spans share ranks, and those ranks."""
    names = list(layouts)
    for index, first in enumerate(names):
        a_first, a_stop = layouts[first].rank_range()
        for second in names[index + 1 :]:
            b_first, b_stop = layouts[second].rank_range()
            low, high = max(a_first, b_first), min(a_stop, b_stop)
            if low < high:
                raise ValueError(
                    f"modules {first!r} (ranks {a_first}-{a_stop - 1}) and {second!r} "
                    f"(ranks {b_first}-{b_stop - 1}) are declared disjoint but share "
                    f"ranks {low}-{high - 1}; move one (rank_offset) or drop "
                    "disjoint=True if they are meant to share ranks"
                )

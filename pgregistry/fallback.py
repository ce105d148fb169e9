"""The one sanctioned path from explicit groups to the global grid, and the warning it raises.

Code that is handed a :class:`~pgregistry.collection.ProcessGroupCollection` uses it. Code that is not (or is
handed one with a field :data:`~pgregistry.collection.UNSET`) falls back to the global grid
(:func:`pgregistry.registry.global_collection`) through the resolvers here, and every such fallback emits
:class:`ProcessGroupFallbackWarning` so it can be found and removed:

* under default filters, once per ``(owner, argument)`` per process, wherever it is called from;
* under an ``error`` filter (``python -W error::pgregistry.ProcessGroupFallbackWarning``, pytest's
  ``filterwarnings``, ``warnings.simplefilter("error", ...)``) it raises *every* time, which is the migration mode;
* ``always`` shows it every time and ``ignore`` never.

A plain "already warned" set would make an ``error`` filter raise only the first time; so the filters are asked
what they would do first, and only a non-``error``/``always`` action is deduplicated.

This module imports no torch at load: ``-W error::pgregistry.ProcessGroupFallbackWarning`` imports the package at
interpreter start.
"""

from __future__ import annotations

import re
import sys
import threading
import warnings
from collections.abc import Iterable
from typing import TYPE_CHECKING, NamedTuple, cast

from pgregistry.collection import UNSET, GroupName, ProcessGroupCollection, check_field_names, group_rank, group_size

if TYPE_CHECKING:
    import torch
    from torch.distributed import ProcessGroup

__all__ = [
    "CommandLineFilter",
    "ProcessGroupFallbackWarning",
    "command_line_filters",
    "forget_fallback_warnings",
    "global_grid_for",
    "gtp_replica_rank",
    "is_global_grid",
    "resolve_gtp_remat_group",
    "resolve_process_groups",
    "warn_global_process_group_fallback",
]


class ProcessGroupFallbackWarning(UserWarning):
    """Code read the global process-group grid because it was not given a group explicitly.

    Turn it into an error to find every such read: ``python -W error::pgregistry.ProcessGroupFallbackWarning``.
    """


class CommandLineFilter(NamedTuple):
    """One ``-W``/``PYTHONWARNINGS`` option, parsed as Python parses it (``message`` and ``module`` literal)."""

    action: str
    message: str
    category: type[Warning]
    category_name: str
    module: str
    lineno: int

    @property
    def message_pattern(self) -> str:
        """``message`` as the regular expression :func:`warnings.filterwarnings` takes (a literal prefix)."""
        return re.escape(self.message)

    @property
    def module_pattern(self) -> str:
        """``module`` as the regular expression :func:`warnings.filterwarnings` takes (the whole name)."""
        return re.escape(self.module) + r"\Z" if self.module else ""

    def apply(self) -> None:
        """Insert this filter at the front of :data:`warnings.filters`, as Python does for ``-W``."""
        warnings.filterwarnings(
            self.action,  # type: ignore[arg-type]  # one of the literals, checked by command_line_filters
            self.message_pattern, self.category, self.module_pattern, self.lineno
        )


def command_line_filters() -> list[CommandLineFilter]:
    """The ``-W``/``PYTHONWARNINGS`` options from the first one naming :class:`ProcessGroupFallbackWarning` on.

    Python processes those options before ``site`` puts site-packages on ``sys.path``, so for an installed
    pgregistry it prints "Invalid -W option ignored: invalid module name: 'pgregistry'" and drops the filter:
    ``python -W error::pgregistry.ProcessGroupFallbackWarning`` would silently not raise. The options from the
    first one naming this category onward are re-applied (at import, and by :mod:`pgregistry.pytest_plugin` inside
    pytest), so later options keep their precedence; those naming a category of another module, not a builtin,
    and those Python rejects as malformed are left out. Empty when no option names this category.
    """
    ours = {f"{__name__}.{ProcessGroupFallbackWarning.__name__}", "pgregistry.ProcessGroupFallbackWarning"}
    options = [option.split(":") for option in sys.warnoptions]
    first = next((i for i, fields in enumerate(options) if len(fields) > 2 and fields[2].strip() in ours), None)
    if first is None:
        return []
    parsed = []
    for fields in options[first:]:
        action, message, category_name, module, lineno = (*(f.strip() for f in fields), "", "", "", "")[:5]
        action = "always" if action == "all" else action
        actions = [a for a in ("default", "always", "ignore", "module", "once", "error") if a.startswith(action)]
        category = ProcessGroupFallbackWarning if category_name in ours else _builtin_warning(category_name)
        if len(fields) > 5 or not actions or category is None or not (lineno or "0").isdigit():
            continue  # Python rejected this option at start-up too
        name = category_name if category is ProcessGroupFallbackWarning else category.__name__
        parsed.append(CommandLineFilter(actions[0], message, category, name, module, int(lineno or 0)))
    return parsed


def _builtin_warning(name: str) -> type[Warning] | None:
    import builtins

    found = getattr(builtins, name, None) if name else Warning
    return found if isinstance(found, type) and issubclass(found, Warning) else None


def _apply_command_line_filters() -> None:
    for option in command_line_filters():
        option.apply()


_apply_command_line_filters()

_warned: set[tuple[str, str]] = set()
_warned_lock = threading.Lock()


def forget_fallback_warnings() -> None:
    """Forget which ``(owner, argument)`` pairs have warned, so each warns again once (for tests)."""
    with _warned_lock:
        _warned.clear()


def warn_global_process_group_fallback(owner: str, argument: str, *, stacklevel: int = 2) -> None:
    """Warn that ``owner`` read ``argument`` (a group name, or ``"pg_collection"`` for the whole collection,
    :func:`pgregistry.resolver.resolve_collection`) from the global grid instead of being given it.

    ``stacklevel`` counts as in :func:`warnings.warn`, from the caller of this function.
    """
    if argument == "pg_collection":
        message = (
            f"{owner} was not given a ProcessGroupCollection (nor a model with one attached) and falls back to the "
            "global grid; pass pg_collection explicitly or attach it to the model (pgregistry.registry.attach)"
        )
    else:
        message = (
            f"{owner} was not given process group {argument!r} and falls back to the global grid; pass a "
            f"ProcessGroupCollection (or the group) explicitly"
        )
    try:
        frame = sys._getframe(stacklevel)
        module, lineno = frame.f_globals.get("__name__", "<string>"), frame.f_lineno
    except ValueError:  # the stack is shallower than stacklevel: warnings.warn then attributes it to "sys"
        module, lineno = "sys", 0
    action = _filter_action(message, ProcessGroupFallbackWarning, module, lineno)
    if action == "ignore":
        return
    if action not in ("error", "always"):
        key = (owner, argument)
        with _warned_lock:
            if key in _warned:
                return
            _warned.add(key)
    warnings.warn(message, ProcessGroupFallbackWarning, stacklevel=stacklevel + 1)


def _filter_action(message: str, category: type[Warning], module: str, lineno: int) -> str:
    """The action the active warning filters would take, matched as :func:`warnings.warn_explicit` does."""
    for action, msg, cat, mod, line in warnings.filters:
        if (
            (msg is None or _matches(msg, message))
            and issubclass(category, cat)
            and (mod is None or _matches(mod, module))
            and (line == 0 or line == lineno)
        ):
            return str(action)
    return str(getattr(warnings, "defaultaction", "default"))


def _matches(pattern: re.Pattern[str] | str, text: str) -> bool:
    if isinstance(pattern, str):
        return re.match(pattern, text) is not None
    return pattern.match(text) is not None


def resolve_process_groups(
    pg_collection: ProcessGroupCollection | None, names: Iterable[GroupName], *, owner: str
) -> dict[GroupName, ProcessGroup | None]:
    """Name -> group for each of ``names``, from ``pg_collection`` where set, else the global grid (warning).

    A set field comes back as it is, ``None`` included (the axis is off). An UNSET field, or every field when
    ``pg_collection`` is None, is read from the global grid after :func:`warn_global_process_group_fallback`.
    Raises ``ValueError`` for an unknown name and ``RuntimeError`` naming ``owner`` and the group when there is
    no global grid to fall back to.
    """
    resolved: dict[GroupName, ProcessGroup | None] = {}
    for name in _group_names(names):
        if pg_collection is not None and pg_collection.is_set(name):
            resolved[name] = pg_collection.get(name)
            continue
        warn_global_process_group_fallback(owner, name, stacklevel=3)
        resolved[name] = _global_group(name, owner)
    return resolved


def global_grid_for(owner: str, *, model_given: bool, stacklevel: int = 2) -> ProcessGroupCollection:
    """The global grid, for ``owner``, which was given no collection (nor a model with one attached): warns with
    :class:`ProcessGroupFallbackWarning`; ``RuntimeError`` naming ``owner`` when there is none.

    The last step of :func:`pgregistry.resolver.resolve_collection`. ``stacklevel`` counts as in
    :func:`warnings.warn`, from the caller of this function.
    """
    grid = _global_grid()
    if grid is None:
        source = "and the model has no collection attached " if model_given else ""
        raise RuntimeError(
            f"{owner} was not given a ProcessGroupCollection {source}and no global grid is initialised; pass "
            "pg_collection, attach one to the model (pgregistry.registry.attach) or initialise the global grid"
        )
    warn_global_process_group_fallback(owner, "pg_collection", stacklevel=stacklevel + 1)
    return grid


def is_global_grid(collection: ProcessGroupCollection) -> bool:
    """Whether ``collection`` is the global grid (the only collection whose groups may be gloo side groups)."""
    return collection is _global_grid()


def _global_grid() -> ProcessGroupCollection | None:
    """The global grid, or ``None``: the one read of it in pgregistry."""
    from pgregistry import registry

    return registry.global_collection_or_none()


def _group_names(names: Iterable[str]) -> tuple[GroupName, ...]:
    """``names``, checked to be one-group fields (``ValueError`` for an unknown one or ``hcp``)."""
    checked = check_field_names(names)
    if "hcp" in checked:
        raise ValueError("'hcp' holds a list of groups; it has no global-grid fallback")
    return cast("tuple[GroupName, ...]", checked)


def _global_group(name: GroupName, owner: str) -> ProcessGroup | None:
    grid = _global_grid()
    if grid is None:
        raise RuntimeError(
            f"{owner} needs process group {name!r}: it was not given one and no global grid is initialised "
            "(pgregistry.registry.initialize_global_grid); pass a ProcessGroupCollection"
        )
    if not grid.is_set(name):
        raise RuntimeError(f"{owner} needs process group {name!r}, which the global grid does not define")
    return grid.get(name)


def resolve_gtp_remat_group(
    pg_collection: ProcessGroupCollection | None, is_expert: bool, *, owner: str
) -> ProcessGroup | None:
    """The GTP-remat group (``expt_gtp_remat`` for experts) a weight is sharded over.

    A field present in the collection is returned even when ``None`` (axis off). An UNSET field or a missing
    collection falls back to the global grid; that fallback warns only when the global group has more than one
    rank, since a 1-rank GTP axis changes nothing.
    """
    name: GroupName = "expt_gtp_remat" if is_expert else "gtp_remat"
    if pg_collection is not None and pg_collection.is_set(name):
        return pg_collection.get(name)
    group = _global_group(name, owner)
    if group_size(group) > 1:
        warn_global_process_group_fallback(owner, name, stacklevel=3)
    return group


def gtp_replica_rank(param: torch.Tensor, explicit_group: ProcessGroup | None = None) -> int:
    """Rank of this process among the true replicas of a GTP-sharded ``param``.

    Read from ``explicit_group``, else ``param.gtp_replica_group``, else the global grid's ``expt_dp`` (routed
    experts, ``param.allreduce is False``) or ``dp_cp`` group, with a fallback warning. 0 when
    ``torch.distributed`` is not initialised; ``RuntimeError`` when no group can be found.
    """
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return 0
    if explicit_group is not None:
        return group_rank(explicit_group)
    attached = getattr(param, "gtp_replica_group", UNSET)
    if attached is not UNSET:
        return group_rank(attached)
    name: GroupName = "expt_dp" if getattr(param, "allreduce", True) is False else "dp_cp"
    group = resolve_process_groups(None, (name,), owner="gtp_replica_rank")[name]
    return group_rank(group)

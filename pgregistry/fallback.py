"""The warning every read of the global grid emits: :class:`ProcessGroupFallbackWarning`.

Code that is handed a :class:`~pgregistry.collection.ProcessGroupCollection` uses it. Code that is
not (or is handed one with a field :data:`~pgregistry.collection.UNSET`) falls back to the global
grid (:mod:`pgregistry.global_grid`), and every such fallback warns, so it can be found and removed:

* under default filters, once per ``(owner, argument)`` per process, wherever it is called from;
* under an ``error`` filter (``python -W error::pgregistry.ProcessGroupFallbackWarning``, pytest's
  ``filterwarnings``, ``warnings.simplefilter("error", ...)``) it raises *every* time, which is the
  migration mode;
* ``always`` shows it every time and ``ignore`` never.

A plain "already warned" set would make an ``error`` filter raise only the first time; so the
filters are asked what they would do first, and only a non-``error``/``always`` action is
deduplicated. The warning is attributed to the first frame outside pgregistry: the user's code that
called an entry point without a collection, so a module filter of a migration config
(``error::pgregistry.ProcessGroupFallbackWarning:mypackage.trainer``) matches it.

Code that ``pgregistry migrate`` rewrote warns through its fallback helper (:mod:`pgregistry.doors`,
or the module the tool wrote into the tree, which uses this warning when pgregistry is importable).

Imports no torch: ``-W error::pgregistry.ProcessGroupFallbackWarning`` imports the package at
interpreter start.
"""

from __future__ import annotations

import re
import sys
import threading
import warnings

from pgregistry._runtime.warning_options import apply_command_line_filters

__all__ = ["ProcessGroupFallbackWarning", "warn_fallback"]


class ProcessGroupFallbackWarning(UserWarning):
    """Code read the global process-group grid because it was not given a group explicitly.

    Turn it into an error to find every such read: ``python -W
    error::pgregistry.ProcessGroupFallbackWarning``. Importing :mod:`pgregistry` does not import
    torch, so the filter works from the command line.

    Example:
        On every rank of a 2-rank world (as :func:`pgregistry.testing.run_world` starts it):

        >>> import warnings
        >>> import torch
        >>> import pgregistry
        >>> from pgregistry.global_grid import initialize_global_grid
        >>> _ = initialize_global_grid(pgregistry.ParallelLayout(num_ranks=2))
        >>> model = torch.nn.Linear(2, 1)
        >>> model(torch.ones(1, 2)).sum().backward()
        >>> warnings.simplefilter("error", pgregistry.ProcessGroupFallbackWarning)
        >>> pgregistry.clip_grad_norm_(model.parameters(), 1.0)  # none given or attached: raises
        Traceback (most recent call last):
        pgregistry.fallback.ProcessGroupFallbackWarning: clip_grad_norm_ was not given ...
    """


apply_command_line_filters(ProcessGroupFallbackWarning)

_warned: set[tuple[str, str]] = set()
_warned_lock = threading.Lock()


def _forget_fallback_warnings() -> None:
    """Forget which ``(owner, argument)`` pairs have warned, so each warns again once.

    The test suite's fixture calls it.
    """
    with _warned_lock:
        _warned.clear()


def warn_fallback(owner: str, argument: str) -> None:
    """Warn that ``owner`` read ``argument`` from the global grid instead of being given it.

    The warning is attributed to the first calling frame outside pgregistry.

    Args:
        owner: the function that read, named in the message.
        argument: a group name, or ``"pg_collection"`` for the whole collection.

    Raises:
        ProcessGroupFallbackWarning: under ``-W error::pgregistry.ProcessGroupFallbackWarning``.
        TypeError: ``owner`` or ``argument`` is no string (a list failed as unhashable only under
            default filters; ``None`` was printed as the owner).

    Example:
        >>> import warnings
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     warn_fallback("my_norm", "tp")
        >>> print(caught[0].message)
        my_norm was not given process group 'tp' and falls back to the global grid; pass a ...
    """
    for name, value, meaning in (
        ("owner", owner, "the entry point's name"),
        ("argument", argument, "a group name, or 'pg_collection'"),
    ):
        if not isinstance(value, str) or not value:
            raise TypeError(
                f"warn_fallback's {name} must be a non-empty str ({meaning}), got {value!r} "
                f"({type(value).__name__})"
            )
    if argument == "pg_collection":
        message = (
            f"{owner} was not given a ProcessGroupCollection (nor a model with "
            "one attached) and falls back to the global grid; pass pg_collection "
            "explicitly or attach it to the model (pgregistry.attach)"
        )
    else:
        message = (
            f"{owner} was not given process group {argument!r} and falls back to the global "
            "grid; pass a ProcessGroupCollection that sets it (None when the axis is off)"
        )
    stacklevel, module, lineno = _first_frame_outside_pgregistry()
    action = _filter_action(message, ProcessGroupFallbackWarning, module, lineno)
    if action == "ignore":
        return
    if action not in ("error", "always"):
        key = (owner, argument)
        with _warned_lock:
            if key in _warned:
                return
            _warned.add(key)
    warnings.warn(message, ProcessGroupFallbackWarning, stacklevel=stacklevel)


def _first_frame_outside_pgregistry() -> tuple[int, str, int]:
    """``(stacklevel for warnings.warn called from warn_fallback, its frame's module, line)``."""
    frame = sys._getframe(2)  # the caller of warn_fallback
    level = 2
    while frame is not None:
        module = str(frame.f_globals.get("__name__", "<string>"))
        if module != "pgregistry" and not module.startswith("pgregistry."):
            return level, module, frame.f_lineno
        frame = frame.f_back  # type: ignore[assignment]
        level += 1
    return level, "sys", 0  # warnings.warn attributes a level beyond the stack to "sys"


def _filter_action(message: str, category: type[Warning], module: str, lineno: int) -> str:
    """The action the active warning filters take, matched as in :func:`warnings.warn_explicit`."""
    for action, msg, cat, mod, line in warnings.filters:
        if (
            (msg is None or _pattern_matches(msg, message))
            and issubclass(category, cat)
            and (mod is None or _pattern_matches(mod, module))
            and (line == 0 or line == lineno)
        ):
            return str(action)
    return str(getattr(warnings, "defaultaction", "default"))


def _pattern_matches(pattern: re.Pattern[str] | str, text: str) -> bool:
    if isinstance(pattern, str):
        return re.match(pattern, text) is not None
    return pattern.match(text) is not None

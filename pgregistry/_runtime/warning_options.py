"""``-W`` / ``PYTHONWARNINGS`` options naming ``ProcessGroupFallbackWarning``, honoured.

The warning is :class:`~pgregistry.fallback.ProcessGroupFallbackWarning`.

Python processes those options before ``site`` puts site-packages on ``sys.path``, so for an
installed pgregistry it prints "Invalid -W option ignored: invalid module name: 'pgregistry'" and
drops the filter: ``python -W error::pgregistry.ProcessGroupFallbackWarning`` would silently not
raise. The options from the first one naming this category onward are parsed here as Python parses
them and re-applied (at import of :mod:`pgregistry.fallback`, and by the pytest plugin inside
pytest), so later options keep their precedence. An option naming a ``pgregistry`` category that
does not exist is an error naming the closest one: Python's own notice is the same for a misspelling
as for a correct name, so a migration run with a typo would pass.

The category without its module (``-W error::ProcessGroupFallbackWarning``) is looked up among the
builtins only, so Python prints "unknown warning category" and a fallback is not an error. What was
meant is plain: the option is applied as if spelled ``pgregistry.ProcessGroupFallbackWarning``, and
one line on stderr (next to Python's notice, which says the option was ignored) gives the spelling
that works without pgregistry's help. A bare name close to the category's but not it
(``ProcessGroupFalbackWarning``) is the misspelling error above.

Imports no torch: ``-W error::pgregistry.ProcessGroupFallbackWarning`` imports the package at
interpreter start.
"""

from __future__ import annotations

import difflib
import re
import sys
import warnings
from typing import Final, NamedTuple

__all__ = ["CommandLineFilter", "apply_command_line_filters", "command_line_filters"]

_ACTIONS: Final = ("default", "always", "ignore", "module", "once", "error")


class CommandLineFilter(NamedTuple):
    """One ``-W``/``PYTHONWARNINGS`` option, parsed as Python parses it.

    ``message`` and ``module`` are literal.
    """

    action: str
    message: str
    category: type[Warning]
    category_name: str
    module: str
    lineno: int
    unqualified: str = ""
    """The option as given when it named the category without its module.

    ``category_name`` is then qualified.
    """

    @property
    def message_pattern(self) -> str:
        """``message`` as the regex :func:`warnings.filterwarnings` takes (a literal prefix)."""
        return re.escape(self.message)

    @property
    def module_pattern(self) -> str:
        """``module`` as the regex :func:`warnings.filterwarnings` takes (the whole name)."""
        return re.escape(self.module) + r"\Z" if self.module else ""

    def apply(self) -> None:
        """Insert this filter first in :data:`warnings.filters`, as Python does for ``-W``."""
        warnings.filterwarnings(
            # One of the literals, checked by command_line_filters.
            self.action,  # type: ignore[arg-type]
            self.message_pattern,
            self.category,
            self.module_pattern,
            self.lineno,
        )


def command_line_filters(category: type[Warning]) -> list[CommandLineFilter]:
    """The options from the first naming ``category`` (a pgregistry category) on; empty if none.

    Those naming a category of another module, not a builtin, and those Python rejects as malformed
    are left out. ``ValueError`` naming the closest existing spelling for an option that names a
    pgregistry category which does not exist.
    """
    ours = _category_spellings(category)
    options = [option.split(":") for option in sys.warnoptions]
    for fields in options:
        _check_spelling(fields[2].strip() if len(fields) > 2 else "", ours, category.__name__)
    first = next(
        (i for i, fields in enumerate(options) if len(fields) > 2 and fields[2].strip() in ours),
        None,
    )
    if first is None:
        return []
    parsed = []
    for option, fields in zip(sys.warnoptions[first:], options[first:], strict=True):
        action, message, category_name, module, lineno = (
            *(f.strip() for f in fields),
            "",
            "",
            "",
            "",
        )[:5]
        action = "always" if action == "all" else action
        actions = [a for a in _ACTIONS if a.startswith(action)]
        found = category if category_name in ours else _builtin_warning(category_name)
        if len(fields) > 5 or not actions or found is None or not (lineno or "0").isdigit():
            continue  # Python rejected this option at start-up too
        name = category_name if found is category else found.__name__
        unqualified = option if name == category.__name__ else ""
        name = f"pgregistry.{name}" if unqualified else name
        parsed.append(
            CommandLineFilter(
                actions[0], message, found, name, module, int(lineno or 0), unqualified
            )
        )
    return parsed


def _category_spellings(category: type[Warning]) -> set[str]:
    """The names an option may give ``category`` by.

    Its module's, the package root's, and the bare class name.
    """
    return {
        f"{category.__module__}.{category.__name__}",
        f"pgregistry.{category.__name__}",
        category.__name__,
    }


def _check_spelling(category_name: str, ours: set[str], bare: str) -> None:
    if category_name in ours:
        return
    if not category_name.startswith("pgregistry."):
        # A bare name Python does not know either (a builtin is never this close to ours): a typo of
        # the bare form.
        if "." in category_name or _builtin_warning(category_name) is not None:
            return
        if not difflib.get_close_matches(category_name, [bare], n=1, cutoff=0.8):
            return
    close = difflib.get_close_matches(category_name, sorted(ours - {bare}), n=1, cutoff=0.0)
    raise ValueError(
        f"the -W / PYTHONWARNINGS option naming {category_name!r} names no "
        f"pgregistry warning category; did you mean {close[0]!r}? (Python ignores "
        "such an option with a generic notice, so the filter would not apply)"
    )


def _builtin_warning(name: str) -> type[Warning] | None:
    import builtins

    found = getattr(builtins, name, None) if name else Warning
    return found if isinstance(found, type) and issubclass(found, Warning) else None


def apply_command_line_filters(category: type[Warning]) -> None:
    """Re-apply the options naming ``category`` (see the module docstring).

    One line on stderr for each option that names it without its module, giving the spelling to
    use."""
    for option in command_line_filters(category):
        option.apply()
        if option.unqualified:
            fields = option.unqualified.split(":")
            fields[2] = option.category_name
            print(
                f"pgregistry: the -W / PYTHONWARNINGS option {option.unqualified!r} "
                "names the category without its module (Python's notice above: it "
                f"ignored it); pgregistry applies it as {':'.join(fields)!r}: spell it so",
                file=sys.stderr,
            )

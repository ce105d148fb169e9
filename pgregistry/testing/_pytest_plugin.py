"""pytest plugin: a test that falls back fails.

As under ``python -W error::pgregistry.ProcessGroupFallbackWarning -m pytest``.

Python drops a ``-W``/``PYTHONWARNINGS`` option naming this category at start-up (site-packages is
not importable yet); :mod:`pgregistry.fallback` re-applies it when imported (and a misspelled
pgregistry category is an error, raised through this plugin at pytest's start). Under pytest that is
not enough: pytest runs collection and every test inside ``warnings.catch_warnings``, which starts
from the filters of the moment and throws away whatever was added inside, so a filter re-applied at
an import during collection is gone by the time a test runs, and a test that falls back passes with
"1 passed, 1 warning".

pytest rebuilds each of those contexts from its ``filterwarnings`` ini list and its own ``-W``
options, so this plugin puts the re-applied options at the *front* of the ini list: they then hold
in every test, with the lowest precedence of pytest's filters (the ini file, pytest's ``-W`` and
``@pytest.mark.filterwarnings`` still override them), the place the interpreter's own filters have.

Registered as a ``pytest11`` entry point, so it loads wherever pgregistry is installed; with plugin
autoloading off (``PYTEST_DISABLE_PLUGIN_AUTOLOAD``) load it with ``-p
pgregistry.testing._pytest_plugin``. Imports no torch.
"""

from __future__ import annotations

import pytest

from pgregistry._runtime.warning_options import CommandLineFilter, command_line_filters
from pgregistry.fallback import ProcessGroupFallbackWarning

__all__ = ["pytest_configure"]


def pytest_configure(config: pytest.Config) -> None:
    """Prepend the interpreter's ProcessGroupFallbackWarning options to ``filterwarnings``."""
    lines = [_as_ini_line(option) for option in command_line_filters(ProcessGroupFallbackWarning)]
    if lines:
        # getini returns the cached list that every later warnings context is built from (pytest's
        # own addinivalue_line appends to it the same way); the front is the lowest precedence.
        config.getini("filterwarnings")[:0] = lines


def _as_ini_line(option: CommandLineFilter) -> str:
    """``option`` in the ini syntax.

    There message and module are regular expressions (Python's are literal).
    """
    return (
        f"{option.action}:{option.message_pattern}:{option.category_name}:"
        f"{option.module_pattern}:{option.lineno}"
    )

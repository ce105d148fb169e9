"""The docstring examples that need no process group or device run and print what they show.

A docstring example is documentation a reader copies: one that went stale would teach a wrong rank
set. Each module listed here must hold at least one example, so a module whose examples were all
dropped fails too. The examples of these modules are plain arithmetic (``pgregistry.rng`` imports
torch, but its seed plans are arithmetic over a layout; ``pgregistry.audit``'s reports are plain
records; ``pgregistry.params`` marks a tensor made in the example), checks of a caller's argument
(``pgregistry.mesh``, ``pgregistry.testing``), names or lookups on small models and collections
assembled by hand (``pgregistry.attachments``, the grad statistics' groups and filters, the
collection ``pgregistry.doors`` is given), a warning caught (``pgregistry.fallback``) or this
process's state (``pgregistry.recovery``'s generation); the examples that need a world are code
blocks (``Example::``), not doctests.
"""

from __future__ import annotations

import doctest
import importlib
import io

import pytest

MODULES_WITH_EXAMPLES = (
    "pgregistry.attachments",
    "pgregistry.audit",
    "pgregistry.collection",
    "pgregistry.doors",
    "pgregistry.experts._keys",
    "pgregistry.experts._names",
    "pgregistry.fallback",
    "pgregistry.grad_stats._filters",
    "pgregistry.layout",
    "pgregistry.mesh",
    "pgregistry.params",
    "pgregistry.placement",
    "pgregistry.recovery",
    "pgregistry.rng",
    "pgregistry.testing",
)


@pytest.mark.parametrize("name", MODULES_WITH_EXAMPLES)
def test_the_docstring_examples_print_what_they_show(name: str) -> None:
    module = importlib.import_module(name)
    report = io.StringIO()
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    tests = [test for test in doctest.DocTestFinder().find(module) if test.examples]
    assert tests, f"{name} has no docstring example"
    for test in tests:
        runner.run(test, out=report.write)
    assert runner.failures == 0, report.getvalue()

"""Fixtures shared by every test directory. Keep this small: only what any test of the package may need."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from hypothesis import settings

from pgregistry.fallback import _forget_fallback_warnings as forget_fallback_warnings

# The same examples on every run, in CI and locally: a property test that fails once fails again (no example
# database either: what a previous run saved would make the next one differ). HYPOTHESIS_PROFILE=explore draws
# new examples on each run, to search further on purpose.
settings.register_profile("repeatable", derandomize=True, database=None)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "repeatable"))


@pytest.fixture(autouse=True)
def _fresh_fallback_warnings() -> Iterator[None]:
    """Each test starts with no ``(owner, argument)`` marked as warned, so "warns once" is per test."""
    forget_fallback_warnings()
    yield
    forget_fallback_warnings()


@pytest.fixture(scope="session", autouse=True)
def _compiled_checks_built() -> None:
    """Build pgregistry's compiled checks once, before the first test's body (``pgregistry/grad_stats/_compiled.py``).

    A first build takes about 25 s (longer on a loaded machine): made inside a test's world, it would eat that world's
    deadline. ``PGREGISTRY_COMPILED_CHECKS`` decides as it does for users (``make test`` sets ``required``: the suite
    runs the checks users get). A build that fails there, or answers its probe wrongly, fails every test, by name."""
    from pgregistry.grad_stats._compiled import steady_checks

    steady_checks()

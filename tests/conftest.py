"""Fixtures shared by every test directory. Keep this small: only what any test of the package may need."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from pgregistry.fallback import _forget_fallback_warnings as forget_fallback_warnings


@pytest.fixture(autouse=True)
def _fresh_fallback_warnings() -> Iterator[None]:
    """Each test starts with no ``(owner, argument)`` marked as warned, so "warns once" is per test."""
    forget_fallback_warnings()
    yield
    forget_fallback_warnings()

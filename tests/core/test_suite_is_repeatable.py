"""The suite runs the same way every time: hypothesis draws the same examples.

Before: hypothesis drew new examples on every CI run (a failure seen once might never come back).
"""

from __future__ import annotations

import os

import pytest
from hypothesis import settings


def test_hypothesis_draws_the_same_examples_on_every_run() -> None:
    if os.environ.get("HYPOTHESIS_PROFILE", "repeatable") != "repeatable":
        pytest.skip("another hypothesis profile was asked for (HYPOTHESIS_PROFILE)")
    assert settings.default.derandomize and settings.default.database is None

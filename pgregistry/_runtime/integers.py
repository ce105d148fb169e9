"""Counts, ranks and indices given to the public API: integers of any type, never bools or floats.

A count is positive (``positive_int``), a rank or offset 0 or more (``non_negative_int``).

``place(layout, np.int64(8))`` was refused as "gpus_per_node must be a positive integer, got
np.int64(8)", which it is, while ``node_of(13, -8)`` answered node -2 and ``node_of(3.5, 2)`` node
1.0. Torch-free.
"""

from __future__ import annotations

import operator
from typing import SupportsIndex

__all__ = ["as_integer", "non_negative_int", "plain_int", "positive_int"]


def plain_int(value: object) -> object:
    """An integer of any type (``np.int64``) as an int; anything else (a bool) as given.

    For a check that takes ``int`` alone, or a value agreed over ranks by its ``repr``. A value
    whose ``__index__`` refuses it (a float tensor: "only integer tensors of a single element can
    be converted to an index", naming no argument) is given back too, for the check to name."""
    if isinstance(value, SupportsIndex) and not isinstance(value, bool | int):
        try:
            return operator.index(value)
        except TypeError:
            return value
    return value


def as_integer(value: object) -> int | None:
    """``value`` as an int when it is an integer of any type (``np.int64``), else ``None``.

    ``None`` for a bool or a float, so a check names the argument with its own message."""
    if isinstance(value, bool) or not isinstance(value, SupportsIndex):
        return None
    try:
        return operator.index(value)
    except TypeError:  # a float tensor says it has an index and then refuses it
        return None


def positive_int(value: object, name: str) -> int:
    """``value`` as an int when it is an integer of any type above 0, else ``ValueError``."""
    number = as_integer(value)
    if number is None or number < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return number


def non_negative_int(value: object, name: str) -> int:
    """``value`` as an int when it is an integer of any type, 0 or more, else ``ValueError``."""
    number = as_integer(value)
    if number is None or number < 0:
        raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
    return number

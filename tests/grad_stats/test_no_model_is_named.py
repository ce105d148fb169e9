"""An entry point given no model, chunks, mapping, tensor or iterable of them names what it takes.

Found by a hostile-input audit: ``grad_norm(None, pg)``, ``count_zeros(5, pg)``, ``clip_grad_norm_(None, 1.0, pg)``
and ``named_global_parameters(None)`` raised Python's ``TypeError: 'NoneType' object is not iterable`` from the door
(``pgregistry._runtime.resolve.source_of``), naming neither the argument nor what it may be. Refused there, before
any collective.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest

from pgregistry.collection import FIELD_NAMES, ProcessGroupCollection
from pgregistry.experts import named_global_parameters
from pgregistry.grad_stats import clip_grad_norm_, count_zeros, grad_norm

ONE_RANK = ProcessGroupCollection(**dict.fromkeys(FIELD_NAMES))

CALLS: dict[str, Callable[[object], object]] = {
    "grad_norm": lambda given: grad_norm(given, ONE_RANK),  # type: ignore[arg-type]
    "count_zeros": lambda given: count_zeros(given, ONE_RANK),  # type: ignore[arg-type]
    "clip_grad_norm_": lambda given: clip_grad_norm_(given, 1.0, ONE_RANK),  # type: ignore[arg-type]
    "named_global_parameters": lambda given: named_global_parameters(given, pg_collection=ONE_RANK),  # type: ignore[arg-type]
}


@pytest.mark.parametrize("given", [None, 5, 1.5])
@pytest.mark.parametrize("call", CALLS.values(), ids=list(CALLS))
def test_a_value_that_is_no_model_or_parameters_is_named(call: Callable[[object], object], given: object) -> None:
    with pytest.raises(TypeError, match=re.escape(f"expected a model, model chunks, a name -> parameter mapping, a "
                                                  f"tensor or an iterable of tensors, got {given!r} "
                                                  f"({type(given).__name__})")):
        call(given)

"""``check_config`` and the keyword helpers given hostile but plausible arguments (one process, no world).

``check_config(config_dict, pg)`` (or ``None``) passed: a dict has none of the size attributes, and a collection
whose groups were of one rank matched every missing one, so ``{"tensor_model_parallel_size": 4}`` against TP 1 said
nothing; a collection given as ``None`` or a layout raised ``vars() argument must have __dict__ attribute``; a size
given as the string ``'1'`` was reported as ``= 1 but ... has 1 ranks``; ``megatron_config_kwargs(None)`` raised
``AttributeError``."""

from __future__ import annotations

import types

import pytest
from megatron_support import require_megatron

require_megatron()

from pgregistry import ParallelLayout, ProcessGroupCollection  # noqa: E402
from pgregistry.collection import FIELD_NAMES  # noqa: E402
from pgregistry.interop.megatron import (  # noqa: E402
    check_config,
    megatron_config_kwargs,
    megatron_initialize_kwargs,
)

ALL_OFF = ProcessGroupCollection(**dict.fromkeys(FIELD_NAMES))


def test_a_config_without_sizes_or_a_collection_of_neither_package_is_refused() -> None:
    for config in ({"tensor_model_parallel_size": 4}, None):
        with pytest.raises(TypeError, match=r"config has none of TransformerConfig's parallel sizes \(got a "):
            check_config(config, ALL_OFF)
    sizes = types.SimpleNamespace(**megatron_config_kwargs(ParallelLayout(num_ranks=1)))
    for collection in (None, ParallelLayout(num_ranks=1)):
        with pytest.raises(TypeError, match="check_config takes pgregistry's or Megatron-Core's ProcessGroup"):
            check_config(sizes, collection)
    check_config(sizes, ALL_OFF)  # one rank everywhere: agrees


def test_a_size_that_is_no_integer_is_quoted_as_given() -> None:
    with pytest.raises(ValueError, match=r"config.tensor_model_parallel_size = '1' but the collection's 'tp' group"):
        check_config(types.SimpleNamespace(tensor_model_parallel_size="1"), ALL_OFF)


@pytest.mark.parametrize("helper", [megatron_config_kwargs, megatron_initialize_kwargs])
def test_the_keyword_helpers_name_a_layout_of_another_type(helper: object) -> None:
    with pytest.raises(TypeError, match="layout must be a pgregistry.layout.ParallelLayout .* got dict"):
        helper({"num_ranks": 8, "tp": 2})  # type: ignore[operator]

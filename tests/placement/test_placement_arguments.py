"""``node_of`` and ``place`` given hostile but plausible arguments.

``node_of(13, -8)`` answered node -2, ``node_of(-1, 8)`` node -1, ``node_of(3.5, 2)`` node 1.0 and ``node_of(13, 0)``
raised ``ZeroDivisionError``; ``place`` refused ``np.int64(8)`` GPUs per node as no positive integer, read
``intra_node_kinds="tp"`` as the kinds ``'t'`` and ``'p'``, and failed with ``AttributeError`` given no layout."""

from __future__ import annotations

import numpy as np
import pytest

from pgregistry.layout import ParallelLayout
from pgregistry.placement import node_of, place


@pytest.mark.parametrize(
    "rank,gpus,name",
    [(13, -8, "gpus_per_node"), (13, 0, "gpus_per_node"), (-1, 8, "rank"), (3.5, 2, "rank"), (True, 1, "rank")],
    ids=["negative-gpus", "zero-gpus", "negative-rank", "float-rank", "bool-rank"],
)
def test_node_of_refuses_what_is_no_rank_or_node_size_instead_of_answering_a_node(
    rank: object, gpus: object, name: str
) -> None:
    given = rank if name == "rank" else gpus
    with pytest.raises(ValueError, match=rf"{name} must be a (positive|non-negative) integer, got {given}"):
        node_of(rank, gpus)  # type: ignore[arg-type]


def test_node_of_and_place_take_integers_of_any_type() -> None:
    assert node_of(np.int64(13), np.int32(8)) == 1
    layout = ParallelLayout(num_ranks=16, tp=2, order="dp-tp-cp-ep-pp")
    assert place(layout, np.int64(8), world_size=np.int64(16)) == place(layout, 8, world_size=16)


def test_place_names_intra_node_kinds_given_as_a_str_and_a_layout_of_another_type() -> None:
    layout = ParallelLayout(num_ranks=8, tp=2)
    kinds = r"intra_node_kinds must be a sequence of group kinds, got the str 'tp': pass \('tp',\)"
    with pytest.raises(TypeError, match=kinds):
        place(layout, 4, "tp")
    with pytest.raises(TypeError, match="layout must be a pgregistry.layout.ParallelLayout .* got dict"):
        place({"num_ranks": 8, "tp": 2}, 4)  # type: ignore[arg-type]

"""``pgregistry.doors``: what ``pgregistry migrate --target pgregistry``'s rewritten reads call, in a 4-rank gloo
world: the collection's field when it sets it, else pgregistry's global grid with the warning naming the reader.

Oracles: the global grid's and a second build's own groups and their ranks, read from the collections directly."""

from __future__ import annotations

import re
import warnings
from typing import Any

from pgregistry import registry
from pgregistry.collection import UNSET
from pgregistry.doors import pg_group, pg_rank, pg_read, pg_size
from pgregistry.fallback import ProcessGroupFallbackWarning
from pgregistry.global_grid import initialize_global_grid
from pgregistry.layout import ParallelLayout
from pgregistry.testing import run_world


def _reads(collection: Any) -> tuple[Any, ...]:
    """A function that reads through the doors (the warning names it)."""
    return (pg_group(collection, "tp"), pg_rank(collection, "tp"), pg_size(collection, "dp"),
            pg_read(collection, "tp", "global_ranks"), pg_read(collection, "pp", "last_stage"),
            pg_size(collection, "dp_gtp_remat"))


def _warned(caught: list[warnings.WarningMessage]) -> list[str]:
    """``owner: what it was not given`` of each fallback warning."""
    found = (re.match(r"(\S+) was not given (a ProcessGroupCollection|process group '\w+')", str(w.message))
             for w in caught if issubclass(w.category, ProcessGroupFallbackWarning))
    return sorted({f"{match.group(1)}: {match.group(2)}" for match in found if match is not None})


def _rank() -> dict[str, Any]:
    import torch.distributed as dist

    grid = initialize_global_grid(ParallelLayout(num_ranks=4, tp=2))
    other = registry.build(ParallelLayout(num_ranks=4, tp=4), name="second")
    out: dict[str, Any] = {"rank": dist.get_rank(), "tp": tuple(dist.get_process_group_ranks(grid.tp))}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ProcessGroupFallbackWarning)
        none = _reads(None)
        out["none warned"] = _warned(caught)
    out["none is the grid"] = none[0] is grid.tp and none[1:] == (grid.tp.rank(), 2, list(out["tp"]), True, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ProcessGroupFallbackWarning)  # a collection that sets them: no fallback
        given = _reads(other)
    out["other"] = (given[0] is other.tp, given[1], given[3])
    unset = grid.evolve(tp=UNSET)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ProcessGroupFallbackWarning)
        filled = _reads(unset)
        out["unset warned"] = _warned(caught)
    out["unset reads the grid's"] = filled[0] is grid.tp
    return out


def test_the_doors_read_the_collections_field_else_the_global_grid_with_the_warning() -> None:
    for out in run_world(4, _rank, timeout=60):
        owner = f"{__name__}._reads"
        assert out["none is the grid"], out
        assert out["none warned"] == [f"{owner}: a ProcessGroupCollection"]
        # the second build's groups, not the global grid's: TP spans all four ranks there
        assert out["other"] == (True, out["rank"], [0, 1, 2, 3])
        assert out["unset reads the grid's"]
        assert out["unset warned"] == [f"{owner}: process group 'tp'"]

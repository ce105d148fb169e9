"""Megatron-LM pull request 8042: a collection that turns TP or GTP off (None) next to a global grid that has them on.

The model runs data-parallel over 4 ranks (its collection has tp = gtp_remat = None) while the global grid is TP2 x
GTP2. With the collection, None means "axis off": every rank counts its replicated grads and the norm is exact,
equal to the same model's on a standard grid (global grid = the model's layout). Reading the global rank instead
(Megatron-Core's behaviour before that change, reproduced here through the fallback) drops the grads of TP/GTP rank
1. Omitted groups warn ProcessGroupFallbackWarning once under default filters, and raise every time under ``error``.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch

from pgregistry import ProcessGroupCollection, registry
from pgregistry._runtime.resolve import resolve_pg_collection
from pgregistry.collection import UNSET, group_rank
from pgregistry.fallback import ProcessGroupFallbackWarning
from pgregistry.fallback import _forget_fallback_warnings as forget_fallback_warnings
from pgregistry.global_grid import global_collection, initialize_global_grid
from pgregistry.grad_stats import (
    StatsGroups,
    grad_norm,
    is_counted,
    norm_of_grads,
    param_is_not_gtp_duplicate,
    param_is_not_tensor_parallel_duplicate,
)
from pgregistry.grad_stats._filters import STATS_FALLBACK
from pgregistry.layout import ParallelLayout
from pgregistry.params import mark_expert
from pgregistry.testing import run_world

WORLD = 4
GLOBAL = ParallelLayout(num_ranks=WORLD, tp=2, gtp_remat=2)
MODEL = ParallelLayout(num_ranks=WORLD)
DENSE_GRAD = [1.0, 2.0, 2.0]
EXPERT_GRAD = [4.0, 0.0, 0.0, 0.0]
ORACLE = math.sqrt(sum(x * x for x in DENSE_GRAD + EXPERT_GRAD))


def _params() -> list[torch.nn.Parameter]:
    dense = torch.nn.Parameter(torch.zeros(3))
    expert = mark_expert(torch.nn.Parameter(torch.zeros(4)))
    dense.grad = torch.tensor(DENSE_GRAD)
    expert.grad = torch.tensor(EXPERT_GRAD)
    return [dense, expert]


def _fallback_warnings(call: Callable[[], Any]) -> tuple[Any, int]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        result = call()
    return result, sum(issubclass(w.category, ProcessGroupFallbackWarning) for w in caught)


def _raises_every_time(call: Callable[[], Any], times: int = 2) -> int:
    raised = 0
    with warnings.catch_warnings():
        warnings.simplefilter("error", ProcessGroupFallbackWarning)
        for _ in range(times):
            try:
                call()
            except ProcessGroupFallbackWarning:
                raised += 1
    return raised


def _by_hand(collection: ProcessGroupCollection, **changes: Any) -> ProcessGroupCollection:
    """``collection``'s groups with ``changes``, assembled by hand: no layout to hold them to."""
    return ProcessGroupCollection(**{**dict(collection.items()), **changes})


def _stats_groups(collection: ProcessGroupCollection) -> StatsGroups:
    """The statistics' groups of ``collection`` as an entry point's door resolves them."""
    collection = resolve_pg_collection(collection, owner="grad statistics", fallback=STATS_FALLBACK)
    return StatsGroups.from_collection(collection)


def _on_rank() -> dict[str, Any]:
    forget_fallback_warnings()
    grid = initialize_global_grid(GLOBAL)
    model = registry.build(MODEL, name="model")
    dense, expert = params = _params()
    out: dict[str, Any] = {"global_tp_rank": group_rank(grid.tp), "global_gtp_rank": group_rank(grid.gtp_remat)}
    out["model_norm"], out["model_warnings"] = _fallback_warnings(lambda: grad_norm(params, model).item())

    # The old reading of None: the global rank decides, so TP/GTP rank 1 drop the replicated dense grad.
    def global_rank_filters() -> float:
        kept = [p.grad for p in params if is_counted(p, StatsGroups.from_collection(global_collection()))]
        return norm_of_grads({None: kept}).item()

    out["global_rank_local_norm"], _ = _fallback_warnings(global_rank_filters)
    out["model_local_norm"] = norm_of_grads(
        {None: [p.grad for p in params if is_counted(p, StatsGroups.from_collection(model))]}
    ).item()

    # Omitted groups: read the global grid, warn once per (owner, argument), raise every time under `error`.
    forget_fallback_warnings()
    out["tp_filter"] = _fallback_warnings(lambda: [param_is_not_tensor_parallel_duplicate(dense) for _ in "ab"])
    out["gtp_filter"] = _fallback_warnings(lambda: [param_is_not_gtp_duplicate(dense) for _ in "ab"])
    out["no_collection_norm"] = _fallback_warnings(lambda: [grad_norm(params, None).item() for _ in "ab"])
    out["raises"] = [
        _raises_every_time(lambda: param_is_not_tensor_parallel_duplicate(dense)),
        _raises_every_time(lambda: param_is_not_tensor_parallel_duplicate(expert, ProcessGroupCollection(tp=None))),
        _raises_every_time(lambda: param_is_not_gtp_duplicate(dense)),
        _raises_every_time(lambda: grad_norm(params, None)),
        _raises_every_time(lambda: _stats_groups(_by_hand(grid, gtp_remat=UNSET))),
    ]
    forget_fallback_warnings()
    groups, out["unset_gtp_warnings"] = _fallback_warnings(lambda: _stats_groups(_by_hand(grid, gtp_remat=UNSET)))
    out["unset_gtp_is_global"] = groups.gtp_remat is grid.gtp_remat
    # UNSET means "not given" for expt_tp as for every field: the global grid's, with a warning; never "tp".
    groups, out["unset_expt_tp_warnings"] = _fallback_warnings(lambda: _stats_groups(_by_hand(grid, expt_tp=UNSET)))
    out["unset_expt_tp_is_global"] = groups.expt_tp is grid.expt_tp
    stats = StatsGroups.from_collection(model)
    out["attached"] = stats.tp is None and stats.gtp_remat is None and stats.collection is model
    try:
        StatsGroups.from_collection(_by_hand(model, tp=UNSET))
        out["unset_tp"] = "no error"
    except ValueError as exc:
        out["unset_tp"] = str(exc)
    # The collection's own mp (None: one rank) fixes GTP off: the global grid's 2-rank GTP group, which would
    # contradict it, is never read.
    groups, warned = _fallback_warnings(lambda: _stats_groups(model.evolve(gtp_remat=UNSET)))
    out["composite_fixes_gtp"] = (groups.gtp_remat, warned)

    # The same model on a standard grid (the global grid is the model's own layout) gives the same norm.
    registry.destroy()
    standard = initialize_global_grid(MODEL)
    out["standard_norm"] = grad_norm(params, standard).item()
    return out


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_world(WORLD, _on_rank)


def test_axis_off_in_the_collection_counts_every_rank(results: list[dict[str, Any]]) -> None:
    for rank, got in enumerate(results):
        assert got["model_norm"] == pytest.approx(ORACLE, rel=1e-6), rank
        assert got["standard_norm"] == pytest.approx(got["model_norm"], rel=1e-7), rank
        assert got["model_local_norm"] == pytest.approx(ORACLE, rel=1e-6), rank
        assert got["model_warnings"] == 0, rank
        assert got["attached"], rank


def test_reading_the_global_rank_would_undercount(results: list[dict[str, Any]]) -> None:
    """The counterfactual the collection avoids: on global TP or GTP rank 1 the dense grad is dropped."""
    undercounted = 0
    for got in results:
        if got["global_tp_rank"] or got["global_gtp_rank"]:
            assert got["global_rank_local_norm"] < got["model_local_norm"]
            undercounted += 1
    assert undercounted == 3


def test_omitted_groups_read_the_global_grid_and_warn_once(results: list[dict[str, Any]]) -> None:
    for got in results:
        counted, warned = got["tp_filter"]
        assert counted == [got["global_tp_rank"] == 0] * 2 and warned == 1
        counted, warned = got["gtp_filter"]
        assert counted == [got["global_gtp_rank"] == 0] * 2 and warned == 1
        norms, warned = got["no_collection_norm"]
        assert norms == pytest.approx([ORACLE] * 2, rel=1e-6) and warned >= 1
        assert got["unset_gtp_is_global"] and got["unset_gtp_warnings"] == 1
        assert got["unset_expt_tp_is_global"] and got["unset_expt_tp_warnings"] == 1


def test_omitted_groups_raise_every_time_under_an_error_filter(results: list[dict[str, Any]]) -> None:
    for got in results:
        assert got["raises"] == [2, 2, 2, 2, 2]


def test_collection_groups_are_required_or_defaulted(results: list[dict[str, Any]]) -> None:
    for got in results:
        assert "'tp'" in got["unset_tp"] and "not set" in got["unset_tp"]
        assert got["composite_fixes_gtp"] == (None, 0)

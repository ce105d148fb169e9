"""setup_process_groups_for_optimizer: validation messages, their order, defaults and the global fallback."""

from __future__ import annotations

import types
import warnings
from typing import Any

import pytest
from torch import nn

from pgregistry import registry
from pgregistry.collection import UNSET, ProcessGroupCollection
from pgregistry.fallback import ProcessGroupFallbackWarning
from pgregistry.fallback import _forget_fallback_warnings as forget_fallback_warnings
from pgregistry.global_grid import initialize_global_grid
from pgregistry.layout import ParallelLayout
from pgregistry.optim._setup import OptimizerProcessGroups, setup_process_groups_for_optimizer
from pgregistry.testing import run_world

STATS_OFF = dict.fromkeys(("tp", "ep", "expt_tp", "gtp_remat", "expt_gtp_remat"))
"""The grad-statistics groups an optimizer also needs, every axis off: set so the door reads no global grid."""


def _message(call: Any) -> str:
    try:
        call()
    except ValueError as exc:
        return str(exc)
    return "no error"


def _chunk(cp_size: int) -> nn.Module:
    chunk = nn.Linear(1, 1)
    chunk.config = types.SimpleNamespace(context_parallel_size=cp_size)  # type: ignore[assignment]
    return chunk


def test_optimizer_validation_order() -> None:
    """Each missing group is reported in Megatron-Core's order; providing it moves on to the next."""
    fields: dict[str, Any] = dict(STATS_OFF)
    seen: list[str] = []
    for name, value in (("dp", None), ("cp", None), ("expt_dp", None), ("intra_dist_opt", None), ("mp", None),
                        ("tp_ep_pp", None)):
        message = _message(
            lambda: setup_process_groups_for_optimizer(
                ProcessGroupCollection(**fields), use_distributed_optimizer=True
            )
        )
        seen.append(message.split(" ")[0])
        assert "not set in pg_collection" in message or "is required" in message, message
        fields[name] = value
    assert seen == ["dp", "dp_cp", "expt_dp", "intra_dist_opt", "mp", "tp_ep_pp"]
    groups = setup_process_groups_for_optimizer(ProcessGroupCollection(**fields), use_distributed_optimizer=True)
    assert isinstance(groups, OptimizerProcessGroups)
    assert groups.dp_cp is None and groups.intra_dist_opt is None and groups.stats.tp is None


def test_messages_say_how_to_fix() -> None:
    full = {"dp": None, "cp": None, "expt_dp": None, "mp": None, "tp_ep_pp": None, **STATS_OFF}
    message = _message(lambda: setup_process_groups_for_optimizer(ProcessGroupCollection(**full),
                                                                  use_distributed_optimizer=True))
    assert message.startswith("intra_dist_opt process group is required when use_distributed_optimizer=True")
    assert "shards its state" in message
    for name in ("expt_dp", "mp", "tp_ep_pp"):
        partial = ProcessGroupCollection(**{k: v for k, v in full.items() if k != name})
        message = _message(lambda c=partial: setup_process_groups_for_optimizer(c))
        assert message.startswith(f"{name} process group is required") and "None" in message


def test_intra_dist_opt_is_only_required_by_a_distributed_optimizer() -> None:
    collection = ProcessGroupCollection(dp=None, cp=None, expt_dp=None, mp=None, tp_ep_pp=None, **STATS_OFF)
    assert setup_process_groups_for_optimizer(collection).intra_dist_opt is UNSET


def test_dp_cp_defaults_to_dp_only_when_cp_is_known_off() -> None:
    base = {"dp": None, "expt_dp": None, "mp": None, "tp_ep_pp": None, **STATS_OFF}
    collection = ProcessGroupCollection(**base)
    assert setup_process_groups_for_optimizer(collection, [_chunk(1)]).dp_cp is None
    assert "size is 2" in _message(lambda: setup_process_groups_for_optimizer(collection, [_chunk(2)]))
    assert "size is unknown" in _message(lambda: setup_process_groups_for_optimizer(collection, [nn.Linear(1, 1)]))
    assert "size is unknown" in _message(lambda: setup_process_groups_for_optimizer(collection))


def _on_rank() -> dict[str, Any]:
    forget_fallback_warnings()
    out: dict[str, Any] = {}
    cp_collection = registry.build(ParallelLayout(num_ranks=4, cp=2, tp=2), name="cp")
    out["cp_unset_dp_cp"] = _message(
        lambda: setup_process_groups_for_optimizer(cp_collection.evolve(dp_cp=UNSET))
    )
    groups = setup_process_groups_for_optimizer(cp_collection, use_distributed_optimizer=True)
    out["from_collection"] = all(
        getattr(groups, name) is cp_collection.get(name)
        for name in ("dp", "dp_cp", "intra_dp_cp", "expt_dp", "intra_expt_dp", "mp", "tp_ep_pp", "intra_dist_opt")
    )
    dp_collection = registry.build(ParallelLayout(num_ranks=4), name="dp")
    out["instances"] = _message(
        lambda: setup_process_groups_for_optimizer(
            dp_collection.evolve(inter_dist_opt=dp_collection.dp, intra_dp_cp=UNSET, intra_expt_dp=UNSET)
        )
    )
    out["no_grid"] = ""
    with warnings.catch_warnings():
        # The fallback warns before it finds no grid; under an error filter (`-W error`) it would raise first.
        warnings.simplefilter("ignore", ProcessGroupFallbackWarning)
        try:
            setup_process_groups_for_optimizer()
        except RuntimeError as exc:
            out["no_grid"] = str(exc)

    forget_fallback_warnings()
    grid = initialize_global_grid(ParallelLayout(num_ranks=4, tp=2))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        groups = setup_process_groups_for_optimizer()
    out["fallback_warnings"] = sorted({str(w.message).split(" ")[0] for w in caught
                                       if issubclass(w.category, ProcessGroupFallbackWarning)})
    out["global_groups"] = (
        groups.mp is grid.mp and groups.dp is grid.dp and groups.intra_dp_cp is grid.intra_dp_cp
        and groups.stats.tp is grid.tp and groups.stats.dense_reduce is grid.mp
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error", ProcessGroupFallbackWarning)
        out["error_filter"] = 0
        for _ in range(2):
            try:
                setup_process_groups_for_optimizer()
            except ProcessGroupFallbackWarning:
                out["error_filter"] += 1
    return out


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_world(4, _on_rank)


def test_with_real_groups(results: list[dict[str, Any]]) -> None:
    for got in results:
        assert got["cp_unset_dp_cp"].startswith("dp_cp process group is required") and "size is 2" in got[
            "cp_unset_dp_cp"]
        assert got["from_collection"]
        assert "intra_dp_cp and intra_expt_dp" in got["instances"] and "4 distributed-optimizer" in got["instances"]


def test_without_a_collection_reads_the_global_grid_and_warns(results: list[dict[str, Any]]) -> None:
    for got in results:
        assert "no global grid is initialised" in got["no_grid"]
        assert got["fallback_warnings"] == ["setup_process_groups_for_optimizer"]
        assert got["global_groups"]
        assert got["error_filter"] == 2

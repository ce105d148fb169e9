"""pgregistry.interop.megatron against the real Megatron-Core: one set of communicators, and bad input refused.

Every check runs in one 4-rank gloo world (each check on every rank), so Megatron-Core is imported once and the
world started once.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from megatron_support import (
    error_of,
    megatron_fields,
    megatron_initialize,
    megatron_kwargs,
    require_megatron,
)

require_megatron()

from megatron.core.process_groups_config import ProcessGroupCollection as MegatronCollection  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

from pgregistry import registry  # noqa: E402
from pgregistry.collection import NOT_MEMBER, UNSET, ProcessGroupCollection  # noqa: E402
from pgregistry.interop.megatron import (  # noqa: E402
    NONE_MEANS_NOT_USED,
    check_config,
    from_megatron,
    megatron_config_kwargs,
    megatron_initialize_kwargs,
    seed_megatron_rng,
    to_megatron,
)
from pgregistry.layout import ParallelLayout  # noqa: E402
from pgregistry.testing import run_world  # noqa: E402

WORLD = 4
SIZES: dict[str, Any] = {"tp": 2, "ep": 2, "expt_tp": 1}


def _as_megatron_reads(mine: ProcessGroupCollection, name: str) -> Any:
    """What Megatron-Core must be handed for ``mine``'s field ``name``: its group; this rank's one-rank group where
    the axis is off (None) and Megatron-Core would read None as "the global group"; None for NOT_MEMBER or where
    None means "not used"; UNSET where unset."""
    if not mine.is_set(name):  # type: ignore[arg-type]  # a Megatron-Core field name
        return UNSET
    if not mine.is_member_of(name):  # type: ignore[arg-type]
        return None
    value = mine.get(name)  # type: ignore[call-overload]
    if value is None and name not in NONE_MEANS_NOT_USED:
        return mine.one_rank_group
    return value


def _same_communicators(mine: ProcessGroupCollection, theirs: Any) -> list[str]:
    """Fields whose communicator differs (by identity) between the two collections; presence must match too."""
    present = vars(theirs)
    wrong = []
    for name in megatron_fields():
        value = _as_megatron_reads(mine, name)
        if (value is UNSET) != (name not in present) or (value is not UNSET and value is not present[name]):
            wrong.append(name)
    return wrong


def _to_megatron_checks() -> dict[str, Any]:
    layout = ParallelLayout(num_ranks=WORLD, **SIZES)
    pg = registry.build(layout)
    created = registry.communicators_created()
    mc = to_megatron(pg)  # a default build: off axes go to Megatron-Core as the build's one-rank group
    partial = ProcessGroupCollection(tp=pg.get("tp"), dp=pg.get("dp"), embd=NOT_MEMBER)
    by_hand = ProcessGroupCollection(**dict(pg.items()))  # the same groups, but no one-rank group
    out = {
        "type": type(mc).__name__ == "ProcessGroupCollection" and isinstance(mc, MegatronCollection),
        "differs": _same_communicators(pg, mc),
        "round_trip": _same_communicators(from_megatron(mc), mc),
        "off_is_one_rank": [dist.get_process_group_ranks(mc.cp), dist.get_process_group_ranks(mc.expt_tp)],
        "created_by_to_megatron": registry.communicators_created() - created,
        "partial_present": sorted(vars(to_megatron(partial))),
        "partial_embd": vars(to_megatron(partial))["embd"],
        "none_refused": error_of(lambda: to_megatron(by_hand)),
        "not_a_collection": error_of(lambda: to_megatron(mc)),
    }
    registry.destroy()
    return out


def _from_megatron_checks() -> dict[str, Any]:
    with megatron_initialize(SIZES) as mc:
        pg = from_megatron(mc)
        before = registry.communicators_created()
        rebuilt = registry.build(ParallelLayout(num_ranks=WORLD, **SIZES))
        out = {
            "differs": _same_communicators(pg, mc),
            "back": _same_communicators(pg, to_megatron(pg)),
            # Megatron-Core has one communicator per kind, pgregistry one per rank set: each rebuilt group must be
            # one of Megatron-Core's with the same ranks, the first field's where several share them.
            "rebuilt_not_megatrons": [
                name for name, value in rebuilt.items()
                if isinstance(value, dist.ProcessGroup) and not any(value is g for g in vars(mc).values())
            ],
            "rebuilt_tp_is_megatrons_tp": rebuilt.get("tp") is mc.tp,
            "rebuilt_ranks": [
                name for name, value in rebuilt.items() if isinstance(value, dist.ProcessGroup)
                and dist.get_process_group_ranks(value) != dist.get_process_group_ranks(pg.get(name))
            ],
            "rebuilt_one_rank_is_megatrons": any(rebuilt.one_rank_group is g for g in vars(mc).values()),
            "created_by_rebuild": registry.communicators_created() - before,
            "unset_stays_unset": from_megatron(MegatronCollection(tp=mc.tp)).is_set("dp"),
            "none_refused": error_of(lambda: from_megatron(MegatronCollection(tp=None, dp=mc.dp))),
            "not_megatrons": error_of(lambda: from_megatron(pg)),
        }
        registry.destroy()
        # Megatron-Core still owns its groups: the registry forgot them without destroying them.
        out["still_usable"] = dist.get_world_size(mc.tp) == 2
    return out


def _config_checks() -> dict[str, str]:
    pg = registry.build(ParallelLayout(num_ranks=WORLD, **SIZES))
    base = {"num_layers": 2, "hidden_size": 8, "num_attention_heads": 2, "num_moe_experts": 4, "add_bias_linear": False}
    out = {
        "agrees": error_of(lambda: check_config(TransformerConfig(**base, tensor_model_parallel_size=2,
                                                                  expert_model_parallel_size=2,
                                                                  expert_tensor_parallel_size=1), pg)),
        "etp_default_is_tp": error_of(lambda: check_config(TransformerConfig(**base, tensor_model_parallel_size=2,
                                                                             expert_model_parallel_size=2), pg)),
        "megatrons_collection": error_of(lambda: check_config(TransformerConfig(**base, tensor_model_parallel_size=1,
                                                                                expert_model_parallel_size=2,
                                                                                expert_tensor_parallel_size=1),
                                                            to_megatron(pg))),
        "unset_group": error_of(lambda: check_config(TransformerConfig(**base, tensor_model_parallel_size=2),
                                                   ProcessGroupCollection(tp=pg.get("tp")))),
    }
    registry.destroy()
    return out


def _on_rank() -> dict[str, Any]:
    return {"to": _to_megatron_checks(), "from": _from_megatron_checks(), "config": _config_checks()}


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_world(WORLD, _on_rank, timeout=60)


def test_to_megatron_carries_the_same_communicators(results: list[dict[str, Any]]) -> None:
    for rank, result in enumerate(results):
        to = result["to"]
        assert to["type"], rank
        assert to["differs"] == [], rank
        assert to["round_trip"] == [], rank
        assert to["off_is_one_rank"] == [[rank], [rank]], rank
        assert to["created_by_to_megatron"] == 0, rank
        assert to["partial_present"] == ["dp", "embd", "tp"], rank  # UNSET stays absent; NOT_MEMBER is None
        assert to["partial_embd"] is None, rank


def test_to_megatron_refuses_none_it_cannot_stand_for(results: list[dict[str, Any]]) -> None:
    for result in results:
        message = result["to"]["none_refused"]
        assert message.startswith("ValueError: pg_collection field 'cp' is None (axis off)"), message
        assert "no one-rank group to stand for the axis" in message
        assert result["to"]["not_a_collection"].startswith("TypeError: to_megatron expects a pgregistry")


def test_from_megatron_adopts_megatrons_communicators(results: list[dict[str, Any]]) -> None:
    for rank, result in enumerate(results):
        frm = result["from"]
        assert frm["differs"] == [] and frm["back"] == [], rank
        # A later build of the same layout reuses Megatron-Core's communicators: no second set.
        assert frm["rebuilt_not_megatrons"] == [] and frm["rebuilt_ranks"] == [], rank
        assert frm["rebuilt_tp_is_megatrons_tp"] and frm["rebuilt_one_rank_is_megatrons"], rank
        assert frm["created_by_rebuild"] == 0, rank
        assert frm["unset_stays_unset"] is False, rank
        assert frm["none_refused"].startswith("ValueError: Megatron-Core collection field 'tp' is None"), rank
        assert frm["not_megatrons"].startswith("TypeError: from_megatron expects"), rank
        assert frm["still_usable"], rank


def test_check_config_refuses_sizes_that_disagree_with_the_groups(results: list[dict[str, Any]]) -> None:
    for result in results:
        config = result["config"]
        assert config["agrees"] == "no error"
        # Megatron-Core accepts expert_tensor_parallel_size defaulting to TP 2 next to a 1-rank expert-TP group.
        assert config["etp_default_is_tp"] == (
            "ValueError: the Megatron-Core config disagrees with the process groups: "
            "config.expert_tensor_parallel_size = 2 but the collection's 'expt_tp' group has 1 ranks"
        )
        assert "config.tensor_model_parallel_size = 1 but the collection's 'tp' group has 2 ranks" in (
            config["megatrons_collection"]
        )
        assert "the collection does not provide 'pp'" in config["unset_group"]


def test_none_is_allowed_only_where_megatron_reads_it_as_not_used() -> None:
    assert NONE_MEANS_NOT_USED <= set(megatron_fields())
    assert {"tp", "dp", "mp", "tp_ep_pp", "expt_tp"}.isdisjoint(NONE_MEANS_NOT_USED)


@pytest.mark.parametrize(
    "sizes",
    [
        {"tp": 2, "ep": 2, "expt_tp": 1},
        {"pp": 2, "cp": 2, "gtp_remat": 2, "ep": 2, "expt_gtp_remat": 2, "order": "tp-cp-ep-pp-dp"},
    ],
)
def test_layout_sizes_under_megatrons_names(sizes: dict[str, Any]) -> None:
    layout = ParallelLayout(num_ranks=16, **sizes)
    full = {"tp": 1, "pp": 1, "cp": 1, "ep": 1, "expt_tp": layout.expt_tp, "gtp_remat": 1, "expt_gtp_remat": 1,
            "order": layout.order, **sizes}
    assert megatron_initialize_kwargs(layout) == megatron_kwargs(full)
    config = TransformerConfig(
        num_layers=2, hidden_size=8, num_attention_heads=2, num_moe_experts=4, add_bias_linear=False,
        pipeline_dtype=torch.float32, **megatron_config_kwargs(layout),
    )
    assert config.tensor_model_parallel_size == layout.tp and config.expert_tensor_parallel_size == layout.expt_tp
    assert (config.gtp_weight_remat_size, config.expert_gtp_weight_remat_size) == (
        layout.gtp_remat, layout.expt_gtp_remat,
    )


def test_seed_megatron_rng_refuses_a_collection_without_its_groups() -> None:
    # Checked before Megatron-Core is called: its own fallback would read the global ranks. (Seeding itself needs
    # CUDA; scripts/megatron_parity.py checks the seeds on a GPU.)
    with pytest.raises(
        ValueError, match=r"needs the collection's \['pp', 'ep', 'expt_tp', 'gtp_remat', 'expt_gtp_remat'\]"
    ):
        seed_megatron_rng(1234, ProcessGroupCollection(tp=None))

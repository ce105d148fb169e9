"""What to write instead of a read: the accessor's own replacement from the ``ProcessGroupCollection``.

``get_data_parallel_group()`` becomes ``pg_collection.dp``, not the ``pg_collection.tp`` a generic hint would
suggest; a rank or size becomes ``group_rank`` / ``group_size`` of the same field (``None`` there means the
axis is off, never WORLD). Field names follow Megatron-Core's ``ProcessGroupCollection``.
"""

from __future__ import annotations

import re

from pgregistry.allowlist._scanner import HELPER, REGISTRY, SHIM, Site

__all__ = ["fix_for"]

#: The axis word of an accessor (``get_<axis>_group``, ``_<AXIS>_GROUP``) -> the collection field.
_FIELDS = {
    "tensor_model_parallel": "tp",
    "context_parallel": "cp",
    "data_parallel": "dp",
    "data_parallel_with_cp": "dp_cp",
    "pipeline_model_parallel": "pp",
    "model_parallel": "mp",
    "tensor_and_context_parallel": "tp_cp",
    "tensor_and_data_parallel": "tp_dp_cp",
    "tensor_and_data_parallel_with_cp": "tp_dp_cp",
    "expert_model_parallel": "ep",
    "expert_tensor_parallel": "expt_tp",
    "expert_data_parallel": "expt_dp",
    "expert_tensor_and_model_parallel": "tp_ep",
    "expert_tensor_model_pipeline_parallel": "tp_ep_pp",
    "gtp_weight_remat": "gtp_remat",
    "expert_gtp_weight_remat": "expt_gtp_remat",
    "embedding": "embd",
    "position_embedding": "pos_embd",
    "intra_partial_data_parallel_with_cp": "intra_dp_cp",
    "intra_partial_expert_data_parallel": "intra_expt_dp",
    "intra_distributed_optimizer_instance": "intra_dist_opt",
    "inter_distributed_optimizer_instance": "inter_dist_opt",
    "hierarchical_context_parallel": "hcp",
}

_SHAPES = (
    # (accessor pattern, replacement with {f} for the field)
    (re.compile(r"get_(?P<axis>\w+?)_groups?_gloo"), "a gloo group built once over `pg_collection.{f}`'s ranks"),
    (re.compile(r"get_(?P<axis>\w+?)_groups?"), "`pg_collection.{f}`"),
    (re.compile(r"get_(?P<axis>\w+?)_rank"), "`group_rank(pg_collection.{f})`"),
    (re.compile(r"get_(?P<axis>\w+?)_world_size"), "`group_size(pg_collection.{f})`"),
    (
        re.compile(r"get_(?P<axis>\w+?)_(src_rank|global_ranks)"),
        "`torch.distributed.get_process_group_ranks(pg_collection.{f})`",
    ),
    (re.compile(r"_(?P<axis>[A-Z_]+?)_GROUPS?(?P<with>(_WITH_(CP|GTP_REMAT|EGTP))*)(_GLOO)?"), "`pg_collection.{f}`"),
    (re.compile(r"_(MPU_)?(?P<axis>[A-Z_]+?)_(RANK|WORLD_SIZE|GLOBAL_RANKS|RANKS)"), "a value of `pg_collection.{f}`"),
)

_PIPELINE_STAGE = {
    "is_pipeline_first_stage": "`group_rank(pg_collection.pp) == 0`",
    "is_pipeline_last_stage": "`group_rank(pg_collection.pp) == group_size(pg_collection.pp) - 1`",
}


def _replacement(accessor: str) -> str | None:
    if accessor in _PIPELINE_STAGE:
        return _PIPELINE_STAGE[accessor]
    for pattern, template in _SHAPES:
        match = pattern.fullmatch(accessor)
        if match is not None:
            axis = match.group("axis").lower()
            qualified = axis + (match.groupdict().get("with") or "").lower()
            for name in (qualified, qualified.replace("_with_gtp_remat", "").replace("_with_egtp", ""), axis):
                if name in _FIELDS:
                    return template.format(f=_FIELDS[name])
    return None


def fix_for(site: Site) -> str:
    """The fix for a new read like ``site``, naming the replacement for its accessor when one is known."""
    if site.family == SHIM:
        return "build the collection once at start-up and pass it down instead of copying the globals with a shim"
    if site.family == REGISTRY:
        return "pass a ProcessGroupCollection down instead of reading pgregistry's global grid"
    if site.family == HELPER:
        return f"pass the group explicitly (never None) instead of calling {site.accessor}, which reads the global one"
    replacement = _replacement(site.accessor)
    if replacement is None:
        return "take the value from the ProcessGroupCollection the caller passes in instead of reading parallel_state"
    return f"use {replacement} from the ProcessGroupCollection the caller passes in instead of `{site.expr}`"

"""What to write instead of a read: the accessor's replacement from the ``ProcessGroupCollection``.

``get_data_parallel_group()`` becomes ``pg_collection.dp``, not the ``pg_collection.tp`` a generic
hint would suggest; a rank or size becomes ``group_rank`` / ``group_size`` of the same field
(``None`` there means the axis is off, never WORLD). Field names follow Megatron-Core's
``ProcessGroupCollection``.

The same table serves ``pgregistry migrate`` (:func:`collection_field`), which must also read the
keyword arguments that pick another group of an axis (``with_context_parallel=True``,
``partial_data_parallel=True``, ``with_gtp_remat``, ``is_expert``): a hint may be approximate, a
rewrite may not.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from pgregistry._source.scanner import HELPER, REGISTRY, SHIM, Site

__all__ = [
    "GLOO_REASON",
    "GTP_REMAT_DP",
    "VIRTUAL_STAGE_REASON",
    "FieldChoice",
    "collection_field",
    "fallback_table",
    "fix_for",
    "virtual_stage_choice",
]

#: The axis word of an accessor (``get_<axis>_group``, ``_<AXIS>_GROUP``) -> the collection field.
_FIELDS: dict[str, str | None] = {
    "tensor_model_parallel": "tp",
    "context_parallel": "cp",
    "data_parallel": "dp",
    "data_parallel_with_cp": "dp_cp",
    "pipeline_model_parallel": "pp",
    "model_parallel": "mp",
    "tensor_and_context_parallel": "tp_cp",
    "tensor_and_data_parallel": None,  # without CP: the collection holds only tp_dp_cp
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
    "data_parallel_with_cp_with_gtp_remat": "dp_cp_gtp_remat",
    "expert_data_parallel_with_gtp_remat": "expt_dp_gtp_remat",
    "intra_partial_data_parallel_with_cp_with_gtp_remat": None,
    "intra_partial_expert_data_parallel_with_gtp_remat": None,
    "data_parallel_with_gtp_remat": None,
}
"""``None``: the group is in Megatron-Core's ``parallel_state`` but no collection field holds it."""

#: The pseudo field of the data-parallel group with GTP remat and without CP
#: (``get_data_parallel_rank()`` on a Megatron-Core with GTP remat): no collection field holds it,
#: but it is the collection's ``dp`` whenever the collection's ``gtp_remat`` is off or one rank (the
#: same ranks); the fallback helper reads ``dp`` then, and the global group otherwise
#: (:mod:`pgregistry.migrate._fallback_helper`).
GTP_REMAT_DP = "dp_gtp_remat"
_PSEUDO_FIELDS: dict[str, str] = {"data_parallel_with_gtp_remat": GTP_REMAT_DP}

_SHAPES = (
    # (accessor pattern, replacement with {f} for the field)
    (
        re.compile(r"get_(?P<axis>\w+?)_groups?_gloo"),
        "a gloo group built once over `pg_collection.{f}`'s ranks",
    ),
    (re.compile(r"get_(?P<axis>\w+?)_groups?"), "`pg_collection.{f}`"),
    (re.compile(r"get_(?P<axis>\w+?)_rank"), "`group_rank(pg_collection.{f})`"),
    (re.compile(r"get_(?P<axis>\w+?)_world_size"), "`group_size(pg_collection.{f})`"),
    (
        re.compile(r"get_(?P<axis>\w+?)_(src_rank|global_ranks)"),
        "`torch.distributed.get_process_group_ranks(pg_collection.{f})`",
    ),
    (
        re.compile(r"_(?P<axis>[A-Z_]+?)_GROUPS?(?P<with>(_WITH_(CP|GTP_REMAT|EGTP))*)(_GLOO)?"),
        "`pg_collection.{f}`",
    ),
    (
        re.compile(r"_(MPU_)?(?P<axis>[A-Z_]+?)_(RANK|WORLD_SIZE|GLOBAL_RANKS|RANKS)"),
        "a value of `pg_collection.{f}`",
    ),
)

_PIPELINE_STAGE = {
    "is_pipeline_first_stage": "`group_rank(pg_collection.pp) == 0`",
    "is_pipeline_last_stage": "`group_rank(pg_collection.pp) == group_size(pg_collection.pp) - 1`",
}


def _replacement_for(accessor: str) -> str | None:
    if accessor in _PIPELINE_STAGE:
        return _PIPELINE_STAGE[accessor]
    for pattern, template in _SHAPES:
        match = pattern.fullmatch(accessor)
        if match is not None:
            axis = match.group("axis").lower()
            qualified = axis + (match.groupdict().get("with") or "").lower()
            for name in (
                qualified,
                qualified.replace("_with_gtp_remat", "").replace("_with_egtp", ""),
                axis,
            ):
                field = _FIELDS.get(name)
                if field is not None:
                    return template.format(f=field)
    return None


def fix_for(site: Site) -> str:
    """The fix for a new read like ``site``, naming its accessor's replacement when one is known."""
    if site.family == SHIM:
        return (
            "build the collection once at start-up and pass it "
            "down instead of copying the globals with a shim"
        )
    if site.family == REGISTRY:
        return "pass a ProcessGroupCollection down instead of reading pgregistry's global grid"
    if site.family == HELPER:
        return (
            "pass the group explicitly (never None) instead of "
            f"calling {site.accessor}, which reads the global one"
        )
    replacement = _replacement_for(site.accessor)
    if replacement is None:
        return (
            "take the value from the ProcessGroupCollection the "
            "caller passes in instead of reading parallel_state"
        )
    return (
        f"use {replacement} from the ProcessGroupCollection "
        f"the caller passes in instead of `{site.expr}`"
    )


#: Accessors whose group also depends on ``with_gtp_remat``, which defaults to True in Megatron-Core
#: since GTP (the group spanning the GTP-remat peers; the very same group object when GTP remat is
#: off).
_GTP_REMAT_AXES = ("data_parallel", "expert_data_parallel")
#: Keyword arguments that change nothing about which group is read (only whether an unset one
#: asserts).
_NEUTRAL_KEYWORDS = frozenset({"check_initialized", "ignore_virtual", "vp_stage"})
_KINDS = (  # the more specific first: ``get_x_src_rank`` also matches ``get_(x_src)_rank``
    (re.compile(r"get_(?P<axis>\w+?)_src_rank"), "src_rank"),
    (re.compile(r"get_(?P<axis>\w+?)_global_ranks"), "global_ranks"),
    (
        re.compile(r"get_(?P<axis>pipeline_model_parallel)_(?P<which>first|last|next|prev)_rank"),
        "_rank",
    ),
    (re.compile(r"get_(?P<axis>\w+?)_groups?"), "group"),
    (re.compile(r"get_(?P<axis>\w+?)_rank"), "rank"),
    (re.compile(r"get_(?P<axis>\w+?)_world_size"), "size"),
)
#: The kinds whose accessors take ``with_gtp_remat`` (the global-rank lists are of the replicate
#: group).
_GTP_REMAT_KINDS = ("group", "rank", "size")
_STAGES = {"is_pipeline_first_stage": "first_stage", "is_pipeline_last_stage": "last_stage"}


@dataclass(frozen=True)
class FieldChoice:
    """What a read is, for a rewrite: a kind of collection field, or why no field says it.

    ``kind`` (``group``, ``rank``, ``size``, ``src_rank``, ``global_ranks``, ``first_rank``,
    ``last_rank``, ``next_rank``, ``prev_rank``, ``first_stage``, ``last_stage``) of collection
    field ``field``; or ``reason`` why no field says it. ``forwarded``: the read's keyword arguments
    the fallback helper must be given too, as they change what it answers (``ignore_virtual``,
    ``vp_stage``)."""

    field: str = ""
    kind: str = ""
    reason: str = ""
    forwarded: tuple[str, ...] = ()


#: A gloo group's accessor (``get_data_parallel_group_gloo``,
#: ``get_expert_data_parallel_group_gloo``).
_GLOO = re.compile(r"get_\w+_groups?_gloo")
#: Why a gloo group's read stays: no collection (Megatron-Core's or pgregistry's) holds gloo groups.
GLOO_REASON = (
    "a gloo group: no collection field holds one (Megatron-Core's "
    "setup_process_groups_for_optimizer reads them from parallel_state, "
    "and refuses use_gloo_process_groups with a collection)"
)
#: Why an ``is_pipeline_first/last_stage(ignore_virtual=False)`` read stays where no rule rewrites
#: it.
VIRTUAL_STAGE_REASON = (
    "ignore_virtual=False also reads the virtual pipeline stage: rewritten only with --target "
    "megatron, on a Megatron-Core whose is_pipeline_first/last_stage take it from vp_stage= "
    "(0.13 on)"
)


def virtual_stage_choice(
    accessor: str, keywords: Mapping[str, object], *, virtual_stages: bool
) -> FieldChoice:
    """The choice for a first / last pipeline-stage read that does not ignore the virtual stage.

    That is ``is_pipeline_first_stage`` / ``is_pipeline_last_stage`` with ``ignore_virtual`` not
    True (False, or not a literal): the stage of the collection's ``pp`` with the keywords
    forwarded, where ``virtual_stages`` says the fallback helper reproduces the release's virtual
    part (:mod:`pgregistry.migrate._virtual_stages`: it returns False unless ``vp_stage`` is the
    first / last virtual stage of the virtual pipeline size, a schedule setting it reads from
    ``parallel_state`` as the accessor does, and only then asks the collection's ``pp``)."""
    ignore_virtual = keywords.get("ignore_virtual", True)
    if ignore_virtual is not ... and ignore_virtual:  # a true literal: the pipeline stage alone
        return FieldChoice("pp", _STAGES[accessor])
    if not virtual_stages:
        not_literal = "ignore_virtual= is not a literal True or False"
        return FieldChoice(reason=not_literal if ignore_virtual is ... else VIRTUAL_STAGE_REASON)
    # False, or an expression the helper is given as the accessor would be, and tests as it does
    forwarded = ("ignore_virtual", "vp_stage") if "vp_stage" in keywords else ("ignore_virtual",)
    return FieldChoice("pp", _STAGES[accessor], forwarded=forwarded)


def collection_field(
    accessor: str,
    keywords: Mapping[str, object],
    *,
    gtp_remat: bool = True,
    virtual_stages: bool = False,
) -> FieldChoice:
    """The collection field a call ``accessor(**keywords)`` reads.

    ``keywords`` maps each keyword argument to its literal value (``True``, ``False``, ``None``, a
    number), or to ``...`` when it is not a literal. ``gtp_remat``: whether the code's Megatron-Core
    has GTP remat (0.19 on), where the data-parallel accessors read the group spanning the GTP-remat
    peers unless ``with_gtp_remat=False``; before it they read the plain group (``dp_cp``, not
    ``dp_cp_gtp_remat``: the fields Megatron-LM's own hand migrations wrote then).
    ``virtual_stages``: whether a pipeline-stage read with ``ignore_virtual=False`` may be rewritten
    (:func:`virtual_stage_choice`).

    A keyword that may pick another group and is not a literal, or one this table does not know, is
    a reason: guessing would change which group the code reads."""
    if (
        accessor == "get_amax_reduction_group"
    ):  # Megatron-Core's: one of four groups, by its two flags
        keywords = dict(keywords)
        tp_only = keywords.pop("tp_only_amax_red", False)
        if not isinstance(tp_only, bool):
            return FieldChoice(reason="tp_only_amax_red= is not a literal True or False")
        with_cp = keywords.get("with_context_parallel", False)
        accessor = (
            (
                "get_tensor_and_context_parallel_group"
                if with_cp
                else "get_tensor_model_parallel_group"
            )
            if tp_only
            else "get_tensor_and_data_parallel_group"
        )
        if tp_only:
            keywords.pop("with_context_parallel", None)
    unknown = sorted(
        set(keywords)
        - _NEUTRAL_KEYWORDS
        - {
            "with_context_parallel",
            "partial_data_parallel",
            "partial_expert_data_parallel",
            "with_gtp_remat",
        }
    )
    if unknown:
        return FieldChoice(reason=f"keyword argument {unknown[0]}= may pick another group")
    if accessor in _STAGES and keywords.get("ignore_virtual", True) is not True:
        return virtual_stage_choice(accessor, keywords, virtual_stages=virtual_stages)
    flags: dict[str, bool] = {}
    for name, value in keywords.items():
        if name in _NEUTRAL_KEYWORDS:
            continue
        if not isinstance(value, bool):
            return FieldChoice(reason=f"{name}= is not a literal True or False")
        flags[name] = value
    if accessor in _STAGES:
        return FieldChoice("pp", _STAGES[accessor])
    matches = ((pattern.fullmatch(accessor), kind) for pattern, kind in _KINDS)
    match, kind = next(((m, k) for m, k in matches if m is not None), (None, ""))
    if match is None and _GLOO.fullmatch(accessor):
        return FieldChoice(reason=GLOO_REASON)
    if match is None:
        return FieldChoice(reason="no collection field says what this accessor reads")
    axis = match.group("axis")
    if kind == "_rank":
        kind = match.group("which") + "_rank"
    partial = flags.get("partial_data_parallel", False) or flags.get(
        "partial_expert_data_parallel", False
    )
    name = ("intra_partial_" if partial else "") + axis
    if flags.get("with_context_parallel", False):
        name += "_with_cp"
    if "with_gtp_remat" in flags and not gtp_remat:
        return FieldChoice(reason="with_gtp_remat= in code whose Megatron-Core has no GTP remat")
    if (
        gtp_remat
        and axis in _GTP_REMAT_AXES
        and kind in _GTP_REMAT_KINDS
        and flags.get("with_gtp_remat", True)
    ):
        name += "_with_gtp_remat"
    elif "with_gtp_remat" in flags and (
        axis not in _GTP_REMAT_AXES or kind not in _GTP_REMAT_KINDS
    ):
        return FieldChoice(reason="with_gtp_remat= on an accessor this table does not know it for")
    if name in _PSEUDO_FIELDS and kind in _GTP_REMAT_KINDS:
        return FieldChoice(_PSEUDO_FIELDS[name], kind)
    if name not in _FIELDS:
        return FieldChoice(reason=f"no collection field holds the {name.replace('_', ' ')} group")
    field = _FIELDS[name]
    if field is None:
        hint = (
            " (with_gtp_remat defaults to True; pass with_gtp_remat=False for the replicate group)"
            if ("gtp_remat" in name and "with_gtp_remat" not in flags)
            else ""
        )
        return FieldChoice(
            reason=f"no collection field holds the {name.replace('_', ' ')} group{hint}"
        )
    return FieldChoice(field, kind)


#: The keyword arguments tried when inverting :func:`collection_field`, fewest first (the accessor's
#: defaults are what a plain call means).
_KEYWORD_SETS: tuple[dict[str, bool], ...] = (
    {},
    {"with_context_parallel": True},
    {"with_gtp_remat": False},
    {"with_context_parallel": True, "with_gtp_remat": False},
    {"partial_data_parallel": True, "with_context_parallel": True},
    {"partial_data_parallel": True, "with_context_parallel": True, "with_gtp_remat": False},
    {"partial_expert_data_parallel": True},
    {"partial_expert_data_parallel": True, "with_gtp_remat": False},
)
#: Accessors that choose among several groups by a run-time flag: never the one a field falls back
#: through.
_COMPOSITE_ACCESSORS = frozenset({"get_amax_reduction_group"})


def fallback_table(
    accessors: Iterable[str], *, gtp_remat: bool
) -> dict[tuple[str, str], tuple[str, dict[str, bool]]]:
    """(field, kind) -> (accessor, keyword arguments): the inverse of :func:`collection_field`.

    Each is the call of Megatron-Core's ``parallel_state`` that reads what :func:`collection_field`
    calls that field and kind, among ``accessors`` (the names the release defines), so the fallback
    helper reads exactly what a rewritten read read."""
    table: dict[tuple[str, str], tuple[str, dict[str, bool]]] = {}
    for accessor in sorted(set(accessors) - _COMPOSITE_ACCESSORS):
        for keywords in _KEYWORD_SETS:
            choice = collection_field(accessor, keywords, gtp_remat=gtp_remat)
            if not choice.reason:
                table.setdefault((choice.field, choice.kind), (accessor, dict(keywords)))
    return dict(sorted(table.items()))

"""Process groups for code `pgregistry migrate` rewrote: the collection's, else the global ones.

Written by `pgregistry migrate` (do not edit: a later run rewrites it). Every read of
Megatron-Core's ``parallel_state`` that the tool rewrote calls one of these, where the read was:

    parallel_state.get_tensor_model_parallel_rank()  ->  pg_rank(pg_collection, "tp")

A collection that holds the field answers (a field of ``None`` is an axis that is off: group
``None``, rank 0, size 1). Without one, or with one that lacks the field (built for other fields),
the read is the original accessor's, called as the original code called it: the same group, the
same values when torch.distributed is not initialised, the same exceptions; with a warning naming
the function that read, once per function and field (every time under an ``error`` filter). With
pgregistry installed the warning is its ``ProcessGroupFallbackWarning``
(``-W error::pgregistry.ProcessGroupFallbackWarning`` finds every fallback); without it, this
module's own. The ``None`` of a group Megatron-Core makes only on some ranks or settings is not
an axis that is off but a group it did not make (``_MADE_SOMEWHERE``): the read falls back.

Needs nothing but Python and Megatron-Core. The copy written into a tree imports Megatron-Core's
``parallel_state`` when it is imported itself (at its end): the rewritten files import it where
they imported ``parallel_state`` before, so the order in which modules load (and every circular
import that order resolves) is kept.
"""

from __future__ import annotations

import importlib
import sys
import warnings
from typing import Any

__all__ = ["ProcessGroupFallbackWarning", "pg_group", "pg_rank", "pg_read", "pg_size"]

# The accessor each (field, kind) falls back to, for the code's Megatron-Core release.
# fmt: off
FALLBACKS: dict[tuple[str, str], tuple[str, dict[str, bool]]] = {
    ("cp", "global_ranks"): ("get_context_parallel_global_ranks", {}),
    ("cp", "group"): ("get_context_parallel_group", {}),
    ("cp", "rank"): ("get_context_parallel_rank", {}),
    ("cp", "size"): ("get_context_parallel_world_size", {}),
    ("dp", "group"): ("get_data_parallel_group", {"with_gtp_remat": False}),
    ("dp", "rank"): ("get_data_parallel_rank", {"with_gtp_remat": False}),
    ("dp", "size"): ("get_data_parallel_world_size", {"with_gtp_remat": False}),
    ("dp", "src_rank"): ("get_data_parallel_src_rank", {}),
    ("dp_cp", "group"): (
        "get_data_parallel_group", {"with_context_parallel": True, "with_gtp_remat": False}
    ),
    ("dp_cp", "rank"): (
        "get_data_parallel_rank", {"with_context_parallel": True, "with_gtp_remat": False}
    ),
    ("dp_cp", "size"): (
        "get_data_parallel_world_size", {"with_context_parallel": True, "with_gtp_remat": False}
    ),
    ("dp_cp", "src_rank"): ("get_data_parallel_src_rank", {"with_context_parallel": True}),
    ("dp_cp_gtp_remat", "group"): ("get_data_parallel_group", {"with_context_parallel": True}),
    ("dp_cp_gtp_remat", "rank"): ("get_data_parallel_rank", {"with_context_parallel": True}),
    ("dp_cp_gtp_remat", "size"): ("get_data_parallel_world_size", {"with_context_parallel": True}),
    ("dp_gtp_remat", "group"): ("get_data_parallel_group", {}),
    ("dp_gtp_remat", "rank"): ("get_data_parallel_rank", {}),
    ("dp_gtp_remat", "size"): ("get_data_parallel_world_size", {}),
    ("embd", "group"): ("get_embedding_group", {}),
    ("ep", "group"): ("get_expert_model_parallel_group", {}),
    ("ep", "rank"): ("get_expert_model_parallel_rank", {}),
    ("ep", "size"): ("get_expert_model_parallel_world_size", {}),
    ("ep", "src_rank"): ("get_expert_model_parallel_src_rank", {}),
    ("expt_dp", "group"): ("get_expert_data_parallel_group", {"with_gtp_remat": False}),
    ("expt_dp", "rank"): ("get_expert_data_parallel_rank", {"with_gtp_remat": False}),
    ("expt_dp", "size"): ("get_expert_data_parallel_world_size", {"with_gtp_remat": False}),
    ("expt_dp_gtp_remat", "group"): ("get_expert_data_parallel_group", {}),
    ("expt_dp_gtp_remat", "rank"): ("get_expert_data_parallel_rank", {}),
    ("expt_dp_gtp_remat", "size"): ("get_expert_data_parallel_world_size", {}),
    ("expt_gtp_remat", "global_ranks"): ("get_expert_gtp_weight_remat_global_ranks", {}),
    ("expt_gtp_remat", "group"): ("get_expert_gtp_weight_remat_group", {}),
    ("expt_gtp_remat", "rank"): ("get_expert_gtp_weight_remat_rank", {}),
    ("expt_gtp_remat", "size"): ("get_expert_gtp_weight_remat_world_size", {}),
    ("expt_tp", "group"): ("get_expert_tensor_parallel_group", {}),
    ("expt_tp", "rank"): ("get_expert_tensor_parallel_rank", {}),
    ("expt_tp", "size"): ("get_expert_tensor_parallel_world_size", {}),
    ("gtp_remat", "global_ranks"): ("get_gtp_weight_remat_global_ranks", {}),
    ("gtp_remat", "group"): ("get_gtp_weight_remat_group", {}),
    ("gtp_remat", "rank"): ("get_gtp_weight_remat_rank", {}),
    ("gtp_remat", "size"): ("get_gtp_weight_remat_world_size", {}),
    ("hcp", "group"): ("get_hierarchical_context_parallel_groups", {}),
    ("inter_dist_opt", "group"): ("get_inter_distributed_optimizer_instance_group", {}),
    ("intra_dist_opt", "group"): ("get_intra_distributed_optimizer_instance_group", {}),
    ("intra_dp_cp", "group"): (
        "get_data_parallel_group",
        {"partial_data_parallel": True, "with_context_parallel": True, "with_gtp_remat": False},
    ),
    ("intra_dp_cp", "rank"): (
        "get_data_parallel_rank",
        {"partial_data_parallel": True, "with_context_parallel": True, "with_gtp_remat": False},
    ),
    ("intra_dp_cp", "size"): (
        "get_data_parallel_world_size",
        {"partial_data_parallel": True, "with_context_parallel": True, "with_gtp_remat": False},
    ),
    ("intra_dp_cp", "src_rank"): (
        "get_data_parallel_src_rank", {"partial_data_parallel": True, "with_context_parallel": True}
    ),
    ("intra_expt_dp", "group"): (
        "get_expert_data_parallel_group",
        {"partial_expert_data_parallel": True, "with_gtp_remat": False},
    ),
    ("intra_expt_dp", "rank"): (
        "get_expert_data_parallel_rank",
        {"partial_expert_data_parallel": True, "with_gtp_remat": False},
    ),
    ("intra_expt_dp", "size"): (
        "get_expert_data_parallel_world_size",
        {"partial_expert_data_parallel": True, "with_gtp_remat": False},
    ),
    ("mp", "group"): ("get_model_parallel_group", {}),
    ("mp", "src_rank"): ("get_model_parallel_src_rank", {}),
    ("pos_embd", "group"): ("get_position_embedding_group", {}),
    ("pp", "first_rank"): ("get_pipeline_model_parallel_first_rank", {}),
    ("pp", "first_stage"): ("is_pipeline_first_stage", {}),
    ("pp", "group"): ("get_pipeline_model_parallel_group", {}),
    ("pp", "last_rank"): ("get_pipeline_model_parallel_last_rank", {}),
    ("pp", "last_stage"): ("is_pipeline_last_stage", {}),
    ("pp", "next_rank"): ("get_pipeline_model_parallel_next_rank", {}),
    ("pp", "prev_rank"): ("get_pipeline_model_parallel_prev_rank", {}),
    ("pp", "rank"): ("get_pipeline_model_parallel_rank", {}),
    ("pp", "size"): ("get_pipeline_model_parallel_world_size", {}),
    ("tp", "group"): ("get_tensor_model_parallel_group", {}),
    ("tp", "rank"): ("get_tensor_model_parallel_rank", {}),
    ("tp", "size"): ("get_tensor_model_parallel_world_size", {}),
    ("tp", "src_rank"): ("get_tensor_model_parallel_src_rank", {}),
    ("tp_cp", "group"): ("get_tensor_and_context_parallel_group", {}),
    ("tp_cp", "rank"): ("get_tensor_and_context_parallel_rank", {}),
    ("tp_cp", "size"): ("get_tensor_and_context_parallel_world_size", {}),
    ("tp_dp_cp", "group"): ("get_tensor_and_data_parallel_group", {"with_context_parallel": True}),
    ("tp_ep", "group"): ("get_expert_tensor_and_model_parallel_group", {}),
    ("tp_ep", "rank"): ("get_expert_tensor_and_model_parallel_rank", {}),
    ("tp_ep", "size"): ("get_expert_tensor_and_model_parallel_world_size", {}),
    ("tp_ep_pp", "group"): ("get_expert_tensor_model_pipeline_parallel_group", {}),
}
# fmt: on
# (end of the table)

#: The pseudo field of the data-parallel group with GTP remat and without CP: no collection field
#: holds it, but it is the collection's ``dp`` when the collection's ``gtp_remat`` is off or of one
#: rank.
_GTP_REMAT_DP = "dp_gtp_remat"
#: Groups Megatron-Core makes only on some ranks or under some settings: the embedding groups on
#: their stages, the inter-instance group with several optimizer instances, the hierarchical CP
#: groups when asked for. Elsewhere the accessor raises ``AssertionError``, and Megatron-Core's
#: ``ProcessGroupCollection`` holds ``None`` (it reads them with ``check_initialized=False``): not
#: an axis that is off, so the read falls back to the accessor, which raises as before.
_MADE_SOMEWHERE = ("embd", "pos_embd", "inter_dist_opt", "hcp")
#: Kind ``group_if_none``: a read of Megatron-Core's fallback helper
#: (``get_tensor_model_parallel_group_if_none(tp_group)`` ->
#: ``tp_group if tp_group is not None else pg_read(c, "tp", "group_if_none")``), which falls back
#: to that helper given no group (it answers ``None`` where torch.distributed or parallel_state is
#: not initialised); for another field, to the field's accessor.
IF_NONE: dict[str, tuple[str, str, dict[str, bool]]] = {
    "tp": ("megatron.core.utils", "get_tensor_model_parallel_group_if_none", {}),
    "expt_tp": (
        "megatron.core.utils",
        "get_tensor_model_parallel_group_if_none",
        {"is_expert": True},
    ),
}
_IF_NONE = "group_if_none"
#: The kinds of ``is_pipeline_first_stage`` / ``is_pipeline_last_stage``, whose
#: ``ignore_virtual=False`` also asks the virtual stage (:func:`virtual_stage_allows`).
_STAGE_KINDS = ("first_stage", "last_stage")
#: Megatron-Core's parallel_state (None: imported when a read first falls back). The copy written
#: into a tree imports it at its end (:mod:`pgregistry.migrate._helper_file`).
parallel_state: Any = None
#: Frames of comprehensions and lambdas are named after the function that holds them.
_INNER = ("<listcomp>", "<dictcomp>", "<setcomp>", "<genexpr>", "<lambda>")

try:
    from pgregistry.fallback import ProcessGroupFallbackWarning
    from pgregistry.fallback import warn_fallback as _warn_through_pgregistry
except ImportError:  # pgregistry is not installed: this module's own warning

    class ProcessGroupFallbackWarning(UserWarning):  # type: ignore[no-redef]
        """Code read Megatron-Core's global process groups: no collection with them was given."""

    _warn_through_pgregistry = None  # type: ignore[assignment]


def reader_and_frame(depth: int = 2) -> tuple[str, Any]:
    """The function ``depth`` frames up (the one that read) and its frame.

    The function is named ``module.Class.method``, comprehensions and lambdas folded into the
    function holding them."""
    frame = sys._getframe(depth)
    while frame.f_back is not None and frame.f_code.co_name in _INNER:
        frame = frame.f_back
    code = frame.f_code
    qualname = getattr(code, "co_qualname", code.co_name).replace(".<locals>", "")
    module = frame.f_globals.get("__name__", "")
    return (f"{module}.{qualname}" if module else qualname), frame


def _warn_of_fallback(field: str) -> None:
    """Warn that the function that called ``pg_*`` (four frames up) fell back for ``field``."""
    owner, frame = reader_and_frame(4)
    if _warn_through_pgregistry is not None:
        _warn_through_pgregistry(owner, field)
        return
    message = (
        f"{owner} was not given process group {field!r} and falls back to Megatron-Core's global "
        "parallel_state; pass a ProcessGroupCollection that sets it"
    )
    # Attributed to the function's definition: once per function and field under default filters.
    registry = frame.f_globals.setdefault("__warningregistry__", {})
    warnings.warn_explicit(
        message,
        ProcessGroupFallbackWarning,
        frame.f_code.co_filename,
        frame.f_code.co_firstlineno,
        module=frame.f_globals.get("__name__"),
        registry=registry,
        module_globals=frame.f_globals,
    )


def group_if_held(collection: Any, field: str) -> tuple[bool, Any]:
    """(True, the group) when ``collection`` holds ``field``; else (False, None).

    A field counts as held when it was set: Megatron-Core's ``ProcessGroupCollection`` answers
    ``None`` for a field it was not built with, which is not the same as one set to ``None``."""
    if collection is None:
        return False, None
    try:
        return True, object.__getattribute__(collection, field)
    except AttributeError:
        return False, None


def _from_collection(collection: Any, field: str) -> tuple[bool, Any]:
    if field in _MADE_SOMEWHERE:
        held, group = group_if_held(collection, field)
        return (held and group is not None), group
    if field != _GTP_REMAT_DP:
        return group_if_held(collection, field)
    has_remat, remat = group_if_held(collection, "gtp_remat")
    if has_remat and (remat is None or remat.size() == 1):  # then dp spans the very same ranks
        return group_if_held(collection, "dp")
    return False, None


def value_of_kind(group: Any, kind: str) -> Any:
    """What ``kind`` of ``group`` is (``None``: an axis that is off, this rank alone)."""
    if kind == "group":
        return group
    rank = 0 if group is None else group.rank()
    size = 1 if group is None else group.size()
    if kind == "rank":
        return rank
    if kind == "size":
        return size
    if kind == "first_stage":
        return rank == 0
    if kind == "last_stage":
        return rank == size - 1
    import torch.distributed

    if group is None:
        ranks = [torch.distributed.get_rank() if torch.distributed.is_initialized() else 0]
    else:
        ranks = torch.distributed.get_process_group_ranks(group)
    if kind == "global_ranks":
        return ranks
    if kind in ("src_rank", "first_rank"):
        return ranks[0]
    if kind == "last_rank":
        return ranks[-1]
    if kind == "next_rank":
        return ranks[(rank + 1) % size]
    if kind == "prev_rank":
        return ranks[(rank - 1) % size]
    raise ValueError(f"unknown kind {kind!r} of a process group read")


def _parallel_state() -> Any:
    """Megatron-Core's ``parallel_state``.

    Imported here on first use where this module was not written into a tree."""
    if parallel_state is not None:
        return parallel_state
    return importlib.import_module("megatron.core.parallel_state")


def virtual_stage_allows(kind: str, vp_stage: Any) -> bool:
    """Whether ``is_pipeline_first_stage`` / ``_last_stage`` may be True for a virtual stage.

    Called with ``ignore_virtual=False, vp_stage=...`` (``kind``: ``first_stage`` / ``last_stage``):
    what Megatron-Core 0.13 on checks before it asks the pipeline group, the same assertion
    included. The virtual pipeline size is a schedule setting, no process group: read from
    ``parallel_state`` given a collection too, as the accessor reads it, without a warning."""
    virtual_size = _parallel_state().get_virtual_pipeline_model_parallel_world_size()
    if virtual_size is None:
        return True
    assert vp_stage is not None, "vp_stage must be passed if virtual pipeline is enabled"
    if vp_stage != (0 if kind == "first_stage" else virtual_size - 1):  # compared as it compares
        return False
    return True


def _read_or_fall_back(
    collection: Any, field: str, kind: str, accessor_keywords: dict[str, Any]
) -> Any:
    found, group = _from_collection(collection, field)
    if found and kind in _STAGE_KINDS and not accessor_keywords.get("ignore_virtual", True):
        if not virtual_stage_allows(kind, accessor_keywords.get("vp_stage")):
            return False
    if found:
        return value_of_kind(group, "group" if kind == _IF_NONE else kind)
    if kind == _IF_NONE and field in IF_NONE:
        _warn_of_fallback(field)
        module, helper, keywords = IF_NONE[field]
        fallback = getattr(importlib.import_module(module), helper)
        return fallback(None, **keywords, **accessor_keywords)
    kind = "group" if kind == _IF_NONE else kind
    if (field, kind) not in FALLBACKS:
        raise ValueError(f"no accessor of Megatron-Core's parallel_state reads {kind} of {field!r}")
    _warn_of_fallback(field)
    accessor, keywords = FALLBACKS[(field, kind)]
    return getattr(_parallel_state(), accessor)(**keywords, **accessor_keywords)


def pg_read(collection: Any, field: str, kind: str, **accessor_keywords: Any) -> Any:
    """``kind`` of the collection's ``field``, else what Megatron-Core's accessor for it returns.

    Without the field (no collection, or one without it), with the warning, the accessor is called
    with ``accessor_keywords`` too (``check_initialized=False`` as the original read passed it)."""
    return _read_or_fall_back(collection, field, kind, accessor_keywords)


def pg_group(collection: Any, field: str, **accessor_keywords: Any) -> Any:
    """The collection's group ``field``, else the global one (see :func:`pg_read`)."""
    return _read_or_fall_back(collection, field, "group", accessor_keywords)


def pg_rank(collection: Any, field: str, **accessor_keywords: Any) -> Any:
    """This rank in the collection's group ``field``, else the global one's (:func:`pg_read`)."""
    return _read_or_fall_back(collection, field, "rank", accessor_keywords)


def pg_size(collection: Any, field: str, **accessor_keywords: Any) -> Any:
    """The size of the collection's group ``field``, else the global one's (see :func:`pg_read`)."""
    return _read_or_fall_back(collection, field, "size", accessor_keywords)

"""Megatron-Core interop: one set of communicators shared by pgregistry and a Megatron-Core model.

* :func:`to_megatron` hands a pgregistry collection to Megatron-Core as its own
  ``ProcessGroupCollection``, holding the same communicators (no group is created);
* :func:`from_megatron` turns Megatron-Core's collection (``use_mpu_process_groups()`` after
  ``initialize_model_parallel``) into a pgregistry one and teaches the registry its communicators,
  so a later ``pgregistry.build`` of the same layout reuses them;
* :func:`from_hyper_comm_grid` reads the collection of a module off Megatron-Core's
  ``HyperCommGrid`` (the grid of a span of ranks its multi-module models use), and both conversions
  above take a multi-module collection too (Megatron-Core's ``MultiModuleProcessGroupCollection``,
  :class:`~pgregistry.modules.MultiModuleCollection`);
* :func:`megatron_config_kwargs` and :func:`megatron_initialize_kwargs` give the sizes of a layout
  under Megatron-Core's names, and :func:`check_config` refuses a config whose sizes disagree with
  the groups (Megatron-Core itself accepts ``expert_tensor_parallel_size=1`` next to a 2-rank
  expert-TP group);
* :func:`seed_megatron_rng` seeds Megatron-Core's own CUDA RNG tracker with the collection's ranks,
  so a Megatron-Core model draws what :mod:`pgregistry.rng` computes; :func:`mark_megatron_experts`
  marks Megatron-Core's routed-expert modules, so the unclassified-expert check of grad statistics
  covers a Megatron-Core MoE model.

Megatron-Core has no "axis off" value. In most fields it reads ``None`` as "use the global
``parallel_state`` group" (or the default group, in a collective): a TP-off model whose collection
said ``tp=None`` under another model's global TP 2 gets its weights sharded over that TP group,
without an error. So :func:`to_megatron` hands Megatron-Core the collection's one-rank group
(:attr:`~pgregistry.collection.ProcessGroupCollection.one_rank_group`, which every build makes)
where an axis is off, and refuses a collection assembled by hand without one. ``None`` passes only
in the fields where Megatron-Core reads it as "not used" (:data:`NONE_MEANS_NOT_USED`), and is what
a rank outside the embedding groups (``NOT_MEMBER``) gets there, as Megatron-Core gives it.

Megatron-Core is imported inside the functions: ``import pgregistry.interop.megatron`` works without
it.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import TYPE_CHECKING, Any, Final

from pgregistry._runtime.resolve import check_usable, require_module
from pgregistry.collection import (
    FIELD_NAMES,
    NOT_MEMBER,
    UNSET,
    GroupName,
    ProcessGroupCollection,
    group_rank,
    group_size,
)
from pgregistry.interop._megatron_grids import (
    describe_groups,
    expert_fields_off,
    from_hyper_comm_grid,
    modules_from_reports,
)
from pgregistry.layout import require_layout

if TYPE_CHECKING:
    from torch import nn

    from pgregistry.layout import ParallelLayout
    from pgregistry.modules import MultiModuleCollection

__all__ = [
    "NONE_MEANS_NOT_USED",
    "check_config",
    "from_hyper_comm_grid",
    "from_megatron",
    "mark_megatron_experts",
    "megatron_config_kwargs",
    "megatron_initialize_kwargs",
    "seed_megatron_rng",
    "to_megatron",
]

NONE_MEANS_NOT_USED: Final = frozenset({"hcp", "inter_dist_opt", "dp_cp_ag", "expt_dp_ag"})
"""Fields where Megatron-Core reads ``None`` as "the feature is not used" (one optimizer instance,
no hierarchical CP, no separate all-gather communicator), as a pgregistry collection reads it.
Everywhere else ``None`` makes Megatron-Core fall back to its global groups."""

_NONE_MEANS_NO_EXPERTS: Final = frozenset({"expt_dp", "tp_ep_pp"})
"""Fields Megatron-Core's optimizer asks for even without experts, "set it to None if you don't need
it" (its ``setup_process_groups_for_optimizer``; Megatron-LM's
``test_get_megatron_optimizer_with_custom_process_groups`` does so): :func:`from_megatron` reads
that ``None`` as pgregistry's, the expert axes off, which a collection then holds to (a 2-rank
``ep`` next to ``tp_ep_pp=None`` is refused)."""

_MEMBERSHIP_FIELDS: Final = frozenset({"embd", "pos_embd"})
"""Fields where Megatron-Core reads ``None`` as "this rank is in no such group".

That is, pgregistry's ``NOT_MEMBER``.
"""

# Fields only recent Megatron-Core releases have, and the field holding the same ranks when their
# axis is off.
_GTP_FIELDS: Final[dict[str, GroupName | None]] = {
    "gtp_remat": None,
    "expt_gtp_remat": None,
    "tp_ep_pp_with_egtp_remat": "tp_ep_pp",
    "dp_cp_gtp_remat": "dp_cp",
    "expt_dp_gtp_remat": "expt_dp",
}

# (Megatron-Core config attribute, initialize_model_parallel keyword, layout attribute, collection
# field)
_SIZES: Final[tuple[tuple[str, str, str, GroupName], ...]] = (
    ("tensor_model_parallel_size", "tensor_model_parallel_size", "tp", "tp"),
    ("pipeline_model_parallel_size", "pipeline_model_parallel_size", "pp", "pp"),
    ("context_parallel_size", "context_parallel_size", "cp", "cp"),
    ("expert_model_parallel_size", "expert_model_parallel_size", "ep", "ep"),
    ("expert_tensor_parallel_size", "expert_tensor_parallel_size", "expt_tp", "expt_tp"),
    ("gtp_weight_remat_size", "gtp_remat_size", "gtp_remat", "gtp_remat"),
    ("expert_gtp_weight_remat_size", "expert_gtp_remat_size", "expt_gtp_remat", "expt_gtp_remat"),
)


def _megatron_collection_type() -> type:
    from megatron.core.process_groups_config import ProcessGroupCollection as MegatronCollection

    return MegatronCollection


def _megatron_fields() -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(_megatron_collection_type()))


def _megatron_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("megatron-core")
    except (
        PackageNotFoundError
    ):  # unpacked from a wheel rather than installed (make setup does that)
        import megatron.core

        return str(getattr(megatron.core, "__version__", "unknown version"))


def to_megatron(pg_collection: ProcessGroupCollection | MultiModuleCollection) -> Any:
    """Megatron-Core's collection of ``pg_collection``'s communicators (none created).

    An UNSET field is left unset there (absent from ``vars()``, Megatron-Core's "not provided").
    ``None`` (axis off) becomes the collection's one-rank group outside :data:`NONE_MEANS_NOT_USED`;
    ``NOT_MEMBER`` becomes ``None`` in the embedding fields. A field the installed Megatron-Core
    does not know (the GTP ones, before 0.17) is left out when it carries nothing: ``None``, one
    rank, or the same communicator as the field it reduces to when GTP is off.

    Args:
        pg_collection: a pgregistry collection, or a
            :class:`~pgregistry.modules.MultiModuleCollection`.

    Returns:
        Megatron-Core's ``ProcessGroupCollection``; for a multi-module collection, its
        ``MultiModuleProcessGroupCollection`` of the modules this rank runs, the language model
        named only where this rank runs it (as Megatron-Core's MIMO does).

    Raises:
        TypeError: ``pg_collection`` is not a collection.
        ValueError: a destroyed collection; ``None`` in a field outside :data:`NONE_MEANS_NOT_USED`
            of a collection without a one-rank group (the field named); ``NOT_MEMBER`` outside the
            embedding fields; a field carrying a group the installed Megatron-Core does not know (it
            cannot run the layout); a multi-module collection on a rank that runs no module
            (Megatron-Core's cannot be empty).

    Example:
        On every rank of a 2-rank world (as :func:`pgregistry.testing.run_world` starts it); a
        Megatron-Core model takes the result as its ``pg_collection`` (``GPTModel(config, spec, ...,
        pg_collection=to_megatron(build(layout)))``, as :func:`mark_megatron_experts` shows):

        >>> from pgregistry import ParallelLayout, build
        >>> pg = build(ParallelLayout(num_ranks=2, tp=2))
        >>> megatron_pg = to_megatron(pg)
        >>> type(megatron_pg).__module__, megatron_pg.tp is pg.get("tp")  # the same communicator
        ('megatron.core.process_groups_config', True)
    """
    from pgregistry.modules import MultiModuleCollection  # imports torch

    if isinstance(pg_collection, MultiModuleCollection):
        return _to_megatron_modules(pg_collection)
    pg_collection = check_usable(pg_collection, "to_megatron")
    known = set(_megatron_fields())
    fields: dict[str, Any] = {}
    for name, value in pg_collection.items():
        if value is UNSET:
            continue
        if name not in known:
            _check_droppable(pg_collection, name, value)
            continue
        if value is NOT_MEMBER:
            if name not in _MEMBERSHIP_FIELDS:
                raise ValueError(
                    f"field {name!r} is NOT_MEMBER, which Megatron-Core cannot express there"
                )
            value = None
        elif value is None and name not in NONE_MEANS_NOT_USED:
            value = _one_rank_group(pg_collection, name)
        fields[name] = value
    return _megatron_collection_type()(**fields)


def _to_megatron_modules(modules: MultiModuleCollection) -> Any:
    from megatron.core.process_groups_config import MultiModuleProcessGroupCollection

    here = modules.here()
    if not here:
        import torch.distributed as dist

        raise ValueError(
            f"rank {dist.get_rank()} runs none of the modules of "
            f"{modules!r}; Megatron-Core's MultiModuleProcessGroupCollection "
            "cannot be empty: give it only to ranks that run a module"
        )
    language_model = modules.language_model if modules.language_model in here else None
    return MultiModuleProcessGroupCollection(
        module_pgs={name: to_megatron(modules[name]) for name in here},
        language_model_module_name=language_model,
    )


def _one_rank_group(pg_collection: ProcessGroupCollection, name: str) -> Any:
    group = pg_collection.one_rank_group
    if group is None:
        raise ValueError(
            f"pg_collection field {name!r} is None (axis off), and Megatron-Core has no "
            "'axis off' value: it reads None there as 'use the global parallel_state "
            "group', so a model on this collection would run on another grid's groups. "
            "This collection has no one-rank group to stand for the axis: build it "
            "with pgregistry.build(layout), or pass one_rank_group= when assembling it"
        )
    return group


def _check_droppable(pg_collection: ProcessGroupCollection, name: str, value: Any) -> None:
    twin = _GTP_FIELDS.get(name)
    if value is None or group_size(value) == 1:
        return
    if twin is not None and pg_collection.is_set(twin) and pg_collection.get(twin) is value:
        return
    raise ValueError(
        f"the installed Megatron-Core ({_megatron_version()}) has no {name!r} "
        f"field, so it cannot carry this collection's {group_size(value)}-rank "
        f"{name!r} group: that Megatron-Core cannot run the layout's GTP axis"
    )


def from_megatron(mc_collection: Any) -> Any:
    """A pgregistry collection holding Megatron-Core's communicators, which pgregistry adopts.

    Collective over the world (every rank calls it): pgregistry learns every rank set, so a later
    :func:`pgregistry.registry.build` of a layout with the same rank sets reuses Megatron-Core's
    communicators instead of creating a second set (:func:`pgregistry.registry.adopt`). A field
    absent from ``vars(mc_collection)`` is UNSET; a field the installed Megatron-Core does not have
    (older releases lack the GTP ones) is UNSET too. ``None`` in an embedding field is
    ``NOT_MEMBER`` (Megatron-Core's "not in an embedding group"); in ``expt_dp`` and ``tp_ep_pp`` it
    is ``None``, the expert axes off (Megatron-Core's optimizer: "set it to None if you don't need
    it"). The collection knows no layout: Megatron-Core's does not carry one.

    A multi-module collection holds, on each rank, only the modules that rank runs. The ranks
    exchange them, so every rank learns every module's layout (recovered from the groups of all its
    ranks: the sizes and span from the groups, the order as the first order string under which every
    group holds the layout's ranks) and gets, for a module it does not run, the collection that
    refuses every use. A module whose ``expt_dp`` / ``tp_ep_pp`` are ``None`` ("not needed") and
    which gives no expert group has expert TP and EP off in its layout (never contradicting an
    expert group it gives), and those fields hold what that layout gives them: ``None`` where this
    rank's group has one rank, else another field's communicator over the same ranks, else UNSET.

    Args:
        mc_collection: Megatron-Core's ``ProcessGroupCollection`` or
            ``MultiModuleProcessGroupCollection``.

    Returns:
        A :class:`ProcessGroupCollection`; for a multi-module one, the job-wide
        :class:`~pgregistry.modules.MultiModuleCollection`.

    Raises:
        ValueError: ``None`` in a field outside :data:`NONE_MEANS_NOT_USED` (Megatron-Core would
            read it as "use the global group", which a pgregistry collection cannot say; the field
            named); on every rank, naming the module, a module's groups no layout gives or ranks
            naming different language models.

    Example:
        On every rank of a 2-rank world (as :func:`pgregistry.testing.run_world` starts it), after
        Megatron-Core made its groups:

        >>> from megatron.core import parallel_state
        >>> from megatron.core.process_groups_config import ProcessGroupCollection
        >>> parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
        >>> pg = from_megatron(ProcessGroupCollection.use_mpu_process_groups())
        >>> pg.get("tp") is parallel_state.get_tensor_model_parallel_group()  # its own communicator
        True
    """
    from megatron.core import process_groups_config

    from pgregistry import registry

    # Megatron-Core releases before 0.17 have no multi-module collection.
    multi_module = getattr(process_groups_config, "MultiModuleProcessGroupCollection", None)
    if multi_module is not None and isinstance(mc_collection, multi_module):
        return _from_megatron_modules(mc_collection)
    fields = _fields_from_megatron(mc_collection)
    registry.adopt(_groups_in(fields))
    return ProcessGroupCollection(**fields)


def _fields_from_megatron(mc_collection: Any) -> dict[str, Any]:
    """pgregistry field -> value of Megatron-Core's collection, nothing adopted.

    See :func:`from_megatron`.
    """
    megatron_type = _megatron_collection_type()
    if not isinstance(mc_collection, megatron_type):
        raise TypeError(
            f"from_megatron expects megatron.core.process_groups_config.ProcessGroupCollection or "
            f"MultiModuleProcessGroupCollection, got {type(mc_collection).__name__}"
        )
    present = vars(mc_collection)
    fields: dict[str, Any] = {}
    for name in _megatron_fields():
        if name not in present:
            continue
        value = present[name]
        if name not in FIELD_NAMES:
            if value is None:
                continue
            raise ValueError(
                f"Megatron-Core field {name!r} holds a group pgregistry has no field for"
            )
        if value is None and name in _MEMBERSHIP_FIELDS:
            value = NOT_MEMBER
        elif (
            value is None and name not in NONE_MEANS_NOT_USED and name not in _NONE_MEANS_NO_EXPERTS
        ):
            raise ValueError(
                f"Megatron-Core collection field {name!r} is None, which "
                "Megatron-Core reads as 'use the global parallel_state group': "
                "a pgregistry collection cannot say that; give the field a group"
            )
        fields[name] = value
    return fields


def _groups_in(fields: dict[str, Any]) -> list[Any]:
    return [
        g
        for value in fields.values()
        for g in (value if isinstance(value, list) else [value])
        if g is not None and g is not NOT_MEMBER
    ]


def _from_megatron_modules(mc_modules: Any) -> MultiModuleCollection:
    import torch.distributed as dist

    from pgregistry import registry
    from pgregistry.modules import MultiModuleCollection

    local = {
        name: _fields_from_megatron(collection)
        for name, collection in mc_modules.module_pgs.items()
    }
    mine = {name: describe_groups(fields) for name, fields in local.items()}
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (mine, mc_modules.language_model_module_name))
    layouts, language_model = modules_from_reports(everyone)
    registry.adopt(g for fields in local.values() for g in _groups_in(fields))
    collections = {
        name: ProcessGroupCollection(
            layout=layout,
            name=name,
            **expert_fields_off(layout, local[name], _NONE_MEANS_NO_EXPERTS),
        )
        if name in local
        else ProcessGroupCollection._for_non_member(layout, name, None)
        for name, layout in layouts.items()
    }
    return MultiModuleCollection(collections, language_model=language_model)


def megatron_config_kwargs(layout: ParallelLayout) -> dict[str, int]:
    """The parallel sizes of ``layout`` as keywords of Megatron-Core's ``TransformerConfig``.

    The same keywords serve ``ModelParallelConfig``. GTP sizes are given only where the installed
    Megatron-Core has them.

    Args:
        layout: the layout whose sizes to give.

    Returns:
        Keyword -> size: ``tensor_model_parallel_size``, ``pipeline_model_parallel_size``, and the
        others.

    Raises:
        TypeError: ``layout`` no :class:`~pgregistry.layout.ParallelLayout`.
        ValueError: a GTP size above 1 the installed Megatron-Core cannot express.

    Example:
        >>> from megatron.core.transformer import TransformerConfig
        >>> from pgregistry import ParallelLayout
        >>> layout = ParallelLayout(num_ranks=8, tp=2, cp=2)
        >>> config = TransformerConfig(
        ...     num_layers=4, hidden_size=8, num_attention_heads=2, **megatron_config_kwargs(layout)
        ... )
        >>> config.tensor_model_parallel_size, config.context_parallel_size
        (2, 2)
    """
    from megatron.core.model_parallel_config import ModelParallelConfig

    known = {f.name for f in dataclasses.fields(ModelParallelConfig)}
    return _sizes_by_name(
        layout, {config: config for config, *_ in _SIZES}, known, "ModelParallelConfig"
    )


def megatron_initialize_kwargs(layout: ParallelLayout) -> dict[str, Any]:
    """Keywords of Megatron-Core's ``initialize_model_parallel`` that build ``layout``'s groups.

    They are the sizes and the order, for ``parallel_state.initialize_model_parallel``; GTP sizes
    only where the installed Megatron-Core has them.

    Args:
        layout: the layout whose groups Megatron-Core's global grid should hold.

    Returns:
        Keyword -> value: the sizes and ``order``.

    Raises:
        TypeError: ``layout`` no :class:`~pgregistry.layout.ParallelLayout`.
        ValueError: a GTP size above 1 the installed Megatron-Core cannot express.

    Example:
        On every rank of a 2-rank world (as :func:`pgregistry.testing.run_world` starts it):

        >>> from megatron.core import parallel_state
        >>> from pgregistry import ParallelLayout
        >>> layout = ParallelLayout(num_ranks=2, tp=2)
        >>> parallel_state.initialize_model_parallel(**megatron_initialize_kwargs(layout))
        >>> parallel_state.get_tensor_model_parallel_world_size()
        2
    """
    from megatron.core import parallel_state

    known = set(inspect.signature(parallel_state.initialize_model_parallel).parameters)
    names = {config: keyword for config, keyword, *_ in _SIZES}
    out: dict[str, Any] = dict(_sizes_by_name(layout, names, known, "initialize_model_parallel"))
    out["order"] = layout.order
    return out


def _sizes_by_name(
    layout: ParallelLayout, names: dict[str, str], known: set[str], where: str
) -> dict[str, int]:
    require_layout(layout)
    out: dict[str, int] = {}
    for config, _, attribute, _ in _SIZES:
        size = int(getattr(layout, attribute))
        name = names[config]
        if name in known:
            out[name] = size
        elif size != 1:
            raise ValueError(
                f"the installed Megatron-Core ({_megatron_version()}) has no "
                f"{name!r} in {where}, so it cannot express {attribute}={size}"
            )
    return out


def check_config(config: Any, pg_collection: Any) -> None:
    """Raise ``ValueError`` when ``config`` disagrees with the sizes of ``pg_collection``'s groups.

    ``expert_tensor_parallel_size=None`` means the tensor-parallel size, as in Megatron-Core. A
    group the collection does not provide is a mismatch (Megatron-Core would read the global one). A
    GTP size the config does not have (an older Megatron-Core) must be matched by a one-rank group
    or an unset field.

    Args:
        config: a Megatron-Core ``TransformerConfig``, or any object with its size attributes.
        pg_collection: the collection, pgregistry's or Megatron-Core's.

    Raises:
        TypeError: ``config`` without any of the size attributes (a dict, ``None``: every one-rank
            group matched it), ``pg_collection`` neither package's collection.
        ValueError: every mismatch, listed in one message (a size that is no integer, such as
            ``'2'``, quoted as given).

    Example:
        On every rank of a 2-rank world (as :func:`pgregistry.testing.run_world` starts it):

        >>> from megatron.core.transformer import TransformerConfig
        >>> from pgregistry import ParallelLayout, build
        >>> layout = ParallelLayout(num_ranks=2, tp=2)
        >>> config = TransformerConfig(
        ...     num_layers=2, hidden_size=8, num_attention_heads=2, **megatron_config_kwargs(layout)
        ... )
        >>> check_config(config, build(layout))  # they agree: nothing raised
        >>> check_config(config, build(ParallelLayout(num_ranks=2)))  # TP off
        Traceback (most recent call last):
        ...
        ValueError: ...tensor_model_parallel_size = 2 but the collection's 'tp' group has 1 ranks...
    """
    if not isinstance(pg_collection, ProcessGroupCollection) and not isinstance(
        pg_collection, _megatron_collection_type()
    ):
        raise TypeError(
            "check_config takes pgregistry's or Megatron-Core's ProcessGroupCollection, got "
            f"{type(pg_collection).__name__}"
        )
    # A dict (or None) has none of the attributes, and every group of one rank then matched it.
    if not any(hasattr(config, attribute) for attribute, *_ in _SIZES):
        raise TypeError(
            f"config has none of TransformerConfig's parallel sizes (got a "
            f"{type(config).__name__}): pass the TransformerConfig (a dict as "
            "types.SimpleNamespace(**sizes))"
        )
    problems: list[str] = []
    for attribute, _, _, field in _SIZES:
        provided, group = _group_in(pg_collection, field)
        has = f"the collection's {field!r} group has {group_size(group)} ranks"
        if not hasattr(config, attribute):
            if provided and group_size(group) != 1:
                problems.append(f"config has no {attribute} but {has}")
            continue
        want = getattr(config, attribute)
        if attribute == "expert_tensor_parallel_size" and want is None:
            want = config.tensor_model_parallel_size
        if not provided:
            problems.append(
                f"config.{attribute} = {want!r} but the collection does not provide {field!r}"
            )
        elif group_size(group) != want:
            problems.append(f"config.{attribute} = {want!r} but {has}")
    if problems:
        raise ValueError(
            "the Megatron-Core config disagrees with the process groups: " + "; ".join(problems)
        )


def _group_in(collection: Any, name: GroupName) -> tuple[bool, Any]:
    """(provided, group) for either package's collection."""
    if isinstance(collection, ProcessGroupCollection):
        return (collection.is_set(name), collection.get_or(name, None))
    present = vars(collection)
    return (name in present, present.get(name))


def seed_megatron_rng(
    seed: int,
    pg_collection: ProcessGroupCollection,
    *,
    data_parallel_random_init: bool = False,
    **megatron_options: Any,
) -> dict[str, int]:
    """Seed Megatron-Core's CUDA RNG tracker from the collection's ranks.

    Through ``model_parallel_cuda_manual_seed``; the seeds are as
    :func:`pgregistry.rng.model_parallel_manual_seed` computes them. The pipeline (and
    data-parallel) offsets are added to ``seed`` as Megatron's training loop adds them before
    seeding. Megatron-Core reads the GTP-remat ranks from its global ``parallel_state`` only, so the
    GTP streams are added here from ``gtp_remat`` / ``expt_gtp_remat``. Needs CUDA.

    Args:
        seed: the job's seed.
        pg_collection: the collection; ``pp``, ``tp``, ``ep``, ``expt_tp`` and the GTP-remat groups
            must be set.
        data_parallel_random_init: add the data-parallel offset too, as Megatron's
            ``--data-parallel-random-init`` does (``dp`` must then be set).
        **megatron_options: passed to ``model_parallel_cuda_manual_seed`` (``te_rng_tracker``,
            ``use_cudagraphable_rng``, ...).

    Returns:
        Tracker name -> seed.

    Raises:
        TypeError: ``pg_collection`` is not a collection.
        ValueError: a seed not an integer in [0, 2**64); a needed group unset (Megatron-Core would
            read its global ranks); a GTP stream its global grid already added with another seed
            than the collection's.

    Example::

        seeds = seed_megatron_rng(1234, pg)
    """
    from megatron.core.tensor_parallel import random as megatron_random

    from pgregistry.rng import (
        DATA_PARALLEL_RNG,
        EGTP_REMAT_RNG,
        GTP_REMAT_RNG,
        rank_seeds,
        seed_fields,
    )

    pg_collection = check_usable(pg_collection, "seed_megatron_rng")
    needed = seed_fields(data_parallel_random_init)
    missing = [name for name in needed if not pg_collection.is_set(name)]
    if missing:
        raise ValueError(
            "seed_megatron_rng needs the collection's "
            f"{missing} group(s); set them (None = axis off)"
        )
    seeds = rank_seeds(seed, pg_collection, data_parallel_random_init=data_parallel_random_init)
    rank = {name: group_rank(pg_collection.get(name)) for name in ("tp", "ep", "expt_tp")}
    megatron_random.model_parallel_cuda_manual_seed(
        seeds[DATA_PARALLEL_RNG],
        tp_rank=rank["tp"],
        ep_rank=rank["ep"],
        etp_rank=rank["expt_tp"],
        **megatron_options,
    )
    tracker = megatron_random.get_cuda_rng_tracker()
    for name in (GTP_REMAT_RNG, EGTP_REMAT_RNG):
        if name not in seeds:
            continue
        if name not in tracker.get_states():
            tracker.add(name, seeds[name])
        elif seeds[name] not in tracker.seeds_:
            raise ValueError(
                f"Megatron-Core's global grid already seeded {name!r} with another seed than "
                f"the collection's {seeds[name]}: its parallel_state has a different GTP layout"
            )
    return seeds


def mark_megatron_experts(model: nn.Module) -> int:
    """Mark the routed experts of every Megatron-Core ``MoELayer`` in ``model``.

    Each is marked with :func:`pgregistry.params.mark_expert_module`. Grad statistics then refuse an
    expert parameter that lost its ``allreduce`` role (a copy that dropped it would otherwise count
    as dense). Shared experts are dense, replicated across EP, and are not marked.

    Args:
        model: the model (an ``nn.Module``).

    Returns:
        How many expert modules were marked.

    Raises:
        TypeError: ``model`` is not an ``nn.Module`` (mark one parameter with
            :func:`pgregistry.params.mark_expert`).

    Example:
        On every rank of a 2-rank world (as :func:`pgregistry.testing.run_world` starts it), a
        small Megatron-Core MoE model on the CPU:

        >>> from megatron.core.models.gpt import GPTModel
        >>> from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        >>> from megatron.core.transformer import TransformerConfig
        >>> from pgregistry import ParallelLayout, build
        >>> layout = ParallelLayout(num_ranks=2)
        >>> config = TransformerConfig(
        ...     num_layers=2, hidden_size=8, num_attention_heads=2, num_moe_experts=2,
        ...     use_cpu_initialization=True, **megatron_config_kwargs(layout),
        ... )
        >>> spec = get_gpt_layer_local_spec(num_experts=2, moe_grouped_gemm=False)
        >>> pg = to_megatron(build(layout))
        >>> model = GPTModel(config, spec, vocab_size=16, max_sequence_length=4, pg_collection=pg)
        >>> mark_megatron_experts(model) == config.num_layers  # one MoE layer per layer
        True
    """
    require_module(model, "mark_megatron_experts")
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from pgregistry.params import mark_expert_module

    marked = 0
    for module in model.modules():
        if isinstance(module, MoELayer) and module.experts is not None:
            mark_expert_module(module.experts)
            marked += 1
    return marked

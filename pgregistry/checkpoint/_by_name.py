"""A rank's parameters and optimizer state keyed by global parameter name, and loading them back.

Every parameter and its optimizer state are keyed by the parameter's global name
(:func:`pgregistry.experts.named_global_parameters`): flat keys ``model/<name>`` and
``optimizer/<name>/<state key>``, which both storage back-ends
(:mod:`~pgregistry.checkpoint._rank_files`, :mod:`~pgregistry.checkpoint._distributed`) write. Each
tensor has one writer: for a dense parameter, data-parallel (``dp_cp``) rank 0 of its replicas and
tensor-parallel (``tp``) rank 0; for an expert parameter, expert-data-parallel (``expt_dp``) rank 0
and expert-TP (``expt_tp``) rank 0.

Tensors are stored whole. A parameter sharded over tensor parallelism (``mark_tensor_parallel``:
expert TP for an expert) is all-gathered over its TP group along its ``partition_dim`` before it is
stored, with each of its optimizer state tensors of its shape; loading takes this rank's piece of
the whole tensor, so a checkpoint reloads at another TP size too. Interleaved shards
(``partition_stride`` above 1) and GTP-remat shards are not resharded here: a model with either is
refused.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final, TypeAlias

import attrs
import torch
import torch.distributed as dist
from torch import nn

from pgregistry._runtime.agreement import raise_own_or_peers_fault, ranks_label
from pgregistry._runtime.integers import as_integer
from pgregistry._runtime.resolve import normalise_model, normalise_params, resolve_pg_collection
from pgregistry.attachments import collection_of
from pgregistry.checkpoint._agreement import (
    Scope,
    each_same_on_every_rank,
    run_agreed_step,
    same_on_every_rank,
    scope_of,
)
from pgregistry.collection import GroupName, ProcessGroupCollection, group_rank, group_size
from pgregistry.experts import is_expert_key
from pgregistry.experts._names import GlobalNamer, NamingOptions, check_naming_options, global_names
from pgregistry.grad_stats._dtensors import is_dtensor
from pgregistry.optim._param_state import (
    ParamState,
    ParamStateOptimizer,
    as_param_state_optimizer,
    param_state_faults,
)
from pgregistry.optim._state_check import refuse_faults
from pgregistry.params import is_expert_param

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["state_by_name"]

Optimizer: TypeAlias = torch.optim.Optimizer | ParamStateOptimizer
"""What the checkpoint functions accept: a ``torch.optim.Optimizer``, or any optimizer pgregistry
builds (each is a :class:`~pgregistry.optim.ParamStateOptimizer`: mixed-precision, sharded or
chained)."""

MODEL_PREFIX: Final = "model/"

OPTIMIZER_PREFIX: Final = "optimizer/"

OPTIMIZED_PREFIX: Final = "optimized/"
"""``optimized/<name>`` marks a parameter the saving optimizer updated (its state may be empty,
before the first step or for an optimizer without state): a load given an optimizer then tells a
checkpoint saved without one."""

_UNSHARDED_AXES: Final[tuple[GroupName, ...]] = ("gtp_remat", "expt_gtp_remat")
_CHECKPOINT_FALLBACK: Final[tuple[GroupName, ...]] = (
    "ep",
    "pp",
    "dp_cp",
    "expt_dp",
    "tp",
    "expt_tp",
    *_UNSHARDED_AXES,
)
"""The fields a checkpoint reads.

Read from the global grid, with a warning, when the collection leaves them UNSET.
"""


@attrs.frozen(slots=True)
class TensorParallelShard:
    """How a parameter is cut over tensor parallelism: along ``dim``, over ``group``.

    ``group`` has ``size`` ranks, this one ``rank``."""

    dim: int
    group: Any
    rank: int
    size: int

    def whole(self, piece: torch.Tensor) -> torch.Tensor:
        """The whole tensor from every rank's ``piece`` (collective over the group: all-gather)."""
        piece = piece.detach().contiguous()
        pieces = [torch.empty_like(piece) for _ in range(self.size)]
        dist.all_gather(pieces, piece, group=self.group)
        return torch.cat(pieces, dim=self.dim)

    def piece(self, whole: torch.Tensor) -> torch.Tensor:
        """This rank's piece of ``whole``."""
        return whole.chunk(self.size, dim=self.dim)[self.rank]

    def whole_shape(self, piece_shape: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(n * self.size if d == self.dim else n for d, n in enumerate(piece_shape))


@attrs.frozen(slots=True)
class RankModel:
    """One rank's view: its parameters by global name, which it writes, TP-sharded ones' cuts."""

    params: dict[str, nn.Parameter]
    writes_dense: bool
    writes_experts: bool
    sharded: dict[str, TensorParallelShard] = attrs.field(factory=dict)
    scope: Scope = attrs.field(factory=lambda: Scope(0, 1))
    tp_groups: tuple[Any, ...] = ()
    """The TP and expert-TP groups of more than one rank, in that order: those the pieces of
    :attr:`sharded` are joined over."""
    pp_group: Any = None
    """The pipeline group, when it has more than one rank: its stages must name no parameter
    alike (:func:`copies_named_as_originals_elsewhere`)."""
    tied_copies: frozenset[str] = frozenset()
    """Tied copies (marked ``shared``) named as an original another stage holds: that stage writes
    the name, this one does not."""

    def writes(self, name: str) -> bool:
        if name in self.tied_copies:
            return False
        return self.writes_experts if is_expert_key(name) else self.writes_dense

    def whole(self, name: str, value: torch.Tensor) -> torch.Tensor:
        """``value`` whole: gathered when TP-sharded, else as it is.

        ``value`` is the parameter ``name``, or a state tensor of its shape; the gather is
        collective over its TP group."""
        shard = self.sharded.get(name)
        if shard is None or tuple(value.shape) != tuple(self.params[name].shape):
            return value.detach()
        return shard.whole(value)

    def whole_shape(self, name: str) -> tuple[int, ...]:
        """The shape ``name`` is stored in."""
        shape = tuple(self.params[name].shape)
        shard = self.sharded.get(name)
        return shard.whole_shape(shape) if shard is not None else shape

    def piece(self, name: str, stored: Any) -> Any:
        """This rank's piece of a stored value of ``name``.

        A tensor of the stored shape is cut when TP-sharded.
        """
        shard = self.sharded.get(name)
        if (
            shard is None
            or not isinstance(stored, torch.Tensor)
            or tuple(stored.shape) != self.whole_shape(name)
        ):
            return stored
        return shard.piece(stored)


def checkpoint_scope(model_chunks: Any, naming: NamingOptions) -> Scope:
    """The ranks a checkpoint of ``model_chunks`` runs over, found before the door.

    See :func:`~pgregistry.checkpoint._agreement.scope_of`: those of the collection its door will
    resolve, the explicit ``pg_collection`` else the one attached to the model, found before the
    door so that its refusals are agreed over those ranks. No collection found (the door then reads
    the global grid, or refuses): the world. The ranks of a module must agree on which collection
    they name (an explicit one on some ranks of a module and another one attached on others leaves
    them in different collectives)."""
    explicit = naming.get("pg_collection")
    if isinstance(explicit, ProcessGroupCollection):
        return scope_of(explicit)
    try:
        chunks = normalise_params(model_chunks).chunks
        attached = collection_of(chunks, None) if chunks else None
    except (TypeError, ValueError):
        attached = None  # the door names the fault, agreed over the world
    return scope_of(attached)


def rank_model(
    model_chunks: nn.Module | Sequence[nn.Module],
    owner: str,
    scope: Scope | None = None,
    **naming: Unpack[NamingOptions],
) -> RankModel:
    """The door of the checkpoint entry points: this rank's parameters by global name.

    Also what it writes and how its TP-sharded parameters are cut, with the collection resolved
    once; ``ValueError`` for a sharded GTP-remat axis, an interleaved TP shard, or two parameters of
    one global name (``owner`` names the caller in errors and fallback warnings). ``scope`` is the
    ranks the call runs over (:func:`checkpoint_scope`); it must be the resolved collection's
    (``ValueError`` otherwise)."""
    check_naming_options(naming, owner)
    chunks = normalise_model(model_chunks, owner).chunks
    collection = resolve_pg_collection(
        naming.get("pg_collection"), chunks, owner=owner, fallback=_CHECKPOINT_FALLBACK
    )
    resolved_scope = scope_of(collection)
    if scope is not None and scope != resolved_scope:
        raise ValueError(
            f"{owner} runs over {scope.label}, but the model's collection "
            f"is {collection.describe()}, on {resolved_scope.label}"
        )
    unsharded = [name for name in _UNSHARDED_AXES if group_size(collection.get(name)) > 1]
    if unsharded:
        raise ValueError(
            f"{owner} stores whole tensors, but the model's {', '.join(unsharded)} axis has "
            "more than one rank; GTP-remat shards are not resharded by pgregistry.checkpoint"
        )
    namer = GlobalNamer(
        chunks,
        lambda: collection,
        num_experts=naming.get("num_experts"),
        layer_offsets=naming.get("layer_offsets"),
    )
    params: dict[str, nn.Parameter] = dict(global_names(namer))  # one name each, or it raised
    _refuse_experts_named_alike_on_every_ep_rank(params, group_size(collection.get("ep")), owner)
    _refuse_dtensors(params, owner)
    tp, expt_tp = collection.get("tp"), collection.get("expt_tp")
    sharded = {}
    for name, param in params.items():
        group = expt_tp if is_expert_param(param) else tp
        if not getattr(param, "tensor_model_parallel", False) or group_size(group) == 1:
            continue
        if getattr(param, "partition_stride", 1) != 1:
            raise ValueError(
                f"{owner}: parameter {name!r} is TP-sharded with partition_stride "
                f"{param.partition_stride} "  # type: ignore[attr-defined]
                "(interleaved shards), which pgregistry.checkpoint does not join"
            )
        sharded[name] = TensorParallelShard(
            _partition_dim_of(param, name, owner),
            group,
            group_rank(group),
            group_size(group),
        )
    return RankModel(
        params,
        group_rank(collection.get("dp_cp")) == 0 and group_rank(tp) == 0,
        group_rank(collection.get("expt_dp")) == 0 and group_rank(expt_tp) == 0,
        sharded,
        resolved_scope,
        tuple(group for group in dict.fromkeys((tp, expt_tp)) if group_size(group) > 1),
        collection.get("pp") if group_size(collection.get("pp")) > 1 else None,
    )


def _partition_dim_of(param: nn.Parameter, name: str, owner: str) -> int:
    """The dim ``param``'s TP pieces are joined along, from its ``partition_dim``, 0 or more.

    Set by hand or by Megatron-Core's ``set_tensor_model_parallel_attributes`` (which checks
    nothing), it may be negative, counted from the end as torch counts dims: a save joined the
    pieces along ``-1`` while the load, matching no dim, expected the piece's own shape and refused
    the rank's own checkpoint (``has shape (4, 2) but the checkpoint holds (4, 4)``). A dim the
    piece lacks, or one that is no integer (``0.5`` was read as 0), is ``ValueError`` naming the
    parameter, where torch's ``IndexError`` named none."""
    given = getattr(param, "partition_dim", None)
    dim, ndim = as_integer(given), max(param.dim(), 1)
    if dim is None or not -ndim <= dim < ndim:
        raise ValueError(
            f"{owner}: parameter {name!r} is TP-sharded (tensor_model_parallel=True) along "
            f"partition_dim {given!r}, which is no dim of its {param.dim()}-d piece "
            f"{tuple(param.shape)}: set partition_dim to the dim its TP pieces are cut along, "
            f"0 to {ndim - 1} (pgregistry.params.mark_tensor_parallel sets and checks it)"
        )
    return dim % ndim


def refuse_unequal_pieces(model: RankModel, owner: str) -> None:
    """``ValueError`` on every rank of a TP group whose TP-sharded pieces join into no one whole.

    A piece's whole is the all-gather of equal pieces, joined along one dim: pieces of 3 and 2
    elements (a size the TP size does not divide, cut by ``chunk``), or of one shape in float32 and
    float16, made gloo abort the process (SIGABRT) in the gather; pieces of one shape that TP ranks
    cut along other ``partition_dim`` values were joined along TP rank 0's dim and stored, and the
    load refused them with a shape misfit naming no dim (:func:`_refuse_unlike_cuts`). Collective
    over each of :attr:`RankModel.tp_groups`, which every rank has alike (one all-reduce of four
    integers each; one gather of each rank's cuts when they differ); the ranks holding no sharded
    piece take part too."""
    for group in model.tp_groups:
        sharded = [name for name, shard in model.sharded.items() if shard.group is group]
        pieces = [f"{name!r} {tuple(model.params[name].shape)}" for name in sharded]
        cuts = [_cut_of(model, name) for name in sharded]
        tp_group = Scope(group_rank(group), group_size(group), group)
        same_shapes, same_cuts = each_same_on_every_rank(
            [pieces, [str(cut) for cut in cuts]], tp_group
        )
        if not same_shapes:
            raise ValueError(
                f"{owner}: the ranks {dist.get_process_group_ranks(group)} of a TP group hold "
                "TP-sharded pieces of other shapes (or other TP-sharded parameters); this rank's: "
                f"{', '.join(pieces) or 'none'}. pgregistry.checkpoint joins equal pieces: give "
                "each TP-sharded parameter a size the TP size divides (pad it, as Megatron-Core "
                "pads its vocabulary), and mark only parameters sharded on every TP rank"
            )
        if not same_cuts:
            _refuse_unlike_cuts(sharded, cuts, group, owner)


def _cut_of(model: RankModel, name: str) -> tuple[int, str]:
    """``(partition dim, dtype)`` of the TP-sharded parameter ``name``'s piece on this rank."""
    return model.sharded[name].dim, str(model.params[name].dtype)


def _refuse_unlike_cuts(
    sharded: list[str], cuts: list[tuple[int, str]], group: Any, owner: str
) -> None:
    """``ValueError`` naming the first of ``sharded`` whose :func:`_cut_of` differs over ``group``.

    Every rank's cuts gathered (one ``all_gather_object`` over the TP group), so the message, the
    same on every rank of the group, names every rank's dim or dtype."""
    every_rank: list[Any] = [None] * group_size(group)
    dist.all_gather_object(every_rank, cuts, group=group)
    ranks = dist.get_process_group_ranks(group)
    unlike = (
        (
            "cut along other dims",
            "partition_dim ",
            "its pieces join into one whole along one dim. Give it the same partition_dim on every "
            "TP rank (the dim its TP pieces are cut along; pgregistry.params.mark_tensor_parallel "
            "sets it)",
        ),
        (
            "held in other dtypes",
            "",
            "its pieces join into one whole of one dtype. Cast the model alike on every TP rank",
        ),
    )
    for index, name in enumerate(sharded):
        every_cut = zip(*(rank_cuts[index] for rank_cuts in every_rank), strict=True)
        for values, (what, label, fix) in zip(every_cut, unlike, strict=True):
            if len(set(values)) > 1:
                each = ", ".join(f"{v} on rank {r}" for r, v in zip(ranks, values, strict=True))
                raise ValueError(
                    f"{owner}: the TP-sharded parameter {name!r} is {what} on the ranks of its TP "
                    f"group ({label}{each}): {fix}"
                )


def _refuse_dtensors(params: Mapping[str, nn.Parameter], owner: str) -> None:
    """``ValueError`` for parameters that are DTensors (``fully_shard``, ``distribute_tensor``).

    Each rank's DTensor holds its local shard alone: a save stored data-parallel rank 0's shard as
    the parameter, a load gave it to every rank (its own shard lost), and DCP's planner failed in
    torch's words."""
    sharded = [name for name, param in params.items() if is_dtensor(param)]
    if sharded:
        raise ValueError(
            f"{owner}: {len(sharded)} parameter(s) are DTensors, e.g. {sharded[0]!r} (sharded by "
            "fully_shard or distribute_tensor): each rank holds its own shard of them, which "
            "pgregistry.checkpoint, storing each parameter whole from one rank, would mix up. "
            "Checkpoint such a model with torch.distributed.checkpoint "
            "(torch.distributed.checkpoint.state_dict.get_model_state_dict), or save it before "
            "fully_shard"
        )


def _refuse_experts_named_alike_on_every_ep_rank(
    params: Mapping[str, nn.Parameter], ep_size: int, owner: str
) -> None:
    """``ValueError`` for an expert parameter whose global name holds no expert index, at EP > 1.

    Such a parameter (experts stacked in one tensor, as torchtitan's ``GroupedExperts`` holds them)
    is named alike on every EP rank while each holds other experts: the checkpoint kept EP rank 0's
    under the name, and a load gave them to every EP rank, the others' experts lost without a word.
    """
    if ep_size == 1:
        return
    unindexed = [
        name for name, param in params.items() if is_expert_param(param) and not is_expert_key(name)
    ]
    if unindexed:
        raise ValueError(
            f"{owner}: {len(unindexed)} routed-expert parameter(s) have no expert index in their "
            f"name, e.g. {unindexed[0]!r} (experts stacked in one tensor?): at EP size {ep_size} "
            "every EP rank holds other experts under that one name, so the checkpoint would keep "
            "one EP rank's experts and load them into every rank. pgregistry.checkpoint stores "
            "experts by global index: give each expert its parameters under "
            "'local_experts.<i>.' (or a grouped GEMM's 'weight<i>'), or checkpoint stacked "
            "experts with torch.distributed.checkpoint over DTensors sharded on the EP mesh dim"
        )


def agree_on_rank_model(
    model_chunks: nn.Module | Sequence[nn.Module], owner: str, naming: NamingOptions, scope: Scope
) -> RankModel:
    """:func:`rank_model` in a collective save or load over ``scope``, raising on all if on any.

    A rank whose model cannot be named must not leave the others waiting in the save's or load's
    collectives; nor may TP pieces of other shapes, dims or dtypes reach the gathers
    (:func:`refuse_unequal_pieces`), nor two pipeline stages name a parameter alike
    (:func:`copies_named_as_originals_elsewhere`)."""
    elsewhere = ValueError(f"{owner}: another rank's model cannot be checkpointed")
    model = run_agreed_step(
        lambda: rank_model(model_chunks, owner, scope, **naming), elsewhere, scope
    )
    if model.tp_groups:  # alike on every rank: the layout's sizes
        run_agreed_step(lambda: refuse_unequal_pieces(model, owner), elsewhere, scope)
    if model.pp_group is not None:  # alike on every rank too
        copies = run_agreed_step(
            lambda: copies_named_as_originals_elsewhere(model, owner), elsewhere, scope
        )
        model = attrs.evolve(model, tied_copies=copies)
    return model


def copies_named_as_originals_elsewhere(model: RankModel, owner: str) -> frozenset[str]:
    """This stage's tied copies named as an original on another stage; refuses names held twice.

    A checkpoint stores each global name once, written by each stage's writer: two stages given one
    layer offset (``layer_offset`` 0 on both) both wrote ``layers.0.weight``, and
    ``save_distributed`` kept one of them and gave it to both stages at load, the other stage's
    weights lost without a word (``load_rank_files`` refused the files as storing a key twice):
    ``ValueError`` on every rank of the pipeline group. A parameter marked ``shared`` (a tied copy,
    as Megatron-Core's last stage holds ``embedding.word_embeddings.weight`` for multi-token
    prediction) may carry its original's name; the original's stage writes it, and a load gives it
    to both (its copy was written too, and ``load_rank_files`` refused the files). One
    ``all_gather_object`` of the names over the pipeline group."""
    names = [(name, bool(getattr(param, "shared", False))) for name, param in model.params.items()]
    every_stage: list[Any] = [None] * group_size(model.pp_group)
    dist.all_gather_object(every_stage, names, group=model.pp_group)
    ranks = dist.get_process_group_ranks(model.pp_group)
    holders: dict[str, list[int]] = {}
    for rank, stage_names in zip(ranks, every_stage, strict=True):
        for name, shared in stage_names:
            if not shared:
                holders.setdefault(name, []).append(rank)
    twice = {name: held for name, held in holders.items() if len(held) > 1}
    if twice:
        name, held = next(iter(twice.items()))
        raise ValueError(
            f"{owner}: the pipeline stages of ranks {held} all hold a parameter named {name!r} "
            f"({len(twice)} such name(s)): a checkpoint stores each global name once, so one "
            "stage's would be kept for all. Give each pipeline chunk its first global layer index "
            "(chunk.layer_offset, or layer_offsets=[...]), name every other parameter once over "
            "the pipeline, or mark a tied copy with pgregistry.params.mark_shared"
        )
    return frozenset(name for name, shared in names if shared and name in holders)


def _state_by_global_name(optimizer: Optimizer, model: RankModel) -> list[tuple[str, ParamState]]:
    """``(global name, whole state)`` of every parameter ``optimizer`` updates, in model order.

    The same order on every rank of a TP group, whose gathers must come in one order; collective for
    a sharded optimizer."""
    by_id = {id(param): name for name, param in model.params.items()}
    out: list[tuple[str, ParamState]] = []
    for param, state in as_param_state_optimizer(optimizer).param_state().items():
        if id(param) not in by_id:
            raise ValueError(
                f"the optimizer holds a parameter of shape {tuple(param.shape)} not in the model"
            )
        out.append((by_id[id(param)], state))
    order = {name: index for index, name in enumerate(model.params)}
    return sorted(out, key=lambda item: order[item[0]])


def flat_state(
    model: RankModel, optimizer: Optimizer | None, owner: str, *, primary_only: bool
) -> dict[str, Any]:
    """The flat entries both storage back-ends write, TP-sharded ones gathered whole.

    The entries are ``model/<name>``, ``optimized/<name>`` and ``optimizer/<name>/<state key>``
    (``primary_only``: only what this rank writes, so each tensor is stored once over all ranks).
    TP-sharded parameters and their state tensors are gathered whole on every rank of their TP group
    (collective), in one order on every rank: the model's parameter order, then by state key. A
    state tensor of a TP-sharded parameter that cannot be joined, or state that differs across its
    TP ranks in keys, kinds or per-parameter values, is refused on every rank of its TP groups,
    before the state's gathers (:func:`_refuse_state_unlike_across_tp`,
    :func:`_refuse_unjoinable_state`; ``owner`` names the caller); a save agrees on this call's
    errors over its ranks."""
    flat: dict[str, Any] = {}
    for name, param in model.params.items():
        whole = model.whole(name, param)
        if not primary_only or model.writes(name):
            flat[MODEL_PREFIX + name] = whole
    states = _state_by_global_name(optimizer, model) if optimizer is not None else None
    _refuse_state_unlike_across_tp(states, model, owner)
    if states is not None:
        _refuse_unjoinable_state(states, model, owner)
        for name, state in states:
            for key in sorted(state):
                value = state[key]
                if isinstance(value, torch.Tensor):
                    value = model.whole(name, value)
                if primary_only and not model.writes(name):
                    continue
                flat[f"{OPTIMIZER_PREFIX}{name}/{key}"] = value
            if not primary_only or model.writes(name):
                flat[OPTIMIZED_PREFIX + name] = True
    return flat


def _refuse_state_unlike_across_tp(
    states: list[tuple[str, ParamState]] | None, model: RankModel, owner: str
) -> None:
    """``ValueError`` on every rank of a TP group whose ranks hold unlike state of a sharded piece.

    A TP-sharded parameter's pieces are joined into one whole, and its per-parameter values (a 0-d
    ``step``, a number) are stored once, from TP rank 0, as Megatron-Core stores its common state:
    a ``step`` of 2 on TP rank 1 beside 1 on TP rank 0 came back 1 on both, Adam's bias correction
    changed without a word. State held on some TP ranks only (a piece that had no grad there, an
    optimizer given on some ranks only) sent the ranks into other gathers, which waited for ever.
    So the ranks of each TP group compare, in one all-reduce of two integers, what they hold of
    each of their sharded parameters (:func:`_state_held_of`); when it differs, the first
    difference is named with every rank's (``states`` is ``None`` without an optimizer)."""
    by_name = dict(states) if states is not None else None
    for group in model.tp_groups:
        held = [
            _state_held_of(name, by_name, model)
            for name, shard in model.sharded.items()
            if shard.group is group
        ]
        lines = [f"{name!r} {updated}" for name, updated, _ in held] + [
            f"{name!r} {key!r} {text}" for name, _, by_key in held for key, text in by_key.items()
        ]
        tp_group = Scope(group_rank(group), group_size(group), group)
        if not same_on_every_rank(lines, tp_group):
            every_rank: list[Any] = [None] * tp_group.size
            dist.all_gather_object(every_rank, held, group=group)
            ranks = dist.get_process_group_ranks(group)
            raise ValueError(f"{owner}: {_first_state_difference(every_rank, ranks)}")


def _state_held_of(
    name: str, states: Mapping[str, ParamState] | None, model: RankModel
) -> tuple[str, str, dict[str, str]]:
    """``(name, whether it is updated, {state key: what this rank holds})`` of a sharded piece.

    "updated", "not updated by the optimizer" or "no optimizer given"; a tensor of the piece's
    shape (gathered whole) by its dtype, a 0-d one by its value and dtype, any other value by its
    ``repr``."""
    if states is None or name not in states:
        return name, "no optimizer given" if states is None else "not updated by the optimizer", {}
    piece, held = tuple(model.params[name].shape), {}
    for key, value in sorted(states[name].items()):
        if not isinstance(value, torch.Tensor):
            held[key] = repr(value)
        elif value.dim() == 0:
            held[key] = f"{value.item()!r} ({value.dtype})"
        elif tuple(value.shape) == piece:
            held[key] = f"a {value.dtype} piece"
        else:
            held[key] = f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    return name, "updated", held


def _first_state_difference(every_rank: list[Any], ranks: list[int]) -> str:
    """The first sharded parameter's state that ``every_rank`` holds unlike, each rank's named.

    ``every_rank`` is each TP rank's list of :func:`_state_held_of`, one order on every rank:
    whether the parameter is updated, then its first state key held unlike (``none`` where a rank
    lacks it)."""
    for index, (name, _, _) in enumerate(every_rank[0]):
        entries = [rank_held[index] for rank_held in every_rank]
        keys = sorted({key for _, _, held in entries for key in held})
        rows = [(None, [updated for _, updated, _ in entries])]
        rows += [(key, [held.get(key, "none") for _, _, held in entries]) for key in keys]
        for key, texts in rows:
            if len(set(texts)) > 1:
                each = "; ".join(f"rank {r}: {text}" for r, text in zip(ranks, texts, strict=True))
                found = (
                    f"the TP-sharded parameter {name!r} is updated on some ranks of its TP group "
                    f"only ({each})"
                    if key is None
                    else f"the optimizer state {key!r} of the TP-sharded parameter {name!r} "
                    f"differs across the ranks of its TP group ({each})"
                )
                return (
                    f"{found}. pgregistry.checkpoint joins its state into one whole and keeps one "
                    "value of each per-parameter state (as Megatron-Core keeps one step), so every "
                    "TP rank must hold the same state keys and values: step one optimizer alike "
                    "on every TP rank (the same parameters and steps, none skipped on some ranks), "
                    "then save"
                )
    raise AssertionError("the ranks' digests differ, but not what they hold")


def _refuse_unjoinable_state(
    states: list[tuple[str, ParamState]], model: RankModel, owner: str
) -> None:
    """``ValueError`` on every rank of the TP groups when a TP-sharded state tensor has no whole.

    A state tensor of the piece's shape is gathered whole, and a 0-d one (a step count) is the
    same on every TP rank; one of another shape (Adafactor's factored ``row_var`` and ``col_var``,
    shapes ``(rows, 1)`` and ``(1, cols)`` of each rank's piece) has no whole to join it into: TP
    rank 0's was stored for the whole, and a load gave it to every TP rank, theirs lost without a
    word. One flag all-reduced over the TP groups, whose ranks gather the state next (no collective
    without TP, where :func:`state_by_name` is local)."""
    unjoinable = [
        f"the optimizer state {key!r} of the TP-sharded parameter {name!r} has shape "
        f"{tuple(state[key].shape)}, not its piece's {tuple(model.params[name].shape)}"
        for name, state in states
        if name in model.sharded
        for key in sorted(state)
        if isinstance(state[key], torch.Tensor)
        and state[key].dim()
        and state[key].shape != model.params[name].shape
    ]
    own = (
        ValueError(
            f"{owner}: {unjoinable[0]}: pgregistry.checkpoint joins state tensors of the "
            "parameter's shape over TP, and this one (factored state, as Adafactor's) has no whole "
            "to join into. Use an optimizer whose state is elementwise (Adam, SGD), or checkpoint "
            "this one with torch.distributed.checkpoint at the same TP layout"
        )
        if unjoinable
        else None
    )
    raise_own_or_peers_fault(
        own,
        lambda faulty: ValueError(
            f"{owner}: the optimizer state of a TP-sharded parameter on {ranks_label(faulty)} of "
            "this rank's TP group has no whole to join into (see its error)"
        ),
        model.tp_groups,
    )


def split_optimizer_key(key: str) -> tuple[str, str]:
    """``(parameter name, state key)`` of a flat ``optimizer/<name>/<state key>`` key."""
    name, state_key = key[len(OPTIMIZER_PREFIX) :].rsplit("/", 1)
    return name, state_key


def param_name_of_key(key: str) -> str | None:
    """The parameter a flat key stores; None for another key.

    The keys are ``model/<name>``, ``optimized/<name>`` and ``optimizer/<name>/<state key>``."""
    for prefix in (MODEL_PREFIX, OPTIMIZED_PREFIX):
        if key.startswith(prefix):
            return key[len(prefix) :]
    if key.startswith(OPTIMIZER_PREFIX) and "/" in key[len(OPTIMIZER_PREFIX) :]:
        return split_optimizer_key(key)[0]
    return None


def _nest_flat_keys(flat: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """``{"model": {name: tensor}, "optimizer": {name: {state key: value}}}`` from flat keys.

    A parameter the optimizer updates has an entry, empty before its first step."""
    out: dict[str, dict[str, Any]] = {"model": {}, "optimizer": {}}
    for key, value in flat.items():
        if key.startswith(MODEL_PREFIX):
            out["model"][key[len(MODEL_PREFIX) :]] = value
        elif key.startswith(OPTIMIZED_PREFIX):
            out["optimizer"].setdefault(key[len(OPTIMIZED_PREFIX) :], {})
        elif key.startswith(OPTIMIZER_PREFIX):
            name, state_key = split_optimizer_key(key)
            out["optimizer"].setdefault(name, {})[state_key] = value
    return out


def state_by_name(
    model_chunks: nn.Module | Sequence[nn.Module],
    optimizer: Optimizer | None = None,
    *,
    primary_only: bool = False,
    **naming: Unpack[NamingOptions],
) -> dict[str, dict[str, Any]]:
    """This rank's parameters and optimizer state by global name.

    The names are the same on every layout, so what one layout gives another loads. TP-sharded
    parameters come whole, gathered over their TP group: with tensor parallelism on, every rank of a
    TP group must call it.

    Args:
        model_chunks: the model, or its pipeline chunks.
        optimizer: its optimizer, whose state is given too (default: none, an empty
            ``"optimizer"``).
        primary_only: keep only what this rank writes (one replica of each tensor over all ranks).
        **naming: ``pg_collection``, ``num_experts``, ``layer_offsets``
            (:class:`~pgregistry.experts._names.NamingOptions`).

    Returns:
        ``{"model": {name: tensor}, "optimizer": {name: {state key: value}}}``; tensors alias the
        live ones, and every parameter the optimizer updates has an entry, empty before its first
        step.

    Raises:
        TypeError: ``model_chunks`` is not a model or a sequence of model chunks.
        ValueError: a sharded GTP-remat axis (not resharded), an interleaved TP shard, a
            ``partition_dim`` that is no dim of its parameter, two parameters of one global name,
            or (on every rank of a TP group) TP pieces of one parameter of other shapes, dtypes or
            ``partition_dim`` values, an optimizer state tensor of a TP-sharded parameter of
            neither its shape nor 0-d (Adafactor's factored state: no whole to join it into), or
            optimizer state of a TP-sharded parameter its TP ranks hold unlike (other keys, a step
            count of other values, state on some ranks only).

    Example:
        On every rank of a 2-rank world (as :func:`pgregistry.testing.run_world` starts it), EP
        over both ranks, each holding two of a layer's four experts (named as Megatron-Core's
        ``local_experts``):

        >>> import torch
        >>> from torch import nn
        >>> from pgregistry import ParallelLayout, build, build_optimizer
        >>> from pgregistry.params import mark_expert
        >>> pg = build(ParallelLayout(num_ranks=2, ep=2))
        >>> experts = nn.ModuleList([nn.Linear(2, 2, bias=False) for _ in range(2)])
        >>> layers = nn.ModuleList([nn.ModuleDict({"local_experts": experts})])
        >>> model = nn.ModuleDict({"layers": layers})
        >>> model.num_experts = 4  # else Megatron-Core's config.num_moe_experts, or an option
        >>> for param in model.parameters():
        ...     _ = mark_expert(param)
        >>> optimizer = build_optimizer(model, pg, optimizer="adam")
        >>> state = state_by_name(model, optimizer, pg_collection=pg)
        >>> every_rank = [None, None]
        >>> torch.distributed.all_gather_object(every_rank, sorted(state["model"]))
        >>> every_rank[1]  # EP rank 1's local experts 0 and 1 are the layer's experts 2 and 3
        ['layers.0.local_experts.2.weight', 'layers.0.local_experts.3.weight']
        >>> state["optimizer"].keys() == state["model"].keys()  # each entry empty before a step
        True
    """
    model = rank_model(model_chunks, "state_by_name", **naming)
    refuse_unequal_pieces(model, "state_by_name")  # before the gathers
    return _nest_flat_keys(flat_state(model, optimizer, "state_by_name", primary_only=primary_only))


def prepare_flat_state_load(
    model: RankModel,
    optimizer: Optimizer | None,
    lookup: Mapping[str, Any],
    scope: Scope,
    subject: str,
) -> Callable[[], None]:
    """The copy of every parameter and its optimizer state from flat ``lookup``, returned uncalled.

    ``optimizer`` given, the optimizer state saved for each parameter too.
    :func:`~pgregistry.checkpoint._strict.refuse_misfits` has found ``lookup`` to fit on every rank;
    the copy is returned once the optimizer state's values are found to fit too
    (:func:`prepare_optimizer_load`: collective over ``scope``, refused on every rank alike)."""
    nested = _nest_flat_keys(lookup)
    load_state = None
    if optimizer is not None:
        load_state = prepare_optimizer_load(optimizer, model, nested["optimizer"], scope, subject)

    def copy_loaded_state() -> None:
        with torch.no_grad():
            for name, param in model.params.items():
                param.copy_(model.piece(name, nested["model"][name]))
        if load_state is not None:
            load_state()

    return copy_loaded_state


def prepare_optimizer_load(
    optimizer: Optimizer,
    model: RankModel,
    state: Mapping[str, Mapping[str, Any]],
    scope: Scope,
    subject: str,
) -> Callable[[], None]:
    """The load of ``state`` into ``optimizer``, returned uncalled once every rank found it fits.

    ``state`` is global name -> state key -> value, whole; the load puts this rank's piece of each
    into ``optimizer``. Every rank of ``scope`` checks its state fits its optimizer
    (:func:`~pgregistry.optim._param_state.param_state_faults`: a misshaped ``exp_avg``, a main copy
    of another shape). A rank whose state does not fit raises its faults, naming itself; every other
    rank raises naming it; no rank has changed anything. ``subject`` names the call in messages."""
    target = as_param_state_optimizer(optimizer)

    def check_state_pieces() -> dict[torch.Tensor, Mapping[str, Any]]:
        by_param: dict[torch.Tensor, Mapping[str, Any]] = {
            param: {key: model.piece(name, value) for key, value in state[name].items()}
            for name, param in model.params.items()
            if state.get(name)
        }
        refuse_faults(
            subject, _unjoinable_stored(model, state) + param_state_faults(target, by_param)
        )
        return by_param

    elsewhere = ValueError(
        f"{subject}: another rank's optimizer state does not fit its optimizer; nothing was loaded"
    )
    by_param = run_agreed_step(check_state_pieces, elsewhere, scope)
    return lambda: target.load_param_state(by_param)


def _unjoinable_stored(model: RankModel, state: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """The stored state tensors of TP-sharded parameters that have no piece to cut for this rank.

    One of the whole's shape is cut, a 0-d one (a step count) is given whole; any other (factored
    state saved at TP 1, shape ``(rows, 1)`` of the whole, or one TP rank's saved before such state
    was refused) was given whole to every TP rank, a piece's state of another shape."""
    return [
        f"the state {key!r} of the TP-sharded parameter {name!r} is stored in shape "
        f"{tuple(value.shape)}, neither its whole's {model.whole_shape(name)} nor 0-d: no piece of "
        "it is this rank's (factored state, as Adafactor's, does not reshard over TP)"
        for name in model.sharded
        for key, value in sorted(state.get(name, {}).items())
        if isinstance(value, torch.Tensor)
        and value.dim()
        and tuple(value.shape) != model.whole_shape(name)
    ]

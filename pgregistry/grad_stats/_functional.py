"""The functional API: global norm, zero count and clipping of a model's grads on its collection.

Every entry point takes one way down (:func:`_read_reduce_and_clip`), entering each module on it
once and never a module above it again: the door (:mod:`pgregistry._runtime.resolve`) takes apart
what was given and resolves its collection, once; the kept plan
(:func:`~pgregistry.grad_stats._plan.check_or_make_plan`) is checked, or made afresh whenever it
could be stale; the plan reads the grads once into local shares, plain grads and DTensor local
pieces alike; the one reducer (:mod:`pgregistry.grad_stats._reductions`) reduces them, first the
DTensor pieces sharded over a data-parallel group, over that group, then everything over its
reduction group. Both statistics come from one read when both are wanted
(:func:`grad_norm_and_zeros`), and clipping scales from that norm: one pass over the grads, none
when the coefficient is 1 (decided on the device where the kernel runs).

Clipping decides job-wide: a NaN or inf seen on any rank that holds grads (the collection's
``intra_dist_opt``, and ``inter_dist_opt`` across optimizer instances) makes the norm non-finite on
every rank, so a data-parallel replica whose grads are finite skips, clips or raises exactly as the
replica whose grads are not.

A ``max_norm`` or ``norm_type`` refused on some ranks only does not leave their peers waiting: the
refusing rank joins the reduction with a NaN share (and, clipping, a refusal in the verdict), then
raises; ranks that clip with different valid ``max_norm``, ``norm_type`` or ``error_if_nonfinite``
values scale nothing, their norm NaN (:class:`~pgregistry.grad_stats._arguments.Agreement`, riding
in the verdict: no collective more).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import attrs
import torch
from torch import nn
from torch.distributed import ProcessGroup

from pgregistry._runtime.resolve import (
    ParamsLike,
    Source,
    normalise_params,
    resolve_pg_collection,
    source_of,
)
from pgregistry.collection import ProcessGroupCollection, group_size
from pgregistry.grad_stats._arguments import Given, arguments_of_call
from pgregistry.grad_stats._classification import require_classified_experts
from pgregistry.grad_stats._filters import StatsGroups, is_counted, reduce_group_of
from pgregistry.grad_stats._lists import check_finite
from pgregistry.grad_stats._plan import Plan, Read, check_or_make_plan
from pgregistry.grad_stats._reductions import (
    Clipping,
    Reduced,
    Wanted,
    check_arguments_after,
    reduce_shares,
    zero_count_after,
)

__all__ = [
    "CheckedPlan",
    "check_expert_classification",
    "check_plan",
    "classify_grads",
    "clip_grad_norm_",
    "clipping_after",
    "count_zeros",
    "grad_norm",
    "grad_norm_and_zeros",
    "reduce_checked",
    "verdict_groups",
]


def classify_grads(
    params: Iterable[torch.Tensor], groups: StatsGroups
) -> dict[ProcessGroup | None, list[torch.Tensor]]:
    """The counted grads of ``params`` (``.grad``, skipping None), keyed by reduction group.

    Args:
        params: the parameters.
        groups: the statistics groups.

    Returns:
        Reduction group -> the counted grads. Both reduction groups are always keys, empty or not
        (one key where they are one group), so every rank issues the same collectives whatever
        parameters it holds (a pipeline stage without experts still joins the expert reduction).

    Example:
        On every rank of a 2-rank world (as :func:`pgregistry.testing.run_world` starts it), a
        layer whose weight is split over TP, half on each rank, and whose bias both ranks hold:

        >>> import torch
        >>> from pgregistry import ParallelLayout, build
        >>> from pgregistry.grad_stats import norm_of_grads
        >>> from pgregistry.params import mark_tensor_parallel
        >>> pg = build(ParallelLayout(num_ranks=2, tp=2))
        >>> model = torch.nn.Linear(2, 1)  # this rank's half of a 4 -> 1 layer's weight
        >>> _ = mark_tensor_parallel(model.weight, partition_dim=1)
        >>> rank = torch.distributed.get_rank()
        >>> model.weight.grad = torch.tensor([[0.0, 3.0]] if rank == 0 else [[0.0, 4.0]])
        >>> model.bias.grad = torch.tensor([12.0])  # a TP duplicate: counted on TP rank 0 only
        >>> groups = StatsGroups.from_collection(pg)
        >>> norm_of_grads(classify_grads(model.parameters(), groups))  # sqrt(3^2 + 4^2 + 12^2)
        tensor(13.)
    """
    buckets: dict[ProcessGroup | None, list[torch.Tensor]] = {
        groups.dense_reduce: [],
        groups.expert_reduce: [],
    }
    for param in params:
        if param.grad is not None and is_counted(param, groups):
            buckets[reduce_group_of(param, groups)].append(param.grad)
    return buckets


def check_expert_classification(
    model_or_params: ParamsLike, pg_collection: ProcessGroupCollection | None = None
) -> None:
    """Refuse a parameter of a marked expert module that does not say whether EP replicates it.

    Every statistics entry point and the optimizer builder run this check; call it to check a model
    on its own. Only when the EP axis is on (more than one rank): with EP off the question does not
    arise.

    Args:
        model_or_params: a model, model chunks, a name -> parameter mapping, or parameters.
        pg_collection: the collection (default: the one attached to the model, else the global grid
            with a fallback warning).

    Raises:
        ValueError: naming every such parameter; classify each with
            :func:`~pgregistry.params.mark_expert` or
            :func:`~pgregistry.params.mark_expert_replicated`.

    Example:
        On every rank of a 2-rank world (as :func:`pgregistry.testing.run_world` starts it), EP over
        both ranks:

        >>> import torch
        >>> from pgregistry import ParallelLayout, build
        >>> from pgregistry.params import mark_expert, mark_expert_module
        >>> pg = build(ParallelLayout(num_ranks=2, ep=2))
        >>> model = torch.nn.ModuleDict({"router": torch.nn.Linear(2, 2)})
        >>> model["experts"] = mark_expert_module(torch.nn.Linear(2, 2))
        >>> _ = mark_expert(model["experts"].weight)  # the bias forgotten
        >>> check_expert_classification(model, pg)
        Traceback (most recent call last):
        ...
        ValueError: 1 parameter(s) of a marked expert module carry no EP classification: ...
        >>> _ = mark_expert(model["experts"].bias)
        >>> check_expert_classification(model, pg)  # passes
    """
    params = normalise_params(model_or_params)
    collection = resolve_pg_collection(
        pg_collection, params.chunks, owner="check_expert_classification", fallback=("ep",)
    )
    require_classified_experts(params, collection)


def verdict_groups(
    collection: ProcessGroupCollection, owner: str
) -> tuple[ProcessGroup | None, ...]:
    """The groups that together span every rank holding grads.

    ``intra_dist_opt`` (every rank of one optimizer instance; the whole layout as the registry
    builds it), then ``inter_dist_opt`` when it spans several instances. ``ValueError`` naming
    ``intra_dist_opt`` when the collection does not set it (``None`` for a one-rank job)."""
    if not collection.is_set("intra_dist_opt"):
        raise ValueError(
            f"{owner} decides whether to clip on every rank that holds grads alike, "
            "over the collection's 'intra_dist_opt' group (every rank of the job, as "
            "pgregistry.build sets it; None for one rank), which is not set; set it"
        )
    inter = collection.get("inter_dist_opt") if collection.is_set("inter_dist_opt") else None
    return (collection.get("intra_dist_opt"), *((inter,) if group_size(inter) > 1 else ()))


def _refuse_tensors_without_grads(source: Source, owner: str) -> None:
    """``ValueError`` when tensors were given and none of them holds a grad or can get one.

    Such tensors are grads themselves (Megatron-Core's ``get_grad_norm_fp32`` and torch's
    ``get_total_norm`` take grads) or a ``state_dict``'s detached copies, whose ``.grad`` is
    ``None``: read as parameters without grads they gave a norm of 0, a zero count of 0 and a clip
    of nothing, on every rank, without a word. A tensor that can hold a grad is a parameter, one
    that requires grad, or one whose ``.grad`` is set (a main copy's, assigned by hand). Local and
    free on the usual path: the first parameter ends the look. Every rank given such tensors raises
    before any collective; one given them while its peers are given parameters raises alone."""
    tensors = source.tensors
    if not tensors or any(map(_may_hold_a_grad, tensors)):
        return
    first = tensors[0]
    name = next(iter(source.given)) if isinstance(source.given, Mapping) else "param[0]"
    raise ValueError(
        f"{owner} reads the .grad of the parameters it is given, but none of the {len(tensors)} "
        f"tensor(s) given has a grad or can get one ({name!r} is a {type(first).__name__} of "
        f"shape {tuple(first.shape)}, not a parameter, requires_grad=False, .grad None): are they "
        "grads (Megatron-Core's get_grad_norm_fp32 and torch's get_total_norm take grads) or a "
        "state_dict's detached copies? Pass the parameters (the model, or model.parameters()); "
        "for grads you filtered yourself, use pgregistry.grad_stats.norm_of_grads"
    )


def _may_hold_a_grad(tensor: object) -> bool:
    """Whether ``tensor`` is no tensor (named later), a parameter, requires grad or has a grad."""
    return (
        not isinstance(tensor, torch.Tensor)
        or isinstance(tensor, nn.Parameter)
        or tensor.requires_grad
        or tensor.grad is not None
    )


@attrs.frozen(slots=True)
class CheckedPlan:
    """What a statistics call was given, with its kept plan checked for this call (or made anew).

    What the read needs: the plan, the parameters in its order and the collection filled for it
    (:func:`~pgregistry.grad_stats._plan.check_or_make_plan`). A caller that looks at the plan
    before the statistic reads (:mod:`pgregistry.modules`' refusal of a tensor in two modules'
    models) checks it once (:func:`check_plan`) and hands it down (:func:`reduce_checked`)."""

    source: Source
    plan: Plan
    params: list[torch.Tensor]
    collection: ProcessGroupCollection


def check_plan(
    source: Source, pg_collection: ProcessGroupCollection | None, owner: str
) -> CheckedPlan:
    """The kept plan of ``source`` checked, or made anew, on the collection the door resolves once.

    ``source`` is what the door took apart (:func:`~pgregistry._runtime.resolve.source_of`)."""
    given = resolve_pg_collection(pg_collection, source.chunks, owner=owner)
    plan, params, collection = check_or_make_plan(source, given, owner)
    return CheckedPlan(source, plan, params, collection)


def reduce_checked(checked: CheckedPlan, owner: str, wanted: Wanted) -> tuple[Reduced, Read]:
    """The statistics ``wanted`` of a plan the caller checked (:func:`check_plan`), reduced.

    The entry points' way down after their own plan check: tensors without grads refused, the grads
    read once and reduced; the plan is not checked a second time. Returns the reduced statistics
    and the read, whose pieces a caller clipping to a norm of its own scales
    (:meth:`~pgregistry.grad_stats._plan.Read.clip_`: :mod:`pgregistry.modules`' job-wide clip,
    without collecting the grads or planning their scaling again)."""
    _refuse_tensors_without_grads(checked.source, owner)
    return _read_and_reduce(checked, owner, wanted)


def _read_reduce_and_clip(
    params: ParamsLike,
    pg_collection: ProcessGroupCollection | None,
    owner: str,
    wanted: Wanted,
    max_norm: object = None,
    error_if_nonfinite: bool = False,
    given: Given | None = None,
) -> Reduced:
    """Read, reduce and (with ``given.clip``) clip: the one way down of every entry point.

    See the module docstring. ``given`` holds the arguments checked by the caller, their fault
    raised after the reduction (:func:`_read_and_reduce`), or before it where the call fails on
    this rank before any collective anyway."""
    try:
        checked = _check_params_and_plan(params, pg_collection, owner)
    except Exception as exc:
        if given is not None and given.refusal is not None:
            raise given.refusal from exc
        raise
    return _read_and_reduce(checked, owner, wanted, max_norm, error_if_nonfinite, given)[0]


def _check_params_and_plan(
    params: ParamsLike, pg_collection: ProcessGroupCollection | None, owner: str
) -> CheckedPlan:
    """What ``params`` are, checked on this rank (tensors without grads refused), and their plan."""
    source = source_of(params)
    _refuse_tensors_without_grads(source, owner)
    return check_plan(source, pg_collection, owner)


@torch.no_grad()
def _read_and_reduce(
    checked: CheckedPlan,
    owner: str,
    wanted: Wanted,
    max_norm: object = None,
    error_if_nonfinite: bool = False,
    given: Given | None = None,
) -> tuple[Reduced, Read]:
    """Read the grads of a checked plan once, reduce them and (with ``given.clip``) clip them.

    Returns the reduced statistics and the read. A fault of ``given`` is raised after the
    reduction, which it joined (:func:`~pgregistry.grad_stats._reductions.reduce_shares`). Without
    grad, as torch's ``get_total_norm`` and ``clip_grad_norm_``: grads made with
    ``create_graph=True`` gave a norm with an autograd graph, and their scaling was in it."""
    plan, ordered = checked.plan, checked.params
    read = plan.read(ordered, wanted)  # refuses sparse grads, naming them
    clip = given is not None and given.clip
    verdict = verdict_groups(checked.collection, owner) if clip else ()
    reduced = reduce_shares(
        read.shares,
        verdict=verdict,
        reread=lambda again: plan.read(ordered, again).shares,
        given=given,
    )
    if clip:
        assert given is not None
        read.clip_(clipping_after(reduced, given, owner, max_norm, error_if_nonfinite))
    elif given is not None:
        check_arguments_after(reduced, given, owner)
    return reduced, read


def clipping_after(
    reduced: Reduced, given: Given, owner: str, max_norm: object, error_if_nonfinite: object
) -> Clipping:
    """A clip's scaling once its reduction is made, after what every clip checks first, in order.

    This rank's refused argument (it joined the reduction first: no peer waits), then the ranks'
    disagreement where it costs no device sync (:func:`check_arguments_after`), then, with
    ``error_if_nonfinite``, a non-finite norm. The functional clips and the optimizers' share it."""
    check_arguments_after(reduced, given, owner, error_if_nonfinite)
    assert reduced.norm64 is not None and isinstance(error_if_nonfinite, bool)
    check_finite(reduced.norm64, error_if_nonfinite)
    return Clipping(max_norm, reduced.norm64)  # type: ignore[arg-type]  # checked: given


def grad_norm(
    params: ParamsLike,
    pg_collection: ProcessGroupCollection | None = None,
    *,
    norm_type: float = 2.0,
) -> torch.Tensor:
    """The global ``norm_type``-norm of the grads of ``params`` on its collection.

    Each grad is classified by its parameter's roles (:func:`is_counted`, :func:`reduce_group_of`);
    a DTensor grad (FSDP2, ``parallelize_module``) by its placements over the mesh dims it spans and
    by the roles elsewhere (:mod:`pgregistry.grad_stats._dtensors`). Collective over the
    collection's ``mp`` and ``tp_ep_pp_with_egtp_remat`` groups (and the data-parallel groups
    DTensor grads are sharded over). The classification is kept between calls
    (:mod:`pgregistry.grad_stats._plan`).

    Args:
        params: a model, model chunks, a name -> parameter mapping, one tensor or an iterable of
            them.
        pg_collection: the collection (default: the one attached to the model, else the global grid
            with a fallback warning).
        norm_type: a positive number, or ``inf`` for the max-norm.

    Returns:
        A 0-dim tensor on the grads' device, float64 where a grad is float64 (or complex128), else
        float32 (:attr:`~pgregistry.grad_stats._reductions.Reduced.norm`); NaN or infinite when a
        grad of any rank of the reduction groups is, counted or not (a duplicate too).

    Raises:
        TypeError: ``norm_type`` not a real number; ``pg_collection`` neither a collection nor
            ``None``.
        ValueError: ``norm_type`` not positive (after the reduction, which this rank joins); on
            the CPU, ``norm_type`` differing across the ranks of a reduction, or refused on one of
            them, on each of them (on a GPU the norm is NaN: no device sync), and so another rank of
            a reduction computing another statistic (:func:`count_zeros`, or
            :func:`grad_norm_and_zeros` beside this one), naming both; given a model or model
            chunks, parameters of a marked expert module without an EP classification
            (:func:`check_expert_classification`);
            given tensors, none that has a grad or can get one (grads, a ``state_dict``'s copies:
            pass the parameters); a collection that disagrees with the model's attached one, that
            this rank is not a member of, or that was destroyed.

    Example:
        On every rank of a 2-rank world (as :func:`pgregistry.testing.run_world` starts it), a
        layer whose weight is split over TP, half on each rank:

        >>> import torch
        >>> from pgregistry import ParallelLayout, build
        >>> from pgregistry.params import mark_tensor_parallel
        >>> pg = build(ParallelLayout(num_ranks=2, tp=2))
        >>> model = torch.nn.Linear(2, 1, bias=False)  # this rank's half of a 4 -> 1 weight
        >>> _ = mark_tensor_parallel(model.weight, partition_dim=1)
        >>> rank = torch.distributed.get_rank()
        >>> model.weight.grad = torch.tensor([[0.0, 3.0]] if rank == 0 else [[0.0, 4.0]])
        >>> grad_norm(model, pg)  # the whole grad's, [0, 3, 0, 4]: the same on every rank
        tensor(5.)
    """
    given = arguments_of_call(norm_type, None, clip=False)
    return _read_reduce_and_clip(
        params, pg_collection, "grad_norm", Wanted(given.p, zeros=False), given=given
    ).norm


def count_zeros(params: ParamsLike, pg_collection: ProcessGroupCollection | None = None) -> int:
    """The global number of zero grad elements of ``params``, each distinct element counted once.

    Classified and reduced as :func:`grad_norm` is, over the same groups (collective). The count
    comes back to the host: a host sync (:func:`grad_norm_and_zeros` has it as a tensor, without
    one).

    Args:
        params: a model, model chunks, a name -> parameter mapping, one tensor or an iterable of
            them.
        pg_collection: the collection (default: the one attached to the model, else the global grid
            with a fallback warning).

    Returns:
        The count, the same on every rank.

    Raises:
        TypeError: ``pg_collection`` neither a collection nor ``None``.
        ValueError: on every rank of a reduction where another rank computes a norm instead
            (:func:`grad_norm`, :func:`clip_grad_norm_`, :func:`grad_norm_and_zeros`: their rows
            carry other arguments), naming both, on a GPU too (the count is read on the host
            anyway; the norm there is NaN and nothing is scaled); as :func:`grad_norm` otherwise
            (an unclassified expert parameter, a collection that disagrees, is not this rank's or
            was destroyed).

    Example:
        On every rank of a 2-rank world (as :func:`pgregistry.testing.run_world` starts it), a
        layer whose weight is split over TP, half on each rank:

        >>> import torch
        >>> from pgregistry import ParallelLayout, build
        >>> from pgregistry.params import mark_tensor_parallel
        >>> pg = build(ParallelLayout(num_ranks=2, tp=2))
        >>> model = torch.nn.Linear(2, 1, bias=False)  # this rank's half of a 4 -> 1 weight
        >>> _ = mark_tensor_parallel(model.weight, partition_dim=1)
        >>> rank = torch.distributed.get_rank()
        >>> model.weight.grad = torch.tensor([[0.0, 3.0]] if rank == 0 else [[0.0, 4.0]])
        >>> count_zeros(model, pg)  # in the whole grad, [0, 3, 0, 4]
        2
    """
    reduced = _read_reduce_and_clip(params, pg_collection, "count_zeros", Wanted.zeros_only())
    return int(zero_count_after(reduced, "count_zeros", on_host=True).item())


def grad_norm_and_zeros(
    params: ParamsLike,
    pg_collection: ProcessGroupCollection | None = None,
    *,
    norm_type: float = 2.0,
    max_norm: float | None = None,
    error_if_nonfinite: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`grad_norm` and :func:`count_zeros` from one read of the grads, reduced together.

    One all-reduce per group for the 2-norm; with ``max_norm``, the grads are clipped from that norm
    as :func:`clip_grad_norm_` does (no second read, and no host sync for the 1-, 2- and inf-norm;
    another ``p`` reads the norm on the host once, and the grads again where it needs the exact
    path: :func:`~pgregistry.grad_stats._reductions.reduce_shares`).

    Args:
        params: a model, model chunks, a name -> parameter mapping, one tensor or an iterable of
            them.
        pg_collection: the collection (default: the one attached to the model, else the global grid
            with a fallback warning).
        norm_type: a positive number, or ``inf`` for the max-norm.
        max_norm: clip to this global norm too (default: no clipping).
        error_if_nonfinite: with ``max_norm``, raise on a NaN or infinite norm instead of skipping
            the clip, as :func:`clip_grad_norm_` does.

    Returns:
        The norm (0-dim, as :func:`grad_norm`'s, before clipping) and the zero count (0-dim int64).

    Raises:
        TypeError: ``norm_type`` or ``max_norm`` not a real number; ``pg_collection`` neither a
            collection nor ``None``.
        ValueError: ``norm_type`` not positive; ``max_norm`` not positive and finite; with
            ``max_norm``, the ranks' arguments differing or refused on another rank, as
            :func:`clip_grad_norm_`; another rank of a reduction counting zeros alone or computing
            the norm without them, where the grads are on the CPU (on a GPU the norm is NaN and the
            count -1); as :func:`grad_norm` otherwise.
        RuntimeError: with ``max_norm`` and ``error_if_nonfinite``, a non-finite norm, on every
            rank.

    Example:
        On every rank of a 2-rank world (as :func:`pgregistry.testing.run_world` starts it), a
        layer whose weight is split over TP, half on each rank:

        >>> import torch
        >>> from pgregistry import ParallelLayout, build
        >>> from pgregistry.params import mark_tensor_parallel
        >>> pg = build(ParallelLayout(num_ranks=2, tp=2))
        >>> model = torch.nn.Linear(2, 1, bias=False)  # this rank's half of a 4 -> 1 weight
        >>> _ = mark_tensor_parallel(model.weight, partition_dim=1)
        >>> rank = torch.distributed.get_rank()
        >>> model.weight.grad = torch.tensor([[0.0, 3.0]] if rank == 0 else [[0.0, 4.0]])
        >>> norm, zeros = grad_norm_and_zeros(model, pg, max_norm=1.0)
        >>> norm, zeros, grad_norm(model, pg)  # the grads are clipped to norm 1
        (tensor(5.), tensor(2), tensor(1.0000))
    """
    given = arguments_of_call(
        norm_type,
        max_norm,
        clip=max_norm is not None,
        error_if_nonfinite=error_if_nonfinite,
        zeros=True,
    )
    reduced = _read_reduce_and_clip(
        params,
        pg_collection,
        "grad_norm_and_zeros",
        Wanted(given.p, zeros=True),
        max_norm,
        error_if_nonfinite,
        given,
    )
    assert reduced.zeros is not None
    return reduced.norm if max_norm is None else reduced.clip_norm, reduced.zeros


def clip_grad_norm_(
    params: ParamsLike,
    max_norm: float,
    pg_collection: ProcessGroupCollection | None = None,
    *,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
) -> torch.Tensor:
    """Clip the grads of ``params`` in place to a global norm of ``max_norm``.

    Every grad is scaled, the duplicates too, so replicas stay identical; a DTensor grad through its
    local tensor. The decision is job-wide (:func:`verdict_groups`): a NaN or infinite grad on any
    rank holding grads makes the returned norm non-finite on every rank, and scales nothing anywhere
    (skip the step). The coefficient is computed from the float64 norm
    (:func:`~pgregistry.grad_stats.clip_grads_`). Collective as :func:`grad_norm`.

    Args:
        params: a model, model chunks, a name -> parameter mapping, one tensor or an iterable of
            them.
        max_norm: the global norm to clip to: positive and finite.
        pg_collection: the collection (default: the one attached to the model, else the global grid
            with a fallback warning).
        norm_type: a positive number, or ``inf`` for the max-norm.
        error_if_nonfinite: raise on a non-finite norm instead of skipping the clip.

    Returns:
        The global norm before clipping, as :func:`grad_norm` returns it.

    Raises:
        TypeError: ``max_norm`` or ``norm_type`` not a real number (a string such as ``'1.0'``, a
            bool, ``None``); ``pg_collection`` neither a collection nor ``None``.
        ValueError: ``max_norm`` not positive and finite (0, negative, NaN, inf); ``norm_type`` not
            positive; the ranks holding grads given different ``max_norm``, ``norm_type`` or
            ``error_if_nonfinite`` values, or another rank refusing its own: on every rank where the
            grads are on the CPU or with ``error_if_nonfinite`` (on a GPU otherwise the norm is NaN
            and nothing is scaled, with no host sync); as :func:`grad_norm` otherwise. A refused
            argument is raised after the norm's reduction, which the rank still joins, so its peers
            do not wait.
        RuntimeError: with ``error_if_nonfinite``, a NaN or infinite norm, on every rank.

    Example:
        On every rank of a 2-rank world (as :func:`pgregistry.testing.run_world` starts it), a
        layer whose weight is split over TP, half on each rank:

        >>> import torch
        >>> from pgregistry import ParallelLayout, build
        >>> from pgregistry.params import mark_tensor_parallel
        >>> pg = build(ParallelLayout(num_ranks=2, tp=2))
        >>> model = torch.nn.Linear(2, 1, bias=False)  # this rank's half of a 4 -> 1 weight
        >>> _ = mark_tensor_parallel(model.weight, partition_dim=1)
        >>> rank = torch.distributed.get_rank()
        >>> model.weight.grad = torch.tensor([[0.0, 3.0]] if rank == 0 else [[0.0, 4.0]])
        >>> optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
        >>> norm = clip_grad_norm_(model, 1.0, pg)
        >>> if norm.isfinite():
        ...     optimizer.step()
        >>> norm, grad_norm(model, pg)  # the norm before clipping, and after
        (tensor(5.), tensor(1.0000))
    """
    given = arguments_of_call(  # max_norm None too: no "do not clip" here
        norm_type, max_norm, clip=True, error_if_nonfinite=error_if_nonfinite
    )
    return _read_reduce_and_clip(
        params,
        pg_collection,
        "clip_grad_norm_",
        Wanted(given.p, zeros=False),
        max_norm,
        error_if_nonfinite,
        given,
    ).clip_norm

"""Norms, zero counts and clipping of grads already filtered and keyed by reduction group
(Megatron-Core's ``get_grad_norm_fp32`` / ``count_zeros_fp32`` / ``clip_grads`` shape): the one
reduction path (:mod:`pgregistry.grad_stats._reductions`) over lists of tensors read by
:mod:`pgregistry.grad_stats._local`.

The reductions issue one all-reduce per distinct group, in an order every rank agrees on, and leave
the result on the grads' device with no host sync, so optimizers and training loops can call them
every step; only a norm other than the 1-, 2- and inf-norm reads its value on the host, whether it
is exact (a device sync on CUDA; see :func:`~pgregistry.grad_stats._reductions.reduce_shares`). See
``docs/design/grad_stats_api.md``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from itertools import chain

import torch
import torch.distributed as dist

from pgregistry._runtime.meta_tensors import meta_tensor_error
from pgregistry.grad_stats._arguments import arguments_of_call, total_norm_as_tensor
from pgregistry.grad_stats._devices import reduction_device
from pgregistry.grad_stats._local import add_parts, by_kind, scale_kind
from pgregistry.grad_stats._reductions import (
    Clipping,
    GradsByGroup,
    GroupKey,
    Shares,
    Wanted,
    check_arguments_after,
    check_max_norm,
    clip_coefficient,
    reduce_shares,
    zero_count_after,
)

__all__ = ["clip_grads_", "norm_of_grads", "scale_grads_", "zeros_of_grads"]


Kinds = dict[tuple[torch.device, torch.dtype], list[torch.Tensor]]
"""Tensors by (device, dtype): :func:`~pgregistry.grad_stats._local.by_kind`'s grouping."""


def _kinds_checked(
    grads: Sequence[Sequence[torch.Tensor]], named: Iterable[tuple[str, object]], use: str
) -> list[Kinds]:
    """``grads`` by kind, each of ``grads``' lists grouped apart, once none is refused.

    Refused: a tensor given twice, a tensor on the meta device, an entry that is no tensor. A tensor
    given twice would be counted twice in a norm, or scaled twice by a clip (torch's
    ``get_total_norm`` and ``clip_grads_with_norm_`` do both, silently); a meta tensor has no values
    (the result would be a meta tensor with none). ``grads`` is one list or several (a group's
    each); ``named`` yields each entry's label and value over all of them, in order. The look is one
    pass at C speed over the tensors' ids, and the grouping the reads need anyway, which refuses an
    entry that is no tensor and shows the meta device as a kind of its own; only a fault walks
    ``named`` to name the first culprit, with what the call does with it (``use``)."""
    if len(set(map(id, chain.from_iterable(grads)))) == sum(map(len, grads)):
        try:
            kinds = [by_kind(same_list) for same_list in grads]
        except (TypeError, RuntimeError):  # torch's words for an entry that is no tensor
            culprit = _first_culprit(named, use)
            if culprit is None:
                raise
            raise culprit from None
        if not any(device.type == "meta" for kinds_of_list in kinds for device, _ in kinds_of_list):
            return kinds
    culprit = _first_culprit(named, use)
    assert culprit is not None  # the walk meets the tensor given twice or on the meta device
    raise culprit


def _first_culprit(named: Iterable[tuple[str, object]], use: str) -> Exception | None:
    """The error naming the first culprit among ``named``, or ``None`` where there is none.

    A culprit is an entry that is no tensor, on the meta device, or the same tensor as an entry
    before it."""
    first_label: dict[int, str] = {}
    for label, grad in named:
        if not isinstance(grad, torch.Tensor):
            return TypeError(
                f"{label} is {grad!r} ({type(grad).__name__}), not a tensor: pass the grads that "
                "are set (skip a parameter whose .grad is None)"
            )
        if grad.is_meta:
            return meta_tensor_error(label)
        if id(grad) in first_label:
            return ValueError(
                f"{first_label[id(grad)]} and {label} are the same tensor (of shape "
                f"{tuple(grad.shape)}), which would be {use} twice: give each grad once"
            )
        first_label[id(grad)] = label
    return None


def _kinds_by_group_checked(grads_by_group: GradsByGroup) -> dict[GroupKey, Kinds]:
    """Each group's grads by kind, checked over every group's list at once (:func:`_kinds_checked`).

    At once: a tensor under two groups would be counted twice."""
    labelled = (
        (f"grads_by_group[{_group_label(group)}][{index}]", grad)
        for group, grads in grads_by_group.items()
        for index, grad in enumerate(grads)
    )
    kinds = _kinds_checked(list(grads_by_group.values()), labelled, "counted")
    return dict(zip(grads_by_group, kinds, strict=True))


def _group_label(group: dist.ProcessGroup | None) -> str:
    if group is None:
        return "None"
    return f"<group of ranks {dist.get_process_group_ranks(group)}>"


def _shares_of_groups(
    grads_by_group: GradsByGroup, kinds_by_group: dict[GroupKey, Kinds], wanted: Wanted
) -> Shares:
    device = reduction_device(
        (grad for grads in grads_by_group.values() for grad in grads), grads_by_group
    )
    shares = Shares(wanted, device, grads_by_group)
    for group, kinds in kinds_by_group.items():
        add_parts(shares, group, kinds)
    return shares


@torch.no_grad()
def norm_of_grads(grads_by_group: GradsByGroup, norm_type: float = 2.0) -> torch.Tensor:
    """The ``norm_type``-norm of already-filtered grads, each group's share summed over its group.

    One all-reduce per distinct group (SUM, the inf-norm's maxima gathered), issued in an order
    every rank agrees on (by the group's ranks); ``None`` and single-rank groups issue none. Exact
    where ``sum |g|^p`` leaves the float range: the 1-, 2- and inf-norm in the one reduction, with
    no host sync; another ``p`` reads the norm on the host once and, only there, the grads twice
    more (:func:`~pgregistry.grad_stats._reductions.reduce_shares`). Without grad, as torch's
    ``get_total_norm`` and the model paths: grads made with ``create_graph=True`` gave a norm with
    an autograd graph, kept alive by every logged norm.

    Args:
        grads_by_group: reduction group -> the grads counted on this rank. Every rank of a group
            must pass that group as a key, with an empty list when it holds no grads for it.
        norm_type: a positive number, or ``inf`` for the max-norm.

    Returns:
        A 0-dim tensor on the grads' device (float64 when a grad is float64, else float32); 0 for an
        empty mapping or empty lists.

    Raises:
        ValueError: a tensor given twice (in one group's list or under two groups: it would be
            counted twice, as torch's ``get_total_norm`` counts it), or on the meta device, naming
            the first; on this rank, before any collective. ``norm_type`` refused, or on the CPU
            differing across the ranks of a group or refused on another, after the reduction
            (every rank joins it), as :func:`~pgregistry.grad_stats.grad_norm`.
        TypeError: an entry that is no tensor; ``norm_type`` no real number (after the reduction).

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
        >>> from pgregistry.grad_stats import StatsGroups, classify_grads
        >>> grads = classify_grads(model.parameters(), StatsGroups.from_collection(pg))
        >>> norm = norm_of_grads(grads)
        >>> norm  # the whole grad's, [0, 3, 0, 4]: the same on every rank
        tensor(5.)
    """
    kinds_by_group = _kinds_by_group_checked(grads_by_group)

    def read_shares(wanted: Wanted) -> Shares:
        return _shares_of_groups(grads_by_group, kinds_by_group, wanted)

    given = arguments_of_call(norm_type, None, clip=False)  # refused after the reduction
    wanted = Wanted(given.p, zeros=False)
    reduced = reduce_shares(read_shares(wanted), reread=read_shares, given=given)
    check_arguments_after(reduced, given, "norm_of_grads")
    return reduced.norm


def zeros_of_grads(grads_by_group: GradsByGroup) -> torch.Tensor:
    """The number of zero elements in already-filtered grads, summed over each group.

    Args:
        grads_by_group: as for :func:`norm_of_grads`.

    Returns:
        A 0-dim int64 tensor; -1 on a GPU where another rank of a group computes a norm instead
        (no device sync: nothing is raised there).

    Raises:
        ValueError: on the CPU, on every rank of a group where another rank computes a norm
            instead (:func:`norm_of_grads`, :func:`~pgregistry.grad_stats.grad_norm`: their rows
            carry other arguments), naming both, after the reduction; as :func:`norm_of_grads`
            otherwise.
        TypeError: as :func:`norm_of_grads`.

    Example:
        >>> import torch
        >>> zeros_of_grads({None: [torch.tensor([0.0, 1.0]), torch.zeros(3)]})  # None: axis off
        tensor(4)
    """
    kinds_by_group = _kinds_by_group_checked(grads_by_group)
    shares = _shares_of_groups(grads_by_group, kinds_by_group, Wanted.zeros_only())
    return zero_count_after(reduce_shares(shares), "zeros_of_grads")


@torch.no_grad()
def clip_grads_(
    grads: list[torch.Tensor] | tuple[torch.Tensor, ...],
    max_norm: float,
    total_norm: torch.Tensor | float,
    *,
    error_if_nonfinite: bool = False,
) -> torch.Tensor:
    """Scale ``grads`` in place by ``max_norm / (total_norm + 1e-6)`` where that is below 1.

    The coefficient is clamped at 1 as a tensor, so nothing waits on the device; scaling by exactly
    1 leaves a grad unchanged (and is skipped). A NaN or infinite ``total_norm`` (an overflow, one
    NaN grad anywhere in the world) leaves every grad unscaled: its coefficient would be NaN, or 0
    for an infinite norm, and would poison or erase the finite grads too; the caller sees the
    non-finite norm and skips the step. Without grad, as torch's ``clip_grads_with_norm_``: grads
    made with ``create_graph=True`` had their scaling recorded in their graph (a gradient penalty
    through them differed from torch's).

    Args:
        grads: the grads to scale, every copy of them (duplicates the norm does not count too, so
            replicas stay identical), each tensor once (one given twice is refused: it would be
            scaled twice, by the square of the coefficient, as torch's ``clip_grads_with_norm_``
            does).
        max_norm: the norm to clip to: positive and finite.
        total_norm: the global norm of the grads: 0 or more, NaN or inf (a number, or a
            one-element tensor; on its own device, else on the grads').
        error_if_nonfinite: raise on a non-finite norm (as ``torch.nn.utils.clip_grad_norm_``),
            which waits for the norm on the host.

    Returns:
        The coefficient applied (a 0-dim float32 tensor).

    Raises:
        TypeError: a grad that is no tensor (``None``); ``max_norm`` not a real number;
            ``total_norm`` neither a real number nor a one-element real tensor.
        ValueError: a tensor given twice, or on the meta device (naming the first);
            ``max_norm`` not positive and finite; ``total_norm`` negative (read on the host only; a
            negative norm on a device leaves the grads unscaled, as NaN does).
        RuntimeError: with ``error_if_nonfinite``, a NaN or infinite ``total_norm``.

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
        >>> from pgregistry.grad_stats import StatsGroups, classify_grads
        >>> grads_by_group = classify_grads(model.parameters(), StatsGroups.from_collection(pg))
        >>> norm = norm_of_grads(grads_by_group)
        >>> clip_grads_([p.grad for p in model.parameters()], 1.0, norm)  # the coefficient
        tensor(0.2000)
        >>> norm_of_grads(grads_by_group)  # each rank's grads scaled alike
        tensor(1.0000)
    """
    check_max_norm(max_norm)
    named = ((f"grads[{i}]", grad) for i, grad in enumerate(grads))
    (kinds,) = _kinds_checked([list(grads)], named, "scaled")
    norm = total_norm_as_tensor(total_norm, grads[0].device if grads else None)
    check_finite(norm, error_if_nonfinite)
    coeff = clip_coefficient(max_norm, norm)
    _scale_kinds_(kinds, coeff)
    return coeff.to(torch.float32)


def check_finite(norm: torch.Tensor, error_if_nonfinite: bool, *, which: str = "total") -> None:
    """With ``error_if_nonfinite``, ``RuntimeError`` for a NaN or infinite ``norm`` (host sync).

    ``which`` names the norm in the message: ``total``, or ``job-wide`` over a job's modules."""
    if error_if_nonfinite and not bool(torch.isfinite(norm)):
        raise RuntimeError(
            f"the {which} grad norm is {float(norm)}, not finite, so the grads "
            "cannot be clipped (they are left as they are); pass "
            "error_if_nonfinite=False to leave them unscaled without raising"
        )


def scale_grads_(
    grads: list[torch.Tensor] | tuple[torch.Tensor, ...], coeff: torch.Tensor | Clipping
) -> None:
    """Multiply ``grads`` (any devices and dtypes) in place by ``coeff``, one call per kind.

    ``coeff`` is 0-dim, at most 1; or clipping's, which the one-read kernel makes on the device from
    the norm."""
    _scale_kinds_(by_kind(grads), coeff)


def _scale_kinds_(kinds: Kinds, coeff: torch.Tensor | Clipping) -> None:
    """Multiply the tensors of each kind in place by ``coeff`` (:func:`scale_grads_`)."""
    for same_kind in kinds.values():
        scale_kind(same_kind, None, coeff)

"""Measure whether each gradient is replicated as its parameter's roles claim.

And what a wrong claim costs.

Grad statistics trust the roles (:mod:`pgregistry.params`): a parameter that is not TP-sharded is
taken to be replicated across TP and counted once; a routed expert is taken to be distinct per EP
rank and counted on each. A wrong role is silent: xorl counted per-expert LoRA factors once where
each EP rank held a different one, and the norm came out 1/sqrt(ep) too small. Replication can be
measured: a gradient is replicated across a group iff MAX - MIN over the group is 0 in every
element. :func:`audit_grad_replication` measures it for every gradient over every axis its
classification makes a claim about, and reports:

* each (parameter, axis) whose measured replication disagrees with the claim. The claims: across TP
  (expert TP for experts), replicated unless TP-sharded; across GTP-remat (expert GTP-remat for
  experts), replicated unless GTP-sharded; across EP, for parameters with an explicit ``allreduce``,
  replicated iff ``allreduce`` is True; across data-parallel replicas (``dp_cp``, ``expt_dp`` for
  experts), always replicated (reported only when no model-parallel axis explains the mismatch: EP
  ranks are dense data-parallel ranks);
* suspected ties: a parameter with a same-shape (2-D or more) counterpart on the other end of the
  pipeline (the collection's ``embd`` group) where neither copy is marked ``shared`` and their grads
  are not identical, so no measurement proves a tie, yet a tie is likely: they are named as an input
  embedding and an output layer (Megatron-Core's ``embedding.word_embeddings.weight`` and
  ``output_layer.weight``), either carries Megatron-Core's ``shared_embedding``, or their values or
  grads agree to 1e-5 (copies 1e-7 apart, or not all-reduced yet). A suspect is reported, never an
  error (an untied model has such pairs legitimately): ``ok`` ignores it;
* the norm the classification gives (exactly what :func:`~pgregistry.grad_stats.grad_norm` computes)
  beside the measured-truth norm, in which every gradient counts once per distinct copy: weighted by
  1/size of each axis it was measured replicated over, and reduced over the expert group when it was
  measured distinct across EP.

Requirements, because the measurement is collective:

* Every rank of the collection calls it, with grads already synchronised across data-parallel
  replicas.
* The ranks of each TP, GTP-remat, EP and data-parallel group (all within one pipeline stage) hold
  the same parameters: same names, shapes and dtypes, in the same order, with grads on the same
  ones. Every such rank then issues the same collectives in the same order, whatever the roles say
  (every axis is measured for every gradient, so even roles that differ between ranks cannot
  desynchronise the collectives). Pipeline stages may hold different parameters: no measuring group
  spans two stages. Ranks first compare a digest of their parameter structure over each group and
  raise ``ValueError`` together, on every rank, when they differ.
* A gradient that is zero over a whole group is consistent with any claim and is not reported.
  Constant grads (all ones) look replicated everywhere, so audit real gradients, not the invariance
  oracle's; non-finite gradients make the measurement meaningless.
"""

from __future__ import annotations

import hashlib
import math
import re
from typing import Any, Final

import attrs
import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from pgregistry._runtime.resolve import ParamsLike, normalise_params, resolve_pg_collection
from pgregistry.collection import ProcessGroupCollection, group_rank, group_size
from pgregistry.grad_stats import StatsGroups, param_is_not_shared, reduction_device
from pgregistry.grad_stats._classification import expert_params_without_allreduce
from pgregistry.grad_stats._dtensors import MeshAxes, classify_dtensor_grad, is_dtensor, mesh_ranks
from pgregistry.grad_stats._filters import STATS_FALLBACK
from pgregistry.grad_stats._local import parts_of
from pgregistry.grad_stats._plan import Plan
from pgregistry.grad_stats._reductions import Shares, Wanted, reduce_shares
from pgregistry.params import is_expert_param

__all__ = ["GradReplicationReport", "ReplicationMismatch", "SuspectedTie", "audit_grad_replication"]

REPLICATED: Final = "replicated"
UNIQUE: Final = "unique"

_AXES: Final = ("tp", "expt_tp", "gtp_remat", "expt_gtp_remat", "ep", "dp_cp", "expt_dp")
"""Every axis measured, in the order every rank measures them."""

_DATA_PARALLEL_AXES: Final = ("dp_cp", "expt_dp")

_BUCKET_ELEMENTS: Final = 1 << 22
"""Grad elements measured per collective (float64, doubled for MIN): bounds the extra memory."""

_HINTS: Final[dict[tuple[str, str], str]] = {
    (
        "tp",
        REPLICATED,
    ): "differs across TP ranks but is not marked TP-sharded (mark_tensor_parallel)",
    ("tp", UNIQUE): "is identical across TP ranks but is marked TP-sharded",
    (
        "gtp",
        REPLICATED,
    ): "differs across GTP-remat ranks but is not marked GTP-sharded (mark_gtp_sharded)",
    ("gtp", UNIQUE): "is identical across GTP-remat ranks but is marked GTP-sharded",
    ("ep", REPLICATED): "differs across EP ranks but is marked expert-replicated (mark_expert)",
    (
        "ep",
        UNIQUE,
    ): "is identical across EP ranks but is marked a routed expert (mark_expert_replicated)",
    (
        "dp",
        REPLICATED,
    ): "differs across data-parallel replicas though its roles hold on every model-parallel "
    "axis: are the grads synchronised yet?",
    (
        "embd",
        UNIQUE,
    ): (
        "is identical on the ranks of the embedding group (a copy tied across "
        "pipeline stages) but no copy is marked shared, so each is counted "
        "(mark_shared the second copy; Megatron-Core sets shared=True)"
    ),
}
_NEAR: Final = 1e-5
"""Relative agreement of two copies' sums and sums of squares that makes a tie likely.

The copies are values or grads.
"""
_INPUT_EMBEDDING: Final = re.compile(
    r"(^|\.)(word_embeddings|embedding|embeddings|embed_tokens|tok_embeddings|wte)\.weight$"
)
_OUTPUT_LAYER: Final = re.compile(r"(^|\.)(output_layer|lm_head|output|embed_out)\.weight$")
"""The names of an input embedding and of an output layer: Megatron-Core's
(``embedding.word_embeddings.weight``, ``output_layer.weight``) and the usual others (Hugging Face,
torchtitan, GPT-2)."""

_UNMARKED_HINT: Final = (
    "differs across EP ranks but carries no EP classification, so "
    "it is counted as a dense parameter (mark it with mark_expert, "
    "or its module with mark_expert_module and it with mark_expert)"
)


@attrs.frozen(slots=True, kw_only=True)
class ReplicationMismatch:
    """One parameter whose measured replication over ``axis`` disagrees with its classification.

    An entry of :attr:`GradReplicationReport.mismatches`; its text says what the mismatch does to
    the norm (:attr:`effect`) and which role helper fixes it (:attr:`hint`).

    Attributes:
        name: The parameter's name.
        axis: The group kind the replication was measured over (``tp``, ``ep``, ``dp_cp``, ...).
        claimed: What its roles say: ``"replicated"`` or ``"distinct"`` across ``axis``.
        measured: What the gradients showed.
        unmarked: True when the parameter carries no EP classification at all.

    Example:
        >>> mismatch = ReplicationMismatch(
        ...     name="norm.weight", axis="tp", claimed="replicated", measured="distinct"
        ... )
        >>> mismatch.effect
        'undercount'
        >>> print(mismatch)
        norm.weight: across tp classified replicated, measured distinct (undercount): differs ...
    """

    name: str
    axis: str
    claimed: str
    measured: str
    unmarked: bool = False
    """The parameter carries no EP classification at all (in no marked expert module)."""

    @property
    def effect(self) -> str:
        """``undercount`` (distinct copies counted once) or ``overcount`` (one copy, many times)."""
        return "undercount" if self.claimed == REPLICATED else "overcount"

    @property
    def hint(self) -> str:
        """What the mismatch means and which role helper fixes it."""
        if self.unmarked:
            return _UNMARKED_HINT
        family = {
            "expt_tp": "tp",
            "expt_gtp_remat": "gtp",
            "gtp_remat": "gtp",
            "dp_cp": "dp",
            "expt_dp": "dp",
        }
        return _HINTS.get((family.get(self.axis, self.axis), self.claimed), "")

    def __str__(self) -> str:
        return (
            f"{self.name}: across {self.axis} classified {self.claimed}, measured {self.measured} "
            f"({self.effect}): {self.hint}"
        )


@attrs.frozen(slots=True, kw_only=True)
class SuspectedTie:
    """A parameter that may be tied to one at the pipeline's other end: reported, never an error.

    No measurement shows the tie (see the module docstring); an entry of
    :attr:`GradReplicationReport.suspected_ties`, which leaves the report ``ok``.

    Attributes:
        name: This rank's parameter.
        other_name: The parameter on the other rank it may be tied to.
        other_rank: The global rank holding ``other_name`` (of this rank's ``embd`` group).
        shape: The shape both share.
        evidence: What else points at a tie (each a short phrase, joined in the text).

    Its ``str`` is the line the report prints: the pair, the evidence, and the fix either way.

    Example:
        >>> tie = SuspectedTie(
        ...     name="lm_head.weight",
        ...     other_name="embed.weight",
        ...     other_rank=0,
        ...     shape=(32, 8),
        ...     evidence=("values that agree to 1e-5",),
        ... )
        >>> print(tie)  # doctest: +NORMALIZE_WHITESPACE
        lm_head.weight and embed.weight on rank 0: same shape (32, 8), values that agree to 1e-5,
        neither copy marked shared, so each is counted. If they are one weight tied across
        pipeline stages, mark the last stage's copy with mark_shared ... nothing is wrong
    """

    name: str
    other_name: str
    other_rank: int
    """The global rank holding ``other_name`` (a rank of this rank's ``embd`` group)."""
    shape: tuple[int, ...]
    evidence: tuple[str, ...]

    def __str__(self) -> str:
        return (
            f"{self.name} and {self.other_name} on rank {self.other_rank}: same shape "
            f"{self.shape}, {', '.join(self.evidence)}, neither copy marked shared, so "
            "each is counted. If they are one weight tied across pipeline stages, mark "
            "the last stage's copy with mark_shared (Megatron-Core sets shared=True "
            "and shared_embedding=True on it) and synchronise the tie's grads over the "
            "'embd' group; if they are distinct weights, nothing is wrong"
        )


@attrs.frozen(slots=True, kw_only=True)
class GradReplicationReport:
    """What :func:`audit_grad_replication` found on this rank.

    ``classified_norm`` is the 2-norm grad statistics compute from the roles (in float64, before the
    statistics' float32 result, so that a mismatch's effect shows); ``true_norm`` the one measured
    replication implies (NaN when some grads differ across data-parallel replicas with no
    model-parallel reason: they are not synchronised, and no norm is the truth). ``mismatches``
    lists this rank's parameters whose replication disagrees with their roles; ``unclassified`` the
    parameters of marked expert modules that carry no EP classification (reported when EP is on);
    ``suspected_ties`` the likely ties no measurement proves, which leave the report ``ok`` (an
    untied model may have such pairs). A report that lists a mismatch never reads as agreeing: it is
    not ``ok``, and its ratio is either shown to the digits that differ from 1 or said to be
    unknown.

    Attributes:
        classified_norm: The norm as the roles classify the grads (float64).
        true_norm: The norm measured replication implies (NaN: grads not synchronised).
        params_checked: How many gradients were checked on this rank.
        mismatches: The :class:`ReplicationMismatch` entries.
        unclassified: Names of expert-module parameters with no EP classification.
        suspected_ties: The :class:`SuspectedTie` entries.

    Example:
        >>> report = GradReplicationReport(
        ...     classified_norm=2.0, true_norm=2.0, params_checked=3, mismatches=()
        ... )
        >>> report.ok, report.norm_ratio
        (True, 1.0)
        >>> print(report)
        grad replication audit: 3 gradient(s) checked, ok
          classified norm 2, measured-truth norm 2, ratio 1.000000 (relative error 0%)
    """

    classified_norm: float
    true_norm: float
    params_checked: int
    mismatches: tuple[ReplicationMismatch, ...]
    unclassified: tuple[str, ...] = ()
    suspected_ties: tuple[SuspectedTie, ...] = ()

    @property
    def ok(self) -> bool:
        """True if every measured replication matches its classification (suspected ties aside)."""
        return not self.mismatches and not self.unclassified

    @property
    def norm_ratio(self) -> float:
        """``classified_norm / true_norm`` (1 when both are 0; NaN when the truth is unknown)."""
        if math.isnan(self.true_norm):
            return math.nan
        if self.true_norm == 0:
            return 1.0 if self.classified_norm == 0 else math.inf
        return self.classified_norm / self.true_norm

    @property
    def relative_error(self) -> float:
        """``|classified_norm - true_norm| / true_norm``."""
        return abs(self.norm_ratio - 1.0)

    def __str__(self) -> str:
        verdict = "ok" if self.ok else f"{len(self.mismatches)} mismatch(es)"
        if math.isnan(self.true_norm):
            norms = (
                f"  classified norm {self.classified_norm:.6g}, measured-truth norm unknown: "
                "grads differ across data-parallel replicas (synchronise them before auditing)"
            )
        else:
            ratio = f"{self.norm_ratio:.6f}"
            if self.mismatches and ratio == "1.000000":  # never "1.000000" beside a mismatch
                ratio = (
                    f"{self.norm_ratio:.17g}"
                    if self.norm_ratio != 1.0
                    else (
                        "1 within the statistics' precision, though "
                        "the mismatches below change what is counted"
                    )
                )
            norms = (
                f"  classified norm {self.classified_norm:.6g}, "
                f"measured-truth norm {self.true_norm:.6g}, ratio {ratio} "
                f"(relative error {100 * self.relative_error:.3g}%)"
            )
        lines = [
            f"grad replication audit: {self.params_checked} gradient(s) checked, {verdict}",
            norms,
        ]
        lines.extend(f"  - {mismatch}" for mismatch in self.mismatches)
        if self.unclassified:
            lines.append(
                "  unclassified expert-module parameters (no "
                f"allreduce): {', '.join(self.unclassified)}"
            )
        lines.extend(
            f"  suspected tie (not an error): {suspect}" for suspect in self.suspected_ties
        )
        return "\n".join(lines)


def audit_grad_replication(
    model_or_params: ParamsLike, pg_collection: ProcessGroupCollection | None = None
) -> GradReplicationReport:
    """Measure each gradient's replication against its classification; see the module docstring.

    Collective over the groups below; the other groups resolve as for the grad statistics
    (:class:`~pgregistry.grad_stats.StatsGroups`).

    Args:
        model_or_params: a model, model chunks, a name -> parameter mapping, or parameters, after a
            backward.
        pg_collection: the collection (default: the one attached to the model, else the global grid
            with a warning); it must set ``tp``, ``mp``, ``ep``, ``dp_cp``, ``expt_dp`` and the
            expert model-parallel group (``None`` when an axis is off).

    Returns:
        The :class:`GradReplicationReport`: the norm as classified and as measured, the parameters
        checked, the mismatches between roles and measured replication, the unclassified parameters
        and the suspected ties across pipeline stages.

    Raises:
        TypeError: ``pg_collection`` neither a collection nor ``None``.
        ValueError: a needed group unset (named); on every rank, the ranks of a group holding
            different parameter structures.

    Example:
        On every rank of a 2-rank world (as :func:`pgregistry.testing.run_world` starts it):

        >>> import torch
        >>> from pgregistry import ParallelLayout, build
        >>> pg = build(ParallelLayout(num_ranks=2, tp=2))
        >>> model = torch.nn.Linear(2, 1)
        >>> model(torch.ones(1, 2)).sum().backward()  # the same grads on both TP ranks
        >>> report = audit_grad_replication(model, pg)  # unmarked: replicated over TP, as measured
        >>> report.ok
        True
    """
    params = normalise_params(model_or_params)
    collection = resolve_pg_collection(
        pg_collection, params.chunks, owner="audit_grad_replication", fallback=STATS_FALLBACK
    )
    missing = [name for name in ("ep", "dp_cp", "expt_dp") if not collection.is_set(name)]
    if missing:
        raise ValueError(
            "audit_grad_replication needs the collection's "
            f"{missing} group(s); set them (None = off)"
        )
    stats = StatsGroups.from_collection(collection)
    axis_groups: dict[str, ProcessGroup | None] = {
        "tp": stats.tp,
        "expt_tp": stats.expt_tp,
        "gtp_remat": stats.gtp_remat,
        "expt_gtp_remat": stats.expt_gtp_remat,
        "ep": collection.get("ep"),
        "dp_cp": collection.get("dp_cp"),
        "expt_dp": collection.get("expt_dp"),
    }
    named = list(params.named)
    _check_same_structure(named, axis_groups, stats)
    audited = [
        (name, param)
        for name, param in named
        if param.grad is not None and param_is_not_shared(param)
    ]
    rank = dist.get_rank()
    axis_ranks = {axis: frozenset(_group_ranks(group, rank)) for axis, group in axis_groups.items()}
    # Over an axis a DTensor grad's mesh spans, its placements say how it is laid out: nothing to
    # measure there.
    spanned = [
        {
            axis
            for axis, ranks in axis_ranks.items()
            if len(mesh_ranks(param.grad, rank) & ranks) > 1  # type: ignore[arg-type]
        }
        for _, param in audited
    ]
    replicated, zero = _measure_replication(audited, axis_groups, spanned)
    ties, suspects = _across_stages(named, audited, _embedding_group(collection))
    mesh_axes = MeshAxes(collection, {False: stats.dense_reduce, True: stats.expert_reduce})
    reduce_groups = (stats.dense_reduce, stats.expert_reduce)
    device = reduction_device([p.grad for _, p in audited if p.grad is not None], reduce_groups)
    truth = Shares(Wanted.of(2.0, zeros=False), device, reduce_groups)

    mismatches: list[ReplicationMismatch] = []
    unsynchronised = False
    for index, (name, param) in enumerate(audited):
        rep = {axis: measured[index] for axis, measured in replicated.items() if index in measured}
        is_zero = {axis: measured[index] for axis, measured in zero.items() if index in measured}
        distinct = {axis for axis in rep if not is_zero[axis] and not rep[axis]}
        found = [
            ReplicationMismatch(
                name=name,
                axis=axis,
                claimed=REPLICATED if claimed else UNIQUE,
                measured=REPLICATED if rep[axis] else UNIQUE,
            )
            for axis, claimed in _replication_claims(param)
            if axis in rep and not is_zero[axis] and claimed != rep[axis]
        ]
        # A parameter without an EP classification (in no marked expert module) that differs across
        # EP ranks and across its data-parallel replicas is, in truth, a routed expert: say so,
        # rather than "not synchronised".
        unmarked_expert = (
            not hasattr(param, "allreduce") and "ep" in distinct and "dp_cp" in distinct
        )
        if unmarked_expert:
            found = [m for m in found if m.axis not in _DATA_PARALLEL_AXES]
            found.append(
                ReplicationMismatch(
                    name=name, axis="ep", claimed=REPLICATED, measured=UNIQUE, unmarked=True
                )
            )
        if index in ties:
            found.append(
                ReplicationMismatch(name=name, axis="embd", claimed=UNIQUE, measured=REPLICATED)
            )
        # Data-parallel replicas span the model-parallel axes of the other grid (EP ranks are dense
        # DP ranks), so a mismatch there is only news when no model-parallel axis explains it; then
        # the grads differ across replicas (not synchronised yet) and no norm is the truth.
        model_parallel = [m for m in found if m.axis not in _DATA_PARALLEL_AXES]
        mismatches.extend(model_parallel or found)
        unsynchronised = unsynchronised or (bool(found) and not model_parallel)
        # An expert-module parameter claimed replicated across EP but measured distinct there is, in
        # truth, a routed expert: its copies are summed over the expert group like any other
        # expert's.
        truly_expert = (
            is_expert_param(param)
            or unmarked_expert
            or (hasattr(param, "allreduce") and "ep" in distinct)
        )
        weight = 1.0 / ties.get(index, 1)
        grad = param.grad
        assert grad is not None  # params without grads were left out above
        if is_dtensor(grad):
            verdict = _measure_dtensor_verdicts(rep, axis_groups, truly_expert)
            entry = classify_dtensor_grad(
                name,
                param,
                grad,  # type: ignore[arg-type]
                mesh_axes,
                verdict,
                expert=truly_expert,
            )
            if entry.outer is not None:
                group = collection.get(entry.outer)
                parts = (
                    _norm_parts_weighted_by(entry.local, weight, device)
                    if entry.counted
                    else [None]
                )
                for part in parts:
                    truth.add_first(entry.outer, group, reduce_groups, int(entry.expert), part)
            elif entry.counted:
                for part in _norm_parts_weighted_by(entry.local, weight, device):
                    truth.add(mesh_axes.reduce_groups[entry.expert], part)
            continue
        for axis in ("expt_tp", "expt_gtp_remat", "ep") if truly_expert else ("tp", "gtp_remat"):
            if rep.get(axis, False):
                weight /= group_size(axis_groups[axis])
        group = stats.expert_reduce if truly_expert else stats.dense_reduce
        for part in _norm_parts_weighted_by(grad.detach(), weight, device):
            truth.add(group, part)

    plan = Plan(named, stats)
    classified = reduce_shares(plan.read([param for _, param in named], truth.wanted).shares).norm64
    measured = reduce_shares(truth).norm64
    assert classified is not None and measured is not None
    unclassified: tuple[str, ...] = ()
    if group_size(axis_groups["ep"]) > 1:
        unclassified = tuple(expert_params_without_allreduce(params))
    return GradReplicationReport(
        classified_norm=float(classified.item()),
        true_norm=math.nan if unsynchronised else float(measured.item()),
        params_checked=len(audited),
        mismatches=tuple(mismatches),
        unclassified=unclassified,
        suspected_ties=suspects,
    )


def _norm_parts_weighted_by(
    grad: torch.Tensor, weight: float, device: torch.device
) -> list[torch.Tensor]:
    """The 2-norm parts of ``grad`` with its squares weighted by ``weight``, in float64.

    In float64 so the weights of replicas add up exactly, and a mismatch as small as float64
    resolves shows in the ratio."""
    parts = parts_of([grad], Wanted.of(2.0, zeros=False), device)
    return [part * _share_weights(part, weight) for part in parts]


def _share_weights(part: torch.Tensor, weight: float) -> torch.Tensor:
    """``weight`` for each share column of ``part``, 1 for its zero count (the second column).

    A float64 grad's 2-norm part has more share columns, its squares by range."""
    weights = torch.full(part.shape, weight, dtype=torch.float64, device=part.device)
    weights[1] = 1.0
    return weights


def _embedding_group(collection: ProcessGroupCollection) -> ProcessGroup | None:
    """The collection's ``embd`` group when this rank is in one of more than one rank.

    ``ValueError`` when it is not set on a collection whose pipeline is on (ties across stages could
    not be checked)."""
    if not collection.is_set("embd"):
        if collection.is_set("pp") and group_size(collection.get("pp")) > 1:
            raise ValueError(
                "audit_grad_replication checks parameters tied across pipeline stages over the "
                "collection's 'embd' group, which is not set; set it (pgregistry.build does)"
            )
        return None
    if not collection.is_member_of("embd"):
        return None
    group = collection.get("embd")
    return group if group_size(group) > 1 else None


def _across_stages(
    named: list[tuple[str, torch.Tensor]],
    audited: list[tuple[str, torch.Tensor]],
    embd: ProcessGroup | None,
) -> tuple[dict[int, int], tuple[SuspectedTie, ...]]:
    """Ties across the pipeline's ends, measured and suspected, in one all-gather over ``embd``.

    Measured: audited grads (by index) identical, and not zero, on other ranks of the embedding
    group (the first and last pipeline stages: a tied embedding) where no copy is marked ``shared``:
    index -> the number of copies (each grad's digest is its values' SHA-256, shape and dtype, and
    whether its parameter is marked shared). A tie whose other copy is marked is counted once and is
    no mismatch. Suspected: see :class:`SuspectedTie`.
    """
    if embd is None:
        return {}, ()
    mine = {id(param): index for index, (_, param) in enumerate(audited)}
    digests = [
        (_grad_digest(param.grad), not param_is_not_shared(param), mine.get(id(param)))
        for _, param in named
        if param.grad is not None and bool(_local_grad(param.grad).any())
    ]
    shapes = [_shape_entry(name, param) for name, param in named if param.dim() >= 2]
    everyone: list[Any] = [None] * group_size(embd)
    dist.all_gather_object(
        everyone, ([(digest, shared) for digest, shared, _ in digests], shapes), group=embd
    )
    here = dist.get_group_rank(embd, dist.get_rank())
    elsewhere: dict[str, list[bool]] = {}
    for position, (entries, _) in enumerate(everyone):
        if position != here:
            for digest, shared in entries:
                elsewhere.setdefault(digest, []).append(shared)
    ties = {
        index: 1 + len(elsewhere[digest])
        for digest, _, index in digests
        if index is not None and digest in elsewhere and not any(elsewhere[digest])
    }
    tied = {audited[index][0] for index in ties}
    suspects = [
        suspect
        for position, (_, theirs) in enumerate(everyone)
        if position != here
        for entry in shapes
        if entry["name"] not in tied
        for other in theirs
        if (suspect := _suspect_tie(entry, other, dist.get_global_rank(embd, position))) is not None
    ]
    return ties, tuple(suspects)


def _shape_entry(name: str, param: torch.Tensor) -> dict[str, Any]:
    """What another stage needs to suspect a tie with ``param``.

    Its name, shape, dtype, marks, and the float64 sum and sum of squares of its (local) values and
    grad."""
    grad = param.grad
    return {
        "name": name,
        "shape": tuple(param.shape),
        "dtype": str(param.dtype),
        "shared": not param_is_not_shared(param),
        "shared_embedding": bool(getattr(param, "shared_embedding", False)),
        "values": _sum_and_sum_of_squares(_local_grad(param)),
        "grad": _sum_and_sum_of_squares(_local_grad(grad)) if grad is not None else None,
    }


def _sum_and_sum_of_squares(tensor: torch.Tensor) -> tuple[float, float] | None:
    """The float64 sum and sum of squares of ``tensor`` (accumulated in float64, no copy of it)."""
    if tensor.is_meta:
        return None
    values = tensor.detach()
    return float(values.sum(dtype=torch.float64)), float(
        torch.linalg.vector_norm(values, dtype=torch.float64)
    ) ** 2


def _sums_agree(
    mine: tuple[float, float] | None, theirs: tuple[float, float] | None, numel: int
) -> bool:
    """Whether two copies' sums and sums of squares agree to :data:`_NEAR` (not both zero)."""
    if mine is None or theirs is None or max(mine[1], theirs[1]) == 0:
        return False
    squares = max(mine[1], theirs[1])
    return abs(mine[1] - theirs[1]) <= _NEAR * squares and abs(
        mine[0] - theirs[0]
    ) <= _NEAR * math.sqrt(squares * numel)


def _suspect_tie(
    mine: dict[str, Any], other: dict[str, Any], other_rank: int
) -> SuspectedTie | None:
    """A suspected tie between this rank's ``mine`` and another stage's ``other``, or ``None``."""
    if (
        mine["shape"] != other["shape"]
        or mine["dtype"] != other["dtype"]
        or mine["shared"]
        or other["shared"]
    ):
        return None
    numel = math.prod(mine["shape"])
    evidence = []
    names = mine["name"], other["name"]
    if any(_INPUT_EMBEDDING.search(a) and _OUTPUT_LAYER.search(b) for a, b in (names, names[::-1])):
        evidence.append("an input embedding's and an output layer's names")
    if mine["shared_embedding"] or other["shared_embedding"]:
        evidence.append(
            "marked shared_embedding (Megatron-Core's mark of a tied embedding's copies)"
        )
    if _sums_agree(mine["values"], other["values"], numel):
        evidence.append("values that agree to 1e-5")
    if _sums_agree(mine["grad"], other["grad"], numel):
        evidence.append("grads that agree to 1e-5 but are not identical")
    if not evidence:
        return None
    return SuspectedTie(
        name=mine["name"],
        other_name=other["name"],
        other_rank=other_rank,
        shape=mine["shape"],
        evidence=tuple(evidence),
    )


def _grad_digest(grad: torch.Tensor) -> str:
    local = _local_grad(grad).detach()
    values = local.to(device="cpu", dtype=torch.float64).contiguous().numpy().tobytes()
    return f"{tuple(local.shape)}:{local.dtype}:{hashlib.sha256(values).hexdigest()}"


def _group_ranks(group: ProcessGroup | None, rank: int) -> list[int]:
    return [rank] if group is None else dist.get_process_group_ranks(group)


def _measure_dtensor_verdicts(
    rep: dict[str, bool], axis_groups: dict[str, ProcessGroup | None], expert: bool
) -> tuple[bool, bool]:
    """Whether this rank counts a DTensor grad's piece over TP and GTP, by measurement.

    For the axes its mesh does not span: a piece measured replicated there is counted on the axis's
    rank 0 only."""
    fields = ("expt_tp", "expt_gtp_remat") if expert else ("tp", "gtp_remat")
    tp, gtp = (not rep.get(field, False) or group_rank(axis_groups[field]) == 0 for field in fields)
    return tp, gtp


def _replication_claims(param: torch.Tensor) -> list[tuple[str, bool]]:
    """``(axis, claimed replicated)`` for each axis ``param``'s classification claims about."""
    expert = is_expert_param(param)
    claims = [
        ("expt_tp" if expert else "tp", not getattr(param, "tensor_model_parallel", False)),
        (
            "expt_gtp_remat" if expert else "gtp_remat",
            not getattr(param, "is_gtp_weight_remat", False),
        ),
    ]
    if hasattr(param, "allreduce"):
        claims.append(("ep", not expert))
    claims.append(("expt_dp" if expert else "dp_cp", True))
    return claims


def _spans_several_ranks(group: ProcessGroup | None) -> bool:
    return group is not None and group_size(group) > 1


def _check_same_structure(
    named: list[tuple[str, torch.Tensor]],
    axis_groups: dict[str, ProcessGroup | None],
    stats: StatsGroups,
) -> None:
    """Raise on every rank when the ranks of a measuring group hold different parameter structures.

    Each measuring group compares a digest of (name, shape, dtype, has grad, shared) for every
    parameter; the verdict is then spread over ``dp_cp`` and ``mp``, which together span every rank,
    so all raise together.
    """
    text = repr(
        [
            (
                n,
                tuple(p.shape),
                str(p.dtype),
                p.grad is not None,
                not param_is_not_shared(p),
                _dtensor_placements(p),
            )
            for n, p in named
        ]
    )
    digest = int(hashlib.sha256(text.encode()).hexdigest()[:15], 16)
    device = reduction_device(
        (p.grad for _, p in named if p.grad is not None), axis_groups.values()
    )
    differing: list[str] = []
    for axis in _AXES:
        group = axis_groups[axis]
        if not _spans_several_ranks(group):
            continue
        both = torch.tensor([digest, -digest], dtype=torch.int64, device=device)
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
        if int(both[0]) != -int(both[1]):
            differing.append(axis)
    verdict = torch.tensor([1 if differing else 0], dtype=torch.int64, device=device)
    for group in (axis_groups["dp_cp"], stats.dense_reduce):
        if _spans_several_ranks(group):
            dist.all_reduce(verdict, op=dist.ReduceOp.MAX, group=group)
    if int(verdict.item()):
        where = (
            f"this rank's {differing} group(s) differ"
            if differing
            else "another rank's groups differ"
        )
        raise ValueError(
            "audit_grad_replication needs the ranks of each TP/GTP/EP/data-parallel group to hold "
            f"the same parameters (names, shapes, dtypes, grads present) in the same order; {where}"
        )


def _measure_replication(
    audited: list[tuple[str, torch.Tensor]],
    axis_groups: dict[str, ProcessGroup | None],
    spanned: list[set[str]],
) -> tuple[dict[str, dict[int, bool]], dict[str, dict[int, bool]]]:
    """Whether each audited gradient is replicated, and zero, over each group its mesh misses.

    Per axis that is on and per audited gradient (by index) not spanned there by its DTensor mesh:
    replicated over the group, and zero over the whole group. A DTensor grad is measured through its
    local piece."""
    on = [axis for axis in _AXES if _spans_several_ranks(axis_groups[axis])]
    replicated: dict[str, dict[int, bool]] = {axis: {} for axis in on}
    zero: dict[str, dict[int, bool]] = {axis: {} for axis in on}
    locals_ = [_local_grad(param.grad) for _, param in audited]  # type: ignore[arg-type]
    for axis in on:
        indices = [index for index in range(len(audited)) if axis not in spanned[index]]
        for bucket in _bucket_indices(indices, [locals_[index].numel() for index in indices]):
            # float64 holds every float32/bf16/fp16 value exactly, so equal there means
            # bit-identical values.
            flat = torch.cat(
                [locals_[index].detach().reshape(-1).to(torch.float64) for index in bucket]
            )
            # A NaN or an infinity has no spread (NaN - NaN, inf - inf are NaN): identical
            # non-finite grads measured as differing, a replicated grad reported as a mismatch.
            # Their kind travels as a code instead, their value as 0.
            values, codes = _finite_and_codes(flat)
            count = flat.numel()
            both = torch.cat([values, -values, codes, -codes])
            dist.all_reduce(both, op=dist.ReduceOp.MAX, group=axis_groups[axis])
            maximum, neg_minimum = both[:count], both[count : 2 * count]
            top_code, neg_bottom_code = both[2 * count : 3 * count], both[3 * count :]
            spread = (maximum + neg_minimum) + (top_code + neg_bottom_code)
            magnitude = torch.maximum(maximum, neg_minimum) + top_code
            sizes = [locals_[index].numel() for index in bucket]
            parts = zip(bucket, spread.split(sizes), magnitude.split(sizes), strict=True)
            for index, part_spread, part_magnitude in parts:
                replicated[axis][index] = bool((part_spread == 0).all())
                zero[axis][index] = bool((part_magnitude == 0).all())
    return replicated, zero


def _finite_and_codes(flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``flat`` with its non-finite values 0, and each element's kind as a code.

    The codes: 0 finite, 1 NaN, 2 +inf, 3 -inf; two ranks' elements are equal when both their values
    and their codes are."""
    finite = flat.isfinite()
    values = torch.where(finite, flat, torch.zeros_like(flat))
    codes = torch.where(
        flat.isnan(),
        1.0,
        torch.where(flat == torch.inf, 2.0, torch.where(flat == -torch.inf, 3.0, 0.0)),
    ).to(flat.dtype)
    return values, codes


def _dtensor_placements(param: torch.Tensor) -> str:
    """A DTensor grad's placements (the measured axes depend on them), else ``""``."""
    grad = param.grad
    if grad is None or not is_dtensor(grad):
        return ""
    return str(grad.placements)  # type: ignore[attr-defined]


def _local_grad(grad: torch.Tensor) -> torch.Tensor:
    return grad.to_local() if is_dtensor(grad) else grad  # type: ignore[attr-defined]


def _bucket_indices(indices: list[int], sizes: list[int]) -> list[list[int]]:
    """Runs of ``indices`` of at most :data:`_BUCKET_ELEMENTS` elements (a larger grad alone)."""
    buckets: list[list[int]] = []
    total = 0
    for index, size in zip(indices, sizes, strict=True):
        if buckets and total + size <= _BUCKET_ELEMENTS:
            buckets[-1].append(index)
            total += size
        else:
            buckets.append([index])
            total = size
    return buckets

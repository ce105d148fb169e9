"""Job-wide grad statistics over the modules of a job.

They are :func:`grad_norm`, :func:`count_zeros` and :func:`clip_grad_norm_`.

Each module's statistic comes from pgregistry's single-model path on that module's collection, as
:func:`pgregistry.grad_stats.grad_norm` and :func:`~pgregistry.grad_stats.count_zeros` take it: the
module's kept plan checked once a call (made anew only where it could be stale:
:mod:`pgregistry.grad_stats._plan`), then the grads read once and reduced; the clip scales what that
read found. It counts each of the module's grads once over the module's span and leaves the same
value on every rank of the span. One all-reduce over the world then combines the modules. A module's
value lives on its ranks only: each rank puts, for each module it runs, that module's value in the
module's slot of a vector indexed by module, and 0 elsewhere; a MAX over the world fills every slot
with its module's value (every rank of a module holds the same), so a rank outside a module
contributes nothing for it, and a module is counted once however many ranks run it. The job-wide
norm is then ``(sum_m n_m^p)^(1/p)`` (the largest ``n_m`` for the inf-norm), the zero count ``sum_m
z_m``, both in float64.

Unlike Megatron-Core's ``MimoOptimizer``, which this follows: a non-finite module norm is sent
encoded as a number above every finite norm (a NaN inside a MAX all-reduce is backend-dependent:
gloo keeps or drops it depending on which rank holds it, and a job-wide norm of a NaN gradient would
then look finite); module norms are combined in float64, scaled by the largest, so no square
overflows (each module's own norm is :mod:`pgregistry.grad_stats`'s, in its grads' precision), and
the job-wide norm is float64 on every rank when any module's is (float64 grads: a norm beyond
float32's range stays finite where it was clipped by), float32 otherwise; and every rank agrees on
the modules, their spans and the call's options first (:func:`_agree_on_models`), so a
rank that lists other modules, or was given a model for a module it does not run (or none for one it
runs), raises on every rank instead of leaving a module's ranks waiting.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from itertools import chain, repeat
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from pgregistry._runtime.agreement import (
    Fault,
    check_agreement,
    check_verdict,
    combine_faults,
    verdict_of,
)
from pgregistry._runtime.communicators import span_text
from pgregistry._runtime.flags import flag_error
from pgregistry._runtime.resolve import ParamsLike, source_of
from pgregistry.grad_stats import backend_device, clip_grads_
from pgregistry.grad_stats._arguments import max_norm_error, norm_type_as_float, norm_type_error
from pgregistry.grad_stats._functional import CheckedPlan, check_plan, reduce_checked
from pgregistry.grad_stats._lists import check_finite
from pgregistry.grad_stats._plan import Read
from pgregistry.grad_stats._reductions import Clipping, Wanted, zero_count_after
from pgregistry.modules._collection import (
    MODULES_ADVICE,
    MultiModuleCollection,
    require_multi_module_collection,
)

if TYPE_CHECKING:
    from pgregistry.collection import ProcessGroupCollection

__all__ = [
    "check_models",
    "clip_grad_norm_",
    "clip_to_job_norm",
    "count_zeros",
    "describe_modules",
    "grad_norm",
    "module_values",
    "reduce_over_modules",
]


def grad_norm(
    models: Mapping[str, ParamsLike], modules: MultiModuleCollection, *, norm_type: float = 2.0
) -> torch.Tensor:
    """The ``norm_type``-norm of every grad of every module of the job, each grad counted once.

    Each module's norm is :func:`pgregistry.grad_stats.grad_norm` on its collection, over its span;
    the modules are combined by one all-reduce over the world (see the module docstring). Collective
    over the world: every rank calls it, with the same ``modules`` and ``norm_type``, a rank that
    runs no module included.

    Args:
        models: the name of each module this rank runs (:meth:`MultiModuleCollection.here`) -> its
            model, model chunks or parameters; exactly those.
        modules: the job's :class:`MultiModuleCollection`.
        norm_type: a positive number, or ``inf`` for the max-norm.

    Returns:
        A 0-dim tensor on the device the world's backend reduces on, float64 when a module's grads
        are float64, else float32, on every rank. A NaN or infinite grad in any module makes it NaN
        or infinite on every rank (NaN wins).

    Raises:
        ValueError: on every rank, naming each culprit rank and module: ranks listing other modules
            or spans; a model for a module this rank does not run, none for one it runs, or a model
            the module's statistics refuse (an unclassified expert parameter, another collection
            attached); a tensor in the models of two modules a rank runs (counted in both).

    Example:
        On every rank of a 4-rank world (as :func:`pgregistry.testing.run_world` starts it), module
        ``"a"`` on ranks 0-1 and ``"b"`` on ranks 2-3:

        >>> import torch
        >>> from pgregistry import ParallelLayout
        >>> from pgregistry.modules import build_modules
        >>> modules = build_modules(
        ...     {"a": ParallelLayout(num_ranks=2), "b": ParallelLayout(num_ranks=2, rank_offset=2)}
        ... )
        >>> (name,) = modules.here()
        >>> weight = torch.nn.Parameter(torch.zeros(2))
        >>> weight.grad = torch.tensor([0.0, 3.0]) if name == "a" else torch.tensor([0.0, 4.0])
        >>> models = {"a": [weight], "b": [weight]}  # each rank's copy of both, say
        >>> grad_norm({name: models[name] for name in modules.here()}, modules)
        tensor(5.)
    """
    owner, options = "pgregistry.modules.grad_norm", {"norm_type": repr(norm_type)}
    checked = _agree_on_models(
        models, modules, owner, options, extra_error=norm_type_error(norm_type)
    )
    return _job_grad_norm(checked, modules, norm_type, owner, options)[0]


def count_zeros(models: Mapping[str, ParamsLike], modules: MultiModuleCollection) -> int:
    """The number of zero grad elements over every module of the job, each element counted once.

    Each module's count is :func:`pgregistry.grad_stats.count_zeros` on its collection; collective
    as :func:`grad_norm`.

    Args:
        models: the name of each module this rank runs -> its model, model chunks or parameters.
        modules: the job's :class:`MultiModuleCollection`.

    Returns:
        The count, the same on every rank.

    Raises:
        ValueError: on every rank, another rank calling another of the job's statistics
            (:func:`grad_norm`, :func:`clip_grad_norm_`), before any module reduces (``'call'
            differs``, naming each rank's call); a module's zero count beside a norm on one of its
            ranks (its reduction's error, named by module, on a GPU too: the count is read on the
            host); as :func:`grad_norm` otherwise.

    Example:
        On every rank of a 4-rank world (as :func:`pgregistry.testing.run_world` starts it), module
        ``"a"`` on ranks 0-1 and ``"b"`` on ranks 2-3:

        >>> import torch
        >>> from pgregistry import ParallelLayout
        >>> from pgregistry.modules import build_modules
        >>> modules = build_modules(
        ...     {"a": ParallelLayout(num_ranks=2), "b": ParallelLayout(num_ranks=2, rank_offset=2)}
        ... )
        >>> (name,) = modules.here()
        >>> weight = torch.nn.Parameter(torch.zeros(2))
        >>> weight.grad = torch.tensor([0.0, 3.0]) if name == "a" else torch.tensor([0.0, 4.0])
        >>> models_here = {name: [weight]}
        >>> count_zeros(models_here, modules)  # one in each module
        2
    """
    owner = "pgregistry.modules.count_zeros"
    checked = _agree_on_models(models, modules, owner, {})

    def module_zeros(name: str, plan: CheckedPlan) -> torch.Tensor:
        reduced = reduce_checked(plan, "count_zeros", Wanted.zeros_only())[0]
        return zero_count_after(reduced, owner, on_host=True)  # the job's count is an int

    zeros, fault = module_values(checked, module_zeros)
    _, total = reduce_over_modules(list(modules), zeros=zeros, check=(owner, {}, fault))
    assert total is not None
    return total


def clip_grad_norm_(
    models: Mapping[str, ParamsLike],
    max_norm: float,
    modules: MultiModuleCollection,
    *,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
) -> torch.Tensor:
    """Clip the grads of every module in place to a job-wide norm of ``max_norm``.

    The norm is :func:`grad_norm`'s; each rank scales the grads of the modules it runs by ``max_norm
    / (norm + 1e-6)`` where that is below 1 (the coefficient of
    :func:`pgregistry.grad_stats.clip_grads_`), duplicates included, so replicas stay identical,
    through the pieces each module's kept plan read for the norm (no walk of the models, no scaling
    planned anew). A NaN or infinite norm scales nothing (skip the step). Collective as
    :func:`grad_norm`.

    Args:
        models: the name of each module this rank runs -> its model, model chunks or parameters.
        max_norm: the job-wide norm to clip to: positive and finite.
        modules: the job's :class:`MultiModuleCollection`.
        norm_type: a positive number, or ``inf`` for the max-norm.
        error_if_nonfinite: raise on a non-finite norm instead of skipping the clip.

    Returns:
        The job-wide norm before clipping.

    Raises:
        ValueError: on every rank, as :func:`grad_norm`; a ``max_norm`` that is not a positive
            finite number; a grad tensor in two modules' models on a rank (scaled once per module).
        RuntimeError: with ``error_if_nonfinite``, a NaN or infinite norm, on every rank.

    Example:
        On every rank of a 4-rank world (as :func:`pgregistry.testing.run_world` starts it), module
        ``"a"`` on ranks 0-1 and ``"b"`` on ranks 2-3:

        >>> import torch
        >>> from pgregistry import ParallelLayout
        >>> from pgregistry.modules import build_modules
        >>> modules = build_modules(
        ...     {"a": ParallelLayout(num_ranks=2), "b": ParallelLayout(num_ranks=2, rank_offset=2)}
        ... )
        >>> (name,) = modules.here()
        >>> weight = torch.nn.Parameter(torch.zeros(2))
        >>> weight.grad = torch.tensor([0.0, 3.0]) if name == "a" else torch.tensor([0.0, 4.0])
        >>> models_here = {name: [weight]}
        >>> clip_grad_norm_(models_here, 1.0, modules)  # the norm before clipping
        tensor(5.)
        >>> round(float(weight.grad[1]), 4) == {"a": 0.6, "b": 0.8}[name]  # 3/5 and 4/5: scaled
        True
    """
    options = {
        "max_norm": repr(max_norm),
        "norm_type": repr(norm_type),
        "error_if_nonfinite": repr(error_if_nonfinite),
    }
    not_a_flag = flag_error(error_if_nonfinite, "error_if_nonfinite")
    bad = combine_faults(max_norm_error(max_norm), norm_type_error(norm_type), not_a_flag)
    owner = "pgregistry.modules.clip_grad_norm_"
    checked = _agree_on_models(models, modules, owner, options, extra_error=bad)
    total, reads = _job_grad_norm(checked, modules, norm_type, owner, options, clipping=True)
    check_finite(total, error_if_nonfinite, which="job-wide")
    clipping = Clipping(max_norm, total.to(torch.float64))
    for read in reads:
        read.clip_(clipping)
    return total


def _job_grad_norm(
    checked: Mapping[str, CheckedPlan],
    modules: MultiModuleCollection,
    norm_type: float,
    owner: str,
    options: Mapping[str, str],
    *,
    clipping: bool = False,
) -> tuple[torch.Tensor, list[Read]]:
    """The job-wide ``norm_type``-norm of the grads of the modules this rank runs, and their reads.

    Each module's norm is read from its kept plan, checked for this call (``checked``,
    :func:`_agree_on_models`); its read holds the pieces a clip scales (:meth:`Read.clip_`). A
    module's statistic that refuses its model is raised on every rank, as ``owner``'s called with
    ``options`` (:func:`module_values`); with ``clipping``, so is a grad tensor in two modules'
    models on a rank (:func:`_grad_in_two_modules`). ``norm_type`` was agreed and checked: a number
    beyond float's range is an infinity (``float()`` raised ``OverflowError``)."""
    p = norm_type_as_float(norm_type)

    def module_norm(name: str, plan: CheckedPlan) -> tuple[torch.Tensor, Read]:
        reduced, read = reduce_checked(plan, "grad_norm", Wanted.of(p, zeros=False))
        return reduced.norm, read

    values, fault = module_values(checked, module_norm)
    reads = {name: read for name, (_, read) in values.items()}
    if clipping and fault is None:
        fault = _grad_in_two_modules(checked, reads)
    norms = {name: norm for name, (norm, _) in values.items()}
    total, _ = reduce_over_modules(
        list(modules), norms=norms, norm_type=p, check=(owner, options, fault)
    )
    assert total is not None
    return total, list(reads.values())


def _grad_in_two_modules(
    checked: Mapping[str, CheckedPlan], reads: Mapping[str, Read]
) -> ValueError | None:
    """Why a grad tensor this rank would scale is in two modules' models, or ``None``.

    Two parameters, one in each of two modules' models, holding one ``.grad`` tensor (each module's
    plan refuses it within its model) would have it scaled once per module, by the square of the
    coefficient. The pieces' ids compared at C speed; a fault walks the module to name the
    parameter. Local: the caller agrees on the answer."""
    if len(reads) < 2:
        return None
    pieces = {name: read.every_piece() for name, read in reads.items()}  # not only those read
    if len(set(map(id, chain.from_iterable(pieces.values())))) == sum(map(len, pieces.values())):
        return None
    holder: dict[int, str] = {}
    for name, read_pieces in pieces.items():
        for piece in read_pieces:
            if id(piece) in holder:
                plan = checked[name]
                param = next(
                    label
                    for label, held in zip(plan.plan.names, plan.params, strict=True)
                    if held.grad is piece or getattr(held.grad, "_local_tensor", None) is piece
                )
                return ValueError(
                    f"module {name!r}: the grad of parameter {param!r} is also a grad in the model "
                    f"of module {holder[id(piece)]!r} on this rank, which would be scaled once per "
                    "module: give each parameter its own grad"
                )
            holder[id(piece)] = name
    return None


def clip_to_job_norm(
    grads: list[torch.Tensor], max_norm: float, total: torch.Tensor, error_if_nonfinite: bool
) -> None:
    """Scale ``grads`` in place to a job-wide norm ``total`` of ``max_norm``.

    With ``error_if_nonfinite``, ``RuntimeError`` for a NaN or infinite ``total``, on every rank
    (``total`` is the same on all)."""
    check_finite(total, error_if_nonfinite, which="job-wide")
    if grads:
        clip_grads_(grads, max_norm, total)


# ---------------------------------------------------------------------------------------- combining


def reduce_over_modules(
    names: Sequence[str],
    *,
    norms: Mapping[str, torch.Tensor] | None = None,
    norm_type: float = 2.0,
    zeros: Mapping[str, torch.Tensor | int] | None = None,
    check: tuple[str, Mapping[str, str], Fault] | None = None,
) -> tuple[torch.Tensor | None, int | None]:
    """The job-wide norm and zero count from the modules' own: one all-reduce (MAX) over the world.

    ``names`` lists every module of the job in one order on every rank; ``norms`` and ``zeros`` hold
    the values of the modules this rank runs (the same on every rank of a module). Each module's
    norm travels as a number, never as a NaN (:func:`_encode_norm`); the zero counts as float64
    (exact below 2**53); whether a module's norm is float64 as one more slot. ``check`` (the call's
    name, the settings every rank must have alike as texts, and this rank's fault) travels in the
    same all-reduce as an agreement's verdict (:func:`pgregistry._runtime.agreement.verdict_of`):
    ranks that differ or any rank's fault raise on every rank, naming the setting or fault and the
    ranks (:func:`~pgregistry._runtime.agreement.check_verdict`). Returns ``(norm, zeros)``, each
    ``None`` when not asked for: the norm a 0-dim tensor, float64 when any module's norm is, else
    float32 (NaN when any module's is NaN, else infinite when any is), the count an int.
    """
    count = len(names)
    index = {name: i for i, name in enumerate(names)}
    device = backend_device(None)
    verdict = verdict_of(check[1], check[2]) if check is not None else []
    # Kept short: gloo's all-reduce of a vector longer than the world takes a ring of 2 x world
    # steps, several times the latency of a shorter one. One slot per module norm, one per module
    # zero count, one for whether a module's norm is float64, then the check's.
    packed = torch.zeros(2 * count + 1 + len(verdict), dtype=torch.float64, device=device)
    if norms is not None:
        for name, norm in norms.items():
            packed[index[name]] = _encode_norm(
                norm.detach().reshape(()).to(device=device, dtype=torch.float64)
            )
        packed[2 * count] = float(any(norm.dtype == torch.float64 for norm in norms.values()))
    if zeros is not None:
        for name, zero_count in zeros.items():
            packed[count + index[name]] = torch.as_tensor(zero_count).to(
                device=device, dtype=torch.float64
            )
    if verdict:
        packed[2 * count + 1 :] = torch.tensor(
            verdict, dtype=torch.float64
        )  # exact: 52-bit digests
    dist.all_reduce(packed, op=dist.ReduceOp.MAX)
    if check is not None:
        check_verdict(
            check[0], check[1], check[2], packed[2 * count + 1 :].tolist(), advice=_STEP_ADVICE
        )
    p = float(norm_type)
    total = None
    if norms is not None:
        slots = packed[:count]
        finite = torch.where(slots < _INF, slots, torch.zeros_like(slots))
        total = _combine_norms(finite, p)
        total = torch.where((slots == _INF).any(), torch.full_like(total, math.inf), total)
        total = torch.where((slots == _NAN).any(), torch.full_like(total, math.nan), total)
        total = total if float(packed[2 * count]) > 0 else total.to(torch.float32)
    zero_total = None
    if zeros is not None:
        zero_total = int(round(float(packed[count : 2 * count].sum())))
    return total, zero_total


_STEP_ADVICE = "every rank must ask for the same job-wide statistic, with the same settings"

_INF = torch.finfo(torch.float64).max
"""How an infinite module norm travels: above every finite norm (a finite float64 norm this large,
the largest float64 itself, reads as infinite)."""

_NAN = math.inf
"""How a NaN module norm travels: above all else, so a MAX keeps it (a bare NaN it might drop)."""


def _encode_norm(norm: torch.Tensor) -> torch.Tensor:
    """A module norm as it travels in the MAX all-reduce: NaN and infinite above any finite one.

    Itself when finite, :data:`_INF` when infinite, :data:`_NAN` when NaN; the job-wide norm's
    order is NaN > infinite > finite."""
    norm = torch.where(torch.isinf(norm), torch.full_like(norm, _INF), norm)
    return torch.where(torch.isnan(norm), torch.full_like(norm, _NAN), norm)


def _combine_norms(norms: torch.Tensor, p: float) -> torch.Tensor:
    """``(sum n^p)^(1/p)`` of non-negative float64 ``norms`` (the largest for the inf-norm).

    Scaled by the largest so that no power overflows; 0 for no norms or all zero."""
    if norms.numel() == 0:
        return torch.zeros((), dtype=torch.float64, device=norms.device)
    largest = norms.max()
    if math.isinf(p):
        return largest
    scale = torch.where(largest > 0, largest, torch.ones_like(largest))
    return scale * (norms / scale).pow(p).sum().pow(1.0 / p)


def module_values(
    given: Mapping[str, Any], compute: Callable[[str, Any], Any]
) -> tuple[dict[str, Any], Fault]:
    """``compute(name, item)`` of each module this rank runs (``given``), and this rank's fault.

    The fault is every module's ``ValueError``, ``TypeError`` or ``RuntimeError``, naming the
    module, joined (``None`` when none raised).

    A module's statistic can refuse what its ranks hold (a sparse grad, a plan its grads do not
    fit); raised here, its ranks would leave the ranks of every other module waiting in the world
    all-reduce. Caught, the fault travels in that all-reduce instead (:func:`reduce_over_modules`'
    ``check``), so every rank raises it, at no cost on the happy path. The other modules this rank
    runs are still computed, so their ranks issue the same collectives. Sound when the module's
    ranks fail alike (the module's statistic refuses its input before or after its collectives on
    all of them, as it does for the layout and roles its ranks share); a fault on some ranks of a
    module only, midway through its collectives, leaves its peers waiting there until the process
    group's timeout: the single-model statistics would hang the same way.

    :func:`pgregistry.modules.build_optimizer` collects each module's build the same way, its fault
    agreed on after the builds.
    """
    values, faults = {}, []
    for name, item in given.items():
        try:
            values[name] = compute(name, item)
        except (
            ValueError,
            TypeError,
            RuntimeError,
        ) as exc:  # on this module's ranks only: agreed in the reduce
            faults.append(type(exc)(f"module {name!r}: {exc}"))
    return values, combine_faults(*faults)


# ------------------------------------------------------------------------------------------- inputs


def describe_modules(modules: MultiModuleCollection) -> dict[str, str]:
    """What all ranks must agree on of the job's modules: names in order, spans and layouts."""
    return {
        "modules": "; ".join(f"{name}={layout!r}" for name, layout in modules.layouts().items()),
        "language_model": repr(modules.language_model),
    }


def check_models(
    models: object,
    modules: MultiModuleCollection,
    owner: str,
    check: Callable[[str, Any, ProcessGroupCollection], None] | None = None,
    *,
    noun: str = "model",
) -> tuple[dict[str, Any], str | None]:
    """``models`` restricted to the modules this rank runs, in their order, and this rank's error.

    The error is ``None`` when it has none; it is one when ``models`` is not a mapping, names a
    module that does not exist or one this rank does not run, lacks one it runs, or a module's
    collection was destroyed; ``check(name, model, collection)`` raising ``ValueError``,
    ``TypeError`` or ``RuntimeError`` is an error too. ``noun`` names what the mapping holds in
    messages (a model, an optimizer, a state). Local: the caller agrees on the error."""
    if not isinstance(models, Mapping) or isinstance(models, MultiModuleCollection):
        got = type(models).__name__
        return {}, f"{owner} takes a mapping from module name to that module's {noun}, got a {got}"
    problems = []
    article = "an" if noun[0] in "aeiou" else "a"
    unknown = [name for name in models if name not in modules]
    if unknown:
        problems.append(
            f"{noun}s for {unknown}, which are not modules of the job ({list(modules)})"
        )
    here = modules.here()
    for name, collection in modules.items():
        layout = collection.layout
        assert layout is not None
        if name in models and name not in here:
            problems.append(
                f"{article} {noun} for module {name!r}, which runs on ranks {span_text(layout)}, "
                f"not on this rank: a rank outside a module passes no {noun} for it"
            )
        elif name in here and name not in models:
            problems.append(
                f"no {noun} for module {name!r} (ranks {span_text(layout)}), which this rank runs"
            )
        elif name in here and collection.is_destroyed:
            problems.append(
                f"module {name!r}, whose groups pgregistry.registry.destroy() destroyed"
            )
    given = {name: models[name] for name in here if name in models}
    if check is not None and not problems:
        for name, model in given.items():
            try:
                check(name, model, modules[name])
            except (ValueError, TypeError, RuntimeError) as exc:
                problems.append(f"module {name!r}: {exc}")
    return given, ("; ".join(problems) if problems else None)


def _agree_on_models(
    models: Mapping[str, ParamsLike],
    modules: MultiModuleCollection,
    owner: str,
    options: Mapping[str, str],
    *,
    extra_error: Fault = None,
) -> dict[str, CheckedPlan]:
    """The kept plan of each module this rank runs, checked, once every rank agreed on no fault.

    Every rank agrees on the call (``owner``: a zero count beside a norm is named as such), the
    modules and options (``pgregistry._runtime.agreement.check_agreement``), and on each rank's
    fault: what the door of each module's statistics refuses, found by checking its kept plan
    (:func:`_check_plans`: the unclassified experts are refused when a plan is made, no walk of a
    model while it is kept), and a tensor in two modules' models. Each module's statistic reads
    from its plan so checked, not checking it again: one check a plan a call."""
    require_multi_module_collection(modules, owner)
    given, error = check_models(models, modules, owner)
    checked: dict[str, CheckedPlan] = {}
    if error is None:
        checked, error = _check_plans(given, modules, owner)
    fields = {"call": owner, **describe_modules(modules), **options}
    check_agreement(owner, fields, combine_faults(extra_error, error), advice=MODULES_ADVICE)
    return checked


def _check_plans(
    given: Mapping[str, ParamsLike], modules: MultiModuleCollection, owner: str
) -> tuple[dict[str, CheckedPlan], str | None]:
    """Each model's kept plan checked (or made anew), by module name, and this rank's error.

    The door of each module's statistics, run before any module's collective so that a refusal
    (an unclassified expert parameter, another collection attached) raises on every rank, not on one
    rank while the module's other ranks wait for it in the module's reductions
    (:func:`~pgregistry.grad_stats._functional.check_plan`; a module's collection sets every field,
    so making a plan reads no group from the global grid and issues no collective). The error names
    every module refused, else a tensor in two modules' models (:func:`_tensor_in_two_modules`);
    no plans on an error. Local: the caller agrees on it."""
    checked: dict[str, CheckedPlan] = {}
    problems = []
    for name, model in given.items():
        try:
            checked[name] = check_plan(source_of(model), modules[name], owner)
        except (ValueError, TypeError, RuntimeError) as exc:
            problems.append(f"module {name!r}: {exc}")
    if problems:
        return {}, "; ".join(problems)
    error = _tensor_in_two_modules(checked)
    return (checked, None) if error is None else ({}, error)


def _tensor_in_two_modules(checked: Mapping[str, CheckedPlan]) -> str | None:
    """Why the models of two modules this rank runs share a tensor, or ``None``.

    A tensor in the models of two modules (a layer shared by two colocated modules, one model given
    for both) was counted in each module's statistic, and clipped once per module: a job-wide norm
    of ``sqrt(10)`` for the ``sqrt(6)`` of the distinct grads, the shared grad scaled by the square
    of the coefficient. Only a rank running several modules can hold one; each model's parameters
    come from its checked kept plan (no walk of the model per call), their ids compared at C
    speed."""
    holder: dict[int, str] = {}
    for name, plan in checked.items() if len(checked) > 1 else ():
        ids = list(map(id, plan.params))
        shared = holder.keys() & ids
        if shared:
            position = next(i for i, tensor_id in enumerate(ids) if tensor_id in shared)
            return (
                f"parameter {plan.plan.names[position]!r} of module {name!r} is also in the model "
                f"of module {holder[ids[position]]!r} on this rank: a tensor in two modules' "
                "models would be counted in both modules' statistics and clipped once per module; "
                "give it to one module's model only, or give each module its own copy"
            )
        holder.update(zip(ids, repeat(name)))
    return None

"""One optimizer over a job's modules: :class:`MultiModuleOptimizer` and :func:`build_optimizer`.

Megatron-Core's ``MimoOptimizer`` is the reference: one optimizer per module (here pgregistry's
:class:`~pgregistry.optim.ChainedOptimizer` of the module's model, on the module's collection),
chained, with job-wide statistics and a job-wide verdict on whether to step. What differs:

* the job-wide norm and zero count are :mod:`pgregistry.modules._stats`'s: one all-reduce over the
  world after each module's own reductions over its span, non-finite norms sent as flags (a NaN
  inside a MAX all-reduce may be dropped), modules combined in float64, both statistics in the same
  all-reduce when both are asked for;
* the verdict: a step is skipped on every rank when the job-wide norm is not finite (a NaN or
  infinite grad in any module). It needs no all-reduce of its own: the norm it is read from is the
  same on every rank. (Megatron-Core agrees on ``found_inf`` with a MAX first, then on the step's
  success with a MIN; pgregistry's optimizers keep no loss scale, so the norm is the whole verdict,
  and a step cannot fail on one rank alone);
* the modules, their spans and what each rank was given are agreed on by every rank when the
  optimizer is made (:func:`~pgregistry._runtime.agreement.check_agreement`): a rank that lists
  other modules, or holds an optimizer for a module it does not run (or none for one it runs),
  raises on every rank.

A training step::

    loss.backward()                   # each rank through the modules it runs
    optimizer.sync_grads()            # each module's grads over its own data-parallel group
    # a job-wide clip; every rank skips the step when the norm is not finite
    stepped, norm, _ = optimizer.step(max_norm=1.0)
    optimizer.zero_grad()
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from types import MappingProxyType
from typing import Any

import torch

from pgregistry._runtime.agreement import check_agreement, combine_faults
from pgregistry.collection import ProcessGroupCollection
from pgregistry.grad_stats import check_expert_classification
from pgregistry.grad_stats._arguments import max_norm_error, norm_type_as_float, norm_type_error
from pgregistry.modules._collection import (
    MODULES_ADVICE,
    MultiModuleCollection,
    require_multi_module_collection,
)
from pgregistry.modules._options import describe_options, options_error
from pgregistry.modules._stats import (
    check_models,
    clip_to_job_norm,
    describe_modules,
    module_values,
    reduce_over_modules,
)
from pgregistry.optim import ChainedOptimizer
from pgregistry.optim import build_optimizer as build_module_optimizer
from pgregistry.optim._state_check import refuse_faults

__all__ = ["MultiModuleOptimizer", "build_optimizer"]


class MultiModuleOptimizer:
    """The optimizers of this rank's modules, stepped as one, with job-wide stats and verdict.

    A job whose modules run on different ranks still clips by one grad norm and skips a step
    everywhere or nowhere: this sums the statistics over the world and steps each module's own
    optimizer. Making one is collective over the world: every rank makes it with the same
    ``modules``, a rank that runs no module included (with no optimizers). The statistics
    (:meth:`get_grad_norm`, :meth:`count_zeros`, :meth:`clip_grad_norm`, :meth:`step`) are
    collective over the world; :meth:`sync_grads` over each module's groups;
    :meth:`load_state_dict` over the world (its checks agreed) and each module's groups.

    Args:
        optimizers: Each module this rank runs (:meth:`MultiModuleCollection.here`) -> its
            optimizer, built on that module's collection
            (:func:`pgregistry.optim.build_optimizer`; :func:`build_optimizer` builds them all).
        modules: The job's modules, the same on every rank.

    Raises:
        ValueError: On every rank, naming each culprit rank and module: the ranks list other
            modules, or a rank holds an optimizer for a module it does not run, none for one it
            runs, or one built on another collection.
        TypeError: Likewise, for an optimizer that is no
            :class:`~pgregistry.optim.ChainedOptimizer`, or ``modules`` that is no
            :class:`MultiModuleCollection`.

    Example:
        On every rank of a 4-rank world (as :func:`pgregistry.testing.run_world` starts it), module
        ``"vision"`` on ranks 0-1 and ``"llm"`` on ranks 2-3:

        >>> import torch
        >>> from pgregistry import ParallelLayout
        >>> from pgregistry.modules import build_modules
        >>> modules = build_modules(
        ...     {"vision": ParallelLayout(num_ranks=2),
        ...      "llm": ParallelLayout(num_ranks=2, rank_offset=2)}
        ... )
        >>> (name,) = modules.here()
        >>> model = torch.nn.Linear(2, 1, bias=False)
        >>> _ = torch.nn.init.zeros_(model.weight)
        >>> model.weight.grad = torch.tensor([[3.0, 0.0]] if name == "vision" else [[0.0, 4.0]])
        >>> from pgregistry.optim import build_optimizer
        >>> optimizer = MultiModuleOptimizer(
        ...     {name: build_optimizer(model, modules[name])}, modules
        ... )  # "vision" on ranks 0-1; ranks 2-3 pass their language model's
        >>> optimizer.step(max_norm=1.0)[:2]  # the same verdict on every rank: stepped, norm
        (True, 5.0)
    """

    __slots__ = ("_optimizers", "_modules")

    def __init__(
        self, optimizers: Mapping[str, ChainedOptimizer], modules: MultiModuleCollection
    ) -> None:
        require_multi_module_collection(modules, "MultiModuleOptimizer")
        given, error = check_models(
            optimizers, modules, "MultiModuleOptimizer", _check_built_on_module, noun="optimizer"
        )
        check_agreement(
            "MultiModuleOptimizer", describe_modules(modules), error, advice=MODULES_ADVICE
        )
        self._optimizers: Mapping[str, ChainedOptimizer] = MappingProxyType(given)
        self._modules = modules

    # ------------------------------------------------------------------------------------- identity

    @property
    def optimizers(self) -> Mapping[str, ChainedOptimizer]:
        """Module name -> its optimizer, for the modules this rank runs (read-only)."""
        return self._optimizers

    @property
    def modules(self) -> MultiModuleCollection:
        """The job's modules."""
        return self._modules

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """Every module optimizer's param groups (change ``lr`` there), in module order."""
        return [
            group for optimizer in self._optimizers.values() for group in optimizer.param_groups
        ]

    def __iter__(self) -> Iterator[ChainedOptimizer]:
        return iter(self._optimizers.values())

    def __repr__(self) -> str:
        return f"MultiModuleOptimizer(here={list(self._optimizers)}, modules={list(self._modules)})"

    # ----------------------------------------------------------------------------------- statistics

    def get_grad_norm(self, norm_type: float = 2.0) -> torch.Tensor:
        """The job-wide grad norm of all modules (0-dim float32; NaN or inf if any module's is).

        Collective over the world.

        Args:
            norm_type: ``p``, positive, or ``inf``; the same on every rank.

        Returns:
            The norm over every module's counted grads, the same on every rank.

        Raises:
            ValueError: on every rank alike, after the reductions every rank joins: a
                ``norm_type`` not positive on some rank, or other values on different ranks (naming
                the ranks); ``TypeError`` for a value that is no number. A module optimizer's
                statistic that raised on its ranks is raised on every rank, in its type, naming
                the module.
        """
        return self._norm_statistics(
            norm_type, zeros=False, subject="MultiModuleOptimizer.get_grad_norm"
        )[0]

    def count_zeros(self) -> int:
        """The job-wide number of zero grad elements, each counted once.

        Collective over the world.

        Returns:
            The count over every module's counted grads, the same on every rank.

        Raises:
            ValueError: a module optimizer's statistic that raised on its ranks is raised on
                every rank, in its type (``ValueError``, ``TypeError`` or ``RuntimeError``), naming
                the module.
        """
        counts, fault = module_values(self._optimizers, lambda _, opt: opt.count_zeros())
        subject = "MultiModuleOptimizer.count_zeros"
        _, zeros = reduce_over_modules(
            list(self._modules), zeros=counts, check=(subject, {}, fault)
        )
        assert zeros is not None
        return zeros

    def get_grad_norm_and_zeros(self, norm_type: float = 2.0) -> tuple[torch.Tensor, int]:
        """:meth:`get_grad_norm` and :meth:`count_zeros` in one all-reduce over the world.

        Args:
            norm_type: ``p``, positive, or ``inf``; the same on every rank.

        Returns:
            ``(norm, zeros)``, as the two give them.

        Raises:
            ValueError: on every rank alike, after the reductions every rank joins: a
                ``norm_type`` not positive on some rank, or other values on different ranks (naming
                the ranks); ``TypeError`` for a value that is no number. A module optimizer's
                statistic that raised on its ranks is raised on every rank, in its type, naming
                the module.
        """
        subject = "MultiModuleOptimizer.get_grad_norm_and_zeros"
        norm, zeros = self._norm_statistics(norm_type, zeros=True, subject=subject)
        assert zeros is not None
        return norm, zeros

    def clip_grad_norm(
        self, max_norm: float, norm_type: float = 2.0, *, error_if_nonfinite: bool = False
    ) -> torch.Tensor:
        """Clip every module's grads to the job-wide norm ``max_norm``; return the norm.

        Grads are scaled by ``max_norm / (norm + 1e-6)`` where that is below 1. A NaN or infinite
        norm scales nothing. Collective over the world.

        Args:
            max_norm: the largest job-wide norm left unscaled, positive and finite.
            norm_type: ``p``, positive, or ``inf``.
            error_if_nonfinite: raise, instead of scaling nothing, on a NaN or infinite norm.

        Returns:
            The job-wide norm before clipping.

        Raises:
            RuntimeError: on every rank, a NaN or infinite norm with ``error_if_nonfinite``.
            ValueError: on every rank alike, after the reductions every rank joins: a
                ``max_norm`` or ``norm_type`` out of range on some rank, or other values on
                different ranks (naming the ranks); ``TypeError`` for a value that is no number. A
                module optimizer's statistic that raised on its ranks is raised on every rank, in
                its type, naming the module.
        """
        total, _ = self._norm_statistics(
            norm_type, zeros=False, max_norm=max_norm, subject="MultiModuleOptimizer.clip_grad_norm"
        )
        self._clip_grads(max_norm, total, error_if_nonfinite)
        return total

    # ---------------------------------------------------------------------------------------- steps

    def sync_grads(self) -> None:
        """Each module's grads averaged over its own data-parallel groups."""
        for optimizer in self._optimizers.values():
            optimizer.sync_grads()

    def step(
        self, max_norm: float | None = None, *, norm_type: float = 2.0, count_zeros: bool = False
    ) -> tuple[bool, float, int | None]:
        """Clip by the job-wide norm (given ``max_norm``), step every module, or skip on all ranks.

        One all-reduce over the world after the modules' own reductions; it also carries the
        agreement on ``max_norm`` and ``norm_type``.

        Args:
            max_norm: clip to this job-wide norm (positive and finite); ``None``: no clipping.
            norm_type: ``p`` of the norm, positive, or ``inf``.
            count_zeros: also count the zero grad elements, in the same all-reduce.

        Returns:
            ``(stepped, grad_norm, num_zeros)`` as Megatron-Core's ``MimoOptimizer.step`` does:
            ``stepped`` is false on every rank when the job-wide norm is NaN or infinite (nothing
            is scaled or stepped, grads are left as they are); ``num_zeros`` is the job-wide zero
            count with ``count_zeros``, else ``None``.

        Raises:
            ValueError: when a rank was given other values than its peers, or a ``max_norm`` not
                positive and finite, a ``norm_type`` not positive: every rank raises, after the
                reductions every rank joins, quoting the values and the ranks given them; nothing
                is scaled or stepped. A module optimizer's statistic that raised is raised on every
                rank likewise, in its type.
            TypeError: likewise, for a value that is no number, such as ``'1.0'``.
        """
        total, zeros = self._norm_statistics(
            norm_type, zeros=count_zeros, max_norm=max_norm, subject="MultiModuleOptimizer.step"
        )
        norm = float(total)
        if not math.isfinite(norm):
            return False, norm, zeros
        if max_norm is not None:
            self._clip_grads(max_norm, total, error_if_nonfinite=False)
        for optimizer in self._optimizers.values():
            optimizer.step()
        return True, norm, zeros

    def zero_grad(self) -> None:
        """Zero the grads of every module optimizer."""
        for optimizer in self._optimizers.values():
            optimizer.zero_grad()

    # ---------------------------------------------------------------------------------------- state

    def state_dict(self) -> dict[str, Any]:
        """Module name -> its optimizer's state dict, for the modules this rank runs.

        Returns:
            Each of :meth:`MultiModuleCollection.here`'s modules -> its
            :meth:`~pgregistry.optim.ChainedOptimizer.state_dict`.
        """
        return {name: optimizer.state_dict() for name, optimizer in self._optimizers.items()}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` output: each module's optimizer from the entry under its name.

        Collective over the world; a refused load leaves every optimizer as it was.

        Args:
            state_dict: this rank's :meth:`state_dict` output.

        Raises:
            ValueError: on every rank, before anything loads, when a rank's state lacks a module it
                runs or holds one it does not run (another rank's state), or a module's state does
                not fit its optimizer
                (:meth:`~pgregistry.optim.ChainedOptimizer.state_dict_faults`: missing, extra,
                another shape or dtype), naming the rank and the module.
        """
        subject = "MultiModuleOptimizer.load_state_dict"
        _, error = check_models(state_dict, self._modules, subject, self._check_state, noun="state")
        check_agreement(subject, describe_modules(self._modules), error, advice=MODULES_ADVICE)
        for name, optimizer in self._optimizers.items():
            optimizer.load_state_dict(state_dict[name])

    def _check_state(self, name: str, state: Any, _collection: ProcessGroupCollection) -> None:
        """``ValueError`` if ``state`` misfits module ``name``'s optimizer (local, loads none)."""
        refuse_faults("its optimizer", self._optimizers[name].state_dict_faults(state))

    # ------------------------------------------------------------------------------------ internals

    def _norm_statistics(
        self, norm_type: float, *, zeros: bool, max_norm: float | None = None, subject: str
    ) -> tuple[torch.Tensor, int | None]:
        """The job-wide norm (and zero count), with bad arguments refused alike on every rank.

        A ``norm_type`` or ``max_norm`` that is bad on some rank only must not raise there before
        the modules' reductions (its module's other ranks would wait in them), so each is checked
        here, and the check travels in the world all-reduce as an agreement's verdict: after it,
        every rank raises alike, naming the value and the ranks given it, or none does. A module
        optimizer's statistic that raises on its module's ranks travels there too
        (:func:`~pgregistry.modules._stats.module_values`)."""
        bad_p = norm_type_error(norm_type)
        # norm_type_as_float, not float(): 10**400 is inf, not an OverflowError on this rank alone
        p = 2.0 if bad_p is not None else norm_type_as_float(norm_type)
        fields = {
            "norm_type": repr(norm_type),
            "max_norm": repr(max_norm),
        }  # None too: step's "do not clip"
        error = combine_faults(bad_p, max_norm_error(max_norm) if max_norm is not None else None)
        if zeros:
            both, fault = module_values(
                self._optimizers, lambda _, opt: opt.get_grad_norm_and_zeros(p)
            )
            norms: dict[str, torch.Tensor] = {name: pair[0] for name, pair in both.items()}
            counts: dict[str, torch.Tensor | int] | None = {
                name: pair[1] for name, pair in both.items()
            }
        else:
            (norms, fault), counts = (
                module_values(self._optimizers, lambda _, opt: opt.get_grad_norm(p)),
                None,
            )
        norm, count = reduce_over_modules(
            list(self._modules),
            norms=norms,
            norm_type=p,
            zeros=counts,
            check=(subject, fields, combine_faults(error, fault)),
        )
        assert norm is not None
        return norm, count

    def _clip_grads(self, max_norm: float, total: torch.Tensor, error_if_nonfinite: bool) -> None:
        grads = [
            grad
            for optimizer in self._optimizers.values()
            for child in optimizer.chained_optimizers
            for grad in child.grads_to_clip()
        ]
        clip_to_job_norm(grads, max_norm, total, error_if_nonfinite)


def _check_built_on_module(name: str, optimizer: Any, collection: ProcessGroupCollection) -> None:
    """``TypeError`` unless ``optimizer`` is a chained optimizer.

    ``ValueError`` unless it runs on ``collection``.
    """
    if not isinstance(optimizer, ChainedOptimizer):
        raise TypeError(
            "expected a pgregistry ChainedOptimizer "
            f"(pgregistry.optim.build_optimizer), got {type(optimizer).__name__}"
        )
    for child in optimizer.chained_optimizers:
        built_on = child.stats_groups.collection
        if built_on != collection:
            raise ValueError(
                f"its optimizer was built on {built_on.describe()}, "
                f"not on the module's {collection.describe()}"
            )


def build_optimizer(
    models: Mapping[str, Any],
    modules: MultiModuleCollection,
    *,
    per_module: Mapping[str, Mapping[str, Any]] | None = None,
    **options: Any,
) -> MultiModuleOptimizer:
    """The :class:`MultiModuleOptimizer` of a job.

    That is :func:`pgregistry.optim.build_optimizer` of each module this rank runs, on the module's
    collection. Collective over the world (every rank calls it, a rank that runs no module included)
    and over each module's groups; every rank passes the same options (plain values compared, code
    by its type). Bad input raises on every rank, naming the rank and module, before any module's
    optimizer is built.

    Args:
        models: each module this rank runs -> its model or model chunks; exactly those.
        modules: the job's :class:`MultiModuleCollection`.
        per_module: module name -> options that update ``options`` for that module (a
            ``param_name_fn`` of its model, another ``lr``).
        **options: :func:`pgregistry.optim.build_optimizer`'s keywords (``optimizer``, ``lr``,
            ``sharded``, ...), for every module.

    Returns:
        The job's optimizer: each module's stepped as one, with a job-wide clip and skip verdict.

    Raises:
        TypeError: ``modules`` not a :class:`MultiModuleCollection`; on every rank, an option of the
            wrong type (``lr='x'``) or none of :func:`pgregistry.optim.build_optimizer`'s, naming
            the module (for ``per_module``) and the option.
        ValueError: on every rank: a model for a module this rank does not run, none for one it
            runs, a model the module's optimizer refuses, ``per_module`` naming no module of the
            job, an option out of range (``lr=-1``); a module whose optimizer fails to build all the
            same, after the builds.

    Example:
        On every rank of a 4-rank world (as :func:`pgregistry.testing.run_world` starts it), module
        ``"vision"`` on ranks 0-1 and ``"llm"`` on ranks 2-3:

        >>> import torch
        >>> from pgregistry import ParallelLayout
        >>> from pgregistry.modules import build_modules
        >>> modules = build_modules(
        ...     {"vision": ParallelLayout(num_ranks=2),
        ...      "llm": ParallelLayout(num_ranks=2, rank_offset=2)}
        ... )
        >>> (name,) = modules.here()
        >>> model = torch.nn.Linear(2, 1, bias=False)
        >>> _ = torch.nn.init.zeros_(model.weight)
        >>> model.weight.grad = torch.tensor([[3.0, 4.0]])
        >>> models_here = {name: model}
        >>> per_module = {"llm": {"lr": 3e-4}}
        >>> optimizer = build_optimizer(models_here, modules, lr=1e-4, per_module=per_module)
        >>> _ = optimizer.step()  # Adam's first step: each module's lr against the grad's sign
        >>> round(-float(model.weight.detach()[0, 0]), 6) == {"vision": 1e-4, "llm": 3e-4}[name]
        True
    """
    require_multi_module_collection(modules, "build_optimizer")
    per_module = dict(per_module or {})

    def check_model(name: str, model: Any, collection: ProcessGroupCollection) -> None:
        if not isinstance(model, torch.nn.Module) and not (
            isinstance(model, (list, tuple))
            and model
            and all(isinstance(m, torch.nn.Module) for m in model)
        ):
            raise TypeError(f"expected a model or model chunks, got {type(model).__name__}")
        check_expert_classification(model, collection)

    given, error = check_models(models, modules, "pgregistry.modules.build_optimizer", check_model)
    stray = sorted(set(per_module) - set(modules))
    if stray:
        error = (
            error + "; " if error else ""
        ) + f"per_module names {stray}, which are not modules of the job"
    request = {
        **describe_modules(modules),
        "options": describe_options(options),
        **{
            f"per_module[{name!r}]": describe_options(dict(per_module[name]))
            for name in sorted(per_module)
            if isinstance(per_module[name], Mapping)
        },
    }
    owner = "pgregistry.modules.build_optimizer"
    fault = combine_faults(options_error(options, per_module, list(modules)), error)
    check_agreement(owner, request, fault, advice=MODULES_ADVICE)
    optimizers, failure = module_values(  # a failure on this module's ranks only: agreed below
        given,
        lambda name, model: build_module_optimizer(
            model, modules[name], **{**options, **per_module.get(name, {})}
        ),
    )
    # Every rank, the ranks of modules whose optimizer was built included, learns of a failure on
    # any rank.
    check_agreement(
        owner,
        describe_modules(modules),
        failure,
        failed="could not build a module's optimizer",
        advice=MODULES_ADVICE,
    )
    return MultiModuleOptimizer(optimizers, modules)

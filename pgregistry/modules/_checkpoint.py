"""A job's checkpoint: each module's parameters and optimizer state in its own directory and span.

Each module is saved with :func:`pgregistry.checkpoint.save_rank_files` on its collection, into
``<directory>/<module name>``: every collective of a module's save runs over the module's span (its
files are numbered over the span and record the module's name and span), so no rank of another
module takes part or waits, and a directory never mixes two modules. Loading runs
:func:`pgregistry.checkpoint.load_rank_files`'s checks the same way for every module (they refuse a
checkpoint saved by another module or over other ranks) and copies once every module's have passed;
within a module, parameters are keyed by global name, so a module reloads under another layout of
the same span (another TP, EP or PP size).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from pgregistry._runtime.agreement import check_agreement
from pgregistry.checkpoint import save_rank_files
from pgregistry.checkpoint._agreement import name_lost_ranks, world_scope
from pgregistry.checkpoint._directory import checkpoint_path
from pgregistry.checkpoint._rank_files import prepare_rank_files_load
from pgregistry.checkpoint._strict import check_strict
from pgregistry.experts._names import NamingOptions, check_naming_options
from pgregistry.modules._collection import (
    MODULES_ADVICE,
    MultiModuleCollection,
    require_multi_module_collection,
)
from pgregistry.modules._optimizer import MultiModuleOptimizer
from pgregistry.modules._stats import check_models, describe_modules

__all__ = ["load_checkpoint", "save_checkpoint"]


def save_checkpoint(
    directory: str | Path,
    models: Mapping[str, Any],
    modules: MultiModuleCollection,
    optimizer: MultiModuleOptimizer | None = None,
    *,
    naming: Mapping[str, NamingOptions] | None = None,
) -> Path:
    """Save every module of the job, each into ``directory/<module name>``.

    See the module docstring. Collective over the world, and over each module's span. A module's
    save that fails (its directory holds a checkpoint already, a disk is full) raises on every rank
    once every module has been tried, naming the module; the other modules' checkpoints are
    complete.

    Args:
        directory: the job's checkpoint directory.
        models: each module this rank runs -> its model or model chunks; exactly those.
        modules: the job's :class:`MultiModuleCollection`.
        optimizer: the job's :class:`MultiModuleOptimizer`; its state is saved by global name beside
            each module's parameters.
        naming: module name -> its naming keywords (``num_experts``, ``layer_offsets``: those of
            :func:`pgregistry.checkpoint.save_rank_files` but ``pg_collection``, which is the
            module's).

    Returns:
        ``directory``.

    Raises:
        ValueError: on every rank, before anything is written: a model for a module this rank does
            not run or none for one it runs, an optimizer over other modules, a module name that is
            no directory name, ``naming`` for no module or with other keywords; after every module
            was tried, a module's failed save (named).

    Example::

        save_checkpoint("ckpt/step-100", models_here, modules, optimizer)
    """
    directory = checkpoint_path(directory, "pgregistry.modules.save_checkpoint")
    _run_per_module("save", directory, models, modules, optimizer, naming, save_rank_files)
    return directory


def load_checkpoint(
    directory: str | Path,
    models: Mapping[str, Any],
    modules: MultiModuleCollection,
    optimizer: MultiModuleOptimizer | None = None,
    *,
    naming: Mapping[str, NamingOptions] | None = None,
    strict: bool = True,
) -> None:
    """Load every module of the job from :func:`save_checkpoint`'s ``directory/<module name>``.

    Collective over the world and each module's span. Every module is checked first, and nothing of
    any module is copied before all pass: the job is loaded whole or not at all.

    Args:
        directory: the directory :func:`save_checkpoint` wrote.
        models: each module this rank runs -> its model or model chunks; exactly those.
        modules: the job's :class:`MultiModuleCollection`.
        optimizer: the job's :class:`MultiModuleOptimizer`, whose state is loaded too.
        naming: as for :func:`save_checkpoint`.
        strict: as :func:`pgregistry.checkpoint.load_rank_files` (given an optimizer, a checkpoint
            saved without one is refused).

    Raises:
        ValueError: on every rank, bad input as for :func:`save_checkpoint`; once every module has
            been tried, naming the module: a module's checkpoint of another module (a renamed
            directory) or of other ranks, missing, damaged or misfit tensors.

    Example::

        load_checkpoint("ckpt/step-100", models_here, modules, optimizer)
    """
    prepare = functools.partial(prepare_rank_files_load, strict=strict)
    directory = checkpoint_path(directory, "pgregistry.modules.load_checkpoint")
    check_strict(strict, "pgregistry.modules.load_checkpoint")
    copies = _run_per_module("load", directory, models, modules, optimizer, naming, prepare)
    for copy in copies:
        copy()


def _run_per_module(
    verb: str,
    directory: Path,
    models: Mapping[str, Any],
    modules: MultiModuleCollection,
    optimizer: MultiModuleOptimizer | None,
    naming: Mapping[str, NamingOptions] | None,
    step: Callable[..., Any],
) -> list[Any]:
    """What ``step`` returns for each module this rank runs, once every rank agreed on the input.

    ``step(directory / module name, model, optimizer, **naming keywords and collection)``; ``verb``:
    ``save`` or ``load``, the function's name. A module's failed step is raised on every rank,
    naming the module, only once every module was tried: the others' are complete."""
    owner = f"pgregistry.modules.{verb}_checkpoint"
    # A rank lost in a world-wide agreement, named.
    with name_lost_ranks(owner, directory, world_scope()):
        given, naming = _agree_on_models(models, modules, optimizer, naming, owner)
        errors: list[str] = []
        results: list[Any] = []
        for name, model in given.items():
            try:
                options: dict[str, Any] = {**naming.get(name, {}), "pg_collection": modules[name]}
                module_optimizer = None if optimizer is None else optimizer.optimizers[name]
                results.append(step(directory / name, model, module_optimizer, **options))
            except (ValueError, OSError, RuntimeError) as exc:
                errors.append(f"module {name!r}: {type(exc).__name__}: {exc}")
        check_agreement(
            owner,
            describe_modules(modules),
            "; ".join(errors) or None,
            failed=f"failed to {verb}",
            advice=MODULES_ADVICE,
        )
    return results


def _agree_on_models(
    models: Mapping[str, Any],
    modules: MultiModuleCollection,
    optimizer: MultiModuleOptimizer | None,
    naming: Mapping[str, NamingOptions] | None,
    owner: str,
) -> tuple[dict[str, Any], dict[str, NamingOptions]]:
    """The models and naming keywords of the modules this rank runs, once no rank has bad input.

    The naming keywords are each module's; every rank first agrees that no rank was given bad
    input."""
    require_multi_module_collection(modules, owner)
    given, error = check_models(models, modules, owner)
    problems = [error] if error else []
    for name in modules:
        if not name or name in (".", "..") or "/" in name or "\\" in name:
            problems.append(f"module name {name!r} cannot name a directory of the checkpoint")
    if optimizer is not None and (
        not isinstance(optimizer, MultiModuleOptimizer) or list(optimizer.modules) != list(modules)
    ):
        problems.append("the optimizer is not a MultiModuleOptimizer over these modules")
    naming = dict(naming or {})
    for name, options in naming.items():
        if name not in modules:
            problems.append(f"naming for {name!r}, which is not a module of the job")
            continue
        try:
            check_naming_options(options, owner)
        except TypeError as exc:
            problems.append(f"naming for {name!r}: {exc}")
        if "pg_collection" in options:
            problems.append(
                f"naming for {name!r} gives a pg_collection: "
                "a module's checkpoint runs on its collection"
            )
    check_agreement(
        owner, describe_modules(modules), "; ".join(problems) or None, advice=MODULES_ADVICE
    )
    return given, naming

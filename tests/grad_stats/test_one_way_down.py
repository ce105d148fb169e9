"""A statistics call takes one way down (issue 39, item 5): the entry point's module passes through the door first
(the collection resolved once, by ``grad_stats/_functional.py`` itself, not by the kept plan), and no module on the
call's route is entered again while it is still below on the stack (a module calling back up into one that called
it). Traced with ``sys.setprofile`` over real calls, the first (the
plan made) and a later one (the plan kept), for each entry point."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

import pytest
import torch
from torch import nn

import pgregistry
from pgregistry.collection import FIELD_NAMES, ProcessGroupCollection
from pgregistry.grad_stats import clip_grad_norm_, count_zeros, grad_norm, grad_norm_and_zeros

OFF = ProcessGroupCollection(**dict.fromkeys(FIELD_NAMES))
ROOT = Path(pgregistry.__file__).parent


def _module_of(frame: FrameType) -> str | None:
    path = Path(frame.f_code.co_filename)
    return ".".join(path.relative_to(ROOT).with_suffix("").parts) if path.is_relative_to(ROOT) else None


def _route(call: Callable[[], Any]) -> tuple[list[str], list[str]]:
    """The functions of pgregistry entered (``caller module > module.function``), and each re-entry from below: a
    module entered while it is on the stack with another pgregistry module above it."""
    entered: list[str] = []
    reentries: list[str] = []
    stack: list[str | None] = []

    def profile(frame: FrameType, event: str, arg: object) -> None:
        if event == "call":
            module = _module_of(frame)
            below = [name for name in stack if name is not None]
            if module is not None:
                entered.append(f"{below[-1] if below else ''} > {module}.{frame.f_code.co_name}")
                if below and below[-1] != module and module in below:
                    reentries.append(" -> ".join([*below[below.index(module) :], module]))
            stack.append(module)
        elif event == "return" and stack:
            stack.pop()

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    return entered, reentries


CALLS: dict[str, Callable[[nn.Module], Any]] = {
    "grad_norm": lambda model: grad_norm(model, OFF),
    "count_zeros": lambda model: count_zeros(model, OFF),
    "grad_norm_and_zeros": lambda model: grad_norm_and_zeros(model, OFF, max_norm=0.5),
    "clip_grad_norm_": lambda model: clip_grad_norm_(model, 0.5, OFF),
}


@pytest.mark.parametrize("entry", list(CALLS))
def test_a_call_resolves_once_and_never_climbs_back(entry: str) -> None:
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    model(torch.randn(5, 4)).sum().backward()
    for which in ("the plan made", "the plan kept"):
        entered, reentries = _route(lambda: CALLS[entry](model))
        resolved = [step for step in entered if step.endswith("> _runtime.resolve.resolve_pg_collection")]
        assert resolved == ["grad_stats._functional > _runtime.resolve.resolve_pg_collection"], (entry, which, entered)
        assert not reentries, (entry, which, reentries)


def _modules_routes(names: tuple[str, ...]) -> dict[str, tuple[list[str], list[str]]]:
    """Each job-wide statistic's checks of a kept plan, and its re-entries, over modules ``names`` colocated on
    one rank (the plans kept: the second call of each)."""
    from pgregistry import modules as mm
    from pgregistry.layout import ParallelLayout

    modules = mm.build_modules({name: ParallelLayout(num_ranks=1) for name in names})
    models = {name: nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2)) for name in modules}
    for model in models.values():
        model(torch.randn(5, 4)).sum().backward()
    calls: dict[str, Callable[[], Any]] = {
        "grad_norm": lambda: mm.grad_norm(models, modules),
        "count_zeros": lambda: mm.count_zeros(models, modules),
        "clip_grad_norm_": lambda: mm.clip_grad_norm_(models, 0.5, modules),
    }
    routes = {}
    for label, call in calls.items():
        call()
        entered, reentries = _route(call)
        routes[label] = ([step for step in entered if step.endswith(".check_or_make_plan")], reentries)
    return routes


@pytest.mark.parametrize("names", [("a", "b"), ("a",)], ids=["two colocated modules", "one module"])
def test_a_job_wide_statistic_checks_each_modules_plan_once(names: tuple[str, ...]) -> None:
    """``pgregistry.modules``' statistics check each module's kept plan once a call, before the agreement (for the
    statistics' door and the refusal of a tensor in two modules' models), and hand it down to the module's
    statistic (which checked its plan again before, on a rank running several modules)."""
    from pgregistry.testing import run_world

    (routes,) = run_world(1, _modules_routes, names, timeout=60)
    for label, (checks, reentries) in routes.items():
        assert checks == ["grad_stats._functional > grad_stats._plan.check_or_make_plan"] * len(names), (
            label, checks)
        assert not reentries, (label, reentries)

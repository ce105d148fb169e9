"""Every public clip path names a bad ``max_norm`` or ``norm_type`` and its value, before any collective.

Reported (issue 41): ``clip_grad_norm_(model, max_norm='1')`` raised Python's bare ``TypeError: '>' not supported
between instances of 'str' and 'int'`` on every rank, and a ``norm_type`` of ``'2'`` was taken as 2. Each path runs
in a 2-rank gloo world (a collection built by the registry, grads set), so a check that came after the first
collective would show as a hang or as a rank raising something else.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from pgregistry import registry
from pgregistry.collection import FIELD_NAMES, ProcessGroupCollection
from pgregistry.grad_stats import (
    clip_grad_norm_,
    clip_grads_,
    grad_norm,
    grad_norm_and_zeros,
    norm_of_grads,
)
from pgregistry.layout import ParallelLayout
from pgregistry.optim import (
    MixedPrecisionOptimizer,
    inner_factory,
    setup_process_groups_for_optimizer,
)
from pgregistry.testing import run_world

BAD_MAX_NORMS = ["1", None, True]
"""Values of no number type, each named with its type (``None`` is no clip for ``grad_norm_and_zeros``)."""


def _model() -> nn.Module:
    model = nn.Linear(3, 2)
    for param in model.parameters():
        param.grad = torch.ones_like(param)
    return model


def _optimizer() -> MixedPrecisionOptimizer:
    groups = setup_process_groups_for_optimizer(ProcessGroupCollection(**dict.fromkeys(FIELD_NAMES)))
    optimizer = MixedPrecisionOptimizer(list(nn.Linear(3, 2).parameters()), groups, inner=inner_factory("sgd", lr=1))
    optimizer.buffer.data.fill_(1.0)
    return optimizer


def _paths() -> dict[str, Callable[[Any, Any], object]]:
    """Each public path, called with ``(max_norm, norm_type)``."""
    collection = registry.build(ParallelLayout(num_ranks=2))
    return {
        "grad_stats.clip_grad_norm_": lambda m, p: clip_grad_norm_(_model(), m, collection, norm_type=p),
        "grad_stats.grad_norm_and_zeros": lambda m, p: grad_norm_and_zeros(_model(), collection, norm_type=p,
                                                                           max_norm=m),
        "grad_stats.clip_grads_": lambda m, p: clip_grads_([torch.ones(2)], m, 1.0),
        "optimizer.clip_grad_norm": lambda m, p: _optimizer().clip_grad_norm(m, p),
    }


def _messages_on_rank() -> dict[str, list[str]]:
    messages: dict[str, list[str]] = {}
    paths = _paths()
    for path, call in paths.items():
        bad_max_norms = [bad for bad in BAD_MAX_NORMS if bad is not None or path != "grad_stats.grad_norm_and_zeros"]
        for max_norm, norm_type in [*((bad, 2.0) for bad in bad_max_norms), (1.0, "2")]:
            try:
                call(max_norm, norm_type)
            except Exception as exc:  # noqa: BLE001 - the type and text are what is checked
                messages.setdefault(path, []).append(f"{type(exc).__name__}: {exc}")
            else:
                messages.setdefault(path, []).append("no error")
    messages["grad_norm"] = []
    try:
        grad_norm(_model(), registry.build(ParallelLayout(num_ranks=2)), norm_type="2")  # type: ignore[arg-type]
    except Exception as exc:  # noqa: BLE001
        messages["grad_norm"].append(f"{type(exc).__name__}: {exc}")
    messages["norm_type=None"] = _norm_type_none_messages(paths)
    # A good call after the refusals: a refusal that had entered a collective would leave the ranks out of step.
    messages["norm after"] = [str(float(grad_norm(_model(), registry.build(ParallelLayout(num_ranks=2)))))]
    return messages


def _norm_type_none_messages(paths: dict[str, Callable[[Any, Any], object]]) -> list[str]:
    """What each path with a norm type says to ``norm_type=None``.

    Reported: ``clip_grad_norm_`` raised a bare ``AssertionError``, ``grad_norm`` and ``norm_of_grads`` ``ValueError:
    no norm was computed``, all after the reduction, since ``None`` meant "no norm" inside."""
    calls: dict[str, Callable[[], object]] = {
        name: lambda call=call: call(1.0, None) for name, call in paths.items() if name != "grad_stats.clip_grads_"
    }
    collection = registry.build(ParallelLayout(num_ranks=2))
    calls["grad_stats.grad_norm"] = lambda: grad_norm(_model(), collection, norm_type=None)  # type: ignore[arg-type]
    calls["grad_stats.norm_of_grads"] = lambda: norm_of_grads({None: [torch.ones(2)]}, None)  # type: ignore[arg-type]
    calls["optimizer.get_grad_norm"] = lambda: _optimizer().get_grad_norm(None)  # type: ignore[arg-type]
    said = []
    for name, call in calls.items():
        try:
            call()
        except Exception as exc:  # noqa: BLE001 - the type and text are what is checked
            said.append(f"{name}: {type(exc).__name__}: {exc}")
        else:
            said.append(f"{name}: no error")
    return said


@pytest.fixture(scope="module")
def messages() -> list[dict[str, list[str]]]:
    return run_world(2, _messages_on_rank, timeout=60)


@pytest.mark.parametrize(
    "path", ["grad_stats.clip_grad_norm_", "grad_stats.grad_norm_and_zeros", "grad_stats.clip_grads_",
             "optimizer.clip_grad_norm"]
)
def test_a_max_norm_of_no_number_is_named_with_its_value(messages: list[dict[str, list[str]]], path: str) -> None:
    for rank_messages in messages:
        shown = rank_messages[path][:-1]  # the last: a bad norm_type
        bad_max_norms = [bad for bad in BAD_MAX_NORMS if bad is not None or path != "grad_stats.grad_norm_and_zeros"]
        for bad, message in zip(bad_max_norms, shown, strict=True):
            assert message == (
                f"TypeError: max_norm must be a positive, finite number (a float), got {bad!r} ({type(bad).__name__})"
            ), (path, message)


@pytest.mark.parametrize("path", ["grad_stats.clip_grad_norm_", "grad_stats.grad_norm_and_zeros",
                                  "optimizer.clip_grad_norm"])
def test_a_norm_type_of_no_number_is_named_with_its_value(messages: list[dict[str, list[str]]], path: str) -> None:
    for rank_messages in messages:
        assert rank_messages[path][-1] == "TypeError: norm_type must be a positive number or inf, got '2' (str)"


def test_grad_norm_names_a_norm_type_string(messages: list[dict[str, list[str]]]) -> None:
    for rank_messages in messages:
        assert rank_messages["grad_norm"] == ["TypeError: norm_type must be a positive number or inf, got '2' (str)"]


def test_a_norm_type_of_none_is_named_on_every_path(messages: list[dict[str, list[str]]]) -> None:
    for rank_messages in messages:
        for said in rank_messages["norm_type=None"]:
            assert said.endswith(": TypeError: norm_type must be a positive number or inf, got None (NoneType)"), said
        assert len(rank_messages["norm_type=None"]) == 6
        assert rank_messages["norm after"] == [str(float(torch.tensor(8.0, dtype=torch.float64).sqrt().float()))]

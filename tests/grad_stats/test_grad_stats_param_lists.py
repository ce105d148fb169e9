"""Grad statistics refuse an unclassified expert parameter however the parameters are passed.

Before, only a model (or model chunks) was checked: ``grad_norm(list(model.parameters()), ...)``, a generator or a
``named_parameters`` dict counted an expert parameter without an EP classification as dense, the bug class of
"xorl: per-expert LoRA factors treated as EP-replicated (norm low by 1/sqrt(ep))". Now the mark travels on the
tensors (``in_expert_module``), including parameters registered after the module was marked, as modules are
marked at the top of their ``__init__``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from fixtures.errors import value_error_of
from torch import nn

from pgregistry import ParallelLayout, registry
from pgregistry.grad_stats import clip_grad_norm_, count_zeros, grad_norm
from pgregistry.params import mark_expert, mark_expert_module, mark_expert_replicated
from pgregistry.testing import run_world

EP = 2


PARAMS = (("dense.weight", (3, 3)), ("experts.fc", (2, 3)), ("experts.lora", (2, 3)), ("experts.proj.weight", (3, 3)))
"""Every parameter in ``named_parameters`` order, with its shape."""
ROUTED = ("experts.fc", "experts.lora")
"""Distinct per EP rank; the others are replicated (the same grad on every rank)."""


def _grad(name: str, rank: int) -> torch.Tensor:
    index = [n for n, _ in PARAMS].index(name)
    generator = torch.Generator().manual_seed(1000 * index + (rank if name in ROUTED else 0))
    return torch.randn(dict(PARAMS)[name], generator=generator, dtype=torch.float64)


class Experts(nn.Module):
    """Marked first, parameters and a submodule registered after the mark."""

    def __init__(self, classify: bool) -> None:
        super().__init__()
        mark_expert_module(self)
        self.fc = mark_expert(nn.Parameter(torch.zeros(2, 3)))
        self.lora = nn.Parameter(torch.zeros(2, 3))
        self.proj = nn.Linear(3, 3, bias=False)
        if classify:
            mark_expert(self.lora)
            mark_expert_replicated(self.proj.weight)


class Model(nn.Module):
    def __init__(self, classify: bool) -> None:
        super().__init__()
        self.dense = nn.Linear(3, 3, bias=False)
        self.experts = Experts(classify)


def _model(rank: int, classify: bool) -> Model:
    model = Model(classify)
    assert [(n, tuple(p.shape)) for n, p in model.named_parameters()] == list(PARAMS)
    for name, param in model.named_parameters():
        param.grad = _grad(name, rank).float()
    return model


def _forms(model: nn.Module) -> dict[str, Callable[[], Any]]:
    return {
        "model": lambda: model,
        "chunks": lambda: [model],
        "list": lambda: list(model.parameters()),
        "generator": lambda: model.parameters(),
        "dict": lambda: dict(model.named_parameters()),
    }


def _on_rank() -> dict[str, Any]:
    collection = registry.build(ParallelLayout(num_ranks=EP, ep=EP, expt_tp=1))
    rank = torch.distributed.get_rank()
    out: dict[str, Any] = {"unclassified": {}, "norms": {}}
    unclassified = _model(rank, classify=False)
    for form, params in _forms(unclassified).items():
        out["unclassified"][form] = [
            value_error_of(lambda params=params: grad_norm(params(), collection)),  # type: ignore[misc]
            value_error_of(lambda params=params: count_zeros(params(), collection)),  # type: ignore[misc]
            value_error_of(lambda params=params: clip_grad_norm_(params(), 1e9, collection)),  # type: ignore[misc]
        ]
    out["one_tensor"] = value_error_of(lambda: grad_norm(unclassified.experts.lora, collection))
    classified = _model(rank, classify=True)
    for form, params in _forms(classified).items():
        out["norms"][form] = float(grad_norm(params(), collection).item())
    return out


def _oracle() -> float:
    """The true norm in float64: routed experts once per EP rank, every replicated parameter once."""
    total = 0.0
    for name, _ in PARAMS:
        for rank in range(EP) if name in ROUTED else (0,):
            total += float((_grad(name, rank).float().double() ** 2).sum())
    return math.sqrt(total)


def test_a_parameter_list_generator_or_dict_is_checked_like_the_model() -> None:
    oracle = _oracle()
    for out in run_world(EP, _on_rank):
        for form, errors in out["unclassified"].items():
            for error in errors:
                assert error.startswith("2 parameter(s) of a marked expert module carry no EP classification"), (
                    form, error,
                )
                if form in ("model", "chunks", "dict"):
                    assert "experts.lora, experts.proj.weight." in error, (form, error)
        assert "carry no EP classification: param[0]" in out["one_tensor"]
        for form, norm in out["norms"].items():
            assert norm == pytest.approx(oracle, rel=1e-6), form

"""xorl: per-expert LoRA factors inside an expert module must never default to "replicated across EP".

EP = world = 4 (TP 1). A marked expert module holds frozen base weights, per-expert LoRA factors (distinct per EP
rank: each rank holds different experts) and a factor shared by all experts (replicated across EP). Checked here:

* classified correctly, the norm equals the unsharded float64 oracle and the audit finds nothing;
* a factor with no classification raises ValueError naming it (grad_norm of the model and
  check_expert_classification), and the audit lists it;
* the seed's bug, per-expert factors classified replicated: the audit reports them and the 1/sqrt(ep) error;
* the reverse, a replicated factor classified as a routed expert: the audit reports a sqrt(ep) overcount.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from fixtures.errors import value_error_of
from torch import nn

from pgregistry import registry
from pgregistry.audit import audit_grad_replication
from pgregistry.grad_stats import check_expert_classification, count_zeros, grad_norm
from pgregistry.layout import ParallelLayout
from pgregistry.params import mark_expert, mark_expert_module, mark_expert_replicated
from pgregistry.testing import run_world

EP = 4
EXPERTS, HIDDEN, RANK = 8, 6, 2
LOCAL = EXPERTS // EP


def _base(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float32).double()


def _full_grads() -> dict[str, torch.Tensor]:
    """Unsharded grads. Each expert's factor is a rotation of one base vector: distinct values, equal norms, so
    the seed's undercount is exactly 1/sqrt(ep) on every rank."""
    base_a, base_b = _base((RANK * HIDDEN,), 1), _base((HIDDEN * RANK,), 2)
    return {
        "lora_a": torch.stack([base_a.roll(e).reshape(RANK, HIDDEN) for e in range(EXPERTS)]),
        "lora_b": torch.stack([base_b.roll(e).reshape(HIDDEN, RANK) for e in range(EXPERTS)]),
        "shared_a": _base((RANK, HIDDEN), 3),
    }


class Experts(nn.Module):
    def __init__(self, ep_rank: int, grads: dict[str, torch.Tensor], with_grads: tuple[str, ...]) -> None:
        super().__init__()
        mark_expert_module(self)
        self.weight = mark_expert(nn.Parameter(torch.zeros(LOCAL, HIDDEN, HIDDEN), requires_grad=False))
        mine = slice(ep_rank * LOCAL, (ep_rank + 1) * LOCAL)
        for name, full in grads.items():
            local = full if name == "shared_a" else full[mine]
            param = nn.Parameter(torch.zeros(local.shape))
            if name in with_grads:
                param.grad = local.float().clone()
            self.register_parameter(name, param)


class Model(nn.Module):
    def __init__(self, experts: Experts) -> None:
        super().__init__()
        self.router = nn.Parameter(torch.zeros(EXPERTS, HIDDEN), requires_grad=False)
        self.experts = experts


def _build(roles: dict[str, Callable[[nn.Parameter], Any] | None], with_grads: tuple[str, ...]) -> Model:
    experts = Experts(torch.distributed.get_rank(), _full_grads(), with_grads)
    for name, mark in roles.items():
        if mark is not None:
            mark(getattr(experts, name))
    return Model(experts)


def _on_rank() -> dict[str, Any]:
    collection = registry.build(ParallelLayout(num_ranks=EP, ep=EP, expt_tp=1))
    out: dict[str, Any] = {}

    correct = _build(
        {"lora_a": mark_expert, "lora_b": mark_expert, "shared_a": mark_expert_replicated},
        ("lora_a", "lora_b", "shared_a"),
    )
    report = audit_grad_replication(correct, collection)
    out["correct"] = (grad_norm(correct, collection).item(), report.ok, report.true_norm, str(report))

    unclassified = _build({"lora_a": mark_expert, "shared_a": mark_expert_replicated}, ("lora_a", "lora_b"))
    report = audit_grad_replication(unclassified, collection)
    out["unclassified"] = (
        value_error_of(lambda: grad_norm(unclassified, collection)),
        value_error_of(lambda: check_expert_classification(unclassified, collection)),
        report.unclassified,
        report.ok,
    )
    # The same model passed as a list of chunks (one chunk: no prefix) is refused as well.
    out["unclassified_chunks"] = (
        value_error_of(lambda: grad_norm([unclassified], collection)),
        value_error_of(lambda: count_zeros([unclassified], collection)),
        audit_grad_replication([unclassified], collection).unclassified,
    )

    seed_bug = _build(
        {"lora_a": mark_expert_replicated, "lora_b": mark_expert_replicated, "shared_a": mark_expert_replicated},
        ("lora_a", "lora_b"),
    )
    report = audit_grad_replication(seed_bug, collection)
    out["seed_bug"] = (
        grad_norm(seed_bug, collection).item(),
        report.classified_norm,
        report.true_norm,
        report.norm_ratio,
        sorted((m.name, m.axis, m.claimed, m.measured, m.effect) for m in report.mismatches),
        str(report),
    )

    reverse = _build({"lora_a": mark_expert, "lora_b": mark_expert, "shared_a": mark_expert}, ("shared_a",))
    report = audit_grad_replication(reverse, collection)
    out["reverse"] = (
        report.norm_ratio,
        [(m.name, m.axis, m.claimed, m.measured, m.effect) for m in report.mismatches],
        str(report),
    )
    return out


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_world(EP, _on_rank)


def _oracle(names: tuple[str, ...]) -> float:
    grads = _full_grads()
    return math.sqrt(sum(float(grads[name].pow(2).sum()) for name in names))


def test_classified_lora_factors_give_the_exact_norm(results: list[dict[str, Any]]) -> None:
    oracle = _oracle(("lora_a", "lora_b", "shared_a"))
    for rank, got in enumerate(results):
        norm, ok, true_norm, text = got["correct"]
        assert norm == pytest.approx(oracle, rel=1e-6), rank
        assert ok, text
        assert true_norm == pytest.approx(oracle, rel=1e-6), rank


def test_a_factor_without_classification_raises_naming_it(results: list[dict[str, Any]]) -> None:
    for got in results:
        from_norm, from_check, listed, ok = got["unclassified"]
        for message in (from_norm, from_check):
            assert "experts.lora_b" in message and "mark_expert" in message
            assert "lora_a" not in message and "shared_a" not in message
        assert listed == ("experts.lora_b",) and not ok
        *from_chunks, listed_from_chunks = got["unclassified_chunks"]
        for message in from_chunks:
            assert "experts.lora_b" in message and "mark_expert" in message
        assert listed_from_chunks == ("experts.lora_b",)


def test_audit_catches_unique_grads_classified_replicated(results: list[dict[str, Any]]) -> None:
    oracle = _oracle(("lora_a", "lora_b"))
    for rank, got in enumerate(results):
        norm, classified, true_norm, ratio, mismatches, text = got["seed_bug"]
        assert classified == pytest.approx(norm, rel=1e-7), rank  # the audit reports what grad_norm computes
        assert true_norm == pytest.approx(oracle, rel=1e-6), rank
        assert ratio == pytest.approx(1 / math.sqrt(EP), rel=1e-6), text
        ep_mismatches = [m for m in mismatches if m[1] == "ep"]
        assert ep_mismatches == [
            ("experts.lora_a", "ep", "replicated", "unique", "undercount"),
            ("experts.lora_b", "ep", "replicated", "unique", "undercount"),
        ]
        assert "experts.lora_a" in text and "ratio 0.500000" in text


def test_audit_catches_replicated_grads_classified_unique(results: list[dict[str, Any]]) -> None:
    for got in results:
        ratio, mismatches, text = got["reverse"]
        assert ratio == pytest.approx(math.sqrt(EP), rel=1e-6), text
        assert mismatches == [("experts.shared_a", "ep", "unique", "replicated", "overcount")]

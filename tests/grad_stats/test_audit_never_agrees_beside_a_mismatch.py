"""The replication audit never reads as agreeing next to a mismatch it lists.

Before, experts in no marked module at EP 4 (no ``allreduce`` at all, so counted as dense) were listed as one
data-parallel mismatch ("are the grads synchronised yet?") beside "ratio 1.000000": the measured truth trusted the
same classification. Now such a parameter, distinct across EP and across its data-parallel replicas, is reported as
an unmarked expert and counted as one in the truth (the ratio shows the undercount); grads that differ across
replicas with no model-parallel reason make the truth unknown, said so; and a ratio that is not 1 is never printed
as "1.000000". Real gloo worlds; the oracles are float64 norms computed here.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from pgregistry import ParallelLayout, registry
from pgregistry.audit import audit_grad_replication
from pgregistry.params import mark_tensor_parallel
from pgregistry.testing import run_world


def _values(shape: tuple[int, ...], seed: int, scale: float = 1.0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(shape, generator=generator, dtype=torch.float64)).float()


def _report(model: nn.Module, layout: ParallelLayout) -> dict[str, Any]:
    report = audit_grad_replication(model, registry.build(layout))
    return {
        "ok": report.ok,
        "mismatches": [(m.name, m.axis, m.claimed, m.measured, m.effect, m.hint) for m in report.mismatches],
        "classified": report.classified_norm,
        "true": report.true_norm,
        "ratio": report.norm_ratio,
        "text": str(report),
    }


def _unmarked_experts() -> dict[str, Any]:
    """EP 4 (dense DP 4): a dense weight, the same on every rank, and an experts weight, distinct per rank, in no
    marked module and with no EP classification."""
    model = nn.Module()
    model.dense = nn.Parameter(torch.zeros(3, 3))
    model.experts = nn.Parameter(torch.zeros(2, 3))
    model.dense.grad = _values((3, 3), 1)
    model.experts.grad = _values((2, 3), 10 + dist.get_rank())
    return _report(model, ParallelLayout(num_ranks=4, ep=4, expt_tp=1))


def test_experts_in_no_marked_module_are_reported_and_the_ratio_shows_it() -> None:
    dense = float(_values((3, 3), 1).double().square().sum())
    experts = [float(_values((2, 3), 10 + rank).double().square().sum()) for rank in range(4)]
    true = math.sqrt(dense + sum(experts))
    for rank, out in enumerate(run_world(4, _unmarked_experts)):
        assert not out["ok"], out["text"]
        [(name, axis, claimed, measured, effect, hint)] = out["mismatches"]
        assert (name, axis, claimed, measured, effect) == ("experts", "ep", "replicated", "unique", "undercount")
        assert "carries no EP classification" in hint and "mark_expert" in hint
        assert out["classified"] == pytest.approx(math.sqrt(dense + experts[rank]), rel=1e-6)
        assert out["true"] == pytest.approx(true, rel=1e-6), out["text"]
        assert out["ratio"] < 0.9 and "ratio 1.000000" not in out["text"], out["text"]


def _unsynchronised() -> dict[str, Any]:
    """DP 2: a dense grad that differs across the replicas (not synchronised yet)."""
    model = nn.Linear(3, 2, bias=False)
    model.weight.grad = _values((2, 3), 20 + dist.get_rank())
    return _report(model, ParallelLayout(num_ranks=2))


def test_grads_that_differ_across_replicas_leave_the_truth_unknown() -> None:
    for out in run_world(2, _unsynchronised):
        assert not out["ok"], out["text"]
        assert [m[1] for m in out["mismatches"]] == ["dp_cp"]
        assert math.isnan(out["true"]) and math.isnan(out["ratio"]), out["text"]
        assert "measured-truth norm unknown" in out["text"] and "ratio" not in out["text"], out["text"]


def _tiny_overcount() -> dict[str, Any]:
    """TP 2: a large replicated weight (right) and a tiny bias marked TP-sharded though the same on both ranks (an
    overcount of about 1e-14 of the norm: below the statistics' float32 precision)."""
    model = nn.Module()
    model.weight = nn.Parameter(torch.zeros(8, 8))
    model.bias = mark_tensor_parallel(nn.Parameter(torch.zeros(2)), 0)
    model.weight.grad = _values((8, 8), 30)
    model.bias.grad = _values((2,), 31, scale=1e-6)
    return _report(model, ParallelLayout(num_ranks=2, tp=2))


def test_a_ratio_next_to_a_mismatch_is_never_printed_as_one() -> None:
    """A mismatch too small to move the ratio's sixth decimal: the report said "ratio 1.000000" beside it; now the
    ratio's digits that differ from one, or that it is one only within the statistics' precision."""
    for out in run_world(2, _tiny_overcount):
        assert not out["ok"] and [m[:2] for m in out["mismatches"]] == [("bias", "tp")], out["text"]
        assert f"{out['ratio']:.6f}" == "1.000000"  # what the report used to print
        assert "ratio 1.000000 " not in out["text"] and "ratio 1" in out["text"], out["text"]

"""The audit reports a likely tie across pipeline stages that no measurement proves, and leaves the report ok.

Reported: an unmarked tie across PP 2 whose copies' grads differ by 1e-7 (or are not all-reduced yet) was counted
twice while ``audit_grad_replication`` said ok, with nothing to see: its identical-grads check needs bit-identical
copies. Now each such pair is a suspect (same shape on the first and last stage, and named as an input embedding
and an output layer as Megatron-Core's ``embedding.word_embeddings.weight`` and ``output_layer.weight`` are,
Megatron-Core's ``shared_embedding``, or values or grads that agree to 1e-5), reported with how to mark it; an
untied model's layers of one shape are not. A 2-rank gloo world, PP 2; the oracle is the float64 norm of the grads
set, each counted.
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
from pgregistry.testing import run_world

VOCAB, HIDDEN = 6, 4


def _values(seed: int) -> torch.Tensor:
    return torch.randn(VOCAB, HIDDEN, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _stage(case: str) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """This rank's stage, and the grad (float64) each of its parameters gets."""
    first = dist.get_rank() == 0
    stage = nn.Module()
    stage.layer = nn.Module()
    stage.layer.weight = nn.Parameter(_values(10 + dist.get_rank()).float())  # untied, same name on both stages
    name = ("embedding.word_embeddings" if first else "output_layer") if case != "untied layers" else ""
    grads = {"layer.weight": _values(20 + dist.get_rank())}
    if name:
        holder = stage
        for part in name.split("."):
            setattr(holder, part, nn.Module())
            holder = getattr(holder, part)
        holder.weight = nn.Parameter(_values(1).float())  # a tie's copies start equal
        tied = _values(2)
        if case == "copies 4e-7 apart" and not first:
            tied = tied * (1 + 4e-7)  # a few float32 ulps: not bit-identical
        elif case == "grads not all-reduced":  # each stage's own part of the tie's grad
            tied = _values(3 + dist.get_rank())
        grads[f"{name}.weight"] = tied
    return stage, grads


def _on_rank(case: str) -> dict[str, Any]:
    collection = registry.build(ParallelLayout(num_ranks=2, pp=2))
    stage, grads = _stage(case)
    for name, param in stage.named_parameters():
        param.grad = grads[name].float()
    report = audit_grad_replication(stage, collection)
    return {
        "ok": report.ok,
        "mismatches": [str(m) for m in report.mismatches],
        "suspects": [(s.name, s.other_name, s.other_rank) for s in report.suspected_ties],
        "text": str(report),
        "classified": report.classified_norm,
        "grads": [grad.float().double() for grad in grads.values()],
    }


@pytest.mark.parametrize("case", ["copies 4e-7 apart", "grads not all-reduced"])
def test_a_tie_no_measurement_proves_is_reported_as_a_suspect(case: str) -> None:
    outs = run_world(2, _on_rank, case)
    counted = math.sqrt(sum(float(grad.square().sum()) for out in outs for grad in out["grads"]))
    expected = [
        ("embedding.word_embeddings.weight", "output_layer.weight", 1),
        ("output_layer.weight", "embedding.word_embeddings.weight", 0),
    ]
    for rank, out in enumerate(outs):
        assert out["ok"] and not out["mismatches"], out["text"]  # reported, not an error
        assert out["suspects"] == [expected[rank]], out["text"]
        assert "suspected tie (not an error)" in out["text"] and "mark_shared" in out["text"], out["text"]
        assert out["classified"] == pytest.approx(counted, rel=1e-6), out["text"]  # both copies counted


def test_an_untied_models_same_named_layers_are_no_suspects() -> None:
    for out in run_world(2, _on_rank, "untied layers"):
        assert out["ok"] and not out["suspects"], out["text"]
        assert "suspected" not in out["text"], out["text"]

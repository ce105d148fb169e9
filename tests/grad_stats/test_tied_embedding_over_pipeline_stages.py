"""A tied embedding over two pipeline stages is counted once (Megatron-LM issue 7228: the norm was inflated by up to
sqrt(2)), with Megatron-Core's own marks, also when they were set before ``fully_shard``; the audit flags a tie no
copy is marked on.

Megatron-Core marks the tie itself, as plain attributes set after the parameters are registered
(``LanguageModule.setup_embeddings_and_output_layer``): the first stage's word embedding ``shared_embedding = True``
(it counts), the last stage's output weight ``shared = True`` and ``shared_embedding = True`` (it does not). Before,
``fully_shard`` replaced both parameters and the marks went with the old objects: the output weight was counted
too. An unmarked tie is counted twice, and ``audit_grad_replication`` called it ok; it now measures, over the
collection's ``embd`` group, the grads identical on the first and last stage, and reports a tie with no shared
copy as an overcount. A 4-rank gloo world, PP 2 x DP 2; the oracle is the float64 norm of the unsharded model's
grads, the tied one counted once.
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
from pgregistry.collection import group_rank
from pgregistry.grad_stats import clip_grad_norm_, grad_norm
from pgregistry.params import param_roles
from pgregistry.testing import run_world

VOCAB, HIDDEN = 8, 4
LAYOUT = ParallelLayout(num_ranks=4, pp=2)  # dp 2: stages {0, 1} and {2, 3}; embd {0, 2} and {1, 3}


def _grad(name: str) -> torch.Tensor:
    """The synchronised (every data-parallel replica's) grad of each parameter; the tie's is the same on both stages."""
    shapes = {"tied": (VOCAB, HIDDEN), "first.hidden": (HIDDEN, HIDDEN), "last.norm": (HIDDEN,)}
    generator = torch.Generator().manual_seed(sum(map(ord, name)))
    values = torch.randn(shapes[name], generator=generator, dtype=torch.float64)
    values[torch.rand(shapes[name], generator=generator) < 0.3] = 0.0
    return values.float()


class FirstStage(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, HIDDEN)
        self.hidden = nn.Parameter(torch.zeros(HIDDEN, HIDDEN))


class LastStage(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.Parameter(torch.zeros(HIDDEN))
        self.output = nn.Linear(HIDDEN, VOCAB, bias=False)


def _stage(marked: bool) -> tuple[nn.Module, dict[str, str]]:
    """This rank's stage and which grad each of its parameters gets; Megatron-Core's marks when ``marked``."""
    if dist.get_rank() < 2:
        stage: nn.Module = FirstStage()
        if marked:
            stage.embedding.weight.shared_embedding = True  # type: ignore[union-attr]
        return stage, {"embedding.weight": "tied", "hidden": "first.hidden"}
    stage = LastStage()
    if marked:
        stage.output.weight.shared = True  # type: ignore[union-attr]
        stage.output.weight.shared_embedding = True  # type: ignore[union-attr]
    return stage, {"norm": "last.norm", "output.weight": "tied"}


def _set_grads(stage: nn.Module, grads: dict[str, str], dp_rank: int) -> None:
    from torch.distributed.tensor import DTensor

    for name, param in stage.named_parameters():
        full = _grad(grads[name])
        if isinstance(param, DTensor):  # FSDP2: this replica's Shard(0) piece
            local = full.chunk(2)[dp_rank].contiguous()
            param.grad = DTensor.from_local(local, param.device_mesh, param.placements, run_check=False,
                                            shape=param.shape, stride=param.stride())
        else:
            param.grad = full.clone()


def _on_rank(marked: bool, sharded: bool) -> dict[str, Any]:
    from torch.distributed.fsdp import fully_shard

    from pgregistry.mesh import to_device_mesh

    collection = registry.build(LAYOUT)
    stage, grads = _stage(marked)
    if sharded:  # the marks were set before fully_shard, which replaces every parameter
        fully_shard(stage, mesh=to_device_mesh(collection, ("dp_cp",)))
    _set_grads(stage, grads, group_rank(collection.get("dp_cp")))
    out: dict[str, Any] = {"norm": float(grad_norm(stage, collection))}
    out["roles"] = {name: param_roles(param) for name, param in stage.named_parameters() if name in grads}
    if not sharded:
        report = audit_grad_replication(stage, collection)
        out["audit"] = (
            report.ok,
            [(m.name, m.axis, m.claimed, m.measured, m.effect) for m in report.mismatches],
            report.classified_norm,
            report.true_norm,
            str(report),
        )
    out["clip"] = float(clip_grad_norm_(stage, 1.0, collection))
    return out


def _oracle(tie_times: int) -> float:
    squares = sum(float(_grad(name).double().square().sum()) for name in ("first.hidden", "last.norm"))
    return math.sqrt(squares + tie_times * float(_grad("tied").double().square().sum()))


@pytest.mark.parametrize("sharded", [False, True], ids=["plain", "fully_shard after the marks"])
def test_megatrons_marks_count_the_tie_once(sharded: bool) -> None:
    once = _oracle(1)
    for rank, out in enumerate(run_world(4, _on_rank, True, sharded)):
        assert out["norm"] == pytest.approx(once, rel=1e-6), (rank, out["norm"], _oracle(2))
        assert out["clip"] == pytest.approx(once, rel=1e-6), rank
        if rank >= 2:  # the last stage's copy keeps Megatron-Core's marks
            assert out["roles"]["output.weight"] == {"shared": True, "shared_embedding": True}, rank
        else:
            assert out["roles"]["embedding.weight"] == {"shared_embedding": True}, rank
        if not sharded:
            ok, mismatches, classified, true, text = out["audit"]
            assert ok and not mismatches, text
            assert classified == pytest.approx(once, rel=1e-6) and true == pytest.approx(once, rel=1e-6), text


def test_the_audit_flags_a_tie_no_copy_is_marked_on() -> None:
    for rank, out in enumerate(run_world(4, _on_rank, False, False)):
        assert out["norm"] == pytest.approx(_oracle(2), rel=1e-6), rank  # counted twice: what the audit must catch
        ok, mismatches, classified, true, text = out["audit"]
        name = "embedding.weight" if rank < 2 else "output.weight"
        assert not ok, text
        assert mismatches == [(name, "embd", "unique", "replicated", "overcount")], text
        assert classified == pytest.approx(_oracle(2), rel=1e-6), text
        assert true == pytest.approx(_oracle(1), rel=1e-6), text
        assert "ratio 1.000000" not in text and "no copy is marked shared" in text, text

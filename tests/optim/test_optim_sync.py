"""Gradient synchronisation: dense grads averaged over ``dp_cp``; expert grads divided by the ``dp_cp`` size and
summed over ``expt_dp`` (Megatron-Core's scaling); one collective per bucket; the sharded optimizer's shard."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from pgregistry import registry
from pgregistry.layout import ParallelLayout
from pgregistry.optim import build_optimizer
from pgregistry.params import mark_expert, mark_expert_module
from pgregistry.testing import run_world

DENSE, EXPERT = 5, 3


def _raw_grads(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's unsynchronised grads: distinct per rank, exact in float32."""
    dense = (rank + 1) * torch.arange(1, DENSE + 1, dtype=torch.float64)
    expert = (rank + 1) ** 2 * torch.arange(1, EXPERT + 1, dtype=torch.float64)
    return dense, expert


def _model() -> nn.Module:
    model = nn.Module()
    model.dense = nn.Parameter(torch.zeros(DENSE))
    model.experts = mark_expert_module(nn.Module())
    model.experts.weight = mark_expert(nn.Parameter(torch.zeros(EXPERT)))
    return model


def _on_rank(layout: ParallelLayout, bucket_numel: int | None) -> dict[str, Any]:
    rank = dist.get_rank()
    collection = registry.build(layout)
    calls: list[Any] = []
    real = dist.all_reduce

    def counting(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        calls.append(kwargs.get("group"))
        return real(tensor, *args, **kwargs)

    dist.all_reduce = counting  # this rank process only
    out: dict[str, Any] = {}
    for sharded in (False, True):
        model = _model()
        opt = build_optimizer(model, collection, sharded=sharded, bucket_numel=bucket_numel, mixed_precision=False)
        dense, expert = _raw_grads(rank)
        model.dense.grad.copy_(dense)
        model.experts.weight.grad.copy_(expert)
        before = len(calls)
        opt.sync_grads()
        collectives = len(calls) - before
        if sharded:
            # Only this rank's shard is synchronised: report each piece's grad with where it sits in its param.
            got = {
                ("dense" if not child.expert else "expert", piece.offset): piece.main.grad.double().tolist()
                for child in opt.chained_optimizers
                for piece in child._pieces
            }
        else:
            got = {
                ("dense", 0): model.dense.grad.double().tolist(),
                ("expert", 0): model.experts.weight.grad.double().tolist(),
            }
        out["sharded" if sharded else "unsharded"] = {
            "got": got,
            "all_reduces": collectives,
            "buffer_numels": [(child.expert, child.buffer.numel) for child in opt.chained_optimizers],
        }
    return out


@pytest.mark.parametrize(
    "world,sizes,bucket_numel",
    [(4, {"cp": 2, "ep": 2}, None), (8, {"tp": 2, "ep": 4, "expt_tp": 1}, 7), (4, {"ep": 4}, 16)],
)
def test_dense_grads_averaged_over_dp_cp_and_expert_grads_over_expt_dp(
    world: int, sizes: dict[str, int], bucket_numel: int | None
) -> None:
    layout = ParallelLayout(num_ranks=world, **sizes)
    dp_cp_size = layout.dp * layout.cp
    results = run_world(world, _on_rank, layout, bucket_numel)
    for rank, result in enumerate(results):
        groups = layout.groups_of(rank)
        want = {
            "dense": sum(_raw_grads(q)[0] for q in groups["dp_cp"]) / dp_cp_size,
            "expert": sum(_raw_grads(q)[1] for q in groups["expt_dp"]) / dp_cp_size,
        }
        for kind, res in result.items():
            where = f"{sizes} rank {rank} {kind}"
            covered = {"dense": 0, "expert": 0}
            for (which, offset), values in res["got"].items():
                expected = want[which][offset : offset + len(values)]
                assert torch.allclose(torch.tensor(values, dtype=torch.float64), expected, rtol=1e-6), where
                covered[which] += len(values)
            if kind == "unsharded":
                assert covered == {"dense": DENSE, "expert": EXPERT}, where
                # One all-reduce per bucket of each child whose data-parallel group has more than one rank.
                sync_sizes = {False: dp_cp_size, True: layout.expt_dp}
                step = bucket_numel or max(n for _, n in res["buffer_numels"])
                expected_calls = sum(
                    math.ceil(n / min(step, n)) for expert, n in res["buffer_numels"] if sync_sizes[expert] > 1
                )
                assert res["all_reduces"] == expected_calls, where
            else:
                assert res["all_reduces"] == 0, where  # reduce-scatter, not all-reduce
    # The sharded pieces of a data-parallel group tile each parameter exactly once.
    for which, numel, group_kind in (("dense", DENSE, "dp_cp"), ("expert", EXPERT, "expt_dp")):
        for group in {layout.groups_of(r)[group_kind] for r in range(world)}:
            pieces = sorted(
                (offset, len(values))
                for r in group
                for (kind, offset), values in results[r]["sharded"]["got"].items()
                if kind == which
            )
            assert sum(n for _, n in pieces) == numel and [o for o, _ in pieces] == sorted({o for o, _ in pieces})

"""DTensor TP (``parallelize_module``) + FSDP2 + EP on the collection's communicators: grad norm against float64.

Run under torchrun: NCCL on GPUs (default where CUDA is), gloo on CPU::

    torchrun --standalone --nproc-per-node 8 scripts/dtensor_tp_fsdp_ep.py --layout tp=2,ep=4,expt_tp=1
    torchrun --standalone --nproc-per-node 4 scripts/dtensor_tp_fsdp_ep.py --layout tp=2,ep=2,expt_tp=1 --backend gloo

Each rank builds the layout (``registry.build``; with NCCL the world is bound to the rank's GPU, so the groups are
split from its communicator) and a model of two parts: a dense MLP made tensor-parallel over the collection's ``tp``
group with ``parallelize_module`` (column- then row-parallel) and sharded by FSDP2 over ``dp_cp`` (a 2-D mesh with
``tp``), and this EP rank's routed experts (``mark_expert``), sharded by FSDP2 over ``expt_dp``. The dense part reads
its data-parallel replica's batch, the experts this rank's own batch; one backward, then ``pgregistry.grad_norm``
(p = 2 and inf) over the DTensor grads.

The oracle is float64 and uses none of pgregistry's code: every rank builds the unsharded model (every expert) and
replays every rank's batch, averaging each gradient over the ranks FSDP2 averages it over (the dense one over the
data-parallel replicas, an expert's over the ranks that hold it). Rank 0 prints each rank's norms against it and
PASS/FAIL lines; every rank exits 1 when a check failed. Each collective has the init timeout (``--timeout``), so a
hang ends in an error, not silence.
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

from pgregistry.cli._layout_views import parse_layout_spec  # noqa: E402
from pgregistry.cli._torchrun_checks import nccl_without_cuda  # noqa: E402

HIDDEN, FFN, EXPERTS, BATCH = 32, 64, 8, 4
REL = 1e-5


class Experts(nn.Module):
    """``count`` experts from ``first`` of the unsharded model's: one square weight each, with a ReLU."""

    def __init__(self, full: torch.Tensor, first: int, count: int) -> None:
        from pgregistry.params import mark_expert, mark_expert_module

        super().__init__()
        mark_expert_module(self)
        self.weight = mark_expert(nn.Parameter(full[first:first + count].clone()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(torch.einsum("eoi,bi->ebo", self.weight, x))


class Model(nn.Module):
    def __init__(self, dense: nn.Sequential, experts: Experts) -> None:
        super().__init__()
        self.dense = dense
        self.experts = experts

    def forward(self, x_dense: torch.Tensor, x_experts: torch.Tensor) -> torch.Tensor:
        return self.dense(x_dense).square().mean() + self.experts(x_experts).square().mean()


def _unsharded() -> tuple[nn.Sequential, torch.Tensor]:
    """The same dense MLP and the same expert weights on every rank (seeded)."""
    torch.manual_seed(0)
    dense = nn.Sequential(nn.Linear(HIDDEN, FFN), nn.ReLU(), nn.Linear(FFN, HIDDEN))
    experts = torch.randn(EXPERTS, HIDDEN, HIDDEN, generator=torch.Generator().manual_seed(1)) / math.sqrt(HIDDEN)
    return dense, experts


def _batch(seed: int) -> torch.Tensor:
    return torch.randn(BATCH, HIDDEN, generator=torch.Generator().manual_seed(seed))


def _dense_batch(layout: Any, rank: int) -> torch.Tensor:
    return _batch(1000 + layout.coords(rank)["dp"])  # TP peers of one replica must read the same data


def _expert_batch(rank: int) -> torch.Tensor:
    return _batch(2000 + rank)


def oracle(layout: Any) -> dict[str, float]:
    """The float64 2-norm and inf-norm of the whole model's grads, as the sharded run averages them."""
    dense32, experts32 = _unsharded()
    dense = copy.deepcopy(dense32).double()
    local = EXPERTS // layout.ep
    grads: list[torch.Tensor] = [torch.zeros_like(p) for p in dense.parameters()]
    expert_grads = torch.zeros_like(experts32, dtype=torch.float64)
    replicas = sorted({layout.coords(r)["dp"] for r in range(layout.num_ranks)})
    for dp in replicas:
        rank = next(r for r in range(layout.num_ranks) if layout.coords(r)["dp"] == dp)
        dense.zero_grad()
        dense(_dense_batch(layout, rank).double()).square().mean().backward()
        for total, param in zip(grads, dense.parameters(), strict=True):
            total += param.grad / len(replicas)
    for rank in range(layout.num_ranks):
        first = layout.coords(rank)["ep"] * local
        holders = sum(layout.coords(r)["ep"] == layout.coords(rank)["ep"] for r in range(layout.num_ranks))
        weight = experts32[first:first + local].double().requires_grad_()
        torch.relu(torch.einsum("eoi,bi->ebo", weight, _expert_batch(rank).double())).square().mean().backward()
        assert weight.grad is not None
        expert_grads[first:first + local] += weight.grad / holders
    flat = torch.cat([g.reshape(-1) for g in [*grads, expert_grads]])
    return {"norm2": float(flat.norm()), "norm_inf": float(flat.abs().max())}


def on_rank(layout: Any, device: torch.device) -> dict[str, Any]:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    from pgregistry import registry
    from pgregistry.grad_stats import grad_norm
    from pgregistry.mesh import to_device_mesh

    rank = dist.get_rank()
    pg = registry.build(layout, name="dtensor-tp-fsdp-ep")
    dense, experts = _unsharded()
    local = EXPERTS // layout.ep
    model = Model(dense, Experts(experts, layout.coords(rank)["ep"] * local, local)).to(device)
    mesh = to_device_mesh(pg, ("dp_cp", "tp"), device_type=device.type)
    parallelize_module(model.dense, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fully_shard(model.experts, mesh=to_device_mesh(pg, ("expt_dp",), device_type=device.type))
    fully_shard(model, mesh=mesh["dp_cp"])
    model(_dense_batch(layout, rank).to(device), _expert_batch(rank).to(device)).backward()
    placements = sorted({str(p.grad.placements) for p in model.parameters() if hasattr(p.grad, "placements")})
    out = {
        "norm2": float(grad_norm(model, pg)),
        "norm_inf": float(grad_norm(model, pg, norm_type=math.inf)),
        "placements": placements,
    }
    registry.destroy()
    return out


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layout", default="tp=1", help="sizes as KEY=VALUE,... (tp pp ep expt_tp order; expert TP 1)")
    parser.add_argument("--backend", choices=("nccl", "gloo"), default="nccl" if torch.cuda.is_available() else "gloo")
    parser.add_argument("--timeout", type=float, default=120.0, help="collective timeout in seconds (default 120)")
    args = parser.parse_args(argv)
    if "RANK" not in os.environ:
        parser.error("run it under torchrun")
    if args.backend == "nccl" and (problem := nccl_without_cuda()) is not None:
        parser.error(problem)  # torch.cuda.set_device would fail naming neither the option nor the fix
    init: dict[str, Any] = {"backend": args.backend, "timeout": timedelta(seconds=args.timeout)}
    if args.backend == "nccl":
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        device = init["device_id"] = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    dist.init_process_group(**init)
    try:
        try:
            _, layout = parse_layout_spec(args.layout, dist.get_world_size(), "layout")
            if layout.expt_tp != 1 or layout.cp != 1 or layout.pp != 1 or EXPERTS % layout.ep:
                raise ValueError(f"{layout!r}: this check takes expert TP 1, no CP or PP, and EP dividing {EXPERTS}")
        except ValueError as exc:  # every rank raises alike
            if dist.get_rank() == 0:
                print(f"dtensor_tp_fsdp_ep: error: {exc}", file=sys.stderr)
            return 2
        mine = on_rank(layout, device)
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
    finally:
        dist.destroy_process_group()
    want = oracle(layout)
    failed = _failed(everyone, want)
    if int(os.environ["RANK"]) != 0:
        return 1 if any(failed.values()) else 0
    where = torch.cuda.get_device_name() if args.backend == "nccl" else "CPU"
    print(f"dtensor_tp_fsdp_ep: backend {args.backend}, {where}, torch {torch.__version__}, world {len(everyone)}, "
          f"layout {layout!r}")
    print(f"grad placements: {'; '.join(sorted({p for out in everyone for p in out['placements']}))}")
    print(f"{'rank':>4s}  {'grad_norm':>16s}  {'float64 oracle':>16s}  {'inf-norm':>12s}  {'oracle':>12s}")
    for rank, out in enumerate(everyone):
        print(f"{rank:4d}  {out['norm2']:16.9g}  {want['norm2']:16.9g}  {out['norm_inf']:12.6g}  "
              f"{want['norm_inf']:12.6g}")
    for name, bad in failed.items():
        print(f"[{'FAIL' if bad else 'PASS'}] {name}" + (f" (ranks {bad})" if bad else ""))
    return 1 if any(failed.values()) else 0


def _failed(everyone: list[dict[str, Any]], want: dict[str, float]) -> dict[str, list[int]]:
    """Check name -> the ranks where it failed."""
    return {
        f"grad_norm (p = 2) equals the float64 oracle on every rank ({REL:g} relative)": [
            r for r, out in enumerate(everyone) if not math.isclose(out["norm2"], want["norm2"], rel_tol=REL)
        ],
        f"grad_norm (p = inf) equals the float64 oracle on every rank ({REL:g} relative)": [
            r for r, out in enumerate(everyone) if not math.isclose(out["norm_inf"], want["norm_inf"], rel_tol=REL)
        ],
    }


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

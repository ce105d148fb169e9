"""Benchmark: what the job-wide clipping verdict costs, in one run.

``clip_grad_norm_`` decides on every rank that holds grads alike: the NaN / inf flags seen anywhere are all-reduced
over the collection's ``intra_dist_opt`` (every rank of the job), a 2-element float64 all-reduce, unless a group the
norm already reduces over spans the same ranks (the flags then ride in its all-reduce: nothing more). Rows, each
the median of ``--repeat`` after ``--warmup``, on every layout of the list that fits the world:

- ``verdict all-reduce``: that 2-element all-reduce alone, over ``intra_dist_opt``;
- ``grad_norm``: the norm of the model's grads (its own collectives, none across data-parallel replicas);
- ``clip_grad_norm_``: the norm, the verdict and the coefficient, with ``max_norm`` above the norm (nothing scaled);
- the difference of the last two: the verdict's cost on the path users call;
- ``count_zeros``: the zero count alone, whose rows are a norm's width and carry its arguments (a row with peers:
  pipeline stages), so a zero count beside a norm on another rank is told, not a collective of another size.

Usage: ``torchrun --nproc-per-node 4 benchmarks/clip_verdict.py`` (gloo on CPU by default; ``--device cuda`` for
NCCL, one GPU per rank). The model: ``--params`` parameters of ``--numel`` elements each per rank.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

from benchmarks.common import fill_, measure  # noqa: E402
from pgregistry import registry  # noqa: E402
from pgregistry.grad_stats import clip_grad_norm_, count_zeros, grad_norm  # noqa: E402
from pgregistry.layout import ParallelLayout  # noqa: E402


def layouts(world: int) -> dict[str, dict[str, int]]:
    candidates = {f"DP{world}": {}, f"PP{world}": {"pp": world}, "PP2-DP": {"pp": 2}}
    out = {}
    for name, sizes in candidates.items():
        try:
            ParallelLayout(num_ranks=world, **sizes)
        except ValueError:
            continue
        out.setdefault(name, sizes)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--params", type=int, default=2000)
    parser.add_argument("--numel", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args(argv)
    if "RANK" not in os.environ:
        parser.error("run under torchrun (e.g. torchrun --nproc-per-node 4 benchmarks/clip_verdict.py)")
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    world, rank = dist.get_world_size(), dist.get_rank()
    model = nn.ParameterList(nn.Parameter(torch.zeros(args.numel, device=device)) for _ in range(args.params))
    for param in model:
        param.grad = torch.empty_like(param)
    fill_([param.grad for param in model], seed=1 + rank)
    rows = []
    for name, sizes in layouts(world).items():
        pg = registry.build(ParallelLayout(num_ranks=world, **sizes), name=name)
        flags = torch.zeros(2, dtype=torch.float64, device=device)
        group = pg.get("intra_dist_opt")
        calls = {
            "verdict all-reduce": lambda: dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group),  # noqa: B023
            "grad_norm": lambda: grad_norm(model, pg),  # noqa: B023
            "clip_grad_norm_": lambda: clip_grad_norm_(model, 1e30, pg),  # noqa: B023
            "count_zeros": lambda: count_zeros(model, pg),  # noqa: B023
        }
        timings = {row: measure(call, device, args.warmup, args.repeat)[0] for row, call in calls.items()}
        rows.append((name, timings))
    if rank == 0:
        where = torch.cuda.get_device_name(device) if cuda else f"CPU ({torch.get_num_threads()} threads)"
        print(f"clip verdict: {world} ranks, {'nccl' if cuda else 'gloo'}, {where}, torch {torch.__version__}, "
              f"{args.params} grads of {args.numel} elements per rank, median of {args.repeat}")
        print(f"  {'layout':<10} {'verdict all-reduce':>19} {'grad_norm':>10} {'clip_grad_norm_':>16} "
              f"{'clip - norm':>12} {'count_zeros':>12}")
        for name, t in rows:
            print(f"  {name:<10} {t['verdict all-reduce']:16.3f} ms {t['grad_norm']:7.3f} ms "
                  f"{t['clip_grad_norm_']:13.3f} ms {t['clip_grad_norm_'] - t['grad_norm']:9.3f} ms "
                  f"{t['count_zeros']:9.3f} ms")
    registry.destroy()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

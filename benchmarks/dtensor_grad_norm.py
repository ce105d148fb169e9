"""Benchmark: the global grad norm of FSDP2's DTensor grads, pgregistry against torch's own, in one run.

A model of ``--tensors`` parameters (``--bytes`` of float32 per rank once sharded) is ``fully_shard``-ed over the
collection's dense data-parallel group (``dp_cp``, a mesh made from the collection); every parameter gets a DTensor
grad laid out as FSDP2 lays them out (``Shard(0)`` over that mesh), about 30% exact zeros. Rows, each timed in
this run:

- ``torch get_total_norm``: ``torch.nn.utils.get_total_norm(grads, foreach=True).full_tensor()`` over the grads
  (the list built once, outside the timing: the DTensor dispatch, then the reduction that makes the scalar every
  rank needs);
- ``pgregistry grad_norm``: :func:`pgregistry.grad_stats.grad_norm` over the model and its collection, as a
  training loop calls it (the classification kept between calls; the local pieces read by the one-read kernel on
  CUDA, the placement reductions after);
- ``pgregistry grad_norm_and_zeros``: both statistics from that one read;
- floors, measured in the same run: the byte floor (the local grads' bytes read once, at the bandwidth of a
  device-to-device copy of that size measured now, bytes read plus written) and the host floor (each parameter's
  ``.grad`` read once from Python at C speed: the least host work any implementation does per call). Each row
  prints its ratio to the larger.

Columns: milliseconds (median of ``--repeat`` after ``--warmup``; CUDA events on a GPU), speed-up over torch's, ratio
to the larger floor. Exits 1 if a norm disagrees with torch's (relative 1e-5): the values before the timing, each
row's last timed call, and one call more after the local grads were halved (outside the timing), which must give
half (no row times a kept result). One process runs as a world of 1; under torchrun, all ranks.

Usage: ``torchrun --nproc-per-node N benchmarks/dtensor_grad_norm.py`` (NCCL on CUDA: 2 GiB over 2,000 tensors
per rank by default) or ``python benchmarks/dtensor_grad_norm.py`` (CPU, gloo, 8 MiB over 200 tensors).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks.common import GiB, MiB, copy_bandwidth, fill_, host_floor, measure, tensor_sizes  # noqa: E402
from pgregistry import registry  # noqa: E402
from pgregistry.grad_stats import grad_norm, grad_norm_and_zeros  # noqa: E402
from pgregistry.layout import ParallelLayout  # noqa: E402
from pgregistry.mesh import to_device_mesh  # noqa: E402


def init(device_type: str) -> None:
    backend = "nccl" if device_type == "cuda" else "gloo"
    if "RANK" in os.environ:  # torchrun
        if device_type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


def sharded_model(sizes: list[int], mesh: Any, device: torch.device) -> torch.nn.Module:
    """A model with one parameter per size, ``fully_shard``-ed over ``mesh``, each grad its ``Shard(0)`` piece."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    model = torch.nn.Module()
    model.params = torch.nn.ParameterList(torch.nn.Parameter(torch.zeros(size, device=device)) for size in sizes)
    fully_shard(model, mesh=mesh)
    params = list(model.parameters())
    locals_ = [torch.empty_like(param._local_tensor) for param in params]  # type: ignore[attr-defined]
    fill_(locals_, seed=1 + dist.get_rank())
    for param, local in zip(params, locals_, strict=True):
        param.grad = DTensor.from_local(
            local, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()  # type: ignore[attr-defined]
        )
    return model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--bytes", type=int, help="grad bytes per rank (default: 2 GiB on CUDA, 8 MiB on CPU)")
    parser.add_argument("--tensors", type=int, help="grads per rank (default: 2,000 on CUDA, 200 on CPU)")
    parser.add_argument("--repeat", type=int, help="timed runs per figure (default: 20 on CUDA, 5 on CPU)")
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args(argv)
    cuda = args.device == "cuda"
    init(args.device)
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    nbytes = args.bytes or (2 * GiB if cuda else 8 * MiB)
    count = args.tensors or (2000 if cuda else 200)
    repeat = args.repeat or (20 if cuda else 5)

    world = dist.get_world_size()
    layout = ParallelLayout(num_ranks=world)  # every rank data parallel
    pg = registry.build(layout)
    mesh = to_device_mesh(pg, ("dp_cp",), device_type=device.type)
    model = sharded_model(tensor_sizes(count, nbytes // 4 * world), mesh, device)
    grads = [param.grad for param in model.parameters()]

    def torch_norm() -> torch.Tensor:
        return torch.nn.utils.get_total_norm(grads, 2.0, foreach=True).full_tensor()  # type: ignore[arg-type,union-attr]

    def ours() -> torch.Tensor:
        return grad_norm(model, pg)

    params = list(model.parameters())
    calls = {
        "torch get_total_norm(foreach=True)": torch_norm,
        "pgregistry grad_norm": ours,
        "pgregistry grad_norm_and_zeros": lambda: grad_norm_and_zeros(model, pg)[0],
    }
    values = {row: float(call()) for row, call in calls.items()}
    last: dict[str, Any] = {}

    def recorded(row: str) -> Any:
        return lambda: last.__setitem__(row, calls[row]())

    timings = {row: measure(recorded(row), device, args.warmup, repeat)[0] for row in calls}
    timed = {row: float(value) for row, value in last.items()}
    torch._foreach_mul_([grad._local_tensor for grad in grads], 0.5)  # type: ignore[union-attr]  # exact
    halved = {row: float(call()) for row, call in calls.items()}
    local_bytes = sum(grad._local_tensor.numel() * grad._local_tensor.element_size() for grad in grads)  # type: ignore[union-attr]
    byte_floor = local_bytes / copy_bandwidth(local_bytes, device) * 1e3
    host_floor_ms = host_floor(params, args.warmup, repeat)
    floor = max(byte_floor, host_floor_ms)
    if dist.get_rank() == 0:
        name = torch.cuda.get_device_name(device) if cuda else "CPU"
        print(f"DTensor grad norm (fully_shard): {world} rank(s), {name}, torch {torch.__version__}, "
              f"{count} grads/rank, "
              f"{nbytes / MiB:.0f} MiB/rank, Shard(0) over dp_cp; median of {repeat}")
        print(f"{'path':40s} {'ms':>10s} {'speed-up':>9s} {'/ floor':>8s}")
        base = timings["torch get_total_norm(foreach=True)"]
        for row, ms in timings.items():
            print(f"{row:40s} {ms:10.3f} {base / ms:8.2f}x {ms / floor:7.2f}x")
        print(f"{'byte floor (local grads read once)':40s} {byte_floor:10.3f}")
        print(f"{'host floor (each .grad read once)':40s} {host_floor_ms:10.3f}")
        print(f"norms: {values} before the timing, {timed} from the last timed calls, {halved} after halving")
    want = values["torch get_total_norm(foreach=True)"]
    agree = all(math.isclose(want, value, rel_tol=1e-5) for value in [*values.values(), *timed.values()])
    agree = agree and all(math.isclose(want / 2, value, rel_tol=1e-5) for value in halved.values())
    registry.destroy()
    dist.destroy_process_group()
    return 0 if agree else 1


if __name__ == "__main__":
    sys.exit(main())

"""``pgregistry verify``: check a layout on a real cluster's backend, under torchrun.

    torchrun --nproc-per-node 2 -m pgregistry verify --tp 2 --ep 2 --backend nccl

On every rank it builds the collection of the given layout on the job's backend, then checks:

* membership: every group of the collection, by an all-reduce of one-hot rank vectors, against the
  layout's arithmetic (so a wrong or crossed communicator cannot pass);
* placement: with ranks per node from ``--gpus-per-node`` or the launcher's ``LOCAL_WORLD_SIZE``, no
  kind of ``--intra-node`` (tp, expt_tp, cp by default) has a group crossing nodes, and the ranks
  the arithmetic puts on one node (``r // N``) really share a host;
* expert grads filtered with the expert TP group (Megatron-LM PR 6470) on a TP = EP = world, expert
  TP 1 grid: grad norm ``sqrt(1 + W)`` and zero count ``1 + W``, through the functional API and both
  optimizers;
* the invariance oracle on the given layout (every grad element 1: norm ``sqrt(numel)``, zero count
  of zeroed grads ``numel``) and the float64 oracle of the unsharded toy model with random grads (p
  = 2 and inf);
* the RNG seeds this rank registers from its collection against the layout's seed plan, and the
  plan's collisions (reported; Megatron-Core's seed offsets collide for some layouts, see
  ``pgregistry seed-plan --check``).

Rank 0 prints a pass/fail table; every rank exits non-zero when any check failed on any rank.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from typing import TYPE_CHECKING, Any

from pgregistry._runtime.empty_options import empty_option
from pgregistry.cli._options import (
    Subparsers,
    add_layout_arguments,
    add_placement_arguments,
    intra_node_kinds,
    positive_seconds,
)

if TYPE_CHECKING:
    import torch

    from pgregistry.cli._torchrun_checks import Check

__all__ = ["add_command", "nodes_share_hosts"]

_REL_TOL = 1e-6


def _checks_on_this_rank(args: argparse.Namespace, device: torch.device) -> list[Check]:
    import torch.distributed as dist

    from pgregistry import registry
    from pgregistry.cli._options import layout_from_args
    from pgregistry.collection import FIELD_NAMES

    world, rank = dist.get_world_size(), dist.get_rank()
    layout = layout_from_args(args, world_size=world)
    pg = registry.build(layout, name="verify")
    checks: list[Check] = []

    expected = layout.groups_of(rank)
    wrong = []
    for name in FIELD_NAMES:
        if name not in expected:
            continue
        want = expected[name]
        if not pg.is_member_of(name):
            if want is not None:
                wrong.append(f"{name}: not a member != {list(want)}")
            continue
        group = pg.get(name)
        members = (
            [rank] if group is None else _group_members(group, world, device)
        )  # None: the axis is off
        if want is None or members != list(want):
            wrong.append(f"{name}: {members} != {list(want) if want else 'not a member'}")
    checks.append(
        ("groups: every communicator holds the layout's ranks", not wrong, "; ".join(wrong[:3]))
    )
    checks += _placement_checks(layout, args)

    checks += _expert_grads_with_expert_tp(world, device)
    checks += _oracle_checks(layout, pg, rank, device)
    checks += _seed_checks(layout, pg, rank, args.seed)
    return checks


def _placement_checks(layout: Any, args: argparse.Namespace) -> list[Check]:
    import socket

    import torch.distributed as dist

    from pgregistry.placement import place

    local = (
        args.gpus_per_node if args.gpus_per_node is not None else os.environ.get("LOCAL_WORLD_SIZE")
    )
    # Every rank decides on the same gathered values, so a bad value raises on every rank alike
    # (none hangs).
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (local, socket.gethostname()))
    values = sorted({str(value) for value, _ in everyone})
    if values == ["None"]:
        raise ValueError(
            "ranks per node unknown: LOCAL_WORLD_SIZE is not "
            "set (torchrun sets it); pass --gpus-per-node"
        )
    if len(values) > 1:
        return [
            (
                "placement: every rank has the same ranks per node",
                False,
                f"LOCAL_WORLD_SIZE values {values}",
            )
        ]
    try:
        gpus_per_node = int(values[0])
    except ValueError:
        raise ValueError(f"ranks per node must be an integer, got {values[0]!r}") from None
    placement = place(layout, gpus_per_node, intra_node_kinds(args))
    kinds = [entry.kind for entry in placement.kinds if entry.should_stay_intra_node]
    return [
        (
            f"placement: {', '.join(kinds) or 'no kind'} "
            f"groups stay on nodes of {gpus_per_node} ranks",
            not placement.violations(),
            "; ".join(placement.warnings()),
        ),
        nodes_share_hosts([host for _, host in everyone], gpus_per_node),
    ]


def nodes_share_hosts(hosts: list[str], gpus_per_node: int) -> Check:
    """Check that the ranks the arithmetic puts on one node (``r // gpus_per_node``) share a host.

    A launcher that deals ranks round-robin over hosts (Slurm's cyclic distribution) breaks every
    placement claim."""
    split = []
    for node in range(len(hosts) // gpus_per_node):
        on_node = sorted(set(hosts[node * gpus_per_node : (node + 1) * gpus_per_node]))
        if len(on_node) > 1:
            split.append(
                f"node {node} (ranks "
                f"{node * gpus_per_node}-{(node + 1) * gpus_per_node - 1}) on {on_node}"
            )
    return (
        f"placement: each node's {gpus_per_node} consecutive ranks share one host",
        not split,
        "; ".join(split[:2]),
    )


def _group_members(group: Any, world: int, device: Any) -> list[int]:
    import torch
    import torch.distributed as dist

    one_hot = torch.zeros(world, dtype=torch.int64, device=device)
    one_hot[dist.get_rank()] = 1
    dist.all_reduce(one_hot, group=group)
    return [r for r in range(world) if int(one_hot[r]) == 1]


def _expert_grads_with_expert_tp(world: int, device: Any) -> list[Check]:
    """Expert grads filtered with the expert TP group, not the dense one (Megatron-LM PR 6470).

    On a TP = EP = world, expert TP 1 grid, norm ``sqrt(1 + W)`` and zero count ``1 + W``, where the
    dense TP group gives ``sqrt(2)`` and 2."""
    import torch

    from pgregistry import registry
    from pgregistry.grad_stats import count_zeros, grad_norm
    from pgregistry.layout import ParallelLayout
    from pgregistry.optim import build_optimizer
    from pgregistry.testing._toy_models import dense_and_expert

    pg = registry.build(
        ParallelLayout(num_ranks=world, tp=world, ep=world, expt_tp=1), name="verify-expert-tp"
    )
    want_norm, want_zeros = math.sqrt(1 + world), 1 + world
    scenario = f"fixed grid TP = EP = world ({world}), expert TP 1"
    model = dense_and_expert(device=device)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    norm = float(grad_norm(model, pg))
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    zeros = count_zeros(model, pg)
    out = [
        (
            f"{scenario}, functional: norm sqrt(1+{world}), zero count {want_zeros}",
            _is_close(norm, want_norm) and zeros == want_zeros,
            f"norm {norm:.7f}, zeros {zeros}",
        )
    ]
    for sharded in (False, True):
        model = dense_and_expert(device=device)
        optimizer = build_optimizer(model, pg, optimizer="sgd", lr=0.0, sharded=sharded)
        # A real backward, so the grads land where the optimizer keeps them (its flat buffer).
        torch.stack([p.float().sum() for p in model.parameters()]).sum().backward()
        optimizer.sync_grads()
        norm = float(optimizer.get_grad_norm())
        optimizer.zero_grad()
        zeros = int(optimizer.count_zeros())
        kind = "sharded" if sharded else "mixed-precision"
        out.append(
            (
                f"{scenario}, {kind} optimizer: norm sqrt(1+{world}), zero count {want_zeros}",
                _is_close(norm, want_norm) and zeros == want_zeros,
                f"norm {norm:.7f}, zeros {zeros}",
            )
        )
    return out


def _oracle_checks(layout: Any, pg: Any, rank: int, device: Any) -> list[Check]:
    from pgregistry.grad_stats import count_zeros, grad_norm
    from pgregistry.testing._toy_models import full_grads, local_model, set_grads

    out = []
    ones = full_grads("ones")
    model, shards = local_model(layout, rank, ones, device=device)
    norm = float(grad_norm(model, pg))
    numel = sum(g.numel() for g in ones.values())
    set_grads(model, shards, full_grads("zeros"), device=device)
    zeros = count_zeros(model, pg)
    out.append(
        (
            f"invariance: all-ones norm sqrt({numel}), zero count {numel}",
            _is_close(norm, math.sqrt(numel)) and zeros == numel,
            f"norm {norm:.7f}, zeros {zeros}",
        )
    )
    grads = full_grads("random")
    set_grads(model, shards, grads, device=device)
    norms, want_zeros = _whole_model_statistics(grads)
    for p, want in norms.items():
        norm = float(grad_norm(model, pg, norm_type=p))
        out.append(
            (
                f"float64 oracle: {p}-norm of random grads",
                _is_close(norm, want),
                f"{norm:.9g} vs {want:.9g}",
            )
        )
    zeros = count_zeros(model, pg)
    out.append(("float64 oracle: zero count of random grads", zeros == want_zeros, f"{zeros}"))
    return out


def _whole_model_statistics(grads: dict[str, torch.Tensor]) -> tuple[dict[float, float], int]:
    """The float64 2-norm, inf-norm and zero count of the whole unsharded model's grads.

    The norms are keyed by p; all three are what its shards must give on any layout. The test suite
    has its own oracle (``tests/fixtures/unsharded_oracle.py``), which this command may not import
    and which never reads this."""
    import torch

    flat = torch.cat([g.reshape(-1) for g in grads.values()])
    return {2.0: float(flat.square().sum().sqrt()), math.inf: float(flat.abs().max())}, int(
        (flat == 0).sum()
    )


def _seed_checks(layout: Any, pg: Any, rank: int, seed: int) -> list[Check]:
    from pgregistry.rng import check_seed_plan, model_parallel_manual_seed, seed_plan

    registered = model_parallel_manual_seed(seed, pg)
    planned = seed_plan(layout, seed)[rank]
    collisions = check_seed_plan(layout, seed)
    return [
        (
            "RNG: this rank's tracker seeds equal the layout's seed plan",
            registered == planned,
            "" if registered == planned else f"{registered} != {planned}",
        ),
        (
            f"RNG: seed plan collisions (Megatron-Core's offsets): {len(collisions)}",
            True,
            collisions[0].describe() if collisions else "",
        ),
    ]


def _is_close(value: float, want: float) -> bool:
    return math.isclose(value, want, rel_tol=_REL_TOL, abs_tol=_REL_TOL)


def _run_verify(args: argparse.Namespace) -> int:
    from pgregistry.cli._torchrun_checks import run_checks

    # Every rank parses the same command line, so every rank refuses alike; rank 0 says why.
    empty = empty_option(args, {"json": ("--json", "a file name, or leave the option out")})
    if empty is not None:
        if os.environ.get("RANK", "0") == "0":
            print(f"pgregistry verify: error: {empty}", file=sys.stderr)
        return 2
    expt_tp = args.expt_tp if args.expt_tp is not None else args.tp
    title = (
        f"pgregistry verify: backend {args.backend}, tp {args.tp} cp "
        f"{args.cp} pp {args.pp} ep {args.ep} expt_tp {expt_tp} "
        f"gtp_remat {args.gtp_remat} expt_gtp_remat {args.expt_gtp_remat}"
    )
    return run_checks(
        title,
        args.backend,
        lambda device: _checks_on_this_rank(args, device),
        timeout=args.timeout,
        json_path=args.json,
    )


def add_command(subparsers: Subparsers) -> None:
    """Register the ``verify`` sub-command."""
    parser = subparsers.add_parser(
        "verify",
        help="check groups, node placement, grad statistics and seeds under torchrun",
        description=(
            "Run under torchrun (torchrun --nproc-per-node N -m pgregistry verify ...): "
            "build the layout's collection on the job's backend and check group "
            "membership, node placement (ranks per node from LOCAL_WORLD_SIZE), grad norms "
            "and zero counts against float64 oracles, and RNG seeds against the seed plan. "
            "Rank 0 prints a pass/fail table; exit 1 when a check failed on any rank."
        ),
    )
    add_layout_arguments(parser, num_ranks=False)
    add_placement_arguments(
        parser,
        check=False,
        gpus_per_node_help=(
            "ranks per node (default: the launcher's LOCAL_WORLD_SIZE): the placement check fails "
            "when a kind of --intra-node crosses nodes or a node's ranks run on different hosts"
        ),
    )
    parser.add_argument(
        "--backend",
        default="gloo",
        choices=("gloo", "nccl"),
        help="process-group backend (default gloo)",
    )
    parser.add_argument(
        "--seed", type=int, default=1234, help="the job's seed for the RNG checks (default 1234)"
    )
    parser.add_argument(
        "--timeout",
        type=positive_seconds,
        default=120.0,
        help="collective timeout in seconds (default 120)",
    )
    parser.add_argument(
        "--json",
        metavar="FILE",
        help="rank 0 also writes the results as JSON (its path is checked before the run)",
    )
    parser.set_defaults(handler=_run_verify)

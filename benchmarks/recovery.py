"""Benchmark: resuming after a lost rank, in-process recovery against restarting every process from a checkpoint.

A gloo world of ``--world`` ranks (TP ``--tp`` x DP) trains a TP-sharded two-layer MLP with Adam. Each rank is a
fresh interpreter (as a launcher starts them); the parent hosts the store, as torchrun's agent does. Measured in
the same run:

- in-process: the last rank SIGKILLs itself after a backward. The parent (the launcher) sees it exit and says so
  in the store; each survivor catches its failed collective and calls :func:`pgregistry.recovery.recover` with the
  lost rank it was told. Phases, each the slowest survivor's: *detect* (the kill to the survivor's exception: a
  survivor whose peer failed first waits for its collective timeout ``--timeout``), *told* (until the launcher's
  word), *agree* and *rebuild* (``Recovered.agree_s`` / ``rebuild_s``, rebuild plus the optimizer re-built on the
  new collection with its state carried over), *first step* (the faulted step redone on the smaller grid, until it
  commits). Communicators created on the new world and the ones whose members all survived ("keepable").
- restart: what torchrun does instead. The launcher ends the survivors, starts a fresh world of the survivors'
  size (new interpreters: import torch, join, build), each rank loads the checkpoint its TP shard saved at the last
  committed step (``torch.save`` of model and optimizer state) and runs the same step.
- the cost of being recoverable when nothing fails, before the fault: steps with :func:`~pgregistry.recovery.commit`
  (one all-reduce of one integer) and steps without it, interleaved in the same run (pairs, their order swapped
  from pair to pair, so a change of load hits both alike); the ratio of their median step times, and the commit's
  own median time. The commit is a barrier: its own time includes waiting for the slowest rank, a wait that
  without it moves to the next step's first collective, so the step-time ratio is the overhead; and the commit's
  latency alone (right after a barrier, so no rank waits for another), the part that is its own.

Usage: ``python benchmarks/recovery.py [--world 4 --tp 2 --hidden 1024 --ffn 4096 --timeout 5]``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
BATCH = 64
FAULT_STEP = 41  # step 0 a warm-up, steps 1-40 timed (20 with commit, 20 without, interleaved), the fault in 41


def _model(args: argparse.Namespace, pg: Any) -> Any:
    import torch
    from torch import nn

    from pgregistry.collection import group_rank, group_size
    from pgregistry.params import mark_tensor_parallel

    tp, tp_rank = group_size(pg.tp), group_rank(pg.tp)
    g = torch.Generator().manual_seed(7)
    model = nn.Module()
    w1 = torch.randn(args.ffn, args.hidden, generator=g) / args.hidden**0.5
    w2 = torch.randn(args.hidden, args.ffn, generator=g) / args.ffn**0.5
    model.w1 = nn.Parameter(mark_tensor_parallel(w1.chunk(tp, 0)[tp_rank].clone(), 0))
    model.w2 = nn.Parameter(mark_tensor_parallel(w2.chunk(tp, 1)[tp_rank].clone(), 1))
    mark_tensor_parallel(model.w1, 0)
    mark_tensor_parallel(model.w2, 1)
    return model


def _step(model: Any, opt: Any, pg: Any, step: int, args: argparse.Namespace, *, recoverable: bool,
          die: bool = False) -> float:
    """One training step; the seconds its :func:`commit` took (0 when not ``recoverable``)."""
    import torch
    import torch.distributed as dist

    from pgregistry.collection import group_rank, group_size
    from pgregistry.recovery import commit

    opt.zero_grad()
    g = torch.Generator().manual_seed(100 + step)
    x, y = torch.randn(BATCH, args.hidden, generator=g), torch.randn(BATCH, args.hidden, generator=g)
    rows = BATCH // group_size(pg.dp)
    part = slice(group_rank(pg.dp) * rows, (group_rank(pg.dp) + 1) * rows)
    partial = torch.relu(x[part] @ model.w1.T) @ model.w2.T
    summed = partial.detach().clone()
    dist.all_reduce(summed, group=pg.tp)
    ((partial + (summed - partial.detach()) - y[part]) ** 2).mean().backward()
    if die:
        os.kill(os.getpid(), signal.SIGKILL)
    opt.sync_grads()
    opt.clip_grad_norm(1.0)
    started = time.perf_counter()
    if recoverable:
        commit(pg)
    committed = time.perf_counter() - started if recoverable else 0.0
    opt.step()
    return committed


def _recoverable(step: int) -> bool:
    """Whether step ``step`` (before the fault) runs :func:`commit`: steps 1-2, 3-4, ... are pairs, one of each,
    the one with the commit first in every other pair."""
    pair, second = divmod(step - 1, 2)
    return step == 0 or (pair % 2 == 0) != bool(second)


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def _join(args: argparse.Namespace, prefix: str, rank: int, world: int) -> Any:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", args.port, world, False, timeout=timedelta(seconds=120))
    dist.init_process_group("gloo", store=dist.PrefixStore(prefix, store), rank=rank, world_size=world,
                            timeout=timedelta(seconds=args.timeout))
    return store


def _in_process(args: argparse.Namespace, rank: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from pgregistry import build, build_optimizer
    from pgregistry.layout import ParallelLayout
    from pgregistry.recovery import LeftWithReplica, carry_optimizer_state, commit, recover

    store = _join(args, "a/world", rank, args.world)
    pg = build(ParallelLayout(num_ranks=args.world, tp=args.tp), name="job", timeout=args.timeout)
    model = _model(args, pg)
    opt = build_optimizer(model, pg, optimizer="adam", lr=1e-3, mixed_precision=False)
    victim = args.world - 1
    timed: dict[bool, list[float]] = {True: [], False: []}
    commits = []
    step = 0
    while step < FAULT_STEP:
        recoverable = _recoverable(step)
        started = time.perf_counter()
        committed = _step(model, opt, pg, step, args, recoverable=recoverable)
        if step > 0:
            timed[recoverable].append(time.perf_counter() - started)
            if recoverable:
                commits.append(committed)
        step += 1
    latency = []
    for _ in range(20):
        dist.barrier()
        started = time.perf_counter()
        commit(pg)
        latency.append(time.perf_counter() - started)
    # The last committed step's checkpoint, for the restart (each TP shard's, from data-parallel replica 0).
    if rank < args.tp:
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()},
                   os.path.join(args.dir, f"tp{rank}.pt"))
    store.set(f"a/saved/{rank}", "1")
    store.wait([f"a/saved/{r}" for r in range(args.world)])
    if rank == victim:
        store.set("a/killed_at", repr(time.time()))
    try:
        _step(model, opt, pg, step, args, recoverable=True, die=rank == victim)
    except RuntimeError:
        caught = time.time()
        store.wait(["a/dead"])
        told = time.time()
        lost = json.loads(store.get("a/dead"))
        try:
            recovered = recover(pg, store, committed_step=step - 1, lost=lost, wait=60.0, timeout=args.timeout)
        except LeftWithReplica:
            return {"left": True}
        agreed = time.time() - recovered.rebuild_s
        new_opt = build_optimizer(model, recovered.collection, optimizer="adam", lr=1e-3, mixed_precision=False)
        carry_optimizer_state(opt, new_opt)
        rebuilt = time.time()
        _step(model, new_opt, recovered.collection, step, args, recoverable=True)
        killed = float(store.get("a/killed_at"))
        # Each phase's end, from the kill: the world goes on when its slowest survivor does.
        return {
            "left": False, "detect": caught - killed, "told": told - killed, "agree": agreed - killed,
            "rebuild": rebuilt - killed, "first_step": time.time() - killed,
            "created": recovered.communicators_created, "keepable": recovered.communicators_keepable,
            "step_s": _median(timed[True]), "bare_step_s": _median(timed[False]), "commit_s": _median(commits),
            "commit_alone_s": _median(latency),
        }
    raise AssertionError("the step with the fault did not fail")


def _restart(args: argparse.Namespace, rank: int) -> dict[str, Any]:
    import torch

    from pgregistry import build, build_optimizer, registry
    from pgregistry.layout import ParallelLayout

    world = args.world - args.world // (args.world // args.tp)  # one replica fewer
    _join(args, "b/world", rank, world)
    pg = build(ParallelLayout(num_ranks=world, tp=args.tp), name="job", timeout=args.timeout)
    model = _model(args, pg)
    opt = build_optimizer(model, pg, optimizer="adam", lr=1e-3, mixed_precision=False)
    joined = time.time()
    started = time.perf_counter()
    saved = torch.load(os.path.join(args.dir, f"tp{rank % args.tp}.pt"))
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["optimizer"])
    load_s = time.perf_counter() - started
    started = time.perf_counter()
    _step(model, opt, pg, FAULT_STEP, args, recoverable=True)
    return {
        "joined": joined, "load": load_s, "first_step": time.perf_counter() - started,
        "created": registry.communicators_created() + 1,
    }


def _spawn(args: argparse.Namespace, role: str, ranks: int) -> list[subprocess.Popen[str]]:
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    common = [sys.executable, __file__, "--role", role, "--port", str(args.port), "--dir", args.dir,
              "--world", str(args.world), "--tp", str(args.tp), "--hidden", str(args.hidden), "--ffn", str(args.ffn),
              "--timeout", str(args.timeout)]
    return [subprocess.Popen([*common, "--rank", str(r)], stdout=subprocess.PIPE, text=True, env=env)
            for r in range(ranks)]


def _results(procs: list[subprocess.Popen[str]]) -> list[dict[str, Any]]:
    out = []
    for proc in procs:
        stdout, _ = proc.communicate(timeout=300)
        if proc.returncode != 0:
            raise SystemExit(f"a rank failed (exit {proc.returncode}):\n{stdout}")
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=4, help="ranks of the world before the loss")
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel size (a replica is tp ranks)")
    parser.add_argument("--hidden", type=int, default=1024, help="model width")
    parser.add_argument("--ffn", type=int, default=4096, help="hidden width of the MLP")
    parser.add_argument("--timeout", type=float, default=5.0, help="collective timeout, seconds")
    parser.add_argument("--role", choices=["in-process", "restart"], help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role is not None:
        worker = _in_process if args.role == "in-process" else _restart
        print(json.dumps(worker(args, args.rank)), flush=True)
        return
    import torch
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=300), wait_for_workers=False)
    args.port = store.port
    with tempfile.TemporaryDirectory(prefix="pgregistry-recovery-bench-") as args.dir:
        procs = _spawn(args, "in-process", args.world)
        procs[-1].wait(timeout=300)
        exit_seen = time.time()
        store.set("a/dead", json.dumps([args.world - 1]))  # the launcher saw it exit, and says so
        launcher_detect = exit_seen - float(store.get("a/killed_at"))
        survivors = [r for r in _results(procs[:-1]) if not r["left"]]
        # Restart, once the in-process survivors are done (they share the machine): the launcher ends the other
        # ranks (timed on a stand-in) and starts a fresh world of the survivors' size.
        teardown = _teardown_estimate()
        started = time.time()
        restarted = _results(_spawn(args, "restart", args.world - args.tp))
    ends = [max(r[k] for r in survivors) for k in ("detect", "told", "agree", "rebuild", "first_step")]
    inproc = dict(zip(("detect", "told", "agree", "rebuild", "first_step"),
                      (b - a for a, b in zip([0.0, *ends[:-1]], ends, strict=True)), strict=True))
    restart = {
        "detect": launcher_detect, "end": teardown, "start": max(r["joined"] for r in restarted) - started,
        "load": max(r["load"] for r in restarted), "first_step": max(r["first_step"] for r in restarted),
    }
    _print_table(args, torch.__version__, survivors, inproc, restart, restarted)


def _teardown_estimate() -> float:
    """Seconds for a launcher to end one live rank (SIGTERM, reap): measured on a sleeping child."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    time.sleep(0.2)
    started = time.perf_counter()
    child.send_signal(signal.SIGTERM)
    child.wait()
    return time.perf_counter() - started


def _print_table(args: argparse.Namespace, torch_version: str, survivors: list[dict[str, Any]],
                 inproc: dict[str, float], restart: dict[str, float], restarted: list[dict[str, Any]]) -> None:
    smaller = args.world - args.tp
    print(f"recovery after SIGKILL of rank {args.world - 1}: TP {args.tp} x DP {args.world // args.tp} -> "
          f"TP {args.tp} x DP {smaller // args.tp}, gloo on CPU, torch {torch_version}, MLP {args.hidden}x{args.ffn} "
          f"(Adam), collective timeout {args.timeout:g} s. In-process: each phase until its slowest survivor is done")
    print()
    rows = [
        ("detect (in-process: every survivor's exception)", inproc["detect"], restart["detect"]),
        ("survivors told the lost rank by the launcher", inproc["told"], None),
        ("agree (store check-in, decision, verdict)", inproc["agree"], None),
        ("end the other ranks (SIGTERM, reap)", None, restart["end"]),
        ("rebuild (world, groups, optimizer) / restart", inproc["rebuild"], restart["start"]),
        ("load the checkpoint", None, restart["load"]),
        ("first step (the faulted one, redone)", inproc["first_step"], restart["first_step"]),
    ]
    print(f"{'phase':<50} {'in-process (s)':>15} {'restart + ckpt (s)':>19}")
    for name, a, b in rows:
        print(f"{name:<50} {_cell(a):>15} {_cell(b):>19}")
    total_a = sum(a for _, a, _ in rows if a is not None)
    total_b = sum(b for _, _, b in rows if b is not None)
    print(f"{'total':<50} {total_a:>15.3f} {total_b:>19.3f}")
    print()
    created = sorted({r["created"] for r in survivors})
    keepable = sorted({r["keepable"] for r in survivors})
    print("steps recomputed: 1 (the faulted step) either way; a checkpoint older than the last step adds its steps")
    print(f"communicators per survivor: kept 0, created {created} (keepable: members all survived {keepable}); "
          f"restart created {sorted({r['created'] for r in restarted})}")
    step = max(r["step_s"] for r in survivors)
    bare = max(r["bare_step_s"] for r in survivors)
    commit = max(r["commit_s"] for r in survivors)
    alone = max(r["commit_alone_s"] for r in survivors)
    print(f"being recoverable when nothing fails (medians of {(FAULT_STEP - 1) // 2} steps each, interleaved, "
          f"slowest rank): step with commit() {step * 1e3:.1f} ms, without {bare * 1e3:.1f} ms "
          f"({(step / bare - 1) * 100:+.2f}%); commit() itself {commit * 1e3:.3f} ms ({commit / step * 100:.2f}% "
          "of the step, its wait for the slowest rank included); commit() alone, after a barrier, "
          f"{alone * 1e3:.3f} ms ({alone / step * 100:.2f}% of the step)")


def _cell(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


if __name__ == "__main__":
    main()

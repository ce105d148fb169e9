"""What the recovery refuses without a fault: ``carry_optimizer_state`` carries a replicated optimizer's state and
refuses a sharded optimizer (the lost replica's shard has no copy) and parameters whose main grads are of another
dtype (their grad hooks stay with the old optimizer); ``recover`` names a bad argument before it checks in."""

from __future__ import annotations

import math

import numpy as np
import torch

from pgregistry.testing import run_world

_CASES = {
    "sharded": (True, torch.float32),
    "low-precision": (False, torch.bfloat16),
    "replicated": (False, torch.float32),
}


def _carry_each() -> dict[str, str]:
    from torch import nn

    from pgregistry import build, build_optimizer
    from pgregistry.layout import ParallelLayout
    from pgregistry.recovery import carry_optimizer_state

    pg = build(ParallelLayout(num_ranks=2))
    out = {}
    for case, (sharded, dtype) in _CASES.items():
        torch.manual_seed(0)
        model = nn.Linear(4, 2, bias=False).to(dtype)
        old = build_optimizer(model, pg, optimizer="sgd", lr=0.1, momentum=0.9, sharded=sharded)
        model(torch.randn(3, 4, dtype=dtype)).sum().backward()
        old.sync_grads()
        old.step()  # momentum state to carry
        before = _tensors(old.state_dict())
        new = build_optimizer(model, pg, optimizer="sgd", lr=0.1, momentum=0.9)
        try:
            carry_optimizer_state(old, new)
        except ValueError as error:
            out[case] = str(error)
            continue
        after = _tensors(new.state_dict())
        same = len(before) == len(after) > 0 and all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
        out[case] = "carried" if same else f"not carried: {before} then {after}"
    return out


def _tensors(state: object) -> list[torch.Tensor]:
    """Every tensor of a nested state dict, in order."""
    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, dict):
        return [t for key in sorted(state, key=str) for t in _tensors(state[key])]
    if isinstance(state, list | tuple):
        return [t for item in state for t in _tensors(item)]
    return []


def test_only_a_replicated_optimizer_carries_over() -> None:
    for got in run_world(2, _carry_each, timeout=30.0):
        assert got["sharded"].startswith(
            "a sharded optimizer's state is cut over the data-parallel replicas and the lost replica's piece has no "
            "copy: reload a checkpoint"
        )
        assert got["low-precision"].startswith("weight (torch.bfloat16) has main grads of another dtype")
        assert got["replicated"] == "carried"


def _bad_arguments() -> list[str]:
    import torch.distributed as dist

    from pgregistry import build
    from pgregistry.layout import ParallelLayout
    from pgregistry.recovery import carry_optimizer_state, commit, recover

    pg = build(ParallelLayout(num_ranks=1))
    store = dist.HashStore()
    out = []
    for kwargs in ({"committed_step": "3"}, {"committed_step": 3, "wait": 0}, {"committed_step": 3, "lost": "3"},
                   {"committed_step": 3, "lost": [1.0]}, {"committed_step": 3, "wait": math.inf},
                   {"committed_step": 3, "timeout": -1}, {"committed_step": 3, "timeout": "5"},
                   {"committed_step": 3, "backend": "ncl"}):
        try:
            recover(pg, store, **kwargs)  # type: ignore[arg-type]
        except (TypeError, ValueError) as error:
            out.append(f"{type(error).__name__}: {error}")
    for call in (lambda: recover(pg.one_rank_group, store, committed_step=3), lambda: commit(pg.one_rank_group),
                 lambda: carry_optimizer_state(torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1), None)):
        try:
            call()  # type: ignore[arg-type]
        except (TypeError, ValueError) as error:
            out.append(f"{type(error).__name__}: {error}")
    try:
        recover(pg, store, committed_step=3, lost=[np.int64(0)])
    except RuntimeError as error:  # refused as no integer before: "lost rank must be an integer, got np.int64(0)"
        out.append(f"{type(error).__name__}: {str(error).split(':')[0]}")
    out.append(f"world kept: {dist.is_initialized() and dist.get_world_size() == 1 and not pg.is_destroyed}")
    return out


def test_recover_names_a_bad_argument_before_it_checks_in() -> None:
    (got,) = run_world(1, _bad_arguments, timeout=30.0)
    assert got == [
        "TypeError: committed_step must be an integer (the last step applied), got '3'",
        "ValueError: wait must be a positive, finite number of seconds, got 0",
        "TypeError: lost must be an iterable of ranks or None, got str",
        "TypeError: lost rank must be an integer, got 1.0 (float)",
        "ValueError: wait must be a positive, finite number of seconds, got inf",  # waited for ever before
        # The three below were taken, the world destroyed, and the new one refused them: "a second failure during
        # recovery ... a rank that was to go on was lost", the job lost.
        "ValueError: timeout must be positive, finite and at most 1e12 seconds (or None for torch's default); got -1",
        "TypeError: timeout must be a number of seconds (an int or a float) or a datetime.timedelta, or None for "
        "torch's default; got '5' (str)",
        "ValueError: backend 'ncl' names ['ncl'], which this torch cannot use here: give one it has ('gloo'; 'nccl' "
        "with CUDA), or None for the old world's",
        *(
            f"TypeError: {name} expects a pgregistry ProcessGroupCollection, got "
            "torch.distributed.distributed_c10d.ProcessGroup"
            for name in ("recover", "commit")
        ),
        "TypeError: carry_optimizer_state takes the optimizers build_optimizer returns (ChainedOptimizer); old is a "
        "SGD",
        "RuntimeError: rank 0 called recover but is among the lost ranks [0] it was given",
        "world kept: True",
    ]


def _commit_over_two_optimizer_instances() -> str:
    from datetime import timedelta

    import torch.distributed as dist

    from pgregistry import build
    from pgregistry.layout import ParallelLayout
    from pgregistry.recovery import commit

    rank = dist.get_rank()
    quick = timedelta(seconds=5)
    instances = [dist.new_group(ranks, timeout=quick) for ranks in ([0, 1], [2, 3])]
    across = [dist.new_group(ranks, timeout=quick) for ranks in ([0, 2], [1, 3])]
    # Two distributed-optimizer instances, as Megatron-Core's num_distributed_optimizer_instances=2 makes them.
    pg = build(ParallelLayout(num_ranks=4)).evolve(intra_dist_opt=instances[rank // 2], inter_dist_opt=across[rank % 2])
    if rank == 3:
        return "its step failed: no commit"  # and its process ends, as a lost rank's does
    try:
        commit(pg)
    except RuntimeError:
        return "refused"
    return "committed: would step"


def test_commit_spans_every_optimizer_instance_so_no_rank_steps_alone() -> None:
    """``commit`` all-reduced over ``intra_dist_opt`` alone, one instance of a partial distributed optimizer: with
    rank 3's step failed, ranks 0 and 1 (the other instance) passed it and stepped, rank 2 did not, so the survivors
    committed different steps and ``recover`` refused to go on (reload a checkpoint). It spans ``inter_dist_opt``
    too now, as a clip's verdict does: no rank passes it."""
    outcomes = run_world(4, _commit_over_two_optimizer_instances, timeout=60.0)
    assert outcomes == ["refused", "refused", "refused", "its step failed: no commit"], outcomes

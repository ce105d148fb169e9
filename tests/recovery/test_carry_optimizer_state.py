"""``carry_optimizer_state`` refuses what cannot carry over: a sharded optimizer (the lost replica's shard has no
copy) and parameters whose main grads are of another dtype (their grad hooks stay with the old optimizer)."""

from __future__ import annotations

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

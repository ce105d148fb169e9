"""``error_if_nonfinite`` given ``True`` on one rank and ``False`` on another ends in an error naming it on every
rank, nothing scaled, with no collective more than the clip's.

Reported in docs/reliability.md (hostile inputs, eighth round, left as found): the flag did not ride in the clip's
verdict, so a non-finite norm raised ``RuntimeError`` on the rank given ``True`` and was returned on the others (a
training loop then skipped the step on some ranks and stopped on the rest), and a finite one went unremarked. Now the
flag rides beside ``max_norm`` and ``norm_type`` in the verdict: in the norm's row over pipeline stages (summed) and
in the verdict's own all-reduce over data-parallel replicas (MAX). Two gloo ranks, a short deadline, so a wait shows
as a failure; after the errors, an agreeing clip gives the float64 oracle's norm and grads (no collective was left
behind).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from torch import nn

from pgregistry import ParallelLayout, clip_grad_norm_, grad_norm_and_zeros, registry
from pgregistry.grad_stats import CLIP_EPSILON
from pgregistry.optim import build_optimizer
from pgregistry.testing import run_world

LAYOUTS: dict[str, dict[str, int]] = {"replicas": {}, "stages": {"pp": 2}}
"""Two ranks as data-parallel replicas (the verdict's own all-reduce) or as pipeline stages (it rides in the row)."""

CALLS = ("clip_grad_norm_", "grad_norm_and_zeros", "optimizer")
GRADS = ("finite", "with an inf")


def _grads(rank: int, replicas: bool) -> list[torch.Tensor]:
    """The grads a rank holds: the same on both replicas, each stage its own; norm well above 1."""
    scale = 1.0 if replicas else rank + 1.0
    return [torch.arange(6, dtype=torch.float32).reshape(2, 3) * scale, torch.tensor([1.5, -2.0]) * scale]


def _set_grads(model: nn.Module, grads: list[torch.Tensor]) -> None:
    """Each parameter's grad made ``grads``' (into the optimizer's buffer where it holds one)."""
    for param, grad in zip(model.parameters(), grads, strict=True):
        if param.grad is None:
            param.grad = grad.clone()
        else:
            param.grad.copy_(grad)


def _clip(call: str, model: nn.Module, pgc: object, optimizer: object, error_if_nonfinite: bool) -> float:
    if call == "clip_grad_norm_":
        return float(clip_grad_norm_(model, 1.0, pgc, error_if_nonfinite=error_if_nonfinite))  # type: ignore[arg-type]
    if call == "grad_norm_and_zeros":
        norm = grad_norm_and_zeros(model, pgc, max_norm=1.0, error_if_nonfinite=error_if_nonfinite)[0]  # type: ignore[arg-type]
        return float(norm)
    return float(optimizer.clip_grad_norm(1.0, error_if_nonfinite=error_if_nonfinite))  # type: ignore[attr-defined]


def _on_rank(layout: str, flags: dict[int, bool]) -> dict[str, object]:
    """Each call with this rank's flag, on finite grads and on grads with an inf: the error (``type: message``,
    empty when none) and whether every grad is unchanged; then an agreeing clip's norm and grads."""
    pgc = registry.build(ParallelLayout(num_ranks=2, **LAYOUTS[layout]))
    replicas = layout == "replicas"
    grads = _grads(dist.get_rank(), replicas)
    out: dict[str, object] = {}
    for call in CALLS:
        model = nn.Linear(3, 2)
        optimizer = build_optimizer(model, pgc, optimizer="sgd", lr=0.1) if call == "optimizer" else None
        for kind in GRADS:
            given = [grad.clone() for grad in grads]
            if kind == "with an inf":
                given[1][0] = math.inf
            _set_grads(model, given)
            try:
                _clip(call, model, pgc, optimizer, flags[dist.get_rank()])
                error = ""
            except (ValueError, RuntimeError) as exc:
                error = f"{type(exc).__name__}: {exc}"
            unchanged = all(bool((p.grad == g).all()) for p, g in zip(model.parameters(), given, strict=True))
            out[f"{call}, {kind}"] = (error, unchanged)
        _set_grads(model, grads)
        out[f"{call}, agreeing"] = (
            _clip(call, model, pgc, optimizer, True),
            [p.grad.detach().clone() for p in model.parameters()],
        )
    return out


def _oracle(replicas: bool) -> tuple[float, list[list[torch.Tensor]]]:
    """The 2-norm of the job's grads (float64, unsharded: the replicas' once) and each rank's grads clipped to 1."""
    counted = [g.double().flatten() for rank in ((0,) if replicas else (0, 1)) for g in _grads(rank, replicas)]
    norm = float(torch.cat(counted).norm())
    coefficient = min(1.0, 1.0 / (norm + CLIP_EPSILON))
    return norm, [[g.double() * coefficient for g in _grads(rank, replicas)] for rank in (0, 1)]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_error_if_nonfinite_that_differs_raises_naming_it_on_every_rank_and_scales_nothing(layout: str) -> None:
    results = run_world(2, _on_rank, layout, {0: True, 1: False}, timeout=40.0)  # a rank left waiting fails
    for rank, got in enumerate(results):
        for call in CALLS:
            for kind in GRADS:
                error, unchanged = got[f"{call}, {kind}"]  # type: ignore[misc]
                assert error.startswith("ValueError: "), (rank, call, kind, error)
                assert "error_if_nonfinite (True on some ranks, False on others) differs across the ranks" in error, (
                    rank,
                    call,
                    kind,
                    error,
                )
                assert f"error_if_nonfinite={[True, False][rank]!r}" in error, (rank, call, error)
                assert unchanged, (rank, call, kind)
    want_norm, want = _oracle(layout == "replicas")
    assert want_norm > 1.0
    for rank, got in enumerate(results):
        for call in CALLS:
            norm, clipped = got[f"{call}, agreeing"]  # type: ignore[misc]
            assert norm == pytest.approx(want_norm, rel=1e-6), (rank, call)
            for after, expected in zip(clipped, want[rank], strict=True):
                torch.testing.assert_close(after.double(), expected, rtol=1e-6, atol=0)

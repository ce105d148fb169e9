"""Grads on the meta device, and a tensor given twice to the list functions, are refused naming them.

A model built under ``torch.device("meta")`` and never materialised gets meta grads from its backward pass:
``grad_norm`` answered a meta tensor with no value, ``clip_grad_norm_`` clipped nothing, and
``norm_of_grads``, ``zeros_of_grads`` and ``clip_grads_`` alike, without a word. ``clip_grads_`` given one
tensor twice scaled it twice (0.01 of it instead of 0.1 at a norm of 10), and ``norm_of_grads`` counted it
twice (as torch's ``clip_grads_with_norm_`` and ``get_total_norm`` do). A 2-rank gloo world, every rank given
the same faulty input: a check after the first collective would show as a hang or another error.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
from torch import nn

from pgregistry import registry
from pgregistry.grad_stats import (
    clip_grad_norm_,
    clip_grads_,
    count_zeros,
    grad_norm,
    grad_norm_and_zeros,
    norm_of_grads,
    zeros_of_grads,
)
from pgregistry.layout import ParallelLayout
from pgregistry.testing import run_world


def _outcome(call: Callable[[], object]) -> str:
    try:
        result = call()
    except (ValueError, TypeError) as error:
        return f"{type(error).__name__}: {error}"
    return f"no error: {result!r}"


def _meta_refusals() -> dict[str, str]:
    collection = registry.build(ParallelLayout(num_ranks=2))
    with torch.device("meta"):
        model = nn.Linear(3, 2)
    model(
        torch.ones(4, 3, device="meta")
    ).sum().backward()  # meta grads, as a real backward gives them
    grads = [param.grad for param in model.parameters()]
    calls: dict[str, Callable[[], object]] = {
        "grad_norm": lambda: grad_norm(model, collection),
        "count_zeros": lambda: count_zeros(model, collection),
        "grad_norm_and_zeros": lambda: grad_norm_and_zeros(model, collection),
        "clip_grad_norm_": lambda: clip_grad_norm_(model, 1.0, collection),
        "norm_of_grads": lambda: norm_of_grads({collection.dp: grads}),
        "zeros_of_grads": lambda: zeros_of_grads({collection.dp: grads}),
        "clip_grads_": lambda: clip_grads_(grads, 1.0, 10.0),
    }
    out = {label: _outcome(call) for label, call in calls.items()}
    # Materialised as the message says, the same model gives the float64 oracle's norm.
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.weight.copy_(torch.arange(6.0).reshape(2, 3))
        model.bias.fill_(1.0)
    model.zero_grad()
    model(torch.ones(4, 3)).sum().backward()
    out["materialised norm"] = repr(float(grad_norm(model, collection)))
    return out


def test_meta_grads_are_refused_on_every_rank_naming_the_parameter_and_the_fix() -> None:
    results = run_world(2, _meta_refusals, timeout=60)
    assert results[0] == results[1]
    out = results[0]
    for label in ("grad_norm", "count_zeros", "grad_norm_and_zeros", "clip_grad_norm_"):
        assert out[label].startswith("ValueError: the grad of 'weight' is on the meta device"), (
            label,
            out[label],
        )
        assert "to_empty" in out[label], out[label]
    for label in ("norm_of_grads", "zeros_of_grads"):
        assert out[label].startswith(
            "ValueError: grads_by_group[<group of ranks [0, 1]>][0] is on the meta device"
        )
    assert out["clip_grads_"].startswith("ValueError: grads[0] is on the meta device"), out[
        "clip_grads_"
    ]
    # d(sum of 4 rows of W x + b)/dW = 4 everywhere (6 elements), /db = 4 (2 elements): both ranks the same
    # (dp 2: each rank's grads are its replica's, the norm is over the model-parallel group of one).
    oracle = math.sqrt(torch.full((8,), 4.0, dtype=torch.float64).square().sum().item())
    assert float(out["materialised norm"]) == pytest.approx(oracle, rel=1e-6)


def _repeated_refusals() -> dict[str, object]:
    collection = registry.build(ParallelLayout(num_ranks=2, tp=2))
    grad = torch.full((4,), 5.0)  # norm 10 alone
    other = torch.full((4,), 5.0)
    out: dict[str, object] = {
        "clip_grads_([g, g])": _outcome(lambda: clip_grads_([grad, grad], 1.0, 10.0)),
        "g after": repr(grad.tolist()),
        "norm_of_grads({tp: [g, g]})": _outcome(
            lambda: norm_of_grads({collection.tp: [grad, grad]})
        ),
        "norm_of_grads({tp: [g], None: [g]})": _outcome(
            lambda: norm_of_grads({collection.tp: [grad], None: [grad]})
        ),
        "zeros_of_grads({tp: [g, g]})": _outcome(
            lambda: zeros_of_grads({collection.tp: [grad, grad]})
        ),
        # Two distinct tensors of the same values are two grads: counted and scaled once each.
        "norm of two": repr(float(norm_of_grads({collection.tp: [grad, other]}))),
    }
    clip_grads_([grad, other], 1.0, 40.0)
    out["two clipped"] = [grad.tolist(), other.tolist()]
    return out


def _shared_grad_refusals() -> dict[str, object]:
    collection = registry.build(ParallelLayout(num_ranks=2))
    model = nn.Linear(4, 2, bias=False)
    model.extra = nn.Parameter(torch.zeros(2, 4))
    shared = torch.full((2, 4), 5.0)
    model.weight.grad = shared
    model.extra.grad = shared  # one tensor, set by hand as two parameters' grad
    return {
        "grad_norm": _outcome(lambda: grad_norm(model, collection)),
        "clip_grad_norm_": _outcome(lambda: clip_grad_norm_(model, 1.0, collection)),
        "shared after": shared.tolist(),
    }


def test_two_parameters_sharing_one_grad_tensor_are_refused_not_counted_twice() -> None:
    """grad_norm answered sqrt(2) times the norm of the distinct grads; the clip scaled the tensor twice."""
    results = run_world(2, _shared_grad_refusals, timeout=60)
    assert results[0] == results[1]
    for label in ("grad_norm", "clip_grad_norm_"):
        assert results[0][label] == (
            "ValueError: parameters 'weight' and 'extra' share one .grad tensor, which would be counted and "
            "scaled twice: give each its own grad"
        )
    assert results[0]["shared after"] == [[5.0] * 4] * 2


def _overlapping_grad_refusals() -> dict[str, object]:
    collection = registry.build(ParallelLayout(num_ranks=2))
    model = nn.Module()
    model.first = nn.Parameter(torch.zeros(2))
    model.second = nn.Parameter(torch.zeros(2))
    buffer = torch.tensor([3.0, 4.0, 0.0])
    model.first.grad, model.second.grad = buffer[0:2], buffer[1:3]  # offsets one element off: 4.0 in both
    out: dict[str, object] = {
        "grad_norm": _outcome(lambda: grad_norm(model, collection)),
        "clip_grad_norm_": _outcome(lambda: clip_grad_norm_(model, 1.0, collection)),
        "buffer after": buffer.tolist(),
    }
    model.second.grad = buffer[2:3].expand(2)  # disjoint views of the buffer are counted as they are
    out["disjoint"] = float(grad_norm(model, collection))
    return out


def test_grads_overlapping_in_memory_are_refused_not_counted_twice() -> None:
    """Grads that are views of one buffer sharing an element (offsets off by one) gave a norm of sqrt(41) for
    the 5 of the buffer, the shared 4.0 counted twice, and a clip scaled it twice."""
    results = run_world(2, _overlapping_grad_refusals, timeout=60)
    assert results[0] == results[1]
    for label in ("grad_norm", "clip_grad_norm_"):
        assert results[0][label] == (
            "ValueError: the grads of parameters 'first' and 'second' overlap in memory (views of one tensor "
            "sharing elements), which would be counted and scaled twice: give each parameter a grad of its own"
        )
    assert results[0]["buffer after"] == [3.0, 4.0, 0.0]
    oracle = math.sqrt(torch.tensor([3.0, 4.0, 0.0, 0.0], dtype=torch.float64).square().sum().item())
    assert results[0]["disjoint"] == pytest.approx(oracle, rel=1e-6)


def test_a_tensor_given_twice_is_refused_not_counted_or_scaled_twice() -> None:
    results = run_world(2, _repeated_refusals, timeout=60)
    assert results[0] == results[1]
    out = results[0]
    assert out["clip_grads_([g, g])"] == (
        "ValueError: grads[0] and grads[1] are the same tensor (of shape (4,)), which would be scaled twice: "
        "give each grad once"
    )
    assert out["g after"] == repr([5.0] * 4)  # untouched, not 0.05 (scaled by 0.1 twice)
    assert (
        "[<group of ranks [0, 1]>][0] and grads_by_group[<group of ranks [0, 1]>][1] are the same tensor"
        in str(out["norm_of_grads({tp: [g, g]})"])
    )
    assert "counted twice" in str(out["norm_of_grads({tp: [g, g]})"])
    assert "grads_by_group[None][0] are the same tensor" in str(
        out["norm_of_grads({tp: [g], None: [g]})"]
    )
    assert "are the same tensor" in str(out["zeros_of_grads({tp: [g, g]})"])
    # float64 oracle: both ranks' two grads of 5.0 (4 elements each) over tp of 2 = 16 elements of 5.
    oracle = math.sqrt(torch.full((16,), 5.0, dtype=torch.float64).square().sum().item())
    assert float(str(out["norm of two"])) == pytest.approx(oracle, rel=1e-6)
    coefficient = 1.0 / (40.0 + 1e-6)
    assert out["two clipped"] == [pytest.approx([5.0 * coefficient] * 4, rel=1e-6)] * 2

"""The one-kernel optimizer step (:mod:`pgregistry.optim._fused_step`), its kernel run by triton's interpreter on CPU:
every step of every rule it takes is the float64 rule to rounding (the oracle, tests/fixtures/optim_reference.py, is
written from torch's documented algorithms), the copies are the stepped params rounded and nothing else, the state
is the one torch keeps (a checkpoint taken after kernel steps continues on torch's step), and what it does not take
it refuses untouched.

Triton 3.9's interpreter rounds float32 to bf16 toward zero (its cast carries no rounding mode); the compiled kernel
rounds to nearest even like torch. So bf16 copies are checked here to be one of the two roundings, element by element
(fp16 copies, which the interpreter rounds with numpy, exactly), and bit for bit by scripts/gpu_check.py on a GPU.
Skipped where triton is not installed; the refusals and the CPU path need no triton.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from fixtures.interpreter import in_interpreter
from fixtures.optim_reference import (
    CASES,
    SENTINEL,
    flat_steps,
    model_params,
    rule_steps,
    state_before,
    values,
    worst_units,
)
from torch import nn

from pgregistry.collection import FIELD_NAMES, ProcessGroupCollection
from pgregistry.optim import (
    ElementwiseRule,
    FlatStep,
    MixedPrecisionOptimizer,
    ShardedOptimizer,
    inner_factory,
    setup_process_groups_for_optimizer,
)
from pgregistry.optim import _flat_step as flat_step_module
from pgregistry.optim import _fused_step as fused_step
from pgregistry.optim._copies import Copy, write_copies

ALL_OFF = ProcessGroupCollection(**dict.fromkeys(FIELD_NAMES))
OFF = setup_process_groups_for_optimizer(ALL_OFF)
SMALL = {"block": 64, "iters": 2}
"""Blocks of 64 elements, programs of two: many programs, and copies starting and ending inside blocks, over few
elements."""
N = 1000
"""Elements of the flat tensor of the rule tests (a multiple of VEC; the last program partial)."""
STEPS = 4
MODEL_RULES: dict[str, dict[str, Any]] = {
    "adam": {"lr": 1e-2, "weight_decay": 0.01},
    "adamw": {"lr": 1e-2, "weight_decay": 0.1},
    "sgd": {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01},
}
TORCH_RULES = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}


def _copy_dtype(name: str) -> torch.dtype:
    return torch.bfloat16 if sorted(CASES).index(name) % 2 else torch.float16


def _flat(n: int) -> nn.Parameter:
    return nn.Parameter(values(n, seed=1))


# ---------------------------------------------------------------------------------------- in the interpreter


def _layout() -> dict[str, Any]:
    """One SGD step over 1500 elements (blocks of 64, programs of 128, the last one of 92) with copies that the
    kernel writes in whole blocks to aligned places, from inside a block, to a misaligned place, and copies it
    leaves (one sharing a block with the copy before it, a minority dtype)."""
    flat = _flat(1500)
    flat.grad = values(1500, seed=7)
    before = state_before(flat, flat.grad, {})
    packed = torch.full((1000,), SENTINEL, dtype=torch.bfloat16)
    halves = torch.full((100,), SENTINEL, dtype=torch.float16)
    copies = {
        "whole blocks, then into one": Copy(0, packed[0:300]),
        "from the block where the last one ends": Copy(300, packed[300:500]),
        "from inside a block, to a misaligned place": Copy(700, packed[521:851]),
        "a minority dtype": Copy(1100, halves),
        "exactly two blocks": Copy(1152, packed[856:984]),
    }
    stepper = fused_step.FusedStep(flat, list(copies.values()), **SMALL)
    ran = stepper.step(torch.optim.SGD([flat], lr=0.5))
    after_kernel = (packed.clone(), halves.clone())
    write_copies(flat, stepper.unfused)
    unfused = [name for name, c in copies.items() if any(c is u for u in stepper.unfused)]
    return {
        "ran": ran,
        "before": before,
        "flat": flat.detach().clone(),
        "kernel": after_kernel,
        "final": (packed, halves),
        "unfused": unfused,
    }


def _optimizer_steps(sharded: bool, rule: str, dtypes: list[torch.dtype], steps: int) -> dict[str, Any]:
    """``steps`` steps of a mixed-precision (or one-rank sharded) optimizer through its flat step with the kernel
    forced on (``kernel_can_step`` patched: it is False off CUDA); each step's inputs and outputs."""
    factory = inner_factory(rule, **MODEL_RULES[rule])  # type: ignore[arg-type]
    groups = setup_process_groups_for_optimizer(ALL_OFF, use_distributed_optimizer=sharded)
    opt = (ShardedOptimizer if sharded else MixedPrecisionOptimizer)(model_params(dtypes), groups, inner=factory)
    records = flat_steps(opt, range(steps))
    fused = opt.inner._fused  # type: ignore[union-attr]
    return {
        "records": records,
        "fused": fused is not None,
        "unfused": len(fused.unfused) if fused is not None else None,
        "params": [p.detach().clone() for p in opt.params],
        "mains": _mains(opt),
        "state_dict": copy.deepcopy(opt.state_dict()),
    }


def _mains(opt: MixedPrecisionOptimizer | ShardedOptimizer) -> list[torch.Tensor]:
    """Each model parameter's main copy (float32), shaped like it."""
    if isinstance(opt, ShardedOptimizer):
        whole = opt.main_shard.detach()
        offsets = opt.buffer.offsets
        return [whole[o : o + p.numel()].view(p.shape).clone() for p, o in zip(opt.params, offsets, strict=True)]
    return [m.detach().clone() for m in opt.main_params]


def _in_interpreter() -> dict[str, Any]:
    """Every kernel launch of these tests (:func:`fixtures.interpreter.in_interpreter` runs it)."""
    flat_step_module.kernel_can_step = lambda flat: True  # type: ignore[assignment]
    mixed = [torch.bfloat16, torch.float32, torch.float16]
    return {
        "rules": {name: rule_steps(name, N, STEPS, _copy_dtype(name), **SMALL) for name in CASES},
        "layout": _layout(),
        "mixed": {rule: _optimizer_steps(False, rule, mixed, STEPS) for rule in MODEL_RULES},
        "sharded": _optimizer_steps(True, "adamw", [torch.bfloat16], STEPS),
        "checkpoint": _optimizer_steps(False, "adam", [torch.bfloat16], 2),
    }


@pytest.fixture(scope="module")
def interpreted() -> dict[str, Any]:
    return in_interpreter(_in_interpreter, timeout=600.0)


# ------------------------------------------------------------------------------------------------- checks


def _truncated_to_bf16(values: torch.Tensor) -> torch.Tensor:
    return (values.float().view(torch.int32) & ~0xFFFF).view(torch.float32).to(torch.bfloat16)


def _is_rounding_of(copied: torch.Tensor, values: torch.Tensor) -> bool:
    """Whether each element of ``copied`` is ``values`` rounded to its dtype: to nearest even or, for bf16 (the
    interpreter), toward zero."""
    nearest = values.to(copied.dtype)
    if copied.dtype != torch.bfloat16:
        return torch.equal(copied, nearest)
    return bool(((copied == nearest) | (copied == _truncated_to_bf16(values))).all())


@pytest.mark.parametrize("name", sorted(CASES))
def test_each_step_is_the_float64_rule_to_rounding(interpreted: dict[str, Any], name: str) -> None:
    records = interpreted["rules"][name]["records"]
    assert all(record["ran"] for record in records)
    assert worst_units(*CASES[name], records) <= 1.0
    counts = [record["step"] for record in records]
    assert counts == ([None] * STEPS if CASES[name][0] is torch.optim.SGD else [1.0, 2.0, 3.0, 4.0])


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_copy_is_the_stepped_params_rounded_and_nothing_else(interpreted: dict[str, Any], name: str) -> None:
    result = interpreted["rules"][name]
    assert result["unfused"] == 0
    for record in result["records"]:
        buffer, param = record["buffer"], record["after"]["param"]
        assert _is_rounding_of(buffer[4 : N - 20], param[8 : N - 16])
        assert bool((buffer[:4] == SENTINEL).all()) and bool((buffer[N - 20 :] == SENTINEL).all())


def test_copies_through_their_own_offsets_and_those_left_to_torch(interpreted: dict[str, Any]) -> None:
    """The kernel writes each copy it takes, wherever its target lies (vector stores, masked edges, a misaligned
    target), leaves a copy that would share a block with the previous one and a minority dtype, and touches nothing
    else; torch's copy after it writes the rest."""
    layout = interpreted["layout"]
    flat = layout["flat"]
    assert layout["ran"]
    assert worst_units(torch.optim.SGD, {"lr": 0.5}, [{"before": layout["before"], "after": {"param": flat}}]) <= 1
    assert layout["unfused"] == ["from the block where the last one ends", "a minority dtype"]
    packed, halves = layout["kernel"]
    assert _is_rounding_of(packed[0:300], flat[0:300])
    assert _is_rounding_of(packed[521:851], flat[700:1030])
    assert _is_rounding_of(packed[856:984], flat[1152:1280])
    for untouched in (packed[300:521], packed[851:856], packed[984:]):
        assert bool((untouched == SENTINEL).all())
    assert bool((halves == SENTINEL).all())
    packed, halves = layout["final"]
    assert torch.equal(packed[300:500], flat[300:500].to(torch.bfloat16))
    assert torch.equal(halves, flat[1100:1200].to(torch.float16))


@pytest.mark.parametrize("rule", sorted(MODEL_RULES))
def test_mixed_precision_steps_its_flat_buffer_and_model_in_the_kernel(interpreted: dict[str, Any], rule: str) -> None:
    """A model of bf16, float32 and fp16 parameters: the kernel steps the main buffer (each step the float64 rule to
    rounding) and writes the fp16 runs (the majority); torch copies the bf16 runs; every model parameter is its
    main param rounded."""
    result = interpreted["mixed"][rule]
    assert result["fused"] and result["unfused"] == 3  # the bf16 runs (SHAPES[0], [3], [6]), each alone
    assert worst_units(TORCH_RULES[rule], MODEL_RULES[rule], result["records"]) <= 1.0
    for param, main in zip(result["params"], result["mains"], strict=True):
        assert torch.equal(param, main.to(param.dtype))


def test_sharded_steps_and_writes_its_shard_in_the_kernel(interpreted: dict[str, Any]) -> None:
    result = interpreted["sharded"]
    assert result["fused"] and result["unfused"] == 0
    assert worst_units(torch.optim.AdamW, MODEL_RULES["adamw"], result["records"]) <= 1.0
    for param, main in zip(result["params"], result["mains"], strict=True):
        assert _is_rounding_of(param, main)


def test_a_checkpoint_after_kernel_steps_continues_on_torchs_step(interpreted: dict[str, Any]) -> None:
    """Two kernel steps, saved; loaded by the same optimizer on torch's step (CPU): steps 3 and 4 are the float64
    rule from the saved state (so the step count and moments were stored as torch stores them), and the state dict
    has the form of one torch's step wrote."""
    saved = interpreted["checkpoint"]
    params = model_params([torch.bfloat16])
    opt = MixedPrecisionOptimizer(params, OFF, inner=inner_factory("adam", **MODEL_RULES["adam"]))  # type: ignore[arg-type]
    torch_only = MixedPrecisionOptimizer(
        model_params([torch.bfloat16]), OFF, inner=inner_factory("adam", **MODEL_RULES["adam"])  # type: ignore[arg-type]
    )
    assert isinstance(opt.inner, FlatStep) and opt.inner._fused is None  # CPU: torch's step
    opt.load_state_dict(copy.deepcopy(saved["state_dict"]))
    records = flat_steps(opt, range(2, STEPS), torch_only)
    assert [record["step"] for record in records] == [3.0, 4.0]
    assert worst_units(torch.optim.Adam, MODEL_RULES["adam"], records, first_step=3) <= 1.0
    for index, entry in saved["state_dict"]["inner"]["state"].items():
        mine = torch_only.state_dict()["inner"]["state"][index]
        assert sorted(entry) == sorted(mine)
        for key, value in entry.items():
            assert (value.dtype, value.shape, value.device) == (mine[key].dtype, mine[key].shape, mine[key].device)


# ------------------------------------------------------------------------------------- refused, no triton


class _OwnAdam(torch.optim.Adam):
    """A subclass may change the rule: refused."""


def _refused() -> dict[str, Callable[[nn.Parameter], torch.optim.Optimizer]]:
    def scaled(flat: nn.Parameter) -> torch.optim.Optimizer:
        opt = torch.optim.Adam([flat])
        opt.grad_scale = torch.ones(())  # type: ignore[attr-defined]
        return opt

    def float64_state(flat: nn.Parameter) -> torch.optim.Optimizer:
        opt = torch.optim.Adam([flat])
        zeros = torch.zeros(flat.shape, dtype=torch.float64)
        opt.state[flat].update(step=torch.tensor(1.0), exp_avg=zeros, exp_avg_sq=zeros.clone())
        return opt

    def amsgrad_turned_on(flat: nn.Parameter) -> torch.optim.Optimizer:
        opt = torch.optim.Adam([flat])
        opt.state[flat].update(step=torch.tensor(1.0), exp_avg=torch.zeros(N), exp_avg_sq=torch.zeros(N))
        opt.param_groups[0]["amsgrad"] = True
        return opt

    def strided_grad(flat: nn.Parameter) -> torch.optim.Optimizer:
        flat.grad = torch.zeros(2 * N)[::2]
        return torch.optim.SGD([flat], lr=0.1)

    def step_count_in_float64(flat: nn.Parameter) -> torch.optim.Optimizer:
        opt = torch.optim.Adam([flat])
        opt.state[flat].update(
            step=torch.tensor(1.0, dtype=torch.float64), exp_avg=torch.zeros(N), exp_avg_sq=torch.zeros(N)
        )
        return opt

    return {
        "capturable": lambda flat: torch.optim.Adam([flat], capturable=True),
        "differentiable": lambda flat: torch.optim.Adam([flat], differentiable=True),
        "a tensor lr": lambda flat: torch.optim.Adam([flat], lr=torch.tensor(1e-3)),
        "tensor betas": lambda flat: torch.optim.AdamW([flat], betas=(torch.tensor(0.9), torch.tensor(0.99))),
        "a tensor lr, SGD": lambda flat: torch.optim.SGD([flat], lr=torch.tensor(1e-3)),
        "a grad scaler's grad_scale": scaled,
        "another rule": lambda flat: torch.optim.RMSprop([flat]),
        "a subclass": lambda flat: _OwnAdam([flat]),
        "two param groups": lambda flat: torch.optim.Adam([{"params": [flat]}, {"params": [_flat(8)]}]),
        "another tensor": lambda flat: torch.optim.Adam([nn.Parameter(torch.ones(N))]),
        "float64 moments": float64_state,
        "amsgrad turned on over state without its maximum": amsgrad_turned_on,
        "a float64 step count": step_count_in_float64,
        "a grad that is not contiguous": strided_grad,
    }


def _snapshot(opt: torch.optim.Optimizer) -> dict[int, dict[str, Any]]:
    return {id(key): {f: v.clone() for f, v in entry.items()} for key, entry in opt.state.items()}


@pytest.mark.parametrize("name", sorted(_refused()))
def test_what_the_kernel_does_not_run_is_refused_untouched(name: str) -> None:
    """``step`` returns False before launching or changing anything (the caller then runs torch's step, which
    raises where torch raises)."""
    flat = _flat(N)
    flat.grad = values(N, seed=3)
    opt = _refused()[name](flat)
    state, value = _snapshot(opt), flat.detach().clone()
    assert fused_step.FusedStep(flat, [Copy(0, torch.zeros(N, dtype=torch.bfloat16))]).step(opt) is False
    assert torch.equal(flat.detach(), value)
    now = _snapshot(opt)
    assert now.keys() == state.keys()
    for key, entry in state.items():
        assert now[key].keys() == entry.keys()
        for field, saved in entry.items():
            assert torch.equal(now[key][field], saved), (name, field)


def test_a_rule_given_torchs_implementation_keeps_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """``fused``/``foreach`` named in the hyperparameters: torch's optimizer, never the kernel, even where it
    applies (patched on here); the rule ``inner_factory`` builds takes the kernel there."""
    monkeypatch.setattr(flat_step_module, "kernel_can_step", lambda flat: True)
    flat = _flat(N)
    named = FlatStep(ElementwiseRule(torch.optim.Adam, {"lr": 1e-3, "foreach": False}), flat, [flat], [0])
    assert named._fused is None
    chosen = FlatStep(inner_factory("adam", lr=1e-3), flat, [flat], [0])  # type: ignore[arg-type]
    assert isinstance(chosen._fused, fused_step.FusedStep)


def test_the_cpu_path_is_torchs_step() -> None:
    """Off CUDA the kernel never runs (the bit-identity with plain torch.optim is test_optim_flat_step.py's)."""
    opt = MixedPrecisionOptimizer(model_params([torch.bfloat16]), OFF, inner=inner_factory("adamw", lr=1e-3))
    assert isinstance(opt.inner, FlatStep) and opt.inner._fused is None
    assert not fused_step.can_run_fused_step(torch.device("cpu"))


def test_a_copy_outside_the_flat_tensor_is_refused() -> None:
    flat = _flat(N)
    with pytest.raises(ValueError, match=r"a copy \[996, 1004\) lies outside the flat tensor"):
        FlatStep(inner_factory("sgd", lr=0.1), flat, [flat], [0], [Copy(996, torch.zeros(8))])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="contiguous 1-d"):
        FlatStep(inner_factory("sgd", lr=0.1), flat, [flat], [0], [Copy(0, torch.zeros(4, 2))])  # type: ignore[arg-type]


def test_a_device_where_the_kernel_cannot_launch_keeps_torchs_step(caplog: pytest.LogCaptureFixture) -> None:
    """The first launch on a device is a probe; a failure (no GPU here, on a GPU a compiler missing) is logged and
    torch's step runs."""
    with caplog.at_level("WARNING"):
        assert fused_step._works_on.__wrapped__(0) is False
    assert "fused_optimizer_step_unavailable" in caplog.text

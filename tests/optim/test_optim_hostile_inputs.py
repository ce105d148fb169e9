"""Hostile but plausible inputs to the optimizers: each is refused naming the culprit, before anything changes, or
gives torch's own numbers.

torch's optimizers skip a frozen parameter (its ``.grad`` is ``None``); the flat optimizers step every element of
their buffer, so a frozen parameter given to them was decayed. float32 main copies of a float64 parameter rounded it
(the model's value too). torch's SGD takes an ``lr`` of NaN, every rule an infinite one. Each of these gave a silently
wrong parameter; here each is refused."""

from __future__ import annotations

import copy
import functools
import re
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn

from pgregistry import registry
from pgregistry.collection import FIELD_NAMES, ProcessGroupCollection
from pgregistry.layout import ParallelLayout
from pgregistry.optim import (
    ChainedOptimizer,
    ElementwiseRule,
    FlatStep,
    MixedPrecisionOptimizer,
    ShardedOptimizer,
    build_optimizer,
    inner_factory,
    setup_process_groups_for_optimizer,
)
from pgregistry.testing import run_world

ALL_OFF = ProcessGroupCollection(**dict.fromkeys(FIELD_NAMES))
OFF = setup_process_groups_for_optimizer(ALL_OFF)


def _linear(dtype: torch.dtype = torch.float32) -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(3, 2).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bf16"])
@pytest.mark.parametrize("kind", [MixedPrecisionOptimizer, ShardedOptimizer], ids=["mixed", "sharded"])
def test_a_frozen_parameter_is_refused_naming_it_not_decayed(kind: type, dtype: torch.dtype) -> None:
    model = _linear(dtype)
    model.weight.requires_grad_(False)
    before = model.weight.detach().clone()
    with pytest.raises(ValueError, match=r"param\[0\] has requires_grad=False: .* trainable parameters only"):
        kind(list(model.parameters()), OFF, inner=inner_factory("adamw", lr=0.1, weight_decay=0.5))
    assert torch.equal(model.weight.detach(), before)


@pytest.mark.parametrize("kind", [MixedPrecisionOptimizer, ShardedOptimizer], ids=["mixed", "sharded"])
def test_float64_parameters_under_float32_main_copies_are_refused_not_rounded(kind: type) -> None:
    model = nn.Module()
    model.weight = nn.Parameter(torch.full((4,), 1 + 2**-40, dtype=torch.float64))
    if kind is MixedPrecisionOptimizer:  # a sharded build needs a world (below)
        rounded = r"would round the float64 parameters .*\['weight'\].* mixed_precision=False"
        with pytest.raises(ValueError, match=rounded):
            build_optimizer(model, ALL_OFF, optimizer="sgd", lr=2**-45)
    rounds = r"param\[0\] is torch.float64, which main copies of torch.float32 would round"
    with pytest.raises(ValueError, match=rounds):
        kind([model.weight], OFF, inner=inner_factory("sgd", lr=0.1))
    assert model.weight.detach().tolist() == [1 + 2**-40] * 4
    # Stepped in float64, it moves as torch's SGD moves it.
    optimizer = kind([model.weight], OFF, inner=inner_factory("sgd", lr=2**-45), main_dtype=None)
    model.weight.sum().backward()
    optimizer.step()
    assert model.weight.detach().tolist() == [1 + 2**-40 - 2**-45] * 4


BAD_OPTIONS = [
    pytest.param("lr", float("nan"), ValueError, "lr must be a non-negative, finite number, got nan", id="lr-nan"),
    pytest.param("lr", float("inf"), ValueError, "lr must be a non-negative, finite number, got inf", id="lr-inf"),
    pytest.param("lr", None, TypeError, r"lr must be a number, got None \(NoneType\)", id="lr-none"),
    pytest.param("lr", True, TypeError, r"lr must be a number, got True \(bool\)", id="lr-bool"),
    pytest.param(
        "weight_decay",
        float("nan"),
        ValueError,
        "weight_decay must be a non-negative, finite number",
        id="weight-decay-nan",
    ),
    pytest.param(
        "momentum",
        float("nan"),
        ValueError,
        "momentum must be a non-negative, finite number",
        id="momentum-nan",
    ),
    pytest.param("eps", None, TypeError, "eps must be a number", id="eps-none"),
    pytest.param("betas", (float("nan"), 0.9), ValueError, r"betas must each be in \[0, 1\)", id="beta-nan"),
    pytest.param("betas", None, TypeError, "betas must be a pair of numbers", id="betas-none"),
    pytest.param(
        "optimizer",
        None,
        ValueError,
        r"optimizer must be one of \['adam', 'adamw', 'sgd'\] or a factory, got None",
        id="optimizer-none",
    ),
    pytest.param("sharded", "no", TypeError, r"sharded must be True or False, got 'no' \(str\)", id="sharded-str"),
    pytest.param("mixed_precision", 1, TypeError, "mixed_precision must be True or False", id="mixed-precision-int"),
    pytest.param(
        "bucket_numel",
        True,
        TypeError,
        "bucket_numel must be a whole number of elements or None, got True",
        id="bucket-numel-bool",
    ),
    pytest.param("bucket_numel", -1, ValueError, "bucket_numel must be positive, got -1", id="bucket-numel-negative"),
]


@pytest.mark.parametrize("option,value,error,text", BAD_OPTIONS)
def test_a_bad_option_is_refused_naming_it_before_anything_is_built(
    option: str, value: Any, error: type[Exception], text: str
) -> None:
    model = _linear()
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = "sgd" if option == "momentum" else "adam"
    with pytest.raises(error, match=text):
        build_optimizer(model, ALL_OFF, **{"optimizer": optimizer, option: value})
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(p.detach(), b) for p, b in zip(model.parameters(), before, strict=True))
    if option in ("lr", "weight_decay", "momentum", "eps", "betas", "optimizer"):
        with pytest.raises(error, match=text):
            inner_factory(**{"optimizer": optimizer, "lr": 0.1, option: value})


def test_numpy_numbers_are_taken_as_their_values() -> None:
    model, reference = _linear(), _linear()
    optimizer = build_optimizer(model, ALL_OFF, optimizer="sgd", lr=np.float64(0.5), bucket_numel=np.int64(64))
    torch_sgd = torch.optim.SGD(reference.parameters(), lr=0.5)
    for module in (model, reference):
        module(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    torch_sgd.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), reference.parameters(), strict=True))


def test_parameters_on_several_devices_are_refused_naming_them() -> None:
    model = nn.Module()
    model.here = nn.Parameter(torch.ones(2))
    model.elsewhere = nn.Parameter(torch.ones(2, device="meta"))
    with pytest.raises(ValueError, match=r"the parameters lie on 2 devices \(\['cpu', 'meta'\]\)"):
        build_optimizer(model, ALL_OFF)


def _float64_on_rank_1() -> str:
    collection = registry.build(ParallelLayout(num_ranks=2, tp=2))
    model = _linear(torch.float64 if dist.get_rank() == 1 else torch.float32)
    try:
        build_optimizer(model, collection)
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_float64_parameters_on_one_rank_are_refused_on_every_rank() -> None:
    here, elsewhere = run_world(2, _float64_on_rank_1)
    assert "(none here)" in here
    assert "(here: ['weight', 'bias'])" in elsewhere


def _trained(optimizer: str = "adam", **options: Any) -> tuple[nn.Linear, Any]:
    model = _linear()
    built = build_optimizer(model, ALL_OFF, optimizer=optimizer, lr=0.1, **options)  # type: ignore[arg-type]
    model(torch.ones(1, 3)).sum().backward()
    built.step()
    return model, built


def test_a_child_chained_twice_or_a_parameter_in_two_children_is_refused_not_counted_twice() -> None:
    model = _linear()
    child = MixedPrecisionOptimizer(list(model.parameters()), OFF, inner=inner_factory("sgd", lr=0.1))
    with pytest.raises(ValueError, match="child 1 is child 0 again: each child is chained once"):
        ChainedOptimizer([child, child])  # its norm was sqrt(2) times the model's
    weight_only = MixedPrecisionOptimizer([model.weight], OFF, inner=inner_factory("sgd", lr=0.1))
    both = MixedPrecisionOptimizer([model.weight, model.bias], OFF, inner=inner_factory("sgd", lr=0.1))
    with pytest.raises(ValueError, match=r"param\[0\] is a parameter of children 0 and 1"):
        ChainedOptimizer([weight_only, both])
    with pytest.raises(TypeError, match="child 0 is a SGD; ChainedOptimizer chains pgregistry's flat optimizers"):
        ChainedOptimizer([torch.optim.SGD(model.parameters(), lr=0.1)])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="needs at least one child"):
        ChainedOptimizer(iter([]))  # type: ignore[arg-type]


@pytest.mark.parametrize("params", ["tensor", "module"])
def test_a_tensor_or_module_given_as_params_is_refused_not_stepped_by_rows(params: str) -> None:
    model = _linear()
    given = model.weight if params == "tensor" else model
    with pytest.raises(TypeError, match=r"params must be an iterable of parameters, got a (Parameter|Linear)"):
        MixedPrecisionOptimizer(given, OFF, inner=inner_factory("sgd", lr=0.1))  # type: ignore[arg-type]


def test_bad_constructor_arguments_are_named() -> None:
    params = list(_linear().parameters())
    cases = [
        ({"inner": None}, TypeError, r"inner must be a factory of the update rule .* got None \(NoneType\)"),
        ({"main_dtype": "float32"}, TypeError, "main_dtype must be a floating-point torch.dtype .* got 'float32'"),
        ({"bucket_numel": 0}, ValueError, "bucket_numel must be positive, got 0"),
        ({"expert": "yes"}, TypeError, r"expert must be True or False, got 'yes' \(str\)"),
    ]
    for keywords, error, text in cases:
        arguments: dict[str, Any] = {"inner": inner_factory("sgd", lr=0.1), **keywords}
        with pytest.raises(error, match=text):
            MixedPrecisionOptimizer(params, OFF, **arguments)


def test_a_flat_step_main_param_not_at_its_start_is_refused() -> None:
    flat = torch.zeros(5)
    flat.grad = torch.ones(5)
    rule = ElementwiseRule(torch.optim.SGD, {"lr": 0.5})
    with pytest.raises(ValueError, match=r"main param 0 is not the view flat\[1:3\] its start says"):
        FlatStep(rule, flat, [flat[0:2], flat[2:5]], starts=[1, 2])  # its state would be read from [1, 3)
    with pytest.raises(TypeError, match="rule must be an ElementwiseRule"):
        FlatStep(torch.optim.SGD, flat, [flat[0:2]], starts=[0])  # type: ignore[arg-type]


def _group(state: dict[str, Any]) -> dict[str, Any]:
    return state["children"][0]["inner"]["param_groups"][0]


def _per_param(state: dict[str, Any]) -> dict[int, dict[str, Any]]:
    return state["children"][0]["inner"]["state"]


SAVED_FAULTS = [
    pytest.param(
        lambda s: _group(s).update(lr=float("nan")),
        r"param group's lr must be a non-negative, finite number, got nan",
        id="lr-nan",
    ),
    pytest.param(
        lambda s: _group(s).pop("lr"),
        r"param group lacks \['lr'\], hyperparameters of this optimizer's Adam",
        id="lr-missing",
    ),
    pytest.param(
        lambda s: _group(s).update(betas="x"), "param group's betas must be a pair of numbers", id="betas-str"
    ),
    pytest.param(
        lambda s: [entry.update(step=torch.tensor(-3.0)) for entry in _per_param(s).values()],
        r"'step' of parameter 0 is tensor\(-3.\), not a count of steps",
        id="step-negative",
    ),
    pytest.param(
        lambda s: [entry.update(step="3") for entry in _per_param(s).values()],
        "'step' of parameter 0 is '3', not a count of steps",
        id="step-str",
    ),
]


@pytest.mark.parametrize("damage,text", SAVED_FAULTS)
def test_a_saved_param_group_or_step_out_of_range_is_refused_leaving_the_optimizer_unchanged(
    damage: Any, text: str
) -> None:
    _, optimizer = _trained()
    state = copy.deepcopy(optimizer.state_dict())
    before = copy.deepcopy(optimizer.state_dict())
    damage(state)
    with pytest.raises(ValueError, match=text):
        optimizer.load_state_dict(state)
    after = optimizer.state_dict()
    assert _group(after) == _group(before)
    assert all(
        torch.equal(after_value, _per_param(before)[pid][key])
        for pid, entry in _per_param(after).items()
        for key, after_value in entry.items()
    )


@pytest.mark.parametrize("saved,loading,lacks", [("adam", "sgd", "momentum"), ("sgd", "adam", "betas")])
def test_state_saved_by_another_update_rule_is_refused_naming_what_it_lacks(
    saved: str, loading: str, lacks: str
) -> None:
    _, source = _trained(saved, momentum=0.9) if saved == "sgd" else _trained(saved)
    _, target = _trained(loading, momentum=0.9) if loading == "sgd" else _trained(loading)
    lr_before = target.param_groups[0]["lr"]
    with pytest.raises(ValueError, match=rf"param group lacks \[.*'{lacks}'.*\], hyperparameters of this optimizer's"):
        target.load_state_dict(source.state_dict())  # Adam's group and moments went into the SGD before
    assert set(target.param_groups[0]) >= {"lr", lacks} and target.param_groups[0]["lr"] == lr_before


def test_param_state_keyed_by_names_or_no_mapping_is_refused_not_ignored() -> None:
    model, optimizer = _trained()
    state = optimizer.param_state()
    by_name = {name: state[param] for name, param in model.named_parameters()}
    with pytest.raises(
        ValueError, match="keyed by 2 key.* that are no parameter, e.g. 'weight' .*load_optimizer_state_by_name"
    ):
        optimizer.load_param_state(by_name)  # loaded nothing, silently, before
    with pytest.raises(ValueError, match="it is a NoneType, not a mapping of parameter -> state"):
        optimizer.load_param_state(None)


def _options_differing_on_rank_1() -> dict[str, str]:
    collection = registry.build(ParallelLayout(num_ranks=2))  # two data-parallel replicas
    rank = dist.get_rank()
    out = {}
    for label, options in (
        ("lr", {"lr": 0.2 if rank else 0.1}),  # replicas stepped alike grads differently before
        ("sharded", {"sharded": rank == 1}),
    ):
        try:
            build_optimizer(_linear(), collection, optimizer="sgd", **options)  # type: ignore[arg-type]
            out[label] = "built"
        except ValueError as exc:
            out[label] = str(exc)
    return out


def test_options_that_differ_across_the_ranks_of_one_optimizer_are_refused_on_every_rank() -> None:
    for rank, out in enumerate(run_world(2, _options_differing_on_rank_1, timeout=60.0)):
        for label in ("lr", "sharded"):
            assert out[label].startswith(
                "build_optimizer was given different options on the ranks of one optimizer"
            ), (rank, label, out[label])
        assert f"lr={0.2 if rank else 0.1}" in out["lr"]


def _replicas_of_other_parameters(kind: str) -> str:
    collection = registry.build(ParallelLayout(num_ranks=2))  # two data-parallel replicas
    rank = dist.get_rank()
    model = nn.Linear(3, 2 + rank) if kind == "shape" else _linear()
    if kind == "frozen" and rank == 1:
        model.bias.requires_grad_(False)
    try:
        build_optimizer(model, collection, optimizer="sgd", lr=0.1)
    except ValueError as exc:
        return str(exc)
    return "built"


@pytest.mark.parametrize("kind", ["shape", "frozen"])
def test_replicas_holding_other_parameters_are_refused_on_every_rank(kind: str) -> None:
    # Both flat buffers are padded to 64 elements, so their grads were all-reduced as if alike: rank 0's bias grad
    # summed with rank 1's padding (frozen), or a (2, 3) weight's with a (3, 3) one's (shape).
    for rank, message in enumerate(run_world(2, _replicas_of_other_parameters, kind, timeout=60.0)):
        assert message.startswith(
            "the data-parallel replicas of this optimizer's dense parameters hold different ones"
        ), (rank, message)


def test_an_option_the_rule_does_not_read_is_refused_not_ignored() -> None:
    model = _linear()
    factory = functools.partial(torch.optim.AdamW)
    # AdamW's own lr of 1e-3 stepped before, not the 0.5 given.
    with pytest.raises(ValueError, match=r"lr given with a factory as optimizer, which carries its own"):
        build_optimizer(model, ALL_OFF, optimizer=factory, lr=0.5)
    with pytest.raises(ValueError, match=r"momentum given, which 'adam' does not read \(it reads lr, weight_decay"):
        build_optimizer(model, ALL_OFF, optimizer="adam", momentum=0.9)
    with pytest.raises(ValueError, match=r"betas, eps given, which 'sgd' does not read"):
        inner_factory("sgd", lr=0.1, betas=(0.5, 0.5), eps=1e-3)
    built = build_optimizer(model, ALL_OFF, optimizer=functools.partial(torch.optim.SGD, lr=0.5))
    assert built.param_groups[0]["lr"] == 0.5


def _meta_model_refusal() -> str:
    collection = registry.build(ParallelLayout(num_ranks=2))
    with torch.device("meta"):
        model = nn.Linear(3, 2)
    try:
        build_optimizer(model, collection)
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_parameters_on_the_meta_device_are_refused_on_every_rank_not_stepped_as_nothing() -> None:
    """A model built under torch.device("meta") and never materialised: its flat buffers were meta too, its
    backward's grads meta, and the optimizer's norm a meta tensor with no value and its step nothing, silently."""
    for message in run_world(2, _meta_model_refusal, timeout=60):
        assert message.startswith("parameter 'weight' is on the meta device"), message
        assert "to_empty" in message and "before building the optimizer" in message


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bf16"])
@pytest.mark.parametrize("kind", [MixedPrecisionOptimizer, ShardedOptimizer], ids=["mixed", "sharded"])
def test_an_optimizer_whose_parameters_a_later_one_took_is_refused_not_read_as_zero_grads(
    kind: type, dtype: torch.dtype
) -> None:
    """A second optimizer over the same parameters moves their grads into its own buffer: the first one's norm
    read 0.0 (2.83 is right) and its step moved nothing; over bf16 parameters the first one's grad hook took each
    grad, and the backward pass failed in the second one's (``add_(): argument 'other' ... not NoneType``)."""
    model = _linear(dtype)
    oracle = copy.deepcopy(model).double()
    earlier = kind(list(model.parameters()), OFF, inner=inner_factory("sgd", lr=0.5))
    later = kind(list(model.parameters()), OFF, inner=inner_factory("sgd", lr=0.5))
    model(torch.ones(1, 3, dtype=dtype)).sum().backward()
    oracle(torch.ones(1, 3, dtype=torch.float64)).sum().backward()
    expected = torch.cat([p.grad.flatten() for p in oracle.parameters()]).norm()
    assert float(later.get_grad_norm()) == pytest.approx(float(expected), rel=1e-6)
    before = [p.detach().clone() for p in model.parameters()]
    taken = rf"param\[0\] of this {kind.__name__} was given to another optimizer built after it"
    for use in ("get_grad_norm", "count_zeros", "sync_grads", "step", "zero_grad"):
        with pytest.raises(RuntimeError, match=taken):
            getattr(earlier, use)()
    with pytest.raises(RuntimeError, match=taken):
        earlier.clip_grad_norm(1.0)
    assert all(torch.equal(p.detach(), b) for p, b in zip(model.parameters(), before, strict=True))
    earlier.state_dict()  # what carrying the state over reads
    later.step()
    for param, reference, start in zip(model.parameters(), oracle.parameters(), before, strict=True):
        stepped = (start.double() - 0.5 * reference.grad).to(dtype)  # torch's SGD, rounded as the model
        assert torch.equal(param.detach(), stepped), (param, stepped)


class _TiedByStorage(nn.Module):
    def __init__(self, one_parameter: bool) -> None:
        super().__init__()
        self.emb = nn.Parameter(torch.ones(4))
        # Two Parameter objects over one tensor, or the tie as torch's own modules make it (one object).
        self.out = self.emb if one_parameter else nn.Parameter(self.emb.detach())

    def forward(self) -> torch.Tensor:
        return self.emb.sum() + 2 * self.out.sum()


def test_parameters_tied_by_storage_are_refused_not_untied() -> None:
    """Two parameters over one tensor were copied each to its own place of the flat buffer, untied without a word:
    after one SGD step of lr 0.5 ``emb`` was 0.5 and ``out`` 0.0, where torch's SGD, stepping the one tensor
    through both, leaves both at -0.5."""
    model = _TiedByStorage(one_parameter=False)
    with pytest.raises(ValueError, match=r"^emb and out share memory .* tie them as one Parameter"):
        build_optimizer(model, ALL_OFF, optimizer="sgd", lr=0.5)
    for kind in (MixedPrecisionOptimizer, ShardedOptimizer):
        with pytest.raises(ValueError, match=r"^param\[0\] and param\[1\] share memory"):
            kind([model.emb, model.out], OFF, inner=inner_factory("sgd", lr=0.5))
    assert model.emb.data_ptr() == model.out.data_ptr()  # still tied
    tied, reference = _TiedByStorage(one_parameter=True), _TiedByStorage(one_parameter=False)
    optimizer = build_optimizer(tied, ALL_OFF, optimizer="sgd", lr=0.5)
    torch_sgd = torch.optim.SGD(reference.parameters(), lr=0.5)
    tied().backward()
    reference().backward()
    optimizer.step()
    torch_sgd.step()
    assert torch.equal(tied.out.detach(), reference.out.detach()), (tied.out, reference.out)
    assert torch.equal(reference.emb.detach(), torch.full((4,), -0.5))


@pytest.mark.parametrize("kind", [MixedPrecisionOptimizer, ShardedOptimizer], ids=["mixed", "sharded"])
def test_a_param_name_fn_giving_two_parameters_one_name_is_refused_not_saved_as_one(kind: type) -> None:
    """State dicts are keyed by ``param_name_fn``: one name for two parameters saved the second's main copy (1.7)
    for both, and a load gave it to the first too (0.9 is its own)."""

    def two_parameters() -> list[nn.Parameter]:
        return [nn.Parameter(torch.full((2,), value, dtype=torch.bfloat16)) for value in (1.0, 2.0)]

    with pytest.raises(ValueError, match=r"param_name_fn names param\[0\] and param\[1\] both 'weight'"):
        kind(two_parameters(), OFF, inner=inner_factory("sgd", lr=0.1), param_name_fn=lambda p: "weight")
    params = two_parameters()
    names = {id(param): f"layer{index}.weight" for index, param in enumerate(params)}
    optimizer = kind(params, OFF, inner=inner_factory("sgd", lr=0.1), param_name_fn=lambda p: names[id(p)])
    (params[0].float().sum() + 3 * params[1].float().sum()).backward()
    optimizer.step()
    fresh = two_parameters()
    fresh_names = {id(param): f"layer{index}.weight" for index, param in enumerate(fresh)}
    loaded = kind(fresh, OFF, inner=inner_factory("sgd", lr=0.1), param_name_fn=lambda p: fresh_names[id(p)])
    loaded.load_state_dict(optimizer.state_dict())
    expected = {"layer0.weight": 1.0 - 0.1 * 1.0, "layer1.weight": 2.0 - 0.1 * 3.0}  # SGD by hand, float64
    saved = loaded.state_dict()
    pieces = saved["main_params"] if kind is MixedPrecisionOptimizer else {
        name: shard["main"] for name, shard in saved["shards"].items()
    }
    for name, value in expected.items():
        assert pieces[name].tolist() == pytest.approx([value] * 2, rel=1e-6), (name, pieces[name])


@pytest.mark.parametrize("kind", [MixedPrecisionOptimizer, ShardedOptimizer], ids=["mixed", "sharded"])
def test_grads_model_zero_grad_detached_are_refused_by_the_statistics_and_step_not_read_as_zeros(kind: type) -> None:
    """``model.zero_grad()`` (torch's default sets ``.grad`` to None) detaches the grads from the flat buffer, which
    only ``sync_grads`` looked for: a loop without it (one replica) read a norm of 0.0 (2.83 is right) and stepped
    nothing, every step."""
    model = _linear()
    optimizer = kind(list(model.parameters()), OFF, inner=inner_factory("sgd", lr=0.5))
    before = [p.detach().clone() for p in model.parameters()]
    model.zero_grad()
    model(torch.ones(1, 3)).sum().backward()
    detached = r"^weight.grad is no longer a view of the optimizer's grad buffer|^param\[0\].grad is no longer a view"
    for use in ("get_grad_norm", "count_zeros", "step"):
        with pytest.raises(RuntimeError, match=detached):
            getattr(optimizer, use)()
    with pytest.raises(RuntimeError, match=detached):
        optimizer.clip_grad_norm(1.0)
    assert all(torch.equal(p.detach(), b) for p, b in zip(model.parameters(), before, strict=True))
    # Zeroed by the optimizer, the grads stay in its buffer: the norm and step are torch's.
    model, reference = _linear(), _linear().double()
    optimizer = kind(list(model.parameters()), OFF, inner=inner_factory("sgd", lr=0.5))
    optimizer.zero_grad()
    model(torch.ones(1, 3)).sum().backward()
    reference(torch.ones(1, 3, dtype=torch.float64)).sum().backward()
    expected = torch.cat([p.grad.flatten() for p in reference.parameters()]).norm()
    assert float(optimizer.get_grad_norm()) == pytest.approx(float(expected), rel=1e-6)
    optimizer.step()
    for param, oracle in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.allclose(param.detach().double(), oracle.detach() - 0.5 * oracle.grad, atol=1e-6)


@pytest.mark.parametrize("kind", [MixedPrecisionOptimizer, ShardedOptimizer], ids=["mixed", "sharded"])
def test_a_grad_assigned_by_hand_to_a_bf16_parameter_is_refused_not_left_out(kind: type) -> None:
    """A bf16 parameter's grad reaches the float32 buffer through a hook on backward's accumulation; a ``.grad``
    assigned by hand (grads from ``torch.autograd.grad``, or loaded) never reached it: the norm read 0.0 for
    the grads' 1.41 and the step moved nothing, without a word."""
    model = _linear(torch.bfloat16)
    optimizer = kind(list(model.parameters()), OFF, inner=inner_factory("sgd", lr=0.5))
    before = [p.detach().clone() for p in model.parameters()]
    grads = [torch.full_like(p, 0.5) for p in model.parameters()]  # 8 elements of 0.5: a norm of sqrt(2)
    for param, grad in zip(model.parameters(), grads, strict=True):
        param.grad = grad.clone()
    assigned = r"^param\[0\]\.grad is set, but this optimizer takes a torch.bfloat16 parameter's grad .*\.main_grad"
    for use in ("get_grad_norm", "count_zeros", "sync_grads", "step"):
        with pytest.raises(RuntimeError, match=assigned):
            getattr(optimizer, use)()
    with pytest.raises(RuntimeError, match=assigned):
        optimizer.clip_grad_norm(1.0)
    assert all(torch.equal(p.detach(), b) for p, b in zip(model.parameters(), before, strict=True))
    # Added to main_grad as the message says: the float64 oracle's norm, and SGD's step by hand.
    for param, grad in zip(model.parameters(), grads, strict=True):
        param.grad = None
        param.main_grad.add_(grad)  # type: ignore[attr-defined]
    expected = torch.cat([grad.double().flatten() for grad in grads]).norm()
    assert float(optimizer.get_grad_norm()) == pytest.approx(float(expected), rel=1e-6)
    optimizer.step()
    for param, start, grad in zip(model.parameters(), before, grads, strict=True):
        assert torch.equal(param.detach(), (start.double() - 0.5 * grad.double()).to(torch.bfloat16))


def _optimizers_of_a_fully_sharded_model() -> dict[str, str]:
    from torch.distributed.fsdp import fully_shard

    from pgregistry.mesh import to_device_mesh

    collection = registry.build(ParallelLayout(num_ranks=2))
    model = nn.Sequential(nn.Linear(4, 4))
    fully_shard(model, mesh=to_device_mesh(collection, ("dp_cp",), "cpu"))
    groups = setup_process_groups_for_optimizer(collection)
    out = {}
    for sharded in (False, True):
        try:
            build_optimizer(model, collection, optimizer="sgd", lr=0.1, sharded=sharded)
        except (TypeError, ValueError) as error:
            out[f"build_optimizer sharded={sharded}"] = f"{type(error).__name__}: {error}"
    for kind in (MixedPrecisionOptimizer, ShardedOptimizer):
        try:
            kind(list(model.parameters()), groups, inner=inner_factory("sgd", lr=0.1))
        except (TypeError, ValueError) as error:
            out[kind.__name__] = f"{type(error).__name__}: {error}"
    return out


def test_dtensor_parameters_of_fully_shard_are_refused_naming_them() -> None:
    """``fully_shard``'s parameters are DTensors, whose storage no flat buffer can take: every optimizer failed in
    torch's ``Attempted to access the data pointer on an invalid python storage``, naming no parameter."""
    for rank, out in enumerate(run_world(2, _optimizers_of_a_fully_sharded_model, timeout=60.0)):
        assert len(out) == 4, (rank, out)
        for call, error in out.items():
            name = "0.weight" if call.startswith("build_optimizer") else r"param\[0\]"
            assert re.fullmatch(
                rf"TypeError: {name} is a DTensor \(sharded by fully_shard or distribute_tensor\): this optimizer "
                r"keeps plain tensors in flat buffers\. Step such a model with a torch optimizer "
                r"\(torch\.optim\.AdamW\(model\.parameters\(\)\)\)",
                error,
            ), (rank, call, error)

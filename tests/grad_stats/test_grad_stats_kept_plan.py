"""The kept classification is never stale: every way it could go stale is made to happen, and each call still equals
the float64 oracle of the grads and roles of that moment.

The functional API classifies a model once and keeps it (``pgregistry/grad_stats/_plan.py``), checking each call
what the classification depends on: the parameter set (a parameter added, removed, or replaced behind the module's
back as ``fully_shard`` does; a submodule added or removed, also from a container that renumbers into a new
dictionary), the roles (marked with a helper, or set and changed as plain attributes as Megatron-Core does), the
grads (new storage, the same grad re-pointed at storage of another shape, grads set to None and freed, a dtype
change), the collection, and a list of tensors given instead of a model. The oracles are computed here from the grads
in float64, never by the code under test.
"""

from __future__ import annotations

import math
import weakref
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from pgregistry import ParallelLayout, ProcessGroupCollection, registry
from pgregistry.collection import FIELD_NAMES
from pgregistry.grad_stats import _plan as plans
from pgregistry.grad_stats import clip_grad_norm_, count_zeros, grad_norm, grad_norm_and_zeros
from pgregistry.grad_stats._compiled import steady_checks as compiled_checks
from pgregistry.params import mark_tensor_parallel
from pgregistry.testing import run_world

OFF = ProcessGroupCollection(**dict.fromkeys(FIELD_NAMES))


@pytest.fixture(autouse=True, params=["compiled", "python"])
def steady_checks(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test twice: with the compiled steady-state checks (pgregistry/grad_stats/_compiled.py) and with the Python
    ones, which run wherever those cannot be built. Each must see every way a plan goes stale."""
    if request.param == "python":
        monkeypatch.setattr(plans, "steady_checks", lambda: None)
    elif compiled_checks() is None:
        pytest.skip("the compiled checks are not built here (PGREGISTRY_COMPILED_CHECKS, or no compiler or ninja)")
    return str(request.param)


def _fill(tensor: torch.Tensor, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(tensor.shape, generator=generator, dtype=torch.float64)
    values[torch.rand(tensor.shape, generator=generator) < 0.3] = 0.0
    return values.to(tensor.dtype)


def _oracle(grads: list[torch.Tensor]) -> tuple[float, int]:
    flat = torch.cat([grad.double().reshape(-1) for grad in grads]) if grads else torch.zeros(0, dtype=torch.float64)
    return float(flat.norm()), int((flat == 0).sum())


def _model() -> nn.Module:
    model = nn.Module()
    model.a = nn.Linear(4, 3)
    model.b = nn.Linear(3, 2)
    for seed, param in enumerate(model.parameters()):
        param.grad = _fill(param, seed)
    return model


def _stats(params: Any, collection: ProcessGroupCollection = OFF) -> tuple[float, int]:
    norm, zeros = grad_norm_and_zeros(params, collection)
    assert float(grad_norm(params, collection)) == pytest.approx(float(norm), rel=1e-7)
    assert count_zeros(params, collection) == int(zeros)
    return float(norm), int(zeros)


def _check(params: Any, grads: list[torch.Tensor], what: str) -> None:
    norm, zeros = _oracle(grads)
    got = _stats(params)
    assert got[0] == pytest.approx(norm, rel=1e-6), what
    assert got[1] == zeros, what


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [param.grad for param in model.parameters() if param.grad is not None]


def test_a_changed_parameter_set_is_seen() -> None:
    model = _model()
    _check(model, _grads(model), "first call")
    model.extra = nn.Parameter(torch.zeros(5))
    model.extra.grad = _fill(model.extra, 10)
    _check(model, _grads(model), "a parameter added")
    del model.extra
    _check(model, _grads(model), "a parameter removed")
    replacement = nn.Parameter(torch.zeros(6, 4))
    replacement.grad = _fill(replacement, 11)
    model.a._parameters["weight"] = replacement  # behind the module's back, as fully_shard does
    _check(model, _grads(model), "a parameter replaced in the module's dictionary")
    model.c = nn.Linear(2, 2)
    for seed, param in enumerate(model.c.parameters(), start=12):
        param.grad = _fill(param, seed)
    _check(model, _grads(model), "a submodule added")
    inner = nn.Linear(1, 7)  # made before the next call: making a module registers parameters, which is seen
    for seed, param in enumerate(inner.parameters(), start=14):
        param.grad = _fill(param, seed)
    del model.c
    _check(model, _grads(model), "a submodule removed")
    model.a._modules["inner"] = inner  # a submodule behind the module's back, into a dictionary that was empty
    _check(model, _grads(model), "a submodule registered in the module's dictionary")


def test_a_parameter_removed_or_added_at_the_end_of_the_parameter_set_is_seen() -> None:
    """The kept plan compares what the modules' dictionaries hold with what they held as one stream of objects,
    the parameter dictionaries after the child dictionaries, module after module, and compares the streams' ends
    too: the last module's last parameter removed, or a parameter added after it, changes no object before it."""
    model = _model()
    _check(model, _grads(model), "first call")
    assert list(model.modules())[-1] is model.b and list(model.b._parameters)[-1] == "bias", "the stream's end"
    del model.b.bias
    _check(model, [model.a.weight.grad, model.a.bias.grad, model.b.weight.grad], "the last parameter removed")
    model.b.extra = nn.Parameter(torch.zeros(3))
    model.b.extra.grad = _fill(model.b.extra, 16)
    _check(model, _grads(model), "a parameter added after the last")


def test_containers_that_renumber_into_a_new_dictionary_are_seen() -> None:
    """Deleting from a ``ModuleList`` or ``Sequential`` renumbers the rest into a new dictionary; the kept plan holds
    the old one, which torch changed first: the next call sees the new parameter set, and so does every call after."""
    model = nn.Module()
    model.layers = nn.ModuleList(nn.Linear(3, 3) for _ in range(4))
    model.stack = nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 2), nn.Linear(2, 1))
    for seed, param in enumerate(model.parameters(), start=30):
        param.grad = _fill(param, seed)
    _check(model, _grads(model), "first call")
    del model.layers[1]
    _check(model, _grads(model), "a layer deleted from a ModuleList")
    del model.stack[0]
    _check(model, _grads(model), "a layer deleted from a Sequential")
    model.layers.insert(0, model.stack.pop(0))  # a layer moved from one container to the other
    _check(model, _grads(model), "a layer moved between containers")
    model.layers.pop(-1)
    _check(model, _grads(model), "a layer popped after the renumbered dictionaries were kept")


def test_changed_grads_are_seen() -> None:
    model = _model()
    _check(model, _grads(model), "first call")
    weight = model.a.weight
    weight.grad = _fill(weight, 20)  # new storage
    _check(model, _grads(model), "a grad with new storage")
    weight.grad.mul_(3.0)  # new values in the same storage
    _check(model, _grads(model), "new values in place")
    weight.data = torch.zeros(2, 4)  # a new shape for the parameter and (below) for the same grad object
    grad = weight.grad
    grad.data = _fill(torch.zeros(2, 4), 21)
    assert weight.grad is grad
    _check(model, _grads(model), "the same grad object re-pointed at storage of another shape")
    model.b.bias.grad = None
    _check(model, _grads(model), "a grad set to None")
    model.b.bias.grad = _fill(model.b.bias, 22)
    _check(model, _grads(model), "a grad back")
    model.double()
    assert model.b.weight.grad.dtype == torch.float64
    _check(model, _grads(model), "every grad converted to float64 in place")
    # A stale plan would still say float32: the host reads the grads as they are (and the 2-norm accumulates in
    # float64 whatever their dtype), so the norm's dtype is what shows it.
    assert grad_norm(model, OFF).dtype == torch.float64
    for param in model.parameters():
        param.grad = None
    _check(model, [], "no grads at all")


def test_the_kept_reads_keep_no_grad_alive() -> None:
    """A call whose grads are the objects its reads were planned for skips their types and sizes; the plan notes
    those objects weakly, so a grad a training loop sets to None is freed at once (its memory is the loop's), and
    each call still reads the grads as they are."""
    model = _model()
    _check(model, _grads(model), "first call")
    _check(model, _grads(model), "the same grad objects")
    model.a.weight.grad.mul_(2.0)
    _check(model, _grads(model), "the same grad objects, new values")
    freed = weakref.ref(model.b.bias.grad)
    model.b.bias.grad = None
    assert freed() is None, "the kept plan keeps a grad alive"
    _check(model, _grads(model), "a grad set to None")
    model.b.bias.grad = _fill(model.b.bias, 23)
    _check(model, _grads(model), "a new grad object")


def test_a_grad_moved_in_place_and_requires_grad_toggled_are_seen() -> None:
    """The same grad object pointed at other storage by ``set_`` (not ``.data =``) is read where it is now; a
    parameter whose ``requires_grad`` is turned off keeps its grad, which counts as torch's clip counts it, until
    the grad is set to None."""
    model = _model()
    _check(model, _grads(model), "first call")
    grad = model.b.weight.grad
    grad.set_(_fill(torch.zeros(2, 3), 24).untyped_storage(), 0, grad.shape, grad.stride())
    assert model.b.weight.grad is grad
    _check(model, _grads(model), "the same grad object moved by set_")
    model.a.bias.requires_grad_(False)
    _check(model, _grads(model), "requires_grad turned off, the grad kept")
    model.a.bias.grad = None
    _check(model, _grads(model), "that grad set to None")
    model.a.bias.requires_grad_(True)
    model.a.bias.grad = _fill(model.a.bias, 25)
    _check(model, _grads(model), "requires_grad back on, a grad again")


def test_grads_replaced_every_call_are_read_where_they_are() -> None:
    """A loop that replaces its grads before every call (``zero_grad(set_to_none=True)``, or new grad objects over
    the same storage) is read right at every call, whether its plan for those grad objects is made again at that
    call or not (1, 2, 4, ... calls in a row)."""
    model = _model()
    for step in range(9):
        for seed, param in enumerate(model.parameters(), start=100 + 10 * step):
            if step % 2:  # a new object over the same storage, new values in it
                param.grad = param.grad.view(param.grad.shape).copy_(_fill(param, seed))
            else:  # a new grad, the old one freed
                param.grad = None
                param.grad = _fill(param, seed)
        _check(model, _grads(model), f"step {step}")
    for seed, param in enumerate(model.parameters(), start=200):
        param.grad.copy_(_fill(param, seed))  # then kept: the same objects, new values
        _check(model, _grads(model), f"kept grads, {param.shape}")


def test_grads_planned_for_before_a_new_plan_are_not_taken_by_it() -> None:
    """Grads replaced at new addresses every call are planned for again after 1, 2, 4, ... calls in a row only, while
    the reads are planned anew at every such call. The grads planned for before a call that plans the reads anew
    must be dropped then: kept alive by the loop and given back later at their addresses, they would be read by
    reads planned for other pieces (on a GPU, the one-read kernel's launch table holds each piece's address and
    size). On the CPU a read by another piece's plan still sums what it is given, so the plan's record is checked
    too: after every call, the grads it names are those its reads were planned for (their addresses and sizes)."""
    from pgregistry.grad_stats._plan import _KEPT

    def call(what: str) -> None:
        grads = _grads(model)
        assert float(grad_norm(model, OFF)) == pytest.approx(_oracle(grads)[0], rel=1e-6), what
        layout = _KEPT[model].plan._layout
        assert layout is not None and layout.facts is not None
        planned = layout.planned_for
        if planned is not None:
            assert planned.addresses == layout.facts[0::3], f"{what}: names grads its reads were not planned for"

    model = _model()
    call("first call")
    weight = model.a.weight
    held = []
    for step in range(2):  # new grads at new addresses: calls 1 and 2 in a row plan the reads and the grads anew
        for seed, param in enumerate(model.parameters(), start=300 + 10 * step):
            param.grad = _fill(param, seed)
        held.append({name: param.grad for name, param in model.named_parameters()})
        call(f"new grads {step}")
    old_data = weight.data
    weight.data = torch.zeros(5, 4)  # a weight and grad of another size: the 3rd call in a row plans its reads anew
    for seed, param in enumerate(model.parameters(), start=400):
        param.grad = _fill(param, seed)
    call("grads of another size, 3 calls in a row")
    weight.data = old_data
    for name, param in model.named_parameters():  # the grads planned for at the 2nd call, back where they were
        param.grad = held[-1][name]
    call("the grads planned for before the last plan, given back")


def _replace_grads(model: nn.Module, seed: int) -> list[torch.Tensor]:
    """New grad objects for every parameter; the old ones returned (kept alive: the new are at new addresses)."""
    old = _grads(model)
    for offset, param in enumerate(model.parameters()):
        param.grad = _fill(param, seed + offset)
    return old


def _check_clip(model: nn.Module, what: str) -> None:
    """The clip to half the norm returns the oracle's norm and leaves the grads scaled by half (float64 oracle)."""
    before = [grad.to(torch.float64, copy=True) for grad in _grads(model)]  # a float64 grad too
    norm = _oracle(before)[0]
    got = clip_grad_norm_(model, norm / 2, OFF)
    assert float(got) == pytest.approx(norm, rel=1e-6), what
    for grad, old in zip(_grads(model), before, strict=True):
        torch.testing.assert_close(grad.double(), old * (norm / 2) / (norm + 1e-6), rtol=1e-5, atol=1e-7)


def _counting_groupings(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the calls of ``_plan._group_into_kinds`` (the full plan of the reads' kinds) from now on."""
    from pgregistry.grad_stats import _plan

    calls: list[int] = []
    group = _plan._group_into_kinds

    def counted(*args: Any) -> Any:
        calls.append(1)
        return group(*args)

    monkeypatch.setattr(_plan, "_group_into_kinds", counted)
    return calls


def test_new_grads_at_new_addresses_keep_the_kinds(monkeypatch: pytest.MonkeyPatch) -> None:
    """New grad objects of the same sizes, shapes, dtypes and devices at new addresses (``zero_grad``'s default,
    then a backward) change only what depends on the addresses: the kinds and host blocks are kept, not grouped
    again, and every statistic and the clip are the float64 oracle's."""
    from pgregistry.grad_stats._plan import _KEPT

    model = _model()
    _check(model, _grads(model), "first call")
    _check_clip(model, "first clip")
    groupings = _counting_groupings(monkeypatch)
    held = []
    for step in range(4):  # calls 1, 2, 3, 4 in a row: the grads planned for again at 1, 2 and 4
        held.append(_replace_grads(model, 500 + 10 * step))
        layout = _KEPT[model].plan._layout
        assert layout is not None and layout.facts is not None
        facts_before = list(layout.facts)
        _check(model, _grads(model), f"new grads at new addresses, step {step}")
        _check_clip(model, f"new grads at new addresses, step {step}, clip")
        assert layout.facts != facts_before, "the grads came at their predecessors' addresses: nothing tested"
    assert not groupings, "grads at new addresses, nothing else changed, grouped into kinds again"


@pytest.mark.parametrize(
    ("what", "bias"),
    [
        ("float64", torch.zeros(3, dtype=torch.float64)),  # as Module.double() would, for one parameter
        ("of shape (3, 1)", torch.zeros(3, 1)),  # read with the other bias (1-D) before: one host block
    ],
    ids=["dtype", "shape"],
)
def test_a_new_grad_of_another_dtype_or_shape_is_planned_in_full(
    monkeypatch: pytest.MonkeyPatch, what: str, bias: torch.Tensor
) -> None:
    """A new grad of another dtype or another shape, with the same element count, at a new address differs from
    the one before only in its address by the facts a call reads each time (addresses, element counts,
    contiguity): the kinds must be planned in full, or the grad would be read as the old dtype (the norm in
    float32 where a grad is float64) or concatenated with tensors of another trailing shape."""
    model = _model()
    _check(model, _grads(model), "first call")
    groupings = _counting_groupings(monkeypatch)
    model.a.bias.data = bias
    held = _replace_grads(model, 600)
    assert model.a.bias.grad.dtype == bias.dtype and model.a.bias.grad.shape == bias.shape
    _check(model, _grads(model), f"one grad {what}, the same element count, at a new address")
    assert groupings, "not planned in full"
    _check_clip(model, f"one grad {what}, clip")
    norm_dtype = torch.float64 if bias.dtype == torch.float64 else torch.float32
    assert grad_norm(model, OFF).dtype == norm_dtype, "the grads read as dtypes they no longer have"
    assert held


def test_a_new_grad_of_another_trailing_shape_with_as_many_dims_is_planned_in_full(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two weights of one trailing shape are read on the host as one block (concatenated along dim 0); a new grad
    of one of them at a new address with another trailing shape and as many dims, the same element count, differs
    from the one before in its address only by the facts a call reads each time: its shape must be compared (each
    dim, not the number of dims), or the kept block concatenates it with the other weight and the call raises."""
    model = nn.Module()
    model.a, model.b = nn.Linear(4, 3), nn.Linear(4, 2)  # weights (3, 4) and (2, 4): one block
    for seed, param in enumerate(model.parameters()):
        param.grad = _fill(param, seed)
    _check(model, _grads(model), "first call")
    groupings = _counting_groupings(monkeypatch)
    model.a.weight.data = torch.zeros(6, 2)
    held = _replace_grads(model, 700)
    _check(model, _grads(model), "one weight's grad of another trailing shape, as many dims, at a new address")
    assert groupings, "not planned in full"
    assert held


def test_a_tensor_made_over_a_dead_grads_memory_is_not_the_planned_grad() -> None:
    """A grad object freed and another tensor made over its storage is at its address (and CPython may give it the
    freed object's id and memory too): that tensor is not the planned grad."""
    from pgregistry.grad_stats._plan import _Planned

    grads = [_fill(torch.zeros(4, 3), 26), _fill(torch.zeros(5), 27)]
    planned = _Planned.of(grads, grads)
    assert planned.pieces_of(list(grads), list) == grads, "the planned grads themselves"
    storage = grads[0].untyped_storage()
    del grads[0]  # freed: its weak reference's callback notes it
    other = torch.empty(0).set_(storage, 0, (4, 3), (1, 4))  # its memory, other strides
    assert planned.pieces_of([other, grads[0]], list) is None, "a tensor over a dead grad's memory taken for it"


def test_a_parameter_whose_planned_grad_was_freed_and_set_to_none_is_not_read_as_planned() -> None:
    """A planned grad freed when its parameter's grad is set to None: its weak reference then gives None too, so
    the identity alone would take the None for the planned grad; the death noted is what refuses it."""
    from pgregistry.grad_stats._plan import _Planned

    first, second = _fill(torch.zeros(4, 3), 28), _fill(torch.zeros(5), 29)
    planned = _Planned.of([first, second], [first, second])
    freed = weakref.ref(first)
    del first  # the first parameter's grad set to None: freed
    assert freed() is None
    assert planned.pieces_of([None, second], list) is None, "a parameter without its freed grad read as planned"


def test_a_parameter_that_had_no_grad_and_has_one_now_is_not_read_as_planned() -> None:
    """The plan records the parameters that had no grad: one that has a grad now is not skipped as planned."""
    from pgregistry.grad_stats._plan import _make_picker, _Planned

    grads: list[torch.Tensor | None] = [_fill(torch.zeros(4, 3), 30), None]
    take_plain = _make_picker([0], 2)
    planned = _Planned.of(grads, take_plain(grads))
    assert planned.pieces_of(list(grads), take_plain) == grads[:1], "the planned grads themselves"
    grads[1] = _fill(torch.zeros(5), 31)
    assert planned.pieces_of(grads, take_plain) is None, "a new grad where there was none skipped"


def test_a_new_grad_at_the_address_of_its_live_planned_grad_is_read_as_it_is() -> None:
    """A new grad object at the address of the planned grad it replaces, which stays alive (no death noted): a view
    of the same buffer with another shape. Only the identity check tells it from the planned grad (on the CPU, the
    plan's host block would concatenate it with the other bias as the 1-dim tensor it was)."""
    from pgregistry.grad_stats._plan import _KEPT

    model = _model()
    buffer = _fill(torch.zeros(4), 40)
    bias = model.a.bias
    bias.grad = buffer[:3]
    _check(model, _grads(model), "first call")
    _check(model, _grads(model), "the planned grads")
    layout = _KEPT[model].plan._layout
    assert layout is not None and layout.planned_for is not None, "the grads planned for are recorded"
    planned_grad = bias.grad
    bias.data = torch.zeros(2, 2)
    bias.grad = buffer.view(2, 2)
    assert bias.grad.data_ptr() == planned_grad.data_ptr()
    _check(model, _grads(model), "a new grad at its live planned grad's address, another shape")


def test_a_list_of_tensors_is_checked_by_identity() -> None:
    model = _model()
    params = list(model.parameters())
    _check(params, _grads(model), "a list")
    _check(list(model.parameters()), _grads(model), "a new list of the same tensors")
    other = nn.Parameter(torch.zeros(3))
    other.grad = _fill(other, 30)
    _check([*params[:-1], other], [p.grad for p in params[:-1]] + [other.grad], "one tensor swapped")
    _check(params[::-1], _grads(model)[::-1], "the same tensors in another order")
    _check({"w": params[0], "b": params[1]}, [params[0].grad, params[1].grad], "a mapping")


def test_a_role_set_as_an_attribute_is_seen_whatever_the_parameter_held_before() -> None:
    """The plan compares the roles only of parameters that had a role when it was made; it holds the others to
    having no attributes (those that had none) or no role among their attributes: a role on a parameter that had
    no attributes, a role in the place of another attribute (their count unchanged) and a role's value changed
    are each seen (``shared`` copies are never counted)."""
    model = _model()
    _check(model, _grads(model), "first call")
    model.a.weight.shared = True  # the first attribute of a parameter that had none
    _check(model, [model.a.bias.grad, model.b.weight.grad, model.b.bias.grad], "a role on a bare parameter")
    model.b.bias.note = "a plain attribute"
    _check(model, [model.a.bias.grad, model.b.weight.grad, model.b.bias.grad], "an attribute that is no role")
    del model.b.bias.note
    model.b.bias.shared = True  # in the place of the other attribute: the count is the same
    _check(model, [model.a.bias.grad, model.b.weight.grad], "a role in the place of another attribute")
    model.a.weight.shared = False  # a role's value changed
    _check(model, [model.a.weight.grad, model.a.bias.grad, model.b.weight.grad], "a role's value changed")


def test_a_role_changed_past_the_first_block_of_marked_parameters_is_seen() -> None:
    """The plan reads the roles block by block of parameters that carry one (``_ROLE_BLOCK`` of them): on a model
    whose every parameter is marked, as Megatron's TP layers mark theirs, a role added to and then changed on the
    last parameter, in the last block, is seen (``shared`` copies are never counted)."""
    from pgregistry.grad_stats._plan import _ROLE_BLOCK

    model = nn.Module()
    model.params = nn.ParameterList(nn.Parameter(torch.zeros(3)) for _ in range(2 * _ROLE_BLOCK + 3))
    for seed, param in enumerate(model.parameters(), start=300):
        param.grad = _fill(param, seed)
        param.tensor_model_parallel = True
    grads = _grads(model)
    _check(model, grads, "every parameter marked")
    last = model.params[-1]
    last.shared = True  # a role the last parameter did not carry
    _check(model, grads[:-1], "the last parameter a shared copy")
    last.shared = False  # that role's value changed
    _check(model, grads, "the last parameter no longer a shared copy")


def test_clipping_twice_clips_from_the_current_grads() -> None:
    model = _model()
    norm = _oracle(_grads(model))[0]
    assert float(clip_grad_norm_(model, norm / 2, OFF)) == pytest.approx(norm, rel=1e-6)
    assert _oracle(_grads(model))[0] == pytest.approx(norm / 2, rel=1e-5)
    model.a.weight.grad = model.a.weight.grad * 4  # new storage after the first clip
    norm = _oracle(_grads(model))[0]
    assert float(clip_grad_norm_(model, 1.0, OFF)) == pytest.approx(norm, rel=1e-6)
    assert _oracle(_grads(model))[0] == pytest.approx(1.0, rel=1e-5)


# -------------------------------------------------------------------------------------- roles and collections


def _tp_world_states() -> list[tuple[str, float]]:
    """Rank r of a TP-2 world: ``w`` is replicated (the same grad on both ranks, counted on TP rank 0 only unless
    its roles say otherwise), ``s`` is TP-sharded (a distinct grad per rank, counted on both)."""
    collection = registry.build(ParallelLayout(num_ranks=2, tp=2))
    dp_only = registry.build(ParallelLayout(num_ranks=2), name="dp only")
    model = nn.Module()
    model.w = nn.Parameter(torch.zeros(4, 3))
    model.s = mark_tensor_parallel(nn.Parameter(torch.zeros(2, 3)), 0)
    model.w.grad = _fill(model.w, 40)
    model.s.grad = _fill(model.s, 41 + dist.get_rank())
    norms: list[tuple[str, float]] = []

    def record(what: str, collection: ProcessGroupCollection = collection) -> None:
        norms.append((what, float(grad_norm(model, collection))))

    record("first call")
    mark_tensor_parallel(model.w, 1)  # with the helper
    record("w marked TP-sharded with the helper")
    model.w.tensor_model_parallel = False  # an existing role changed as a plain attribute
    record("w's tensor_model_parallel set to False as an attribute")
    model.w.shared = True  # a new role as a plain attribute (Megatron-Core's tied copies)
    record("w marked shared as an attribute")
    del model.w.shared
    record("w's shared mark removed")
    record("another collection: TP off", dp_only)
    return norms


def _tp_world_oracle(rank: int) -> dict[str, float]:
    w = _fill(torch.zeros(4, 3), 40).double()
    s = [_fill(torch.zeros(2, 3), 41 + r).double() for r in (0, 1)]

    def with_w(times: int) -> float:
        return math.sqrt(float(times * w.square().sum() + sum(part.square().sum() for part in s)))

    return {
        "first call": with_w(1),
        "w marked TP-sharded with the helper": with_w(2),
        "w's tensor_model_parallel set to False as an attribute": with_w(1),
        "w marked shared as an attribute": with_w(0),
        "w's shared mark removed": with_w(1),
        # TP off: each rank counts what it holds, nothing is summed across ranks.
        "another collection: TP off": math.sqrt(float(w.square().sum() + s[rank].square().sum())),
    }


def test_changed_roles_and_collections_are_seen() -> None:
    for rank, norms in enumerate(run_world(2, _tp_world_states, timeout=60)):
        oracle = _tp_world_oracle(rank)
        for what, got in norms:
            assert got == pytest.approx(oracle[what], rel=1e-6), (rank, what)


def _dtensor_states() -> list[tuple[str, float]]:
    """A DTensor grad whose placement changes between calls: Shard(0) over the data-parallel mesh (summed over
    it), then Replicate (each replica counts its own copy)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from pgregistry.mesh import to_device_mesh

    collection = registry.build(ParallelLayout(num_ranks=2))
    mesh = to_device_mesh(collection, ("dp_cp",), device_type="cpu")
    rank = dist.get_rank()
    model = nn.Module()
    model.d = nn.Parameter(DTensor.from_local(torch.zeros(2, 3), mesh, [Shard(0)], run_check=False))
    model.p = nn.Parameter(torch.zeros(5))
    model.p.grad = _fill(model.p, 50)
    norms = []
    for what, rows, placement in (("sharded", 2, Shard(0)), ("replicated", 4, Replicate())):
        local = _fill(torch.zeros(rows, 3), 51 + rank)
        model.d.grad = DTensor.from_local(local, mesh, [placement], run_check=False)
        norms.append((what, float(grad_norm(model, collection))))
    return norms


def test_a_changed_dtensor_placement_is_seen() -> None:
    p = _fill(torch.zeros(5), 50).double().square().sum()
    pieces = [_fill(torch.zeros(2, 3), 51 + r).double().square().sum() for r in (0, 1)]
    copies = [_fill(torch.zeros(4, 3), 51 + r).double().square().sum() for r in (0, 1)]
    for rank, norms in enumerate(run_world(2, _dtensor_states, timeout=60)):
        got = dict(norms)
        # Sharded: the pieces are summed over dp; p is each rank's own (dp replicas are not summed).
        assert got["sharded"] == pytest.approx(math.sqrt(float(p + pieces[0] + pieces[1])), rel=1e-6), rank
        assert got["replicated"] == pytest.approx(math.sqrt(float(p + copies[rank])), rel=1e-6), rank


def _expert_module_marked_later() -> tuple[float, str]:
    """At EP 2: a first call, then the module marked as holding experts (its parameter unclassified)."""
    from fixtures.errors import value_error_of

    from pgregistry.params import mark_expert_module

    collection = registry.build(ParallelLayout(num_ranks=2, ep=2, expt_tp=1))
    model = nn.Module()
    model.experts = nn.Linear(3, 2, bias=False)
    model.experts.weight.grad = _fill(model.experts.weight, 60)
    first = float(grad_norm(model, collection))
    mark_expert_module(model.experts)
    return first, value_error_of(lambda: grad_norm(model, collection))


def test_an_expert_module_marked_after_a_call_is_checked() -> None:
    norm = float(_fill(torch.zeros(2, 3), 60).double().norm())
    for first, error in run_world(2, _expert_module_marked_later, timeout=60):
        assert first == pytest.approx(norm, rel=1e-6)
        assert "carry no EP classification: experts.weight" in error, error

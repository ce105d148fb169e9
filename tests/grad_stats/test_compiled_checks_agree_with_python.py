"""The compiled steady-state checks (``pgregistry/grad_stats/_compiled.py``) answer as the Python ones do.

Each case makes a kept plan of a small model, changes one thing a plan depends on (or nothing, or something it does
not depend on), then asks both the compiled checks and the Python ones, on the same kept plan, whether the parameter
set, the roles and the planned grads are still those the plan was made for. The expected answers are written per
case from what changed; both checks must give them. ``tests/grad_stats/test_grad_stats_kept_plan.py`` runs the
whole path under each of the two against float64 oracles.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from pgregistry import ProcessGroupCollection
from pgregistry.collection import FIELD_NAMES
from pgregistry.grad_stats import _plan as plans
from pgregistry.grad_stats import grad_norm
from pgregistry.grad_stats._compiled import steady_checks

OFF = ProcessGroupCollection(**dict.fromkeys(FIELD_NAMES))



@pytest.fixture(autouse=True)
def _skip_without_compiled_checks() -> None:
    if steady_checks() is None:
        pytest.skip("the compiled checks are not built here (PGREGISTRY_COMPILED_CHECKS, or no compiler or ninja)")


def _model() -> nn.Module:
    model = nn.Module()
    model.a = nn.Linear(4, 3)
    model.b = nn.Linear(3, 2)
    model.a.weight.tensor_model_parallel = True  # a role
    model.a.bias.note = "no role"  # attributes, none a role
    for param in model.parameters():
        param.grad = torch.ones_like(param)
    return model


def _set_grad_to_none(model: nn.Module) -> None:
    model.b.bias.grad = None


def _repoint_grad(model: nn.Module) -> None:
    grad = model.b.weight.grad
    assert grad is not None
    grad.data = torch.ones(3 * 2).reshape(2, 3)  # the same tensor object at other storage


class _RaisesOnCompare:
    def __eq__(self, other: object) -> bool:
        raise ArithmeticError("compared")

    __hash__ = None  # type: ignore[assignment]


CASES: dict[str, tuple[Callable[[nn.Module], Any], tuple[bool, bool, bool]]] = {
    # case: (change, (same parameter set, same roles, the planned grads))
    "nothing changed": (lambda model: None, (True, True, True)),
    "a parameter replaced": (
        lambda model: model.a._parameters.__setitem__("weight", nn.Parameter(torch.ones(3, 4))),
        (False, True, True),
    ),
    "the last parameter deleted": (lambda model: delattr(model.b, "bias"), (False, True, True)),
    "a parameter added to a module that held none": (
        lambda model: model.register_parameter("extra", nn.Parameter(torch.ones(1))),
        (False, True, True),
    ),
    "a submodule added to a leaf": (lambda model: model.b.add_module("c", nn.Linear(1, 1)), (False, True, True)),
    "a role on a bare parameter": (lambda model: setattr(model.b.weight, "shared", True), (True, False, True)),
    "a role on a parameter without one": (lambda model: setattr(model.a.bias, "allreduce", False), (True, False, True)),
    "a role's value changed": (
        lambda model: setattr(model.a.weight, "tensor_model_parallel", False),
        (True, False, True),
    ),
    "a role's value equal, another object": (
        lambda model: setattr(model.a.weight, "tensor_model_parallel", 1),
        (True, True, True),
    ),
    "a role removed": (lambda model: delattr(model.a.weight, "tensor_model_parallel"), (True, False, True)),
    "an attribute that is no role": (lambda model: setattr(model.a.bias, "other", 1), (True, True, True)),
    "a grad replaced": (lambda model: setattr(model.a.bias, "grad", torch.ones(3)), (True, True, False)),
    "a grad set to None": (_set_grad_to_none, (True, True, False)),
    "a grad re-pointed at other storage": (_repoint_grad, (True, True, False)),
}


def _kept(model: nn.Module) -> plans.Kept:
    grad_norm(model, OFF)
    grad_norm(model, OFF)  # the plan made, and its grads planned for
    kept = plans._KEPT[model]
    assert kept._checks is not None
    return kept


def _first_only(planned: plans._Planned) -> torch.Tensor:
    """A mask keeping the first planned piece only: where a read is the kernel's alone, the pieces after it are left
    out of the list, but every grad is still checked."""
    kept = torch.zeros(len(planned.references), dtype=torch.bool)
    kept[0] = True
    return kept


def _compiled_answers(kept: plans.Kept) -> tuple[bool, bool, bool]:
    layout = kept.plan._layout
    assert layout is not None and layout.planned_for is not None and layout.planned_for.checks is not None
    holders = kept._checks.same_holders(kept._empty_holders, kept._full_holders, kept._held)
    roles = kept._checks.same_roles(kept._bare, kept._roleless, kept._roled_blocks, plans.ROLE_KEYS, kept._roles)
    pieces, _ = layout.planned_for.pieces_from(kept.params, layout.take_plain)
    masked, _ = layout.planned_for.pieces_from(kept.params, layout.take_plain, _first_only(layout.planned_for))
    assert (masked is None) == (pieces is None), "the check with a mask answered otherwise than without"
    return holders, roles, pieces is not None


def _python_answers(kept: plans.Kept) -> tuple[bool, bool, bool]:
    layout = kept.plan._layout
    assert layout is not None and layout.planned_for is not None
    holders = plans._all_empty(kept._empty_holders) and plans._same_stream(kept._current_holder_contents(), kept._held)
    roles = (
        plans._all_empty(kept._bare)
        and all(map(plans._NO_ROLE, kept._roleless))
        and kept._role_values() == kept._roles
    )
    pieces = layout.planned_for.pieces_of(plans._grads_of(kept.params), layout.take_plain)
    return holders, roles, pieces is not None


@pytest.mark.parametrize("case", list(CASES), ids=[case.replace(" ", "-") for case in CASES])
def test_the_compiled_checks_answer_as_the_python_ones(case: str) -> None:
    change, expected = CASES[case]
    model = _model()
    kept = _kept(model)
    change(model)
    assert _python_answers(kept) == expected, "the Python checks (the case's expectation is wrong?)"
    assert _compiled_answers(kept) == expected


def test_the_planned_pieces_are_the_grads_themselves() -> None:
    model = _model()
    kept = _kept(model)
    layout = kept.plan._layout
    assert layout is not None and layout.planned_for is not None
    pieces, _ = layout.planned_for.pieces_from(kept.params, layout.take_plain)
    assert pieces is not None
    assert [id(piece) for piece in pieces] == [id(param.grad) for param in kept.params]


def test_a_mask_leaves_out_the_pieces_it_does_not_keep_at_their_positions() -> None:
    """With a mask, the list holds the kept pieces at their positions and None at the others'; without compiled
    checks (the Python check) every piece, mask or not. A mask of another length than the pieces is refused."""
    model = _model()
    kept = _kept(model)
    layout = kept.plan._layout
    assert layout is not None and layout.planned_for is not None
    planned = layout.planned_for
    grads = [param.grad for param in kept.params]
    for mask in ([True, False, False, True], [False] * 4, [True] * 4):
        pieces, _ = planned.pieces_from(kept.params, layout.take_plain, torch.tensor(mask))
        assert pieces is not None
        want = [id(grad) if keep else id(None) for grad, keep in zip(grads, mask, strict=True)]
        assert [id(piece) for piece in pieces] == want
    for wrong in (torch.ones(3, dtype=torch.bool), torch.ones(5, dtype=torch.bool)):
        with pytest.raises(ValueError, match="kept holds (fewer|more) entries than the planned pieces"):
            planned.pieces_from(kept.params, layout.take_plain, wrong)
    with pytest.raises(ValueError, match="kept must be a contiguous 1-dim bool or uint8 CPU tensor"):
        planned.pieces_from(kept.params, layout.take_plain, torch.ones(4))
    planned.checks = None  # the Python check: every piece
    pieces, _ = planned.pieces_from(kept.params, layout.take_plain, _first_only(planned))
    assert pieces is not None and [id(piece) for piece in pieces] == [id(grad) for grad in grads]


def test_an_error_raised_comparing_a_role_is_raised_as_in_python() -> None:
    model = _model()
    kept = _kept(model)
    model.a.weight.tensor_model_parallel = _RaisesOnCompare()
    with pytest.raises(ArithmeticError, match="compared"):
        kept._role_values() == kept._roles  # noqa: B015 - the Python check's comparison
    with pytest.raises(ArithmeticError, match="compared"):
        kept._same_roles()


def test_a_model_holding_a_dictionary_of_another_type_is_checked_in_python() -> None:
    """The compiled check walks a dictionary's entries in their order, which is an exact ``dict``'s iteration order
    only: a module whose parameters sit in another mapping type is checked in Python."""

    class Ordered(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.ones(2))
            self._parameters = type("Parameters", (dict,), {})(self._parameters)

    model = Ordered()
    model.weight.grad = torch.ones(2)
    grad_norm(model, OFF)
    assert plans._KEPT[model]._checks is None


def _pieces() -> list[torch.Tensor]:
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    return [
        base,
        base.t(),  # not contiguous
        base[1:, 2:],  # a view at an offset
        torch.zeros(0),  # no elements
        torch.ones(3, dtype=torch.bfloat16),
        torch.ones(2, 2, dtype=torch.float64),
        torch.ones(5, dtype=torch.complex64),
        torch.ones((), dtype=torch.int64),
    ]


@pytest.mark.parametrize("contiguity", [True, False])
def test_the_compiled_piece_facts_are_the_python_ones(contiguity: bool) -> None:
    pieces = _pieces()
    checks = steady_checks()
    assert checks is not None
    reads: list[Callable[[Any], Any]] = [torch.Tensor.data_ptr, torch.Tensor.numel, operator.attrgetter("dtype")]
    python = plans._facts_of(pieces, [*reads, *([torch.Tensor.is_contiguous] if contiguity else [])])
    assert checks.piece_facts(pieces, contiguity) == python
    assert checks.kind_facts(pieces) == plans._facts_of(pieces, plans._KIND_READS)
    assert [type(fact) for fact in checks.kind_facts(pieces)[1::2]] == [torch.Size] * len(pieces)


def _moved_kinds_in_python(pieces: list[torch.Tensor], moved: list[bool], held: list[Any]) -> bool:
    """The Python answer of the moved pieces' kinds, written here from its definition (no compiled pass)."""
    return all(
        (piece.device, piece.shape) == (held[2 * index], held[2 * index + 1])
        for index, (piece, flagged) in enumerate(zip(pieces, moved, strict=True))
        if flagged
    )


def test_the_compiled_moved_kinds_are_the_python_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each moved piece's device and shape compared where they lie, against the kind facts of the plan: the same
    answer as the facts read and compared as lists, for the same pieces, another shape of the same size, another
    number of dims, another device; a piece not flagged as moved is not compared."""
    checks = steady_checks()
    assert checks is not None
    pieces = _pieces()
    held = plans._facts_of(pieces, plans._KIND_READS)
    every = [True] * len(pieces)
    cases: dict[str, tuple[list[torch.Tensor], list[bool]]] = {
        "the same pieces": (pieces, every),
        "another shape, same size": ([pieces[0].reshape(6, 4), *pieces[1:]], every),
        "another number of dims": ([*pieces[:4], pieces[4].reshape(1, 3), *pieces[5:]], every),
        "another device": ([*pieces[:5], torch.ones(2, 2, dtype=torch.float64, device="meta"), *pieces[6:]], every),
        "a scalar made a vector": ([*pieces[:7], torch.ones(1, dtype=torch.int64)], every),
        "another shape, not flagged": ([pieces[0].reshape(6, 4), *pieces[1:]], [False, *every[1:]]),
    }
    for case, (now, moved) in cases.items():
        want = _moved_kinds_in_python(now, moved, held)
        assert checks.same_kinds_where_moved(now, moved, held) is want, case
        assert plans._same_kinds_where_moved(now, moved, held) is want, case
    monkeypatch.setattr(plans, "steady_checks", lambda: None)  # the Python reads, where nothing is built
    for case, (now, moved) in cases.items():
        assert plans._same_kinds_where_moved(now, moved, held) is _moved_kinds_in_python(now, moved, held), case
    assert [_moved_kinds_in_python(now, moved, held) for now, moved in cases.values()] == [
        True, False, False, False, False, True]


class _Subclass(torch.Tensor):
    pass


def test_the_compiled_facts_leave_a_subclass_to_python_and_refuse_a_sparse_tensor_as_python_does() -> None:
    checks = steady_checks()
    assert checks is not None
    subclass = torch.ones(2).as_subclass(_Subclass)  # its __torch_function__ is the Python reads' to ask
    assert checks.piece_facts([torch.ones(1), subclass], True) is None
    assert checks.kind_facts([subclass]) is None
    assert checks.same_kinds_where_moved([subclass], [True], [subclass.device, subclass.shape]) is None
    assert checks.same_kinds_where_moved([subclass], [False], [subclass.device, subclass.shape]) is True  # not read
    sparse = torch.ones(2, 2).to_sparse()
    with pytest.raises(RuntimeError) as python:
        torch.Tensor.data_ptr(sparse)
    with pytest.raises(RuntimeError) as compiled:
        checks.piece_facts([sparse], False)
    assert str(compiled.value).split("\n")[0] == str(python.value).split("\n")[0]


def test_the_compiled_planned_rows_are_each_grads_tensor_and_data_address() -> None:
    checks = steady_checks()
    assert checks is not None
    grads = [*_pieces(), None]
    rows = checks.planned_rows(grads)
    assert rows.dtype == torch.int64 and rows.is_contiguous()
    want = [[0, 0] if grad is None else [grad._cdata, grad.data_ptr()] for grad in grads]
    assert rows.tolist() == want

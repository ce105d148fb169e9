"""A collection checks itself when built: field types, and composite groups against the axes they span.

Before these checks a collection held anything (``ProcessGroupCollection(tp=5, ep="oops")`` built, and its
``repr`` crashed), and a collection whose ``tp`` was ``None`` while its ``mp`` group spanned the 2 TP ranks gave a
grad norm of 2.83 instead of 2.0: both ranks counted the replicated grad as rank 0 of an axis that was off, and
``mp`` summed them.
"""

from __future__ import annotations

import math
import subprocess
import sys
from typing import Any

import pytest
import torch
from fixtures.groups import SizeRankGroup
from torch import nn

from pgregistry import ParallelLayout, ProcessGroupCollection, registry
from pgregistry.collection import UNSET
from pgregistry.grad_stats import grad_norm
from pgregistry.testing import run_world


def test_a_field_that_is_not_a_group_is_a_type_error_naming_it() -> None:
    expected = r"'tp' must be a torch ProcessGroup, None \(axis off\), UNSET or NOT_MEMBER; got int"
    with pytest.raises(TypeError, match=expected):
        ProcessGroupCollection(tp=5, ep="oops")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"field 'ep' .* got str 'oops'"):
        ProcessGroupCollection(tp=None, ep="oops")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"field 'hcp\[1\]' must be a torch ProcessGroup; got NoneType"):
        ProcessGroupCollection(hcp=[SizeRankGroup(2), None])  # type: ignore[list-item]
    with pytest.raises(TypeError, match=r"field 'hcp' must be a list of torch ProcessGroups"):
        ProcessGroupCollection(hcp=SizeRankGroup(2))
    with pytest.raises(TypeError, match="NON_GROUP_MEMBER"):
        ProcessGroupCollection(dp=-100)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"field 'cp'"):
        ProcessGroupCollection(tp=None).evolve(cp=object())  # type: ignore[arg-type]


def test_composite_groups_are_listed_from_the_layout_kinds() -> None:
    from pgregistry.collection import COMPOSITE_AXES

    assert COMPOSITE_AXES["mp"] == ("tp", "gtp_remat", "pp")
    assert COMPOSITE_AXES["tp_cp"] == ("tp", "cp")
    assert COMPOSITE_AXES["dp_cp"] == ("dp", "cp")
    assert COMPOSITE_AXES["tp_dp_cp"] == ("tp", "gtp_remat", "dp", "cp")  # as Megatron-Core's: GTP included
    assert COMPOSITE_AXES["dp_cp_gtp_remat"] == ("gtp_remat", "dp", "cp")
    assert COMPOSITE_AXES["tp_ep"] == ("expt_tp", "ep")
    assert COMPOSITE_AXES["tp_ep_pp"] == ("expt_tp", "ep", "pp")  # as Megatron-Core's: expert GTP left out
    assert COMPOSITE_AXES["tp_ep_pp_with_egtp_remat"] == ("expt_tp", "expt_gtp_remat", "ep", "pp")
    assert COMPOSITE_AXES["expt_dp_gtp_remat"] == ("expt_gtp_remat", "expt_dp")


def test_a_composite_group_larger_than_its_axes_is_refused_naming_both() -> None:
    spans = r"'mp' spans 2 rank\(s\), but it spans the axes tp \(off\), gtp_remat \(off\), pp \(off\), so its size"
    spans += " must be 1"
    with pytest.raises(ValueError, match=spans):
        ProcessGroupCollection(tp=None, gtp_remat=None, pp=None, mp=SizeRankGroup(2))
    with pytest.raises(ValueError, match=r"'tp_ep' spans 4 .* expt_tp \(2\), ep \(off\)"):
        ProcessGroupCollection(expt_tp=SizeRankGroup(2), ep=None, tp_ep=SizeRankGroup(4))
    # Some axes unset: the set ones must still divide the composite.
    with pytest.raises(ValueError, match=r"'dp_cp' spans 2 .* dp \(4\), cp \(unset\), so its size must be a multiple"):
        ProcessGroupCollection(dp=SizeRankGroup(4), dp_cp=SizeRankGroup(2))


def test_consistent_composites_are_accepted() -> None:
    ProcessGroupCollection(tp=SizeRankGroup(2), gtp_remat=None, pp=SizeRankGroup(2), mp=SizeRankGroup(4))
    ProcessGroupCollection(tp=SizeRankGroup(2), mp=SizeRankGroup(4))  # pp and gtp_remat unset: 4 is a multiple
    ProcessGroupCollection(tp=None, gtp_remat=None, pp=None, mp=None)
    ProcessGroupCollection(mp=SizeRankGroup(8))  # no axis given: nothing to compare with
    assert ProcessGroupCollection(tp=SizeRankGroup(2)).evolve(tp=UNSET, mp=SizeRankGroup(2)).is_set("mp")


def test_checking_imports_no_torch() -> None:
    done = subprocess.run(
        [sys.executable, "-c",
         "import sys, pgregistry\n"
         "from pgregistry import ProcessGroupCollection\n"
         "try:\n    ProcessGroupCollection(tp=5)\nexcept TypeError:\n    pass\n"
         "ProcessGroupCollection(tp=None, mp=None)\n"
         "assert 'torch' not in sys.modules\n"],
        capture_output=True, text=True, timeout=60,
    )
    assert done.returncode == 0, done.stderr


GRAD = torch.tensor([1.2, -0.4, 0.9, 1.3, 0.0, -0.6, 0.5, 0.3], dtype=torch.float64)
"""The grad of one parameter replicated across TP (not TP-sharded): counted once, its norm is the true norm."""


def _tp_off_but_mp_on() -> dict[str, Any]:
    grid = registry.build(ParallelLayout(num_ranks=2, tp=2))
    model = nn.Linear(8, 1, bias=False)  # replicated across the 2 TP ranks, identical grads
    model.weight.grad = GRAD.reshape(1, 8).float().clone()
    out: dict[str, Any] = {"norm": float(grad_norm(model, grid).item())}
    try:
        # TP off, but the model-parallel group still spans the 2 TP ranks (the other TP composites left out).
        grid.evolve(tp=None, tp_cp=UNSET, tp_dp_cp=UNSET)
        out["tp_off"] = "built"
    except ValueError as exc:
        out["tp_off"] = str(exc)
    return out


def test_tp_off_while_mp_spans_two_ranks_is_refused_instead_of_a_wrong_norm() -> None:
    oracle = math.sqrt(float((GRAD**2).sum()))  # the one replicated grad, counted once
    for out in run_world(2, _tp_off_but_mp_on):
        assert out["norm"] == pytest.approx(oracle, rel=1e-6)
        assert out["tp_off"].startswith("process group 'mp' spans 2 rank(s), but it spans the axes tp (off)")


SHARDED = torch.tensor([3.0, 4.0, 12.0, 0.0], dtype=torch.float64)
"""A TP-sharded grad, cut in two along dim 0: TP rank 0 holds [3, 4], TP rank 1 [12, 0]; its norm is 13."""


def _mp_of_another_kind() -> dict[str, Any]:
    grid = registry.build(ParallelLayout(num_ranks=4, tp=2))  # tp (0, 1) (2, 3); dp (0, 2) (1, 3)
    weight = nn.Parameter(torch.zeros(2))
    weight.tensor_model_parallel = True  # type: ignore[attr-defined]
    weight.partition_dim = 0  # type: ignore[attr-defined]
    weight.grad = SHARDED.reshape(2, 2)[torch.distributed.get_rank(grid.tp)].float().clone()
    out: dict[str, Any] = {"norm": float(grad_norm([weight], grid))}
    fields = dict(grid.items())
    fields["mp"] = grid.dp  # of the size TP x PP gives mp, over the data-parallel ranks
    try:
        out["mp_of_dp"] = f"norm {float(grad_norm([weight], ProcessGroupCollection(**fields)))}"
    except ValueError as exc:
        out["mp_of_dp"] = str(exc)
    return out


def test_a_composite_group_of_the_right_size_but_other_ranks_is_refused_instead_of_a_wrong_norm() -> None:
    """A collection assembled by hand with the ``dp`` group as ``mp`` passed the size check (2 = TP x PP): the norm
    summed the data-parallel replicas and missed the TP peer, 7.07 on ranks 0 and 2, 16.97 on 1 and 3, for 13."""
    oracle = math.sqrt(float((SHARDED**2).sum()))
    for rank, out in enumerate(run_world(4, _mp_of_another_kind)):
        assert out["norm"] == pytest.approx(oracle, rel=1e-6)
        tp_peers = [0, 1] if rank < 2 else [2, 3]
        assert out["mp_of_dp"].startswith(
            f"process group 'mp' holds ranks {[rank % 2, rank % 2 + 2]}, but it spans the axis 'tp', whose group "
            f"holds ranks {tp_peers}"
        ), out["mp_of_dp"]


def test_get_or_gives_the_default_only_for_an_unset_field() -> None:
    tp = SizeRankGroup(2)
    collection = ProcessGroupCollection(tp=tp, cp=None)
    default = SizeRankGroup(4)
    assert collection.get_or("tp", default) is tp
    assert collection.get_or("cp", default) is None  # off is not unset
    assert collection.get_or("dp", default) is default
    with pytest.raises(ValueError, match="did you mean 'expt_dp'"):
        collection.get_or("exp_dp", None)  # type: ignore[arg-type]

"""Unit tests: the duplicate rules, the reductions' arithmetic, clipping, parameter roles and the audit's guard."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import nn

from pgregistry import ProcessGroupCollection, ProcessGroupFallbackWarning, registry
from pgregistry._runtime.resolve import normalise_params
from pgregistry.audit import audit_grad_replication
from pgregistry.grad_stats import (
    CLIP_EPSILON,
    clip_grads_,
    norm_of_grads,
    param_is_not_gtp_duplicate,
    param_is_not_shared,
    param_is_not_tensor_parallel_duplicate,
    zeros_of_grads,
)
from pgregistry.layout import ParallelLayout
from pgregistry.params import (
    ROLE_ATTRIBUTES,
    copy_param_roles,
    is_expert_param,
    mark_expert,
    mark_expert_replicated,
    mark_gtp_sharded,
    mark_shared,
    mark_tensor_parallel,
)
from pgregistry.testing import run_world

# ----------------------------------------------------------------------------------------- duplicate rules


def _param(*, allreduce: bool | None = None, tp_sharded: bool = False, gtp_sharded: bool = False) -> nn.Parameter:
    param = nn.Parameter(torch.zeros(2, 2))
    if allreduce is False:
        mark_expert(param)
    elif allreduce is True:
        mark_expert_replicated(param)
    if tp_sharded:
        mark_tensor_parallel(param, 0)
    if gtp_sharded:
        mark_gtp_sharded(param)
    return param


def _rules_on_rank() -> dict[str, Any]:
    """Each rule with a 2-rank group G on one axis and the other axis off; rank 1 exercises the non-zero ranks."""
    group = registry.build(ParallelLayout(num_ranks=2, tp=2)).tp

    def on(tp: Any, expt_tp: Any) -> ProcessGroupCollection:
        return ProcessGroupCollection(tp=tp, expt_tp=expt_tp, gtp_remat=tp, expt_gtp_remat=expt_tp)

    tp_table = {}
    # (allreduce, tp rank, etp rank) -> counted, with the ranks of this process under each group assignment.
    for tp_group, etp_group in ((group, None), (None, group)):
        ranks = (group.rank() if tp_group is not None else 0, group.rank() if etp_group is not None else 0)
        for allreduce in (True, False):
            counted = param_is_not_tensor_parallel_duplicate(_param(allreduce=allreduce), on(tp_group, etp_group))
            tp_table[(allreduce, *ranks)] = counted
    sharded_everywhere = all(
        param_is_not_tensor_parallel_duplicate(_param(allreduce=a, tp_sharded=True), on(group, group))
        for a in (None, True, False)
    )
    unmarked_is_dense = param_is_not_tensor_parallel_duplicate(_param(), on(group, None))
    gtp = {
        "dense": param_is_not_gtp_duplicate(_param(), on(group, None)),
        "dense_sharded": param_is_not_gtp_duplicate(_param(gtp_sharded=True), on(group, group)),
        "expert_axis_off": param_is_not_gtp_duplicate(_param(allreduce=False), on(group, None)),
        "expert": param_is_not_gtp_duplicate(_param(allreduce=False), on(None, group)),
        "expert_sharded": param_is_not_gtp_duplicate(_param(allreduce=False, gtp_sharded=True), on(group, group)),
    }
    return {
        "rank": group.rank(),
        "tp_table": tp_table,
        "sharded_everywhere": sharded_everywhere,
        "unmarked_is_dense": unmarked_is_dense,
        "gtp": gtp,
    }


@pytest.fixture(scope="module")
def rules() -> list[dict[str, Any]]:
    return run_world(2, _rules_on_rank)


def test_tp_duplicate_table(rules: list[dict[str, Any]]) -> None:
    on_rank_1 = rules[1]["tp_table"]
    # Megatron-Core's duplicate-filter rule: (allreduce, tp rank, expert TP rank) -> counted.
    assert on_rank_1 == {(True, 0, 1): True, (True, 1, 0): False, (False, 0, 1): False, (False, 1, 0): True}
    assert all(rules[0]["tp_table"].values())  # rank 0 of every group counts
    assert rules[0]["unmarked_is_dense"] and not rules[1]["unmarked_is_dense"]


def test_tp_sharded_params_are_unique_on_every_rank(rules: list[dict[str, Any]]) -> None:
    assert all(got["sharded_everywhere"] for got in rules)


def test_gtp_rule(rules: list[dict[str, Any]]) -> None:
    rank0, rank1 = rules[0]["gtp"], rules[1]["gtp"]
    assert all(rank0.values())
    assert rank1 == {
        "dense": False,  # replicated across GTP: only GTP rank 0 counts it
        "dense_sharded": True,
        "expert_axis_off": True,  # experts use the expert GTP group, off here
        "expert": False,
        "expert_sharded": True,
    }


def test_shared_params_are_never_counted() -> None:
    assert param_is_not_shared(_param())
    assert not param_is_not_shared(mark_shared(_param()))


def test_an_omitted_group_without_a_global_grid_raises_naming_the_group() -> None:
    with (
        pytest.warns(ProcessGroupFallbackWarning),
        pytest.raises(RuntimeError, match="param_is_not_tensor_parallel_duplicate needs process group 'expt_tp'"),
    ):
        param_is_not_tensor_parallel_duplicate(_param(allreduce=False), ProcessGroupCollection(tp=None))
    with pytest.raises(RuntimeError, match="param_is_not_gtp_duplicate was not given a ProcessGroupCollection"):
        param_is_not_gtp_duplicate(_param())


# ------------------------------------------------------------------------------------------------ reductions


def _grads() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [
        torch.randn(5, 3, generator=gen),
        torch.randn(7, generator=gen, dtype=torch.float64),
        torch.randn(4, 2, generator=gen).to(torch.bfloat16),
        torch.zeros(3),
    ]


@pytest.mark.parametrize("p", [0.5, 1.0, 2.0, 3.0, math.inf])
def test_p_norm_matches_float64(p: float) -> None:
    grads = _grads()
    flat = torch.cat([g.double().reshape(-1) for g in grads]).abs()
    expected = float(flat.max()) if math.isinf(p) else float(flat.pow(p).sum() ** (1 / p))
    got = norm_of_grads({None: grads}, norm_type=p)
    assert got.dtype == torch.float64 and got.dim() == 0  # the widest dtype among the grads, as torch's
    assert float(got) == pytest.approx(expected, rel=1e-6)


def test_zero_count() -> None:
    grads = _grads()
    grads[0][1, 2] = 0.0
    got = zeros_of_grads({None: grads})
    assert got.dim() == 0 and int(got) == 3 + 1


@pytest.mark.parametrize("grads_by_group", [{}, {None: []}, {None: [torch.empty(0), torch.empty(0, 3)]}])
def test_empty_inputs_give_zero(grads_by_group: dict[Any, list[torch.Tensor]]) -> None:
    for p in (2.0, math.inf, 3.0):
        assert float(norm_of_grads(grads_by_group, norm_type=p)) == 0.0
    assert int(zeros_of_grads(grads_by_group)) == 0


def test_empty_grads_beside_others_count_nothing() -> None:
    grads = [torch.empty(0), torch.tensor([0.0, -3.0, 4.0]), torch.empty(0, 2)]
    for p, want in ((2.0, 5.0), (math.inf, 4.0), (3.0, 91.0 ** (1 / 3))):
        assert float(norm_of_grads({None: grads}, norm_type=p)) == pytest.approx(want, rel=1e-6)
    assert int(zeros_of_grads({None: grads})) == 1


@pytest.mark.parametrize("bad", [0, -1.0, math.nan])
def test_norm_type_must_be_positive(bad: float) -> None:
    with pytest.raises(ValueError, match="norm_type"):
        norm_of_grads({None: _grads()}, norm_type=bad)


def _two_groups_in_either_order(rank: int) -> float:
    """Ranks pass the two groups in insertion orders that would wait in a cycle if reduced as given: rank 0 waits
    for 1 on tp, 1 for 3 on dp, 3 for 2 on tp, 2 for 0 on dp."""
    collection = registry.build(ParallelLayout(num_ranks=4, tp=2))
    tp_share = [torch.full((1,), float(rank + 1))]
    dp_share = [torch.full((1,), 10.0 * (rank + 1))]
    items = [(collection.tp, tp_share), (collection.dp, dp_share)]
    return float(norm_of_grads(dict(items if rank in (0, 3) else items[::-1])))


def test_reduction_order_does_not_depend_on_insertion_order() -> None:
    results = run_world(4, lambda: _two_groups_in_either_order(torch.distributed.get_rank()), timeout=30)
    # tp groups {0,1},{2,3}; dp groups {0,2},{1,3}; shares x = rank + 1 and 10 x.
    for rank, got in enumerate(results):
        tp_peers = [rank - rank % 2, rank - rank % 2 + 1]
        dp_peers = [rank % 2, rank % 2 + 2]
        expected = math.sqrt(sum((r + 1) ** 2 for r in tp_peers) + sum((10 * (r + 1)) ** 2 for r in dp_peers))
        assert got == pytest.approx(expected, rel=1e-6)


# -------------------------------------------------------------------------------------------------- clipping


def test_clip_scales_only_when_the_coefficient_is_below_one() -> None:
    grads = _grads()
    before = [g.clone() for g in grads]
    total = norm_of_grads({None: grads})
    coeff = clip_grads_(grads, float(total) * 2, total)
    assert float(coeff) == 1.0
    assert all(torch.equal(a, b) for a, b in zip(grads, before, strict=True))

    max_norm = float(total) / 4
    coeff = clip_grads_(grads, max_norm, float(total))
    expected = max_norm / (float(total) + CLIP_EPSILON)
    assert float(coeff) == pytest.approx(expected, rel=1e-6)
    for got, old in zip(grads, before, strict=True):
        assert got.dtype == old.dtype
        rtol = 1e-2 if got.dtype == torch.bfloat16 else 1e-6
        torch.testing.assert_close(got.double(), old.double() * expected, rtol=rtol, atol=0)
    assert float(norm_of_grads({None: grads})) == pytest.approx(max_norm, rel=1e-2)


@pytest.mark.parametrize("bad", [0.0, -1.0, math.inf, math.nan])
def test_clip_rejects_bad_max_norm(bad: float) -> None:
    with pytest.raises(ValueError, match="max_norm"):
        clip_grads_(_grads(), bad, 1.0)


# ---------------------------------------------------------------------------------------------------- roles


def test_copy_param_roles_copies_every_present_role() -> None:
    src = mark_gtp_sharded(mark_tensor_parallel(mark_expert(nn.Parameter(torch.zeros(4, 2))), 1, stride=2))
    dst = copy_param_roles(src, nn.Parameter(torch.zeros(4, 2)))
    assert is_expert_param(dst) and dst.partition_dim == 1 and dst.partition_stride == 2
    assert dst.tensor_model_parallel and dst.is_gtp_weight_remat
    assert not hasattr(dst, "shared")
    assert set(ROLE_ATTRIBUTES) >= {"allreduce", "tensor_model_parallel", "is_gtp_weight_remat", "shared"}
    assert not is_expert_param(copy_param_roles(nn.Parameter(torch.zeros(1)), nn.Parameter(torch.zeros(1))))


def test_mark_tensor_parallel_validates() -> None:
    with pytest.raises(ValueError, match="partition_dim 2"):
        mark_tensor_parallel(nn.Parameter(torch.zeros(2, 2)), 2)
    with pytest.raises(ValueError, match="stride"):
        mark_tensor_parallel(nn.Parameter(torch.zeros(2, 2)), 0, stride=0)


def test_the_normaliser_accepts_models_chunks_mappings_and_tensors() -> None:
    a, b = nn.Linear(2, 2), nn.Linear(2, 1)
    assert [n for n, _ in normalise_params(a).named] == ["weight", "bias"]
    assert [n for n, _ in normalise_params([a, b]).named][2:] == ["chunk1.weight", "chunk1.bias"]
    assert [n for n, _ in normalise_params({"x": a.weight, "y": a.weight}).named] == ["x"]  # once per tensor
    assert [n for n, _ in normalise_params([a.weight, a.bias]).named] == ["param[0]", "param[1]"]
    assert normalise_params(a.weight).named[0][1] is a.weight
    with pytest.raises(TypeError, match="param\\[1\\]"):
        normalise_params([a.weight, "nope"])  # type: ignore[list-item]
    # Chunks as a generator or a tuple are chunks, not tensors: the attached collection is then found through them.
    assert normalise_params(chunk for chunk in [a, b]).chunks == (a, b)
    assert normalise_params((a, b)).chunks == (a, b)


# --------------------------------------------------------------------------------------------- audit guard


def _audit_with_extra_param_on_rank_1() -> str:
    collection = registry.build(ParallelLayout(num_ranks=2))
    params = {"w": nn.Parameter(torch.zeros(3))}
    if torch.distributed.get_rank() == 1:
        params["extra"] = nn.Parameter(torch.zeros(1))
    for param in params.values():
        param.grad = torch.ones_like(param)
    try:
        audit_grad_replication(params, collection)
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_audit_refuses_different_structures_on_every_rank() -> None:
    for message in run_world(2, _audit_with_extra_param_on_rank_1, timeout=30):
        assert "same parameters" in message and "dp_cp" in message


def test_a_kinds_launch_replanned_for_new_addresses_is_the_new_tensors_launch() -> None:
    """Tensors of the same sizes at new addresses keep a kind's route (kernel and rest) and host blocks; its launch
    has the offsets made for the new tensors and keeps its program table, which depends on the sizes only (built on
    the host for host tensors: no kernel runs here); a kind the kernel does not read is kept as it is."""
    from pgregistry.grad_stats import _fused
    from pgregistry.grad_stats._local import KindPlan, plan_kind, replan_launch

    def tensors(gap: int) -> list[torch.Tensor]:  # the third after a gap: its offset from the first is known
        flat = torch.ones(70_000 + gap + 9)
        return [flat[:70_000], torch.ones(4, 3).t(), flat[70_000 + gap :]]

    old = tensors(0)
    kernel_read = [old[0], old[2]]
    plan = KindPlan(old[0].device, old[0].dtype, (0, 2), _fused.launch_of(kernel_read), (1,), ())
    new = tensors(1_000)
    replanned = replan_launch(plan, new)
    expected = _fused.launch_of([new[0], new[2]])
    assert replanned.launch is not None and expected.table is not None and plan.launch is not None
    assert (replanned.kernel, replanned.rest, replanned.blocks) == (plan.kernel, plan.rest, plan.blocks)
    assert replanned.launch.base == expected.base
    assert torch.equal(replanned.launch.offsets, expected.offsets)
    assert replanned.launch.offsets.tolist() == [0, 70_000 + 1_000]  # the third tensor's new offset, in elements
    assert plan.launch.offsets.tolist() == [0, 70_000]
    # the program table depends on the sizes only: the same object, not made again
    assert plan.launch.table is not None and replanned.launch.table is plan.launch.table
    host = plan_kind(new, new[0].device, new[0].dtype)
    assert replan_launch(host, tensors(2_000)) is host


def test_a_launch_addresses_its_tensors_from_an_aligned_one() -> None:
    """The kernels' base is the first tensor at a 16-byte aligned address (triton specializes a kernel on its
    pointer's alignment: a misaligned base would read every tensor element by element), the others at their
    distance from it in elements, before it too; without an aligned tensor, the first that holds elements."""
    from pgregistry.grad_stats import _fused

    flat = torch.zeros(64)
    assert flat.data_ptr() % 16 == 0
    launch = _fused.launch_of([flat[:0], flat[1:5], flat[8:12], flat[4:7]])
    assert launch.base == 2 and launch.offsets.tolist() == [0, -7, 0, -4]
    misaligned = _fused.launch_of([flat[:0], flat[1:3], flat[5:6]])
    assert misaligned.base == 1 and misaligned.offsets.tolist() == [0, 0, 4]

"""The flat grad buffer: layout by statistics class, grads as views, statistics equal to the list path and the
float64 oracle, classification done once, and no allocation of the buffer's size by the statistics."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.distributed as dist
from fixtures.unsharded_oracle import oracle_norm, oracle_zeros
from torch import nn
from torch.profiler import ProfilerActivity, profile

import pgregistry.grad_stats._local as host_reads
import pgregistry.optim._grad_buffer as grad_buffer
from pgregistry import registry
from pgregistry.collection import FIELD_NAMES, ProcessGroupCollection
from pgregistry.grad_stats import (
    StatsGroups,
    classify_grads,
    is_counted,
    norm_of_grads,
    reduce_group_of,
    zeros_of_grads,
)
from pgregistry.grad_stats._reductions import Shares, Wanted, make_part, reduce_shares
from pgregistry.layout import ParallelLayout
from pgregistry.optim import (
    MixedPrecisionOptimizer,
    ShardedOptimizer,
    build_optimizer,
    inner_factory,
    setup_process_groups_for_optimizer,
)
from pgregistry.optim._grad_buffer import SPAN_ALIGNMENT, GradBuffer, count_nonzero_by_rows
from pgregistry.params import mark_expert, mark_shared
from pgregistry.testing import run_world
from pgregistry.testing._toy_models import full_grads, local_model

ALL_OFF = ProcessGroupCollection(**dict.fromkeys(FIELD_NAMES))
"""Every axis off: a single process, no torch.distributed."""
OFF = setup_process_groups_for_optimizer(ALL_OFF)
SHARDED_OFF = setup_process_groups_for_optimizer(ALL_OFF, use_distributed_optimizer=True)

OFF_GROUPS = StatsGroups.from_collection(ALL_OFF)


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _on_rank(layout: ParallelLayout) -> dict[str, Any]:
    collection = registry.build(layout)
    groups = StatsGroups.from_collection(collection)
    model, _ = local_model(layout, dist.get_rank(), full_grads("random"))  # the grads: shards of the random ones
    model.tied = mark_shared(nn.Parameter(torch.zeros(3)))  # a shared copy: never counted
    params = list(model.parameters())
    buffer = GradBuffer(params, groups)
    out: dict[str, Any] = {"same_storage": all(_storage(v) == _storage(buffer.data) for v in buffer.views)}
    out["views_at_offsets"] = all(
        v.data_ptr() == buffer.data[o:].data_ptr() and v.shape == p.shape
        for v, o, p in zip(buffer.views, buffer.offsets, params, strict=True)
    )
    # One span per class, each param inside the span of its class (classified here with grad_stats directly).
    classes = [(is_counted(p, groups), reduce_group_of(p, groups)) for p in params]
    spans = buffer.spans
    out["one_span_per_class"] = len(spans) == len({(c, id(g)) for c, g in classes})
    out["spans_disjoint_aligned"] = all(
        a.stop <= b.start for a, b in zip(spans, spans[1:], strict=False)
    ) and all(s.start % SPAN_ALIGNMENT == 0 for s in spans)
    out["params_in_their_span"] = all(
        any(s.counted == c and s.group is g and s.start <= o and o + p.numel() <= s.stop for s in spans)
        for p, o, (c, g) in zip(params, buffer.offsets, classes, strict=True)
    )
    out["spans_cover_params"] = sum(s.numel for s in spans) == sum(p.numel() for p in params)
    # Statistics: buffer path, list path (grad_stats over per-tensor grads), oracle in the parent.
    model.tied.grad = torch.full((3,), 7.0)
    for param, view in zip(params, buffer.views, strict=True):
        view.copy_(param.grad)
    listed = classify_grads(params, groups)
    out["buffer"] = (float(buffer.grad_norm()), float(buffer.grad_norm(math.inf)), int(buffer.count_zeros()))
    out["list"] = (float(norm_of_grads(listed)), float(norm_of_grads(listed, math.inf)), int(zeros_of_grads(listed)))
    return out


@pytest.mark.parametrize(
    "name,sizes",
    [
        ("TP2-EP4-ETP1", {"tp": 2, "ep": 4, "expt_tp": 1}),
        ("TP2-EP2-ETP2", {"tp": 2, "ep": 2, "expt_tp": 2}),
        ("TP2-PP2-EP2-ETP1", {"tp": 2, "pp": 2, "ep": 2, "expt_tp": 1}),
    ],
)
def test_buffer_layout_and_statistics(name: str, sizes: dict[str, int]) -> None:
    grads = full_grads("random")
    want = (oracle_norm(grads, 2.0), oracle_norm(grads, math.inf), oracle_zeros(grads))
    for rank, out in enumerate(run_world(4, _on_rank, ParallelLayout(num_ranks=4, **sizes))):
        where = f"{name} rank {rank}"
        for check in ("same_storage", "views_at_offsets", "one_span_per_class", "spans_disjoint_aligned",
                      "params_in_their_span", "spans_cover_params"):
            assert out[check], f"{where}: {check}"
        assert out["buffer"] == pytest.approx(want, rel=1e-6), where
        assert out["list"] == pytest.approx(out["buffer"], rel=1e-6), where
        assert out["buffer"][2] == want[2], where


def test_classification_happens_once_at_construction(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = grad_buffer.is_counted

    def counting(param: torch.Tensor, groups: StatsGroups) -> bool:
        calls.append(param)
        return real(param, groups)

    monkeypatch.setattr(grad_buffer, "is_counted", counting)
    params = [nn.Parameter(torch.ones(5)) for _ in range(6)]
    buffer = GradBuffer(params, OFF_GROUPS)
    assert len(calls) == len(params)
    for _ in range(3):
        buffer.grad_norm()
        buffer.count_zeros()
    assert len(calls) == len(params)


def test_mixed_precision_grads_live_only_in_the_buffer() -> None:
    model = nn.Linear(4, 3).to(torch.bfloat16)
    model.scale = nn.Parameter(torch.ones(3))  # already float32: its own main param
    opt = MixedPrecisionOptimizer(list(model.parameters()), OFF, inner=inner_factory("sgd", lr=0.1))
    data = opt.buffer.data
    assert data.dtype == torch.float32
    for param, main in zip(opt.params, opt.main_params, strict=True):
        assert _storage(param.main_grad) == _storage(data)
        assert main.grad is param.main_grad
        assert (main is param) == (param.dtype == torch.float32)
    x = torch.ones(2, 4, dtype=torch.bfloat16)
    for _ in range(2):  # accumulate two backward passes
        ((model(x).float() * model.scale).sum()).backward()
    assert model.weight.grad is None and model.bias.grad is None  # bf16 grads were added into the buffer, freed
    assert model.scale.grad is model.scale.main_grad  # float32: autograd accumulated in place
    assert torch.equal(model.bias.main_grad, torch.full((3,), 4.0))
    assert torch.equal(model.weight.main_grad, torch.full((3, 4), 4.0))
    opt.zero_grad()
    assert int(data.count_nonzero()) == 0


def test_sharded_parameters_are_views_of_one_buffer() -> None:
    params = [nn.Parameter(torch.randn(3, 5)), nn.Parameter(torch.randn(7))]
    values = [p.detach().clone() for p in params]
    opt = ShardedOptimizer(params, SHARDED_OFF, inner=inner_factory("sgd", lr=0.5), main_dtype=None)
    for param, value in zip(params, values, strict=True):
        assert _storage(param) == _storage(opt.param_data)
        assert torch.equal(param.detach(), value)
        assert param.grad is param.main_grad
        param.grad.fill_(1.0)
    opt.step()
    for param, value in zip(params, values, strict=True):
        assert torch.allclose(param.detach(), value - 0.5)


def test_detached_grad_is_refused() -> None:
    param = nn.Parameter(torch.ones(4))
    opt = build_optimizer(param_module(param), ALL_OFF, mixed_precision=False)
    param.grad = None  # what model.zero_grad() does
    with pytest.raises(RuntimeError, match=r"\.grad is no longer a view of the optimizer's grad buffer"):
        opt.sync_grads()


def param_module(param: nn.Parameter) -> nn.Module:
    module = nn.Module()
    module.weight = param
    return module


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("row", [1, 7, 1000, 1 << 20])
def test_row_zero_count_is_exact(dtype: torch.dtype, row: int) -> None:
    gen = torch.Generator().manual_seed(row)
    x = torch.randn(10_007, generator=gen).to(dtype)
    x[torch.rand(10_007, generator=gen) < 0.4] = 0
    assert int(count_nonzero_by_rows(x, row)) == int(torch.count_nonzero(x))


def test_float32_counting_is_inexact_past_2_pow_24_which_rows_avoid() -> None:
    # Why rows: one float32 reduction of a count above 2**24 loses units; rows of 2**24 keep every count exact.
    n = (1 << 25) + 3
    ones = torch.ones(n, dtype=torch.bfloat16)
    assert float(torch.linalg.vector_norm(ones, 0, dtype=torch.float32)) != n
    assert int(count_nonzero_by_rows(ones, 1 << 24)) == n


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_host_norm_in_blocks_and_rows_matches(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype) -> None:
    monkeypatch.setattr(grad_buffer, "HOST_BLOCK", 1000)  # the zero count's blocks
    monkeypatch.setattr(host_reads, "HOST_NORM_BLOCK", 1000)  # the norm's blocks and rows (host_share)
    monkeypatch.setattr(host_reads, "HOST_ROW", 64)
    params = [nn.Parameter(torch.empty(2_500, dtype=dtype)), mark_expert(nn.Parameter(torch.empty(10)))]
    buffer = GradBuffer(params, OFF_GROUPS, dtype=dtype)
    gen = torch.Generator().manual_seed(0)
    for view in buffer.views:
        view.normal_(generator=gen)
    flat = torch.cat([v.double() for v in buffer.views])
    for p in (2.0, 1.0, 3.0, math.inf):
        assert float(buffer.grad_norm(p)) == pytest.approx(float(torch.linalg.vector_norm(flat, p)), rel=1e-5)


def test_host_norm_keeps_float32_precision_over_a_long_span() -> None:
    # One float32 vector_norm over 2**23 elements on CPU is off by ~1e-4; rows combined in float64 are not.
    params = [nn.Parameter(torch.empty(1 << 23))]
    buffer = GradBuffer(params, OFF_GROUPS)
    buffer.views[0].normal_(generator=torch.Generator().manual_seed(1))
    exact = float(torch.linalg.vector_norm(buffer.data.double()))
    assert float(buffer.grad_norm()) == pytest.approx(exact, rel=1e-6)


def _peak_bytes(fn: Any) -> int:
    """Peak CPU memory allocated while ``fn`` runs, from the profiler's allocation and free events in time order."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    live = peak = 0
    for event in sorted(prof.events(), key=lambda e: e.time_range.start):
        live += event.cpu_memory_usage if event.name == "[memory]" else event.self_cpu_memory_usage
        peak = max(peak, live)
    return peak


def test_statistics_allocate_nothing_of_the_buffers_size() -> None:
    params = [nn.Parameter(torch.empty(1 << 20)) for _ in range(8)] + [mark_shared(nn.Parameter(torch.empty(100)))]
    buffer = GradBuffer(params, OFF_GROUPS)
    for view in buffer.views:
        view.normal_()
    size = buffer.data.numel() * buffer.data.element_size()
    # The measurement sees a mask of the buffer's size (so this test can fail) ...
    assert _peak_bytes(lambda: (buffer.data != 0).sum()) >= buffer.data.numel()
    # ... and the statistics' peak is bounded by one block (row norms; the zero count's reused mask).
    assert _peak_bytes(buffer.grad_norm) < 16 * 1024 < size // 1000
    assert _peak_bytes(buffer.count_zeros) <= grad_buffer.HOST_BLOCK + 4096 < size // 100


def _same_ranks_in_either_order(rank: int) -> int:
    """Two communicators over the same ranks, passed in opposite insertion orders on the two ranks: reduced as
    given, each rank would wait for the other on a different group."""
    first, second = dist.new_group([0, 1]), dist.new_group([0, 1])
    counts = [(first, torch.tensor(rank + 1)), (second, torch.tensor(10 * (rank + 1)))]
    shares = Shares(Wanted.zeros_only(), torch.device("cpu"))
    for group, count in counts if rank == 0 else counts[::-1]:
        shares.add(group, make_part(None, count, torch.device("cpu")))
    return int(reduce_shares(shares).zeros)  # type: ignore[arg-type]


def test_zero_counts_reduce_groups_of_the_same_ranks_in_one_order() -> None:
    results = run_world(2, lambda: _same_ranks_in_either_order(dist.get_rank()), timeout=30)
    assert results == [(1 + 2) + (10 + 20)] * 2

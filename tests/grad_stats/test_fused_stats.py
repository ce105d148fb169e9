"""The one-read statistics kernels (:mod:`pgregistry.grad_stats._fused`), run by triton's interpreter on CPU: the sum
of squares equals the float64 oracle, the zero count is exact, over one span and over a table of tensors.

Skipped where triton is not installed (it ships with torch's CUDA wheels; ``pip install triton`` on a CPU machine
brings the interpreter). On a GPU, ``scripts/gpu_check.py`` and ``benchmarks/grad_stats.py`` run the compiled
kernels.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any
from unittest import mock

import pytest
import torch
from fixtures.finish_cases import FINISH_ROWS, bits, finished_side_by_side
from fixtures.interpreter import in_interpreter
from torch import nn

from pgregistry.collection import FIELD_NAMES, ProcessGroupCollection
from pgregistry.grad_stats import _fused as fused_stats
from pgregistry.grad_stats import _local as local
from pgregistry.grad_stats import _reductions as reductions
from pgregistry.grad_stats import (
    clip_grad_norm_,
    grad_norm,
    grad_norm_and_zeros,
    norm_of_grads,
    zeros_of_grads,
)
from pgregistry.grad_stats._reductions import Shares, Wanted
from pgregistry.optim._grad_buffer import Span, span_shares
from pgregistry.params import mark_shared

SMALL = {"block": 64, "iters": 4}
"""Programs of 256 elements: many programs and partial last blocks on small tensors."""


def _grads(dtype: torch.dtype, sizes: list[int]) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    grads = []
    for size in sizes:
        grad = torch.randn(size, generator=gen)
        grad[torch.rand(size, generator=gen) < 0.3] = 0.0
        if size > 2:
            grad[1] = -0.0  # a zero too
        grads.append(grad.to(dtype))
    return grads


def _stats(result: tuple[torch.Tensor, torch.Tensor]) -> tuple[float, int, torch.dtype, torch.dtype]:
    squares, zeros = result
    return float(squares), int(zeros), squares.dtype, zeros.dtype


def _errors(calls: list[tuple[str, Callable[[], Any]]]) -> dict[str, str]:
    out = {}
    for name, call in calls:
        try:
            call()
        except ValueError as error:
            out[name] = str(error)
    return out


def _in_interpreter() -> dict[str, Any]:
    """Every kernel call of these tests, in a spawned process that imports triton with its interpreter on (the
    mode is read when triton's own kernels are decorated: a process that imported triton already cannot switch)."""
    data = {dtype: _grads(dtype, [5000])[0] for dtype in DTYPES}
    spans = {
        (str(dtype), index): _stats(fused_stats.span_squares_and_zeros(view, **SMALL))
        for dtype, whole in data.items()
        for index, view in enumerate(_span_views(whole))
    }
    tables = {str(dtype): _stats(fused_stats.squares_and_zeros(_table(dtype), **SMALL)) for dtype in DTYPES}
    tables["with empty"] = _stats(fused_stats.squares_and_zeros([torch.empty(0), *_table(torch.float32)], **SMALL))
    tables["all empty"] = _stats(fused_stats.squares_and_zeros([torch.empty(0), torch.empty(0)], **SMALL))
    defaults = {str(dtype): _stats(fused_stats.squares_and_zeros(_long(dtype))) for dtype in DTYPES}
    # The launch table is kept by addresses and sizes: the same tensor objects with new storage, or new values in
    # the same storage, are read afresh.
    kept = _table(torch.float32)
    first = _stats(fused_stats.squares_and_zeros(kept, **SMALL))
    kept[3].data = _grads(torch.float32, [700])[0]
    kept[5].mul_(2.0)
    tables["kept"] = (first, _stats(fused_stats.squares_and_zeros(kept, **SMALL)), kept)
    special = {
        "nan": _stats(fused_stats.span_squares_and_zeros(torch.tensor([0.0, float("nan"), 1.0, 0.0]), **SMALL)),
        "inf": _stats(fused_stats.squares_and_zeros([torch.tensor([float("inf"), 0.0])], **SMALL)),
    }
    errors = _errors([
        ("dtypes", lambda: fused_stats.squares_and_zeros([torch.ones(3), torch.ones(3, dtype=torch.bfloat16)])),
        ("layout", lambda: fused_stats.squares_and_zeros([torch.ones(4), torch.ones(4, 4).t()])),
        ("float64", lambda: fused_stats.span_squares_and_zeros(torch.ones(4, dtype=torch.float64))),
    ])
    data = _grads(torch.float32, [4000])[0]
    buffer_spans = (Span(None, True, 0, 1000), Span(None, False, 1024, 2000), Span(None, True, 2048, 3001))
    both = Wanted.of(2.0, zeros=True)
    one_read, two_reads = Shares(both, data.device), Shares(both, data.device)
    span_shares(data, buffer_spans, one_read, one_read=True)
    span_shares(data, buffer_spans, two_reads, one_read=False)
    # The list path with the kernel on (here, on CPU, through the interpreter): mixed dtypes, a float64 grad and a
    # non-contiguous one take torch's route beside it.
    local.one_read_applies = lambda device, dtype: dtype in DTYPES  # type: ignore[assignment]
    read: list[int] = []
    real = fused_stats.read_over

    def counting(tensors: list[torch.Tensor], launch: fused_stats.Launch) -> tuple[torch.Tensor, torch.Tensor]:
        read.append(len(tensors))
        return real(tensors, launch)

    fused_stats.read_over = counting  # type: ignore[assignment]
    listed = _mixed_list()
    list_path = (float(norm_of_grads({None: listed})), int(zeros_of_grads({None: listed})), read)
    fused_stats.read_over = real  # type: ignore[assignment]
    # float32 grads whose squares fit the kernel's float32 partials but whose sum does not fit float32: summed in
    # float64 as the kernel's caller claims (the share was cast to float32 before, an infinite norm).
    huge = [torch.full((256,), 1e18 * sign) for sign in (1, -1, 1, -1)]
    large = float(norm_of_grads({None: huge}))
    # Squares beyond float32's range (1e20: 1e40 each) and below it (1e-25: 1e-50), float32 and bf16, through the
    # kernel: summed in its float64 lanes, exact in the one reduction, with the host read refused.
    with (
        mock.patch.object(reductions, "_needs_exact_norm", side_effect=AssertionError("a host read")),
        mock.patch.object(fused_stats, "read_over", side_effect=real) as beyond_read,
    ):
        beyond = {
            (str(dtype), size): float(norm_of_grads({None: [torch.full((300,), size, dtype=dtype)]}))
            for dtype in (torch.float32, torch.bfloat16)
            for size in (1e20, 1e-25)
        }
    beyond_reads = beyond_read.call_count
    # A model through the kept classification, read by the kernel and clipped by it: twice (the second call from the
    # kept plan and launch tables), then clipped below its norm.
    launches: list[str] = []
    real_clip = fused_stats.clip_over_

    def counted(name: str, function: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            launches.append(name)
            return function(*args, **kwargs)

        return call

    fused_stats.read_over = counted("read", real)  # type: ignore[assignment]
    fused_stats.clip_over_ = counted("clip", real_clip)  # type: ignore[assignment]
    model = _model()
    through_model = [tuple(map(float, grad_norm_and_zeros(model, OFF))) for _ in range(2)]
    returned = float(clip_grad_norm_(model, 0.5, OFF))
    clipped = [param.grad.clone() for param in model.parameters()]
    seen = len(launches)
    other_norms = [float(grad_norm(model, OFF, norm_type=p)) for p in (1.0, math.inf)]  # the kernel reads 2-norms
    other_launches = launches[seen:]
    del launches[seen:]
    # A NaN (an inf) in a shared copy, which no rank counts: the kernel reads it too, for its NaN only.
    uncounted = {}
    for poison in (math.nan, math.inf):
        tied = _model()
        mark_shared(tied[0].bias)
        tied[0].bias.grad[3] = poison
        before = [param.grad.clone() for param in tied.parameters()]
        norm, zeros = grad_norm_and_zeros(tied, OFF)
        returned_norm = float(clip_grad_norm_(tied, 0.5, OFF))
        unscaled = all(
            bool(((p.grad == b) | (p.grad.isnan() & b.isnan())).all())
            for p, b in zip(tied.parameters(), before, strict=True)
        )
        uncounted[str(poison)] = (float(norm), int(zeros), returned_norm, unscaled)
    uncounted_launches = launches[seen:]
    del launches[seen:]
    fused_stats.read_over, fused_stats.clip_over_ = real, real_clip  # type: ignore[assignment]
    return {
        "spans": spans,
        "tables": tables,
        "defaults": defaults,
        "special": special,
        "errors": errors,
        "buffer": (one_read.by_group, two_reads.by_group),
        "list": list_path,
        "large": large,
        "beyond": (beyond, beyond_reads),
        "scaled": _scaled(),
        "clipped": _clipped_from_norms(),
        "model": (through_model, returned, clipped, launches),
        "other norms": (other_norms, other_launches),
        "uncounted": (uncounted, uncounted_launches),
        "finished": finished_side_by_side(torch.device("cpu")),
        "another dtype at the address": _another_dtype_at_the_planned_address(),
        "finished through a model": _finished_through_a_model(),
    }


OFF = ProcessGroupCollection(**dict.fromkeys(FIELD_NAMES))

def _another_dtype_at_the_planned_address() -> tuple[float, float]:
    """A model's norm on float32 grads, then on bf16 grads of the same element counts at the same addresses (its
    parameters made bf16, their grads set anew over the old grads' memory), all read by the kernel: the weight's
    grad 3s, the bias's 5s."""
    weight, bias = 64 * 64, 64
    memory = torch.full((2 * (weight + bias),), 3.0, dtype=torch.bfloat16)  # read as float32: 3.0039, not 3
    memory[2 * weight :] = 5.0
    model = nn.Linear(64, 64)
    wide = memory.view(torch.float32)
    model.weight.grad, model.bias.grad = wide[:weight].view(64, 64), wide[weight:]
    first = float(grad_norm(model, OFF))
    for param in model.parameters():
        param.grad = None
        param.data = param.data.to(torch.bfloat16)
    model.weight.grad, model.bias.grad = memory[:weight].view(64, 64), memory[2 * weight : 2 * weight + bias]
    return first, float(grad_norm(model, OFF))


def _finished_through_a_model() -> dict[str, list[int | None]]:
    """The public calls on a model (its grads read by the kernel), their results finished by the kernel and by
    torch's operations: the bits of each, and the clipped grads' bits; the kernel's launches counted."""
    launches = []
    real = fused_stats.finish_rows

    def counting(*args: Any, **kwargs: Any) -> Any:
        launches.append(kwargs["norm"])
        return real(*args, **kwargs)

    out: dict[str, list[int | None]] = {}
    for by_kernel in (True, False):
        model = _model()
        with (
            mock.patch.object(reductions, "can_run_fused_stats", lambda device, on=by_kernel: on),
            mock.patch.object(reductions, "finish_rows", counting),
        ):
            norm, zeros = grad_norm_and_zeros(model, OFF)
            results = [bits(norm), bits(zeros), bits(grad_norm(model, OFF)), bits(clip_grad_norm_(model, 0.5, OFF))]
            results.append(hash(tuple(torch.cat([p.grad.double().flatten() for p in model.parameters()]).tolist())))
        out[f"by kernel {by_kernel}"] = results
    out["launches"] = launches
    return out


def _model() -> nn.Module:
    """Two layers, float32 and a bf16 one, with grads from :func:`_grads` (the same ones in every process)."""
    model = nn.Sequential(nn.Linear(40, 30), nn.Linear(30, 7).to(torch.bfloat16))
    for index, param in enumerate(model.parameters()):
        param.grad = _grads(param.dtype, [param.numel()])[0].roll(index).view(param.shape)
    return model


def _scale_inputs(dtype: torch.dtype) -> list[torch.Tensor]:
    grads = _table(dtype)
    grads[3][0] = float("nan")
    return grads


def _scaled() -> dict[str, Any]:
    """The scale kernel over a table of tensors (views off the 16-byte grid included), coefficients 0.37 and 1."""
    out = {}
    for dtype in DTYPES:
        for coeff in (0.37, 1.0):
            tensors = _scale_inputs(dtype)
            fused_stats.scale_(tensors, torch.tensor(coeff, dtype=torch.float64), block=64, iters=4)
            out[(str(dtype), coeff)] = tensors
    return out


CLIPS = (
    (1.0, 2.7),  # a coefficient of about 0.37
    (1.0, 1.0),  # 1 / (1 + 1e-6): below 1 in float32, 1 in bf16
    (1.0, 1.0 - 1e-6),  # about 1: clamped
    (1e300, 1e-300),  # far above 1: clamped
    (5e-324, 3.0),  # the smallest float64: its bits fit int32, the kernel's argument is int32
    (0.5, math.nan),  # a NaN norm scales nothing
    (0.5, math.inf),  # nor an infinite one
)
"""(max_norm, total norm) pairs clipped by the kernel from the norm."""


def _clipped_from_norms() -> dict[tuple[str, int], tuple[list[torch.Tensor], list[torch.Tensor]]]:
    """The scale kernel clipping from the norm (its coefficient made on the device), and the same kernel scaling by
    the coefficient torch's route makes (``clip_coefficient``, on the host), for each of :data:`CLIPS`."""
    from pgregistry.grad_stats._reductions import clip_coefficient

    out = {}
    for dtype in DTYPES:
        for case, (max_norm, norm) in enumerate(CLIPS):
            norm64 = torch.tensor(norm, dtype=torch.float64)
            from_norm, by_coefficient = _scale_inputs(dtype), _scale_inputs(dtype)
            fused_stats.clip_over_(from_norm, fused_stats.launch_of(from_norm, **SMALL), max_norm, norm64)
            fused_stats.scale_(by_coefficient, clip_coefficient(max_norm, norm64), **SMALL)
            out[(str(dtype), case)] = (from_norm, by_coefficient)
    return out


def _mixed_list() -> list[torch.Tensor]:
    grads = [*_table(torch.float32), *_table(torch.bfloat16), *_grads(torch.float16, [300, 1])]
    grads += [_grads(torch.float32, [400])[0].to(torch.float64), _grads(torch.float32, [900])[0].view(30, 30).t()]
    return grads


DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _long(dtype: torch.dtype) -> list[torch.Tensor]:
    """Tensors over several of the default programs of ``dtype`` (:func:`~pgregistry.grad_stats._fused.iterations_for`),
    one ending part-way through a program."""
    return _grads(dtype, [3 * fused_stats.BLOCK * fused_stats.iterations_for(dtype) + 5, 3])


def _span_views(whole: torch.Tensor) -> list[torch.Tensor]:
    return [whole, whole[7:4103], whole[:1], whole[:0]]  # offsets and lengths off the block grid, empty


def _table(dtype: torch.dtype) -> list[torch.Tensor]:
    """Tensors of several sizes; the first, the kernel's base, above two views of its buffer (addressed before it:
    negative offsets)."""
    grads = _grads(dtype, [1, 3, 255, 256, 257, 1000, 2])
    whole = _grads(dtype, [600])[0]
    grads.insert(0, whole[500:590])  # the base
    grads.append(whole[100:400])  # a view: read from its own address
    grads.append(whole[401:498])  # a view off the 16-byte grid: read element by element
    return grads


@pytest.fixture(scope="module")
def interpreted() -> dict[str, Any]:
    return in_interpreter(_in_interpreter, timeout=180.0)


def _oracle(grads: list[torch.Tensor]) -> tuple[float, int]:
    squares = sum(float(g.double().pow(2).sum()) for g in grads)
    return squares, sum(int((g == 0).sum()) for g in grads)


def _check(got: tuple[float, int, torch.dtype, torch.dtype], grads: list[torch.Tensor]) -> None:
    want_squares, want_zeros = _oracle(grads)
    assert got[2:] == (torch.float64, torch.int64)
    assert got[0] == pytest.approx(want_squares, rel=1e-6, abs=0.0)
    assert got[1] == want_zeros


@pytest.mark.parametrize("dtype", DTYPES)
def test_one_span_equals_the_oracle(interpreted: dict[str, Any], dtype: torch.dtype) -> None:
    for index, view in enumerate(_span_views(_grads(dtype, [5000])[0])):
        _check(interpreted["spans"][(str(dtype), index)], [view])


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_table_of_tensors_equals_the_oracle(interpreted: dict[str, Any], dtype: torch.dtype) -> None:
    _check(interpreted["tables"][str(dtype)], _table(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_default_programs_of_each_dtype_read_every_element_once(
    interpreted: dict[str, Any], dtype: torch.dtype
) -> None:
    """Each program reads ``BLOCK * ITERS`` elements of its dtype (32 KiB of float32, 64 KiB of bf16 / fp16), the
    last of a tensor what is left; read through those programs, the oracle's statistics."""
    tensors = _long(dtype)
    launch = fused_stats.launch_of(tensors)  # built on the host for host tensors: no kernel runs here
    per_program = fused_stats.BLOCK * {4: 8, 2: 32}[dtype.itemsize]
    assert launch.table is not None and launch.iters * fused_stats.BLOCK == per_program
    assert launch.table[:, 2].tolist() == [per_program] * 3 + [5, 3]  # [tensor, first element, elements]
    _check(interpreted["defaults"][str(dtype)], tensors)


def test_a_table_with_empty_tensors(interpreted: dict[str, Any]) -> None:
    _check(interpreted["tables"]["with empty"], _table(torch.float32))
    _check(interpreted["tables"]["all empty"], [])


def test_a_kept_table_is_never_stale(interpreted: dict[str, Any]) -> None:
    """Same tensor objects, one with new storage of another size and one with new values: the new statistics."""
    first, again, kept = interpreted["tables"]["kept"]
    _check(first, _table(torch.float32))
    _check(again, kept)
    assert again[:2] != first[:2]


def test_nan_and_inf_propagate_and_nan_is_not_a_zero(interpreted: dict[str, Any]) -> None:
    squares, zeros, _, _ = interpreted["special"]["nan"]
    assert math.isnan(squares) and zeros == 2
    assert math.isinf(interpreted["special"]["inf"][0])


def test_refuses_tensors_it_cannot_read(interpreted: dict[str, Any]) -> None:
    errors = interpreted["errors"]
    assert "tensor 1 (torch.bfloat16" in errors["dtypes"]
    assert "contiguous=False" in errors["layout"]
    assert "torch.float64" in errors["float64"]


def test_span_statistics_in_one_read_equal_the_two_reductions(interpreted: dict[str, Any]) -> None:
    one_read, two_reads = interpreted["buffer"]
    # The counted spans' parts, and between them the uncounted span's seen part (its NaN or inf only: none here).
    assert set(one_read) == set(two_reads) == {None} and len(one_read[None]) == len(two_reads[None]) == 3
    assert one_read[None][1].tolist() == two_reads[None][1].tolist() == [0.0, 0.0]
    for got, want in zip(one_read[None], two_reads[None], strict=True):
        assert got.dtype == want.dtype == torch.float64  # [sum of squares, zeros, NaN seen, inf seen]
        assert float(got[0]) == pytest.approx(float(want[0]), rel=1e-6)
        assert int(got[1]) == int(want[1])


def test_the_list_path_reads_through_the_kernel_and_equals_the_oracle(interpreted: dict[str, Any]) -> None:
    grads = _mixed_list()
    squares, zeros = _oracle(grads)
    assert interpreted["list"][0] == pytest.approx(math.sqrt(squares), rel=1e-6)
    assert interpreted["list"][1] == zeros
    # One launch per readable (device, dtype) for each statistic: float32 (with its non-contiguous grad left to
    # torch), bf16 and fp16; the float64 grad is torch's.
    assert sorted(interpreted["list"][2]) == sorted([len(_table(torch.float32)), len(_table(torch.bfloat16)), 2] * 2)


def test_float32_squares_are_summed_in_float64(interpreted: dict[str, Any]) -> None:
    """The squares of a 256-element tensor of 1e18 fit one program's float32 partial; 1,024 of them do not fit
    float32 (the norm does)."""
    want = math.sqrt(1024 * 1e36)
    assert interpreted["large"] == pytest.approx(want, rel=1e-6)


def test_squares_beyond_float32s_range_are_exact_in_the_kernels_float64_lanes(interpreted: dict[str, Any]) -> None:
    """Before, each lane summed float32 squares: grads of 1e20 gave an infinite norm, of 1e-25 a norm of 0 (each
    rescued by a host read and two more reads). Now each element is cast to float64 before it is squared."""
    beyond, reads = interpreted["beyond"]
    assert reads == 4  # every one through the kernel
    for (dtype, size), norm in beyond.items():
        value = float(torch.tensor(size, dtype=getattr(torch, dtype.removeprefix("torch."))).double())
        assert norm == pytest.approx(value * math.sqrt(300), rel=1e-6), (dtype, size)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_scale_kernel_gives_torchs_bits_and_leaves_a_coefficient_of_one_alone(
    interpreted: dict[str, Any], dtype: torch.dtype
) -> None:
    """Bit for bit, but for bf16 with a coefficient: triton's interpreter rounds float32 to bf16 toward zero where
    the compiled kernel rounds to nearest even (torch's rounding; ``scripts/gpu_check.py`` checks those bits on a
    GPU), so there one bf16 unit in the last place is allowed. The reference's coefficient is of the grads' dtype,
    as torch on CUDA casts a 0-dim coefficient (the kernel rounds it so too). A coefficient of 1 leaves every bit,
    NaN included."""
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    for coeff in (0.37, 1.0):
        want = _scale_inputs(dtype)
        if coeff != 1.0:
            torch._foreach_mul_(want, torch.tensor(coeff, dtype=dtype))
        ulps = 1 if dtype == torch.bfloat16 and coeff != 1.0 else 0
        for got, expected in zip(interpreted["scaled"][(str(dtype), coeff)], want, strict=True):
            apart = (got.view(bits).int() - expected.view(bits).int()).abs()
            nan = expected.isnan()
            if coeff != 1.0:  # NaN stays NaN (its payload is the hardware's)
                assert torch.equal(got.isnan(), nan) and not bool(nan.all())
                apart = apart[~nan]
            assert int(apart.max()) <= ulps, (coeff, got, expected)


@pytest.mark.parametrize("dtype", DTYPES)
def test_clipping_from_the_norm_gives_the_bits_of_torchs_coefficient(
    interpreted: dict[str, Any], dtype: torch.dtype
) -> None:
    """The kernel makes clipping's coefficient from the norm on the device: every bit as scaling by the coefficient
    torch's route computes (``clip_coefficient``), across a clamp at 1, float32 against bf16 rounding, a max_norm
    whose bits fit int32, and NaN and infinite norms (nothing scaled)."""
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    for case, (max_norm, norm) in enumerate(CLIPS):
        from_norm, by_coefficient = interpreted["clipped"][(str(dtype), case)]
        unscaled = _scale_inputs(dtype)
        for got, want, before in zip(from_norm, by_coefficient, unscaled, strict=True):
            assert torch.equal(got.view(bits), want.view(bits)), (max_norm, norm, got, want)
            if not math.isfinite(norm) or max_norm > norm:
                assert torch.equal(got.view(bits), before.view(bits))
    scaled = interpreted["clipped"][(str(dtype), 0)][0]
    assert not all(map(torch.equal, scaled, _scale_inputs(dtype)))  # the first case does scale


def test_a_model_is_read_and_clipped_through_the_kernels(interpreted: dict[str, Any]) -> None:
    through_model, returned, clipped, launches = interpreted["model"]
    # One read per kind (float32, bf16) per call, and the clip's scaling one launch per kind.
    assert sorted(launches) == ["clip"] * 2 + ["read"] * 6
    grads = [param.grad for param in _model().parameters()]
    squares, zeros = _oracle(grads)
    for norm, count in through_model:
        assert norm == pytest.approx(math.sqrt(squares), rel=1e-6) and count == zeros
    assert returned == pytest.approx(math.sqrt(squares), rel=1e-6)
    coeff = 0.5 / (math.sqrt(squares) + 1e-6)
    for got, grad in zip(clipped, grads, strict=True):
        rtol = 1e-2 if grad.dtype == torch.bfloat16 else 1e-6
        torch.testing.assert_close(got.double(), grad.double() * coeff, rtol=rtol, atol=1e-30)


def test_a_norm_the_kernel_does_not_compute_is_read_once_by_torch(interpreted: dict[str, Any]) -> None:
    """The 1-norm and the inf-norm without the zero count: torch's route reads the grads, the kernel reads nothing
    (it computes squares and zeros only; it read every grad for nothing before)."""
    (one, peak), launches = interpreted["other norms"]
    clipped = torch.cat([grad.double().flatten() for grad in interpreted["model"][2]])
    assert launches == []
    assert one == pytest.approx(float(clipped.abs().sum()), rel=1e-2)  # the bf16 layer's norm is torch's, in bf16
    assert peak == pytest.approx(float(clipped.abs().max()), rel=1e-2)


def test_not_available_off_cuda() -> None:
    assert not fused_stats.can_run_fused_stats(torch.device("cpu"))


def test_a_device_where_the_kernel_cannot_launch_keeps_the_torch_path(caplog: pytest.LogCaptureFixture) -> None:
    """The first launch on a device is a probe; a failure (no GPU here, on a GPU a compiler missing) is logged and
    the torch path runs."""
    with caplog.at_level("WARNING"):
        assert fused_stats._works_on.__wrapped__(0) is False
    assert "one_read_stats_unavailable" in caplog.text


def test_a_nan_in_a_grad_no_rank_counts_is_read_by_the_kernel(interpreted: dict[str, Any]) -> None:
    """A ``shared`` copy's NaN or inf makes the norm NaN or infinite through the kernel's read too; the zero count
    stays that of the counted grads, and the clip scales nothing."""
    uncounted, launches = interpreted["uncounted"]
    counted = [param.grad for name, param in _model().named_parameters() if name != "0.bias"]
    want_zeros = sum(int((grad == 0).sum()) for grad in counted)
    for poison, (norm, zeros, returned, unscaled) in uncounted.items():
        assert (math.isnan(norm) and math.isnan(returned)) if poison == "nan" else norm == returned == math.inf
        assert zeros == want_zeros and unscaled, poison
    # Each call reads the counted float32 and bf16 kinds and the shared float32 copy: three launches (two before).
    assert launches.count("read") == 3 * 2 * len(uncounted), launches



def test_the_finishing_kernel_gives_the_bits_of_the_reductions_torch_operations(interpreted: dict[str, Any]) -> None:
    """The reduced rows made results in one launch (the 2-norm from its range columns, the zero count, the norm in
    float32 and as a clip returns it): every case's bits equal those of the torch operations the reductions run off
    the kernels, NaN, inf, values beyond float32 and the range columns included."""
    finished = dict(interpreted["finished"])
    assert finished.pop("zeros only") == ([None, 8], [None, 8])
    for name, (kernel, torch_path) in finished.items():
        assert kernel == torch_path, name
    assert len(finished) == len(FINISH_ROWS)


def test_a_model_finished_by_the_kernel_gives_the_samebits(interpreted: dict[str, Any]) -> None:
    """``grad_norm_and_zeros``, ``grad_norm`` and ``clip_grad_norm_`` on a model: the same bits and the same clipped
    grads whether the kernel or torch's operations finish the reduction; the kernel finished each of the three calls
    where asked to, and none otherwise."""
    through = interpreted["finished through a model"]
    assert through["by kernel True"] == through["by kernel False"]
    assert through["launches"] == [True, True, True]


def test_a_grad_of_another_dtype_at_the_planned_address_is_read_in_its_dtype(interpreted: dict[str, Any]) -> None:
    """A new grad object of the same element count and contiguity at the address the kernel's reads were planned for,
    but of another dtype (its parameter converted, the grad set anew over the old grad's memory): read as bf16, not
    as the float32 the reads were planned for (before: the bias was read at its float32 offset in bf16 elements,
    192)."""
    first, second = interpreted["another dtype at the address"]
    as_float32 = [float(torch.full((2,), value, dtype=torch.bfloat16).view(torch.float32)) for value in (3.0, 5.0)]
    assert first == pytest.approx(math.sqrt(64 * 64 * as_float32[0] ** 2 + 64 * as_float32[1] ** 2), rel=1e-6)
    assert second == pytest.approx(math.sqrt(64 * 64 * 9.0 + 64 * 25.0), rel=1e-6)

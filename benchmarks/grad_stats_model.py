"""Benchmark: the public grad statistics over a model, as a training loop calls them, against torch in the same run.

One process, a collection with every axis off (a world of one rank: nothing is reduced across ranks, so the rows
measure the local read and the host work per call). The model holds ``--params`` parameters (pairs of a weight and
a bias per module, sizes spread over two orders of magnitude) filling ``--bytes``, every grad set, about 30% exact
zeros. Each row is timed in this run, median of ``--repeat`` after ``--warmup`` (CUDA events on a GPU, each run
bracketed on the stream, so a call's device work is inside its time), torch's calls first, then pgregistry's:

- ``norm``, ``zeros``, ``norm + zeros``: torch's ``get_total_norm(grads, foreach=True)`` and a ``count_nonzero``
  loop over the grads (the list built once, outside the timing: the most favourable baseline) against
  ``grad_norm(model, pg)``, ``count_zeros(model, pg)``, both (two calls) and ``grad_norm_and_zeros(model, pg)``
  (one call, one read);
- ``clip, nothing to scale``: torch's ``clip_grad_norm_(params, max_norm, foreach=True)`` (parameter list built
  once) against ``clip_grad_norm_(model, max_norm, pg)``, ``max_norm`` four times the norm;
- ``clip, scaling``: the same two calls where every call scales: ``max_norm`` starts at a quarter of the norm and
  is halved before each call, so each call finds the grads at the norm the call before clipped them to, twice its
  own ``max_norm`` (a fixed ``max_norm`` scales once, then finds nothing to scale).

Those rows call on the same grad objects again and again (a loop that zeroes its grads in place, or pgregistry's
optimizers, whose grads are views of one buffer): pgregistry's kept plan then takes its fastest path (the grads it
planned for, known by their identity and addresses). torch's ``optimizer.zero_grad()`` sets every grad to ``None``
instead (``set_to_none=True``, its default), so each backward makes new grad objects: the rows named ``..., new
grads each call`` time that path. Before each call, outside its timing (``benchmarks.common.measure``'s
``prepare``; on CUDA the stream synchronized after it), every parameter's grad is set to ``None`` (freed) and then
given a new tensor holding the same values (a clone of a saved copy, made in parameter order), so every call reads
new grad objects: at new addresses where the allocator hands back other memory (the CPU's, mostly), at the old ones
where it hands back the same blocks (CUDA's caching allocator, mostly); the output says how many came back at their
predecessor's address. torch's calls read the new grads from the parameters inside their timing too.

- ``norm, new grads each call``, ``norm + zeros, new grads each call`` (pgregistry's one call);
- ``clip, new grads each call``: ``max_norm`` a quarter of the norm; as the new grads hold the saved values, every
  call finds the full norm and scales by a quarter.

Each of those rows checks every call (warm-up too, outside the timing, before the next call's new grads): its
statistics against the float64 oracle, pgregistry's call not taken by the kept plan's path for the grads it planned
for (the plan's count of calls in a row whose grads were not those objects is above zero after each call: a call
that took that path with new grads would have read stale objects), and the grads it left: unchanged (their float64
norm bit for bit), or for the clip the saved values times the coefficient of the norm it returned.

Every row checks its work after it is timed, and the run fails (exit 1) when a row's work did not happen: the last
call's statistics against a float64 oracle of the grads (relative 1e-4 for float32, 1e-2 for bf16 where torch keeps
per-tensor norms in bf16; zero counts exactly), the grads unchanged by every row but the scaling one (their float64
norm bit for bit), one more call after the grads were halved (outside the timing) seeing them halved (no row
times a kept result), and for the scaling rows every call's returned norm against the norm the call before left (the
call scaled by the coefficient it reported, ``max_norm / (norm + 1e-6)``, below 0.67 each time) and the grads' norm
after the last call against that call's. The grads are restored from a copy (outside the timing) before each row.

Floors, measured in the same run and stated in the output:

- byte floor: the bytes any implementation must move through device memory (read every grad once for a statistic;
  for a clip that scales, read them for the norm, then read and write them to scale: three times the grads'
  bytes), at the bandwidth of a device-to-device copy of the grads' size (64 MiB at least) measured in this run
  (bytes read plus bytes written);
- host floor: the least host work any implementation must do per call: each parameter's ``.grad`` read once from
  Python at C speed (``map`` over a parameter list built beforehand; torch's ``clip_grad_norm_`` starts with that
  too), nothing else: no walk of the model, no check of a kept plan, no address, no launch. Timed two ways (the
  getter as is, and with the ``__torch_function__`` question of ``nn.Parameter`` off), interleaved, and the lesser
  median taken (``benchmarks.common.host_floor``), so it is no implementation's own reads; measured between each
  row's own runs (in rounds: a loaded host's speed drifts within seconds).

A row that makes two calls has twice each floor. Each row prints its ratio to the larger floor, torch's too.

It also prints the memory the kept classification takes (Python objects, by ``tracemalloc``, and device memory),
per parameter.

With ``--pieces``, it also prints where a steady-state call's host time goes: each piece of the kept plan's check
(the door, the parameter set, the roles, the grads' reads, their identity and addresses) timed alone, then the whole of
that host path as a call runs it (door to the checked pieces, before any read of their values), interleaved with the
host floor, in nanoseconds a parameter. Each piece must give a steady-state call's answer (the same plan, its
planned grads taken as they are) before and after its timing, or the run stops: a piece that missed, or a plan made
anew, would time another path than a steady-state call takes.

With ``--stages``, it prints a steady ``grad_norm`` call's host time stage by stage (the arguments, the door and the
kept plan's check, the read with its launches, the reduction with the finishing launch, the result) beside the whole
call and the host floor, in microseconds a call: the private steps of the entry point's one way down, the staged
call's norm held bit for bit to the entry point's and its path to a steady call's.

Usage: ``python benchmarks/grad_stats_model.py --device cuda`` (2 GiB over 2,000 and 20,000 parameters) or
``--device cpu`` (20,000 parameters of 64 elements by default: the host cost); ``--dtype bfloat16``; ``--marked``
(every parameter carries the attributes Megatron's TP layers set, so the kept plan's roles check compares values).
"""

from __future__ import annotations

import argparse
import math
import operator
import os
import statistics
import sys
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from benchmarks.common import (  # noqa: E402
    GiB,
    MiB,
    Target,
    copy_bandwidth,
    describe_device,
    fill_,
    finish,
    host_floor,
    host_floor_runs,
    lesser_median,
    measure_runs,
    norm64,
    selected_device,
    tensor_sizes,
)
from pgregistry._runtime.resolve import resolve_pg_collection, source_of  # noqa: E402
from pgregistry.collection import FIELD_NAMES, ProcessGroupCollection  # noqa: E402
from pgregistry.grad_stats import _fused as fused  # noqa: E402
from pgregistry.grad_stats import _plan as plans  # noqa: E402
from pgregistry.grad_stats import clip_grad_norm_, count_zeros, grad_norm, grad_norm_and_zeros  # noqa: E402
from pgregistry.grad_stats._compiled import ENV as COMPILED_ENV  # noqa: E402
from pgregistry.grad_stats._compiled import steady_checks  # noqa: E402
from pgregistry.grad_stats._fused import can_run_fused_stats  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
OFF = ProcessGroupCollection(**dict.fromkeys(FIELD_NAMES))
"""Every axis off: one rank, nothing reduced across ranks."""
EPSILON = 1e-6
"""Both clips' ``max_norm / (norm + 1e-6)``."""
GOAL = 1.25
"""A pgregistry row's most time over the larger of its floors."""
MEGATRON_TP_MARKS = {"tensor_model_parallel": True, "partition_dim": 0, "partition_stride": 1}
"""What ``--marked`` sets on every parameter, as Megatron's TP layers mark theirs: the kept plan then compares
their roles' values each call, not only that the parameters still carry no attributes (with every axis off each is
counted, as unmarked)."""


def make_model(count: int, numel: int, dtype: torch.dtype, device: torch.device, *, marked: bool = False) -> nn.Module:
    """``count`` parameters in ``count // 2`` modules holding about ``numel`` elements: a weight matrix of rows of
    16 elements (its size rounded up to whole rows) and a bias vector each. ``marked``: every parameter carries
    the attributes Megatron's TP layers set on theirs (:data:`MEGATRON_TP_MARKS`)."""
    sizes = tensor_sizes(count, numel)
    model = nn.Module()
    layers = nn.ModuleList()
    for first in range(0, count, 2):
        layer = nn.Module()
        for name, size in zip(("weight", "bias"), sizes[first : first + 2], strict=False):
            shape = (-(-size // 16), 16) if name == "weight" else (size,)
            setattr(layer, name, nn.Parameter(torch.empty(shape, dtype=dtype, device=device)))
        layers.append(layer)
    model.layers = layers
    params = list(model.parameters())
    for param in params if marked else ():
        for name, value in MEGATRON_TP_MARKS.items():
            setattr(param, name, value)
    for param in params:
        param.grad = torch.empty_like(param)
    fill_([param.grad for param in params], seed=1)
    return model


def kept_size(model: nn.Module, device: torch.device) -> tuple[float, float]:
    """Bytes per parameter of the kept classification, made anew (another collection: ``hcp`` left unset) and
    measured while it is made and kept: Python objects (tracemalloc) and device memory (the launch tables)."""
    params = sum(1 for _ in model.parameters())
    collection = ProcessGroupCollection(**dict.fromkeys(name for name in FIELD_NAMES if name != "hcp"))
    fused._TABLES = fused._Tables(8)  # the launch tables are kept by addresses: make them afresh too
    plans._KEPT.pop(model, None)  # and the kept plan, which holds its launch tables
    torch.cuda.empty_cache() if device.type == "cuda" else None
    before_device = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    tracemalloc.start()
    grad_norm_and_zeros(model, collection)
    clip_grad_norm_(model, 1e30, collection)  # the clip's tables too
    first = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    kept_device = (torch.cuda.memory_allocated(device) - before_device) if device.type == "cuda" else 0
    grad_norm_and_zeros(model, OFF)  # back to the benchmark's plan
    return first / params, kept_device / params


class Halving:
    """A clip whose every call scales: ``max_norm`` starts at a quarter of the grads' norm and halves before each
    call, so each call finds the grads at the norm the call before clipped them to, about twice its own
    ``max_norm``. Keeps each call's ``max_norm`` and returned norm (device tensors: no sync inside the timing) for
    :meth:`problems`."""

    def __init__(self, clip: Callable[[float], torch.Tensor], norm: float) -> None:
        self.clip = clip
        self.next = norm / 4
        self.max_norms: list[float] = []
        self.norms: list[torch.Tensor] = []

    def __call__(self) -> None:
        self.max_norms.append(self.next)
        self.norms.append(self.clip(self.next))
        self.next /= 2

    def problems(self, row: str, first: float, last: float, tolerance: float) -> list[str]:
        """Whether every call scaled by the coefficient of the norm it reported: the first call found the grads'
        norm ``first``, each later call the norm the one before left (``norm * coefficient``), every coefficient
        below 0.67, and the grads' norm ``last`` after the run is the last call's."""
        found = [float(norm) for norm in self.norms]
        expected = [first] + [norm * _coefficient(m, norm) for m, norm in zip(self.max_norms, found, strict=True)]
        problems = []
        for call, (norm, want, max_norm) in enumerate(zip(found, expected, self.max_norms, strict=False)):
            if not math.isclose(norm, want, rel_tol=tolerance):
                problems.append(f"{row}: call {call} found the norm {norm:.7g}, not {want:.7g}: a call before it did "
                                "not scale by the coefficient of the norm it reported")
                break
            if not _coefficient(max_norm, norm) < 0.67:
                problems.append(f"{row}: call {call} had nothing to scale (norm {norm:.7g}, max_norm {max_norm:.7g})")
                break
        if not problems and not math.isclose(last, expected[-1], rel_tol=tolerance):
            problems.append(f"{row}: the grads' norm after the last call is {last:.7g}, not {expected[-1]:.7g}: the "
                            "last call did not scale them")
        return problems


def _coefficient(max_norm: float, norm: float) -> float:
    return min(1.0, max_norm / (norm + EPSILON))


def oracle(grads: list[torch.Tensor]) -> tuple[float, int]:
    """The grads' norm in float64 and their exact zero count: what every row's statistics are checked against."""
    nonzero = torch.stack([torch.count_nonzero(grad) for grad in grads]).sum()
    return norm64(grads), sum(grad.numel() for grad in grads) - int(nonzero)


class NewGrads:
    """Before each call (``measure``'s untimed ``prepare``): every parameter's grad set to ``None`` (freed), then a new
    tensor holding the saved values (a clone, in parameter order), as ``zero_grad(set_to_none=True)`` and a backward
    give. Checks the call before it (:meth:`check_call`) and counts the new grads that came at their predecessor's
    address (the allocator's choice, which decides what a kept plan may keep)."""

    def __init__(self, params: list[nn.Parameter], saved: list[torch.Tensor]) -> None:
        self.params, self.saved = params, saved
        self.grads: list[torch.Tensor] = []
        """The grads the next call reads (held here too: no call may keep them alive in their place)."""
        self.given = self.at_old_address = 0
        self.check_call: Callable[[], None] | None = None
        """Run first, on the call just made (outside the timing)."""

    def __call__(self) -> None:
        if self.check_call is not None and self.grads:
            self.check_call()
        old_addresses = [param.grad.data_ptr() if param.grad is not None else 0 for param in self.params]
        self.grads = []
        for param in self.params:
            param.grad = None
        for param, values in zip(self.params, self.saved, strict=True):
            param.grad = values.clone()
        self.grads = [param.grad for param in self.params]
        self.given += len(self.grads)
        self.at_old_address += sum(map(operator.eq, old_addresses, map(torch.Tensor.data_ptr, self.grads)))


def plan_misses(model: nn.Module) -> int:
    """How many calls in a row the kept plan of ``model`` found grads that were not the objects it planned for (0
    after a call its path for those objects read: ``pgregistry/grad_stats/_plan.py``'s ``_Layout.misses``)."""
    layout = plans._KEPT[model].plan._layout
    if layout is None:
        raise RuntimeError("the kept plan of the benchmark's model has no layout after a call")
    return layout.misses


class Row:
    """One row: a label, torch's call and pgregistry's, how many calls each makes (the floors' multiple), the
    grads' bytes one call must move over the grads' size (the byte floor's multiple), and what the last call must
    have returned (``norm``, ``zeros``: which statistics, from ``read(result)``)."""

    def __init__(self, label: str, theirs: Callable[[], Any], ours: Callable[[], Any], *, calls: int = 1,
                 moves: int = 1, read: Callable[[Any, Any], tuple[Any, Any]] | None = None,
                 new_grads: NewGrads | None = None) -> None:
        self.label, self.calls, self.moves = label, calls, moves
        self.fns = {"torch": theirs, "pgregistry": ours}
        self.read = read
        self.new_grads = new_grads
        """Given: every call reads new grads (:class:`NewGrads`, run before each call outside its timing)."""
        self.last: dict[str, Any] = {}

    def recorded(self, who: str) -> Callable[[], None]:
        fn = self.fns[who]

        def call() -> None:
            self.last[who] = fn()

        return call


def run(count: int, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    dtype = DTYPES[args.dtype]
    model = make_model(count, args.bytes // torch.finfo(dtype).bits * 8, dtype, device, marked=args.marked)
    params = list(model.parameters())
    numel = sum(param.numel() for param in params)
    nbytes = numel * torch.finfo(dtype).bits // 8
    grads = [param.grad for param in params]
    saved = [grad.clone() for grad in grads]
    norm, zeros = oracle(grads)
    tolerance = 1e-2 if args.dtype == "bfloat16" else 1e-4  # torch keeps bf16 grads' per-tensor norms in bf16

    def torch_norm() -> torch.Tensor:
        return torch.nn.utils.get_total_norm(grads, 2.0, foreach=True)

    def torch_zeros() -> torch.Tensor:
        return numel - torch.stack([torch.count_nonzero(grad) for grad in grads]).sum()

    def torch_clip(max_norm: float) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)

    def ours_clip(max_norm: float) -> torch.Tensor:
        return clip_grad_norm_(model, max_norm, OFF)

    both = (lambda result: result, lambda result: result)
    rows = [
        Row("norm", torch_norm, lambda: grad_norm(model, OFF), read=lambda r: (r, None)),
        Row("zeros", torch_zeros, lambda: count_zeros(model, OFF), read=lambda r: (None, r)),
        Row("norm + zeros, two calls", lambda: (torch_norm(), torch_zeros()),
            lambda: (grad_norm(model, OFF), count_zeros(model, OFF)), calls=2, read=both[0]),
        Row("norm + zeros, one call", lambda: (torch_norm(), torch_zeros()), lambda: grad_norm_and_zeros(model, OFF),
            read=both[1]),
        Row("clip, nothing to scale", lambda: torch_clip(4 * norm), lambda: ours_clip(4 * norm),
            read=lambda r: (r, None)),
        Row("clip, scaling", Halving(torch_clip, norm), Halving(ours_clip, norm), moves=3),
    ]
    new_grads = NewGrads(params, saved)

    def torch_norm_new() -> torch.Tensor:  # torch reads the new grads from the parameters too
        return torch.nn.utils.get_total_norm([param.grad for param in params], 2.0, foreach=True)

    def torch_zeros_new() -> torch.Tensor:
        return numel - torch.stack([torch.count_nonzero(param.grad) for param in params]).sum()

    rows += [
        Row("norm, new grads each call", torch_norm_new, lambda: grad_norm(model, OFF), read=lambda r: (r, None),
            new_grads=new_grads),
        Row("norm + zeros, new grads each call", lambda: (torch_norm_new(), torch_zeros_new()),
            lambda: grad_norm_and_zeros(model, OFF), read=both[1], new_grads=new_grads),
        Row("clip, new grads each call", lambda: torch_clip(norm / 4), lambda: ours_clip(norm / 4), moves=3,
            read=lambda r: (r, None), new_grads=new_grads),
    ]
    clip_grad_norm_(model, 1e30, OFF)  # compiles the scale kernel first: its compilation is no kept memory
    per_param = kept_size(model, device)
    bandwidth = copy_bandwidth(max(nbytes, 64 * MiB), device)
    results: dict[str, dict[str, float]] = {}
    problems: list[str] = []
    for row in rows:
        times = {}
        floors: tuple[list[float], list[float]] = ([], [])
        for who in ("torch", "pgregistry"):  # one after the other: the scaling rows' calls each follow their own
            torch._foreach_copy_(grads, saved)
            if row.new_grads is None:
                times[who] = timed_beside_floor(row.recorded(who), params, floors, device, args)
                if who == "pgregistry":
                    times["back to back"] = back_to_back(row.recorded(who), device, args.repeat)
                problems += check_row(row, who, grads, (norm, zeros), tolerance)
                continue
            found: list[str] = []
            row.new_grads.check_call = lambda row=row, who=who, found=found: found.extend(
                check_new_grads_call(row, who, model, row.new_grads, (norm, zeros), tolerance))
            times[who] = timed_beside_floor(row.recorded(who), params, floors, device, args, prepare=row.new_grads)
            row.new_grads.check_call()
            row.new_grads.check_call, row.new_grads.grads = None, []
            for param, grad in zip(params, grads, strict=True):  # the benchmark's own grads back, for the next rows
                param.grad = grad
            problems += found[:1]  # the first problem found: every later call would repeat it
        one_call = lesser_median(floors)
        results[row.label] = {
            **times,
            "bytes": row.calls * row.moves * nbytes / bandwidth * 1e3,
            "host": row.calls * one_call,
            "host a call": one_call,
        }
    torch._foreach_copy_(grads, saved)
    return {"count": count, "bytes": nbytes, "results": results, "problems": problems, "kept": per_param,
            "bandwidth": bandwidth, "oracle": (norm, zeros),
            "new grads": (new_grads.at_old_address, new_grads.given)}


ROUNDS = 4
"""The rounds each row's timed runs are cut into, each followed by as many runs of the host floor."""


def timed_beside_floor(fn: Callable[[], Any], params: list[nn.Parameter], floors: tuple[list[float], list[float]],
                       device: torch.device, args: argparse.Namespace,
                       prepare: Callable[[], Any] | None = None) -> float:
    """The median milliseconds of ``fn`` over ``--repeat`` runs (rounded up to whole rounds) after ``--warmup``, in
    :data:`ROUNDS` rounds, each followed by as many runs of the host floor, added to ``floors`` (one list a way of
    reading the grads, ``benchmarks.common.host_floor_runs``). A loaded host's speed drifts within seconds: timed
    once after each row, the floor moved between 2.3 and 3.7 ms from row to row of one H100 run at 20,000
    parameters; timed between the row's own runs, the row and its floor see the same host."""
    per_round = -(-args.repeat // ROUNDS)
    runs: list[float] = []
    for index in range(ROUNDS):
        runs += measure_runs(fn, device, args.warmup if index == 0 else 0, per_round, prepare)[0]
        for mine, new in zip(floors, host_floor_runs(params, 0, per_round), strict=True):
            mine += new
    return statistics.median(runs)


def back_to_back(fn: Callable[[], Any], device: torch.device, calls: int) -> float:
    """Milliseconds a call of ``fn`` over ``calls`` calls made back to back, one bracket around them all: what a
    call costs in a loop whose host runs ahead of its device, where one call's host work hides under the device
    work before it (a training step's clip after its backward). Each row's own time brackets every call alone: the
    device idles at its start until the host has read the grads and launched, so its least is the host floor
    plus the byte floor, not the larger of the two; back to back, the least is the larger."""
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        torch.cuda.synchronize(device)
        return start.elapsed_time(end) / calls
    began = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - began) * 1e3 / calls


def check_new_grads_call(
    row: Row, who: str, model: nn.Module, new_grads: NewGrads, want: tuple[float, int], tolerance: float
) -> list[str]:
    """The call just made on new grads (outside the timing): pgregistry's call was not taken by the kept plan's path
    for the grads it planned for (:func:`plan_misses` above zero: that path on new grads would read stale objects),
    its statistics are the oracle's, and a clip left the grads scaled by the coefficient of the norm it returned."""
    name = f"{len(new_grads.params):,} parameters, {who} {row.label}"
    problems = []
    if who == "pgregistry" and plan_misses(model) == 0:
        problems.append(f"{name}: the call took the kept plan's path for the grads it planned for, but its grads "
                        "were new objects (a stale plan's read)")
    got_norm, value_problems = _returned_values(row, who, name, want, tolerance)
    problems += value_problems
    after = norm64(new_grads.grads)
    scaled = row.moves > 1
    expected = want[0] * (_coefficient(want[0] / 4, float(got_norm)) if scaled else 1.0)
    if not math.isclose(after, expected, rel_tol=tolerance if scaled else 0.0):
        problems.append(f"{name}: left the grads at the norm {after:.7g}, not {expected:.7g}"
                        f"{' (not scaled by the coefficient of the norm it returned)' if scaled else ''}")
    return problems


def check_row(row: Row, who: str, grads: list[torch.Tensor], want: tuple[float, int], tolerance: float) -> list[str]:
    """What the row's last timed call returned and left in the grads (see the module docstring); then, for a
    statistics row, one more call after the grads were halved (outside the timing) must see them halved: a call
    that returned a kept result would time no read."""
    name = f"{len(grads):,} parameters, {who} {row.label}"
    fn = row.fns[who]
    if isinstance(fn, Halving):
        return fn.problems(name, want[0], oracle(grads)[0], tolerance)
    problems = _returned(row, who, name, grads, want, tolerance)
    torch._foreach_mul_(grads, 0.5)  # exact: the norm halves, the zeros stay
    row.recorded(who)()
    return problems + _returned(row, who, f"{name} (grads halved)", grads, (want[0] / 2, want[1]), tolerance)


def _returned(
    row: Row, who: str, name: str, grads: list[torch.Tensor], want: tuple[float, int], tolerance: float
) -> list[str]:
    problems = []
    after = oracle(grads)
    if after != want:
        problems.append(f"{name}: changed the grads (norm {after[0]!r}, zeros {after[1]} after, {want} before)")
    problems += _returned_values(row, who, name, want, tolerance)[1]
    return problems


def _returned_values(
    row: Row, who: str, name: str, want: tuple[float, int], tolerance: float
) -> tuple[Any, list[str]]:
    """The norm the row's last call by ``who`` returned (``None`` for a zero count alone), and what in its
    statistics differs from ``want`` (the oracle's norm and zero count)."""
    assert row.read is not None
    got_norm, got_zeros = row.read(row.last[who])
    problems = []
    if got_norm is not None and not math.isclose(float(got_norm), want[0], rel_tol=tolerance):
        problems.append(f"{name}: returned the norm {float(got_norm):.7g}, not {want[0]:.7g}")
    if got_zeros is not None and int(got_zeros) != want[1]:
        problems.append(f"{name}: returned {int(got_zeros):,} zeros, not {want[1]:,}")
    return got_norm, problems


FLOOR_PIECE = "host floor (each .grad, C speed)"
WHOLE_PIECE = "whole: door to the checked pieces"
"""The host path of a steady-state call up to its reads, the pieces above it in a row as the call runs them."""


def host_pieces(model: nn.Module, warmup: int, repeat: int) -> dict[str, float]:
    """Where a steady-state call's host time goes (``--pieces``): each piece of the kept plan's check timed alone, then
    their whole as a call runs it (:data:`WHOLE_PIECE`), interleaved with the host floor run by run, in nanoseconds a
    parameter (medians). The pieces are pgregistry's own (private) steps, so this names what each costs beside the
    floor, not a floor. ``RuntimeError`` when a piece does not give a steady-state call's answer, before or after its
    timing (a check that missed, or a plan made anew, would time another path than a steady-state call takes)."""
    params = list(model.parameters())
    grad_norm(model, OFF)
    grad_norm(model, OFF)  # the plan and its planned grads made
    source = source_of(model)
    kept = plans._KEPT[model]
    layout = kept.plan._layout
    planned = layout.planned_for if layout is not None else None
    if layout is None or planned is None:
        raise RuntimeError("--pieces: the kept plan has no planned grads (every grad should be a plain tensor)")
    grads = plans._grads_of(params)

    def whole() -> bool:
        given = source_of(model)
        collection = resolve_pg_collection(OFF, given.chunks, owner="bench")
        plan, ordered, _ = plans.check_or_make_plan(given, collection, "bench")
        steady = plan._layout
        return (
            plan is kept.plan
            and steady is layout
            and planned.pieces_from(ordered, steady.take_plain)[0] is not None
        )

    pieces: dict[str, tuple[Callable[[], Any], Callable[[Any], bool]]] = {  # each piece, and its steady answer
        "door (taken apart, resolved)": (
            lambda: resolve_pg_collection(OFF, source_of(model).chunks, owner="bench"),
            lambda collection: collection == OFF,
        ),
        "kept: parameter set": (lambda: kept.plan_params(source), lambda params_read: params_read is kept.params),
        "kept: roles": (kept._same_roles, lambda same: same is True),
        **(
            {
                "grads read (pgregistry's)": (
                    lambda: plans._grads_of(params),
                    lambda read: len(read) == len(grads) and all(map(operator.is_, read, grads)),
                ),
                # what _Planned.pieces_of compares, the planned grads alive (no death noted); every grad a piece here
                "planned grads: identity": (
                    lambda: planned._are_planned(grads, grads),
                    lambda same: same and not planned.deaths,
                ),
                "planned grads: addresses": (lambda: planned._at_planned_addresses(grads), lambda same: same is True),
            }
            if planned.checks is None
            else {  # the compiled pass (grad_stats._compiled): the grads read, their identity and addresses at once
                "planned grads: compiled pass": (
                    lambda: planned.pieces_from(params, layout.take_plain)[0],
                    lambda read: read is not None and all(map(operator.is_, read, grads)),
                ),
            }
        ),
        WHOLE_PIECE: (whole, lambda same: same is True),
    }

    def check_answers(when: str) -> None:
        for label, (piece, steady) in pieces.items():
            if not steady(piece()):
                raise RuntimeError(f"--pieces: {label!r} did not give a steady-state call's answer {when}: it would "
                                   "time another path than a steady-state call takes")

    check_answers("before the timing")
    times: dict[str, list[float]] = {FLOOR_PIECE: [], **{label: [] for label in pieces}}
    for run_index in range(warmup + repeat):
        took = {FLOOR_PIECE: host_floor(params, 0, 1) / 1e3}
        for label, (piece, _) in pieces.items():
            start = time.perf_counter()
            piece()
            took[label] = time.perf_counter() - start
        if run_index >= warmup:
            for label, seconds in took.items():
                times[label].append(seconds)
    check_answers("after the timing")
    return {label: statistics.median(runs) / len(params) * 1e9 for label, runs in times.items()}


STAGES = ("arguments", "door and the kept plan's check", "grads checked and read (launches)",
          "reduction and finish (launch)", "the result")
"""The stages of a steady ``grad_norm(model, pg)`` as its one way down runs them (``--stages``)."""


def host_stages(model: nn.Module, device: torch.device, warmup: int, repeat: int) -> dict[str, float]:
    """Where a steady ``grad_norm`` call's host time goes, stage by stage (``--stages``), in microseconds a call
    (medians), beside the whole call timed the same way and the host floor, interleaved run by run.

    Each stage is the private step the entry point takes (``_functional._read_reduce_and_clip`` for a norm without
    a clip: the arguments, the door and the kept plan's check, the plan's read, the reduction, the returned norm),
    so the stages follow that code: ``RuntimeError`` when the staged call's norm is not the entry point's, bit for
    bit, or the kept plan was made anew or missed its planned grads (another path than a steady call's). On a GPU
    the device is synchronised before each run, outside the timing: each figure is host time, the device's work
    left queued, as a training loop leaves it."""
    from pgregistry.grad_stats import _functional as functional
    from pgregistry.grad_stats._arguments import arguments_of_call
    from pgregistry.grad_stats._reductions import Wanted, check_arguments_after, reduce_shares

    params = list(model.parameters())

    @torch.no_grad()
    def staged(took: dict[str, float]) -> torch.Tensor:
        clock = [time.perf_counter()]

        def lap(label: str) -> None:
            clock.append(time.perf_counter())
            took[label] = (clock[-1] - clock[-2]) * 1e6

        given = arguments_of_call(2.0, None, clip=False)
        wanted = Wanted(given.p, zeros=False)
        lap(STAGES[0])
        checked = functional._check_params_and_plan(model, OFF, "grad_norm")
        lap(STAGES[1])
        read = checked.plan.read(checked.params, wanted)
        lap(STAGES[2])
        reduced = reduce_shares(
            read.shares, reread=lambda again: checked.plan.read(checked.params, again).shares, given=given
        )
        check_arguments_after(reduced, given, "grad_norm")
        lap(STAGES[3])
        norm = reduced.norm
        lap(STAGES[4])
        return norm

    def synchronize() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    grad_norm(model, OFF)
    kept = plans._KEPT[model]
    layout = kept.plan._layout
    want = grad_norm(model, OFF)
    times: dict[str, list[float]] = {label: [] for label in (*STAGES, "whole call", FLOOR_PIECE)}
    for run_index in range(warmup + repeat):
        took: dict[str, float] = {}
        synchronize()
        got = staged(took)
        synchronize()
        start = time.perf_counter()
        grad_norm(model, OFF)
        took["whole call"] = (time.perf_counter() - start) * 1e6
        synchronize()
        took[FLOOR_PIECE] = host_floor(params, 0, 1) * 1e3
        if not torch.equal(got, want) or plans._KEPT[model] is not kept or kept.plan._layout is not layout or (
            layout is not None and layout.misses
        ):
            raise RuntimeError("--stages: the staged call did not take a steady call's path or give its norm")
        if run_index >= warmup:
            for label, micros in took.items():
                times[label].append(micros)
    return {label: statistics.median(runs) for label, runs in times.items()}


def print_table(run: dict[str, Any], device: torch.device, dtype: str) -> None:
    floors = [r["host a call"] for r in run["results"].values()]
    print(f"\n{run['count']:,} {dtype} parameters, {run['bytes'] / GiB:.3f} GiB on {device}: copy bandwidth "
          f"{run['bandwidth'] / 1e12:.3f} TB/s (read + written), host floor {min(floors):.3f}-{max(floors):.3f} ms "
          "a call over the rows (each parameter's .grad read once at C speed, the lesser of two ways)")
    print(f"  {'statistic':<34} {'torch ms':>9} {'pgregistry ms':>13} {'byte floor':>10} {'host floor':>10} "
          f"{'torch/floor':>11} {'pgregistry/floor':>16} {'vs torch':>9} {'back to back ms':>15} {'/floor':>7}")
    for label, r in run["results"].items():
        floor = max(r["bytes"], r["host"])
        queued = (f"{r['back to back']:15.3f} {r['back to back'] / floor:6.2f}x" if "back to back" in r
                  else f"{'-':>15} {'-':>7}")
        print(f"  {label:<34} {r['torch']:9.3f} {r['pgregistry']:13.3f} {r['bytes']:10.3f} {r['host']:10.3f} "
              f"{r['torch'] / floor:10.2f}x {r['pgregistry'] / floor:15.2f}x {r['torch'] / r['pgregistry']:8.2f}x "
              f"{queued}")
    host, on_device = run["kept"]
    print(f"  kept classification: {host:.0f} bytes of Python objects and {on_device:.1f} bytes of device memory "
          "per parameter")
    norm, zeros = run["oracle"]
    print(f"  grads: float64 norm {norm:.9g}, {zeros:,} zeros; every row checked (see FAIL lines below)")
    at_old_address, given = run["new grads"]
    print(f"  rows without 'new grads': the same grad objects every call; rows with: new grads before every call, "
          f"{at_old_address:,} of {given:,} ({at_old_address / max(given, 1):.0%}) at their predecessor's address")


def targets(runs: list[dict[str, Any]], device: torch.device) -> list[Target]:
    lines: list[Target] = []
    for run in runs:
        for label, r in run["results"].items():
            floor = max(r["bytes"], r["host"])
            ratio = r["pgregistry"] / floor
            lines.append((f"{label} at {run['count']:,} parameters within {GOAL}x the larger floor", ratio <= GOAL,
                          f"{ratio:.2f}x ({r['pgregistry']:.3f} ms, floor {floor:.3f} ms)"))
            if "back to back" in r:
                queued = r["back to back"] / floor
                lines.append((f"{label} at {run['count']:,} parameters, back to back, within {GOAL}x the larger "
                              "floor", queued <= GOAL, f"{queued:.2f}x ({r['back to back']:.3f} ms)"))
        if device.type == "cpu":
            for label, most in (("norm", 1.2), ("zeros", 1.1), ("clip, scaling", 1.2)):
                r = run["results"][label]
                cost = r["pgregistry"] / r["torch"]
                lines.append((f"{label} at {run['count']:,} parameters costs <= {most}x torch's", cost <= most,
                              f"{cost:.2f}x"))
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--bytes", type=int, help="grad bytes (default: 2 GiB on CUDA, 64 elements a parameter on "
                        "CPU)")
    parser.add_argument("--params", help="comma-separated parameter counts (default: 2000,20000 on CUDA, 20000 on CPU)")
    parser.add_argument("--repeat", type=int, help="timed runs per figure (default: 20 on CUDA, 15 on CPU)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--pieces", action="store_true", help="also print where a call's host time goes, per piece "
                        "of the kept plan's check (ns a parameter)")
    parser.add_argument("--stages", action="store_true", help="also print a steady grad_norm call's host time stage "
                        "by stage (arguments, door and plan check, read, reduction, result), us a call")
    parser.add_argument("--marked", action="store_true", help="every parameter carries the attributes Megatron's TP "
                        "layers set (tensor_model_parallel, partition_dim, partition_stride)")
    args = parser.parse_args(argv)
    device = selected_device(args.device)
    counts = [int(c) for c in (args.params or ("2000,20000" if device.type == "cuda" else "20000")).split(",")]
    args.repeat = args.repeat or (20 if device.type == "cuda" else 15)
    if not counts or min(counts) < 2 or args.repeat < 1 or args.warmup < 0:
        parser.error("parameter counts must be at least 2, --repeat positive, --warmup not negative")
    kernel = "on" if can_run_fused_stats(device) else "off"
    checks = "compiled" if steady_checks() is not None else f"Python ({COMPILED_ENV}={os.environ.get(COMPILED_ENV)})"
    print(f"grad statistics over a model: torch {torch.__version__}, device {describe_device(device)}, one-read "
          f"kernel {kernel}, steady-state checks {checks}, {args.dtype} grads"
          f"{', every parameter marked as by Megatron TP' if args.marked else ''}, "
          f"median of {args.repeat} after {args.warmup} warm-up runs")
    runs, problems = [], []
    for count in counts:
        itemsize = torch.finfo(DTYPES[args.dtype]).bits // 8
        size = args.bytes or (2 * GiB if device.type == "cuda" else 64 * count * itemsize)
        run_args = argparse.Namespace(**{**vars(args), "bytes": size})
        result = run(count, run_args, device)
        print_table(result, device, args.dtype)
        if args.pieces or args.stages:  # one model for both: neither changes its grads
            model = make_model(count, size // itemsize, DTYPES[args.dtype], device, marked=args.marked)
        if args.pieces:
            costs = host_pieces(model, args.warmup, args.repeat)
            floor = costs[FLOOR_PIECE]
            print("  host time of a steady-state call, piece by piece (ns a parameter, x the host floor):")
            for label, cost in costs.items():
                print(f"    {label:<34} {cost:8.1f} ns {cost / floor:6.2f}x")
            parts = sum(cost for label, cost in costs.items() if label not in (FLOOR_PIECE, WHOLE_PIECE))
            print(f"    {'the pieces above, summed':<34} {parts:8.1f} ns {parts / floor:6.2f}x")
        if args.stages:
            stages = host_stages(model, device, args.warmup, args.repeat)
            print("  host time of a steady grad_norm call, stage by stage (us a call, medians; device synchronised "
                  "before each run, outside the timing):")
            for label, micros in stages.items():
                print(f"    {label:<34} {micros:9.1f} us {micros * 1e3 / count:8.1f} ns a parameter")
            parts = sum(stages[label] for label in STAGES)
            print(f"    {'the stages above, summed':<34} {parts:9.1f} us")
        if args.pieces or args.stages:
            del model
        problems += result["problems"]
        runs.append(result)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    goals = f"{describe_device(device)}, {GOAL}x the larger of the byte and host floors"
    return finish(f"Targets ({goals}):", targets(runs, device), problems)


if __name__ == "__main__":
    sys.exit(main())

"""What the benchmarks share: model-like tensor sizes, reproducible grads with zeros, and the timer.

Timing: median milliseconds of ``repeat`` runs after ``warmup``; on CUDA each run is bracketed by CUDA events
(no host sync inside the timed region) and the peak memory allocated beyond what was live before is reported.
"""

from __future__ import annotations

import operator
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = [
    "GiB",
    "MiB",
    "Target",
    "copy_bandwidth",
    "describe_device",
    "fill_",
    "finish",
    "grad_reads",
    "grad_reads_unchecked",
    "host_floor",
    "host_floor_runs",
    "host_median",
    "lesser_median",
    "measure",
    "measure_runs",
    "norm64",
    "selected_device",
    "tensor_sizes",
]

GiB = 1 << 30
MiB = 1 << 20

Target = tuple[str, bool, str]
"""A goal, whether this run met it, and the measured figure."""


def tensor_sizes(count: int, numel: int, seed: int = 0) -> list[int]:
    """``count`` sizes summing to ``numel``, spread over two orders of magnitude like a model's parameters."""
    gen = torch.Generator().manual_seed(seed)
    weights = torch.exp(torch.rand(count, generator=gen, dtype=torch.float64) * 4.6)  # 1x .. 100x
    sizes = (weights / weights.sum() * numel).floor().to(torch.int64).clamp(min=1)
    sizes[0] += numel - int(sizes.sum())
    return [int(s) for s in sizes]


def fill_(tensors: list[torch.Tensor], seed: int, zeros: float = 0.3) -> None:
    """Normal values with about ``zeros`` exact zeros, the same for the same sizes and seed on any device."""
    gen = torch.Generator(device=tensors[0].device).manual_seed(seed)
    for t in tensors:
        t.normal_(generator=gen)
        if zeros:
            t.masked_fill_(torch.rand(t.shape, generator=gen, device=t.device) < zeros, 0.0)


def measure(
    fn: Callable[[], Any], device: torch.device, warmup: int, repeat: int, prepare: Callable[[], Any] | None = None
) -> tuple[float, float | None]:
    """Median milliseconds of ``fn`` and, on CUDA, the peak MiB it allocated beyond what was live before.

    ``prepare``, when given, runs before every call of ``fn`` (warm-up calls too) outside its timing: on CUDA the
    stream is synchronized after it, so none of its device work runs under ``fn``'s bracket and ``fn``'s host work
    hides under none of it."""
    times, peak = measure_runs(fn, device, warmup, repeat, prepare)
    return statistics.median(times), peak


def measure_runs(
    fn: Callable[[], Any], device: torch.device, warmup: int, repeat: int, prepare: Callable[[], Any] | None = None
) -> tuple[list[float], float | None]:
    """Each of ``repeat`` runs' milliseconds, as :func:`measure` times them, and its peak MiB: for a caller that
    interleaves these runs with other timings (a floor measured under the same load) and takes one median of all."""
    for _ in range(warmup):
        if prepare is not None:
            prepare()
        fn()
    if device.type != "cuda":
        times = []
        for _ in range(repeat):
            if prepare is not None:
                prepare()
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return times, None
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repeat)]
    for start, end in events:
        if prepare is not None:
            prepare()
            torch.cuda.synchronize(device)
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize(device)
    peak = (torch.cuda.max_memory_allocated(device) - before) / MiB
    return [s.elapsed_time(e) for s, e in events], peak


def host_median(fn: Callable[[], Any], warmup: int, repeat: int) -> float:
    """Median host milliseconds of ``fn`` (for host-only work: nothing is left on a device stream)."""
    return measure(fn, torch.device("cpu"), warmup, repeat)[0]


def grad_reads(params: Sequence[torch.Tensor]) -> list[Any]:
    """Each parameter's ``.grad``, read once from Python at C speed (``map``) into one list: the least host work any
    implementation of a statistic over a model's grads must do per call (torch's ``clip_grad_norm_`` and
    pgregistry's alike read every ``.grad`` before anything else). One of the two ways :func:`host_floor` times."""
    return list(map(_GRAD, params))


def grad_reads_unchecked(params: Sequence[torch.Tensor]) -> list[Any]:
    """:func:`grad_reads` with the ``__torch_function__`` question of tensor subclasses (``nn.Parameter``) off:
    the getter then skips a lookup through the parameter's class, so this can be the cheaper way."""
    with torch._C.DisableTorchFunctionSubclass():
        return list(map(_GRAD, params))


def host_floor(params: Sequence[torch.Tensor], warmup: int, repeat: int) -> float:
    """The host floor in milliseconds: the least host work any implementation must do per call, which is reading
    each parameter's ``.grad`` once at C speed, from a parameter list built beforehand (no walk of the model, no
    check, no read of anything else). Both ways of reading them (:func:`grad_reads`, :func:`grad_reads_unchecked`)
    are timed, interleaved run by run so that both see the same load, and the lesser median is the floor: it
    depends on no implementation's choice."""
    return lesser_median(host_floor_runs(params, warmup, repeat))


def lesser_median(runs_by_way: Sequence[Sequence[float]]) -> float:
    """The host floor from :func:`host_floor_runs`' runs (one list a way): the lesser of the ways' medians."""
    return min(statistics.median(runs) for runs in runs_by_way)


def host_floor_runs(params: Sequence[torch.Tensor], warmup: int, repeat: int) -> tuple[list[float], list[float]]:
    """The runs :func:`host_floor` takes its medians of, one list a way, in milliseconds: for a caller that
    interleaves them with other timings and takes :func:`lesser_median` of each way's runs over all."""
    ways = (grad_reads, grad_reads_unchecked)
    for _ in range(warmup):
        for way in ways:
            way(params)
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(repeat):
        for way, runs in zip(ways, times, strict=True):
            start = time.perf_counter()
            way(params)
            runs.append((time.perf_counter() - start) * 1e3)
    return times


_GRAD = operator.attrgetter("grad")


def copy_bandwidth(nbytes: int, device: torch.device, warmup: int = 3, repeat: int = 10) -> float:
    """Bytes per second of a device-to-device copy of ``nbytes`` (read plus written, so twice ``nbytes`` a copy),
    measured now: the bandwidth the byte floors are taken at."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).normal_()
    dst = torch.empty_like(src)
    ms = measure(lambda: dst.copy_(src), device, warmup, repeat)[0]
    if not torch.equal(dst, src):
        raise RuntimeError("the copy bandwidth's copy did not copy")
    return 2 * src.numel() * 4 / (ms / 1e3)


def norm64(tensors: Sequence[torch.Tensor]) -> float:
    """The 2-norm of ``tensors`` in float64 (per tensor, then over them): the oracle a row's work is checked by."""
    norms = torch.stack([torch.linalg.vector_norm(tensor, dtype=torch.float64) for tensor in tensors])
    return float(torch.linalg.vector_norm(norms))


def selected_device(name: str) -> torch.device:
    """``--device``'s device, made current when it names one GPU of several."""
    device = torch.device(name)
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)
    return device


def describe_device(device: torch.device) -> str:
    """``cuda (NVIDIA H200)`` or ``cpu (2 threads)``."""
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return f"{device} ({torch.get_num_threads()} threads)"


def finish(title: str, targets: list[Target], problems: list[str]) -> int:
    """Print the targets (MET / NOT MET: informative) and the problems (FAIL); 1 if there is any problem."""
    print(f"\n{title}")
    for name, ok, detail in targets:
        print(f"  [{'MET' if ok else 'NOT MET'}] {name}: {detail}")
    for problem in problems:
        print(f"FAIL: {problem}")
    return 1 if problems else 0

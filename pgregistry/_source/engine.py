"""Scanning many files: read, look up the cache, parse the rest in parallel, store.

Parsing dominates (``ast.parse`` of Megatron-LM's 250k-line ``megatron/`` tree takes 1.2-1.3 s on
one core), so files the cache does not hold are split into size-balanced buckets, one per core; a
forked child (:mod:`pgregistry._source.processes`) scans every extra bucket while this process scans
the first. The children inherit the file contents (nothing is pickled to them) and send back compact
:mod:`marshal`-encoded rows. The garbage collector is off while parsing: each tree is dropped as
soon as it is walked and holds no reference cycles, so collections would only rescan the objects
that stay alive.

Forking needs the ``fork`` start method and a single-threaded process; otherwise, or when there is
too little work to repay a fork, everything runs in this process. A child that fails (raises, dies,
sends what does not decode) is not trusted: its bucket is rescanned here, so a result never depends
on how the work was split.
"""

from __future__ import annotations

import gc
import marshal
import os
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from multiprocessing.connection import Connection
from typing import Any

from pgregistry._source.cache import ScanCache, content_key
from pgregistry._source.config import ScanConfig
from pgregistry._source.files import SourceFile, read_regular_file
from pgregistry._source.processes import Child, can_fork, start_child
from pgregistry._source.scanner import (
    FileResult,
    ParseFailure,
    decode_result,
    encode_result,
    scan_source,
)

__all__ = [
    "PARALLEL_MIN_BYTES",
    "ScanReport",
    "default_jobs",
    "read_source",
    "scan_files",
    "scan_sources",
    "split_into_buckets",
]

#: Below this many bytes to parse, forking costs more than it saves.
PARALLEL_MIN_BYTES = 512 * 1024


@dataclass
class ScanReport:
    """Every file's result, in the order the files were given, and where the results came from."""

    results: list[FileResult]
    parsed: int = 0
    cached: int = 0
    processes: int = 1

    @property
    def failures(self) -> list[FileResult]:
        """The results of the files that could not be read or parsed."""
        return [result for result in self.results if result.failure is not None]


def default_jobs() -> int:
    """The cores this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


def _scan_bucket(items: Sequence[tuple[str, bytes]], config: ScanConfig) -> list[FileResult]:
    return [scan_source(data, path, config) for path, data in items]


def split_into_buckets(count: int, sizes: Sequence[int]) -> list[list[int]]:
    """Indexes split into ``count`` lists of near-equal size (largest first, into the lightest)."""
    filled: list[list[int]] = [[] for _ in range(count)]
    loads = [0] * count
    for index in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        lightest = loads.index(min(loads))
        filled[lightest].append(index)
        loads[lightest] += sizes[index]
    return [bucket for bucket in filled if bucket]


def _send_scan(
    items: Sequence[tuple[str, bytes]],
    bucket: Sequence[int],
    config: ScanConfig,
    connection: Connection,
) -> None:
    """In a child: send the results of the inherited files at ``bucket``'s indexes.

    They are sent :mod:`marshal`-encoded.
    """
    scanned = _scan_bucket([items[i] for i in bucket], config)
    connection.send_bytes(marshal.dumps([encode_result(result) for result in scanned]))


def _child_results(
    child: Child, items: Sequence[tuple[str, bytes]], bucket: Sequence[int]
) -> list[FileResult] | None:
    """A child's results for ``bucket``; None when it raised, died or sent what does not decode."""
    try:
        rows: Any = marshal.loads(child.connection.recv_bytes())
        return [decode_result(items[i][0], row) for i, row in zip(bucket, rows, strict=True)]
    except Exception:  # noqa: BLE001
        # Whatever went wrong in the child, its bucket is rescanned here.
        return None


def _scan_parallel(
    items: Sequence[tuple[str, bytes]], config: ScanConfig, jobs: int
) -> tuple[list[FileResult], int]:
    split = split_into_buckets(jobs, [len(data) for _, data in items])
    results: list[FileResult | None] = [None] * len(items)
    children: list[Child] = []
    try:
        for bucket in split[1:]:
            children.append(start_child(partial(_send_scan, items, bucket, config), children))
        for index, result in zip(
            split[0], _scan_bucket([items[i] for i in split[0]], config), strict=True
        ):
            results[index] = result
        for child, bucket in zip(children, split[1:], strict=True):
            decoded = _child_results(child, items, bucket)
            if decoded is None:  # the child failed: trust nothing it sent
                decoded = _scan_bucket([items[i] for i in bucket], config)
            for index, result in zip(bucket, decoded, strict=True):
                results[index] = result
    finally:
        for child in children:
            child.kill()
    return [result for result in results if result is not None], len(split)


def read_source(source: SourceFile) -> tuple[bytes, int] | FileResult:
    """The file's bytes and modification time (ns); a failure for anything but a regular file.

    Read by :func:`~pgregistry._source.files.read_regular_file`, so a FIFO (or a file swapped for
    one after discovery) never blocks the scan, nor ``migrate``, which reads with it too."""
    try:
        return read_regular_file(source.absolute)
    except OSError as error:
        return FileResult(source.path, failure=ParseFailure(f"cannot read: {error.strerror}", 1, 1))


def scan_files(
    files: Sequence[SourceFile],
    config: ScanConfig,
    *,
    cache: ScanCache | None = None,
    jobs: int = 1,
) -> ScanReport:
    """Scan ``files``: cached results where cached, the rest parsed on up to ``jobs`` cores."""
    read = [(source.path, read_source(source)) for source in files]
    return scan_sources(
        [(path, data if isinstance(data, FileResult) else data[0]) for path, data in read],
        config,
        cache=cache,
        jobs=jobs,
    )


def scan_sources(
    sources: Sequence[tuple[str, bytes | FileResult]],
    config: ScanConfig,
    *,
    cache: ScanCache | None = None,
    jobs: int = 1,
) -> ScanReport:
    """Scan (project path, bytes) pairs, e.g. read from git.

    A :class:`FileResult` in place of the bytes is a file that could not be read, passed through."""
    results: list[FileResult | None] = [None] * len(sources)
    pending: list[tuple[int, str, str, bytes]] = []
    for index, (path, data) in enumerate(sources):
        if isinstance(data, FileResult):
            results[index] = data
            continue
        key = content_key(path, data)
        cached = cache.get(key, path) if cache is not None else None
        if cached is not None:
            results[index] = cached
        else:
            pending.append((index, key, path, data))
    items = [(path, data) for _, _, path, data in pending]
    processes = 1
    enabled = gc.isenabled()
    gc.disable()
    try:
        work = min(jobs, len(items))
        if work > 1 and sum(len(data) for _, data in items) >= PARALLEL_MIN_BYTES and can_fork():
            scanned, processes = _scan_parallel(items, config, work)
        else:
            scanned = _scan_bucket(items, config)
    finally:
        if enabled:
            gc.enable()
    for (index, key, _, _), result in zip(pending, scanned, strict=True):
        results[index] = result
        if cache is not None:
            cache.put(key, result)
    if cache is not None:
        cache.save()
    done = [result for result in results if result is not None]
    return ScanReport(
        done, parsed=len(pending), cached=len(sources) - len(pending), processes=processes
    )

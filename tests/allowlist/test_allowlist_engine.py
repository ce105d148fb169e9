"""Scanning many files: file discovery and excludes, the forked parallel scan, and the content-hash cache.
None of these may change a result; they only change how fast it comes."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import ModuleType

import pytest
from fixtures.module_files import module_from_file
from fixtures.processes import gone_within, killed_parents_child

from pgregistry._source import engine
from pgregistry._source.cache import ScanCache, content_key
from pgregistry._source.config import ScanConfig
from pgregistry._source.files import PathError, discover_files

REPO = Path(__file__).resolve().parents[2]


def _benchmark() -> ModuleType:
    """The benchmark script, for its generator of realistic trees."""
    return module_from_file("allowlist_scan_bench", REPO / "benchmarks" / "allowlist_scan.py")


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("tree")
    _benchmark().generate_tree(root, files=80, lines=12_000, seed=3)
    return root


def _touch(root: Path, *paths: str) -> None:
    for path in paths:
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text("x = 1\n")


def test_discover_sorts_and_excludes(tmp_path: Path) -> None:
    _touch(
        tmp_path,
        "src/b.py",
        "src/a.py",
        "src/notes.txt",
        "src/.hidden/h.py",
        "src/__pycache__/c.py",
        "src/gen/x_pb2.py",
        "src/vendored/v.py",
        "src/deep/vendored/w.py",
        "build/lib/d.py",
    )
    files = discover_files([tmp_path], tmp_path, ("*_pb2.py", "src/vendored", ".*", "__pycache__", "build")).files
    assert [f.path for f in files] == ["src/a.py", "src/b.py", "src/deep/vendored/w.py"]
    assert files[0].absolute == tmp_path / "src" / "a.py"


def test_discover_applies_excludes_to_named_files_and_reads_any_named_file(tmp_path: Path) -> None:
    _touch(tmp_path, "src/x_pb2.py", "scripts/run", "src/a.py")
    named = [tmp_path / "src" / "x_pb2.py", tmp_path / "scripts" / "run", tmp_path / "src" / "a.py"]
    assert [f.path for f in discover_files(named, tmp_path, ("*_pb2.py",)).files] == ["scripts/run", "src/a.py"]


def test_discover_rejects_a_missing_path(tmp_path: Path) -> None:
    with pytest.raises(PathError, match="no-such-dir: no such file or directory"):
        discover_files([tmp_path / "no-such-dir"], tmp_path, ())


def test_parallel_scan_equals_serial_scan(tree: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    files = discover_files([tree], tree, ()).files
    serial = engine.scan_files(files, ScanConfig(), jobs=1)
    monkeypatch.setattr(engine, "PARALLEL_MIN_BYTES", 0)
    parallel = engine.scan_files(files, ScanConfig(), jobs=3)
    assert parallel.processes == 3
    assert parallel.results == serial.results
    assert sum(len(r.sites) for r in serial.results) > 20


def test_a_failing_worker_is_rescanned_not_trusted(tree: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    files = discover_files([tree], tree, ()).files
    serial = engine.scan_files(files, ScanConfig(), jobs=1)
    monkeypatch.setattr(engine, "PARALLEL_MIN_BYTES", 0)

    def broken(value: object) -> bytes:  # only the forked children encode their results
        raise RuntimeError("worker crashed")

    monkeypatch.setattr(engine.marshal, "dumps", broken)
    assert engine.scan_files(files, ScanConfig(), jobs=2).results == serial.results



def test_a_worker_that_dies_is_rescanned_not_waited_for(tree: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    files = discover_files([tree], tree, ()).files
    serial = engine.scan_files(files, ScanConfig(), jobs=1)
    monkeypatch.setattr(engine, "PARALLEL_MIN_BYTES", 0)

    def killed(result: object) -> object:  # only the forked workers encode their results
        os._exit(3)

    monkeypatch.setattr(engine, "encode_result", killed)
    assert engine.scan_files(files, ScanConfig(), jobs=2).results == serial.results

_KILLED_WHILE_SCANNING = """
import os, signal, sys, time
from pgregistry._source import engine
from pgregistry._source.config import ScanConfig

here, scan = os.getpid(), engine._scan_bucket


def recorded(items, config):  # the child says who it is; this process, once the child has scanned, is killed
    if os.getpid() != here:
        with open(sys.argv[1] + ".tmp", "w") as record:
            record.write(str(os.getpid()))
        os.rename(sys.argv[1] + ".tmp", sys.argv[1])
    else:
        while not os.path.exists(sys.argv[1]):
            time.sleep(0.01)
        time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGKILL)
    return scan(items, config)


engine._scan_bucket, engine.PARALLEL_MIN_BYTES = recorded, 0
engine.scan_sources([(f"m{i}.py", b"x = 1\\n") for i in range(4)], ScanConfig(), jobs=2)
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads /proc")
def test_a_scanning_child_exits_when_the_process_scanning_is_killed(tmp_path: Path) -> None:
    """A pool's worker waits for its next task on a queue it holds the write end of: killed by SIGKILL, its parent
    would leave it waiting forever. A child of the scan exits once it has sent its bucket."""
    child = killed_parents_child(_KILLED_WHILE_SCANNING, tmp_path)
    assert gone_within(child, 20), f"the scan's child {child} outlived the process that scanned"


def test_unreadable_file_is_a_failure(tmp_path: Path) -> None:
    _touch(tmp_path, "a.py")
    files = discover_files([tmp_path], tmp_path, ()).files
    (tmp_path / "a.py").unlink()
    (report,) = engine.scan_files(files, ScanConfig()).failures
    assert report.failure is not None and "cannot read" in report.failure.message


def test_cache_reuses_results_until_the_content_changes(tree: Path, tmp_path: Path) -> None:
    files = discover_files([tree], tree, ()).files
    config = ScanConfig()
    cold = engine.scan_files(files, config, cache=ScanCache(tmp_path, config))
    assert (cold.parsed, cold.cached) == (len(files), 0)
    warm = engine.scan_files(files, config, cache=ScanCache(tmp_path, config))
    assert (warm.parsed, warm.cached) == (0, len(files))
    assert warm.results == cold.results
    changed = next(f for f in files if "import" in f.absolute.read_text())
    original = changed.absolute.read_bytes()
    try:
        changed.absolute.write_bytes(original + b"\nREAD = ps.get_data_parallel_rank()\n")
        again = engine.scan_files(files, config, cache=ScanCache(tmp_path, config))
        assert (again.parsed, again.cached) == (1, len(files) - 1)
        assert again.results == engine.scan_files(files, config).results
    finally:
        changed.absolute.write_bytes(original)


def test_cache_is_per_configuration(tree: Path, tmp_path: Path) -> None:
    files = discover_files([tree], tree, ()).files
    engine.scan_files(files, ScanConfig(), cache=ScanCache(tmp_path, ScanConfig()))
    narrow = ScanConfig(accessors=("get_*_rank",))
    report = engine.scan_files(files, narrow, cache=ScanCache(tmp_path, narrow))
    assert report.cached == 0
    assert all(site.accessor.endswith("_rank") for r in report.results for site in r.sites)
    assert len(list(tmp_path.glob("allowlist-scan-*.json"))) == 2
    assert (tmp_path / ".gitignore").read_text().endswith("*\n")


def test_a_corrupt_cache_is_ignored(tree: Path, tmp_path: Path) -> None:
    files = discover_files([tree], tree, ()).files
    config = ScanConfig()
    cache = ScanCache(tmp_path, config)
    truth = engine.scan_files(files, config, cache=cache).results
    # A hand-edited entry of the wrong shape, and a truncated file: both rescanned, never trusted.
    payload = json.loads(cache.file.read_text())
    key = content_key(files[0].path, files[0].absolute.read_bytes())
    payload["entries"][key] = [[["one", 1, "s", "a", "call", "e", "f"]], None]
    cache.file.write_text(json.dumps(payload))
    report = engine.scan_files(files, config, cache=ScanCache(tmp_path, config))
    assert report.results == truth and report.parsed == 1
    cache.file.write_text(cache.file.read_text()[:100])
    report = engine.scan_files(files, config, cache=ScanCache(tmp_path, config))
    assert report.results == truth and report.parsed == len(files)


def test_an_unwritable_cache_directory_is_not_an_error(tree: Path, tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    files = discover_files([tree], tree, ()).files
    report = engine.scan_files(files, ScanConfig(), cache=ScanCache(blocker / "cache", ScanConfig()))
    assert report.parsed == len(files) and not report.failures

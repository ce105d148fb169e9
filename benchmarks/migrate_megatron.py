"""Benchmark on the real tree: ``pgregistry migrate`` over Megatron-LM's ``megatron/core``.

Exports ``megatron/core`` at ``--rev`` (``git archive``, into a temporary directory), or copies the installed
Megatron-Core's (``--installed``: megatron-core 0.19.2 in the project's environment), twice (one copy stays the
baseline), runs ``pgregistry migrate --write --isolated --preset megatron megatron/core`` on one (a fresh
interpreter, timed), and reports in one run:

- reads by family (the ratchet's scan, the same preset) before and after, and the share of direct reads left;
- every file byte-compiles (``python -m compileall -q``);
- ``ruff check --select F`` findings before and after (a finding is keyed by file, code and message, not by line,
  which the rewrite moves, also where the message names one); the new ones are listed;
- ``pgregistry migrate --check`` right after exits 0, and a second ``--write`` changes no file (the rewrite is
  idempotent);
- no rewritten file imports pgregistry (the fallback helper is written into the tree), and the rewrite adds no
  line over the tree's line length (the tool's reading of its settings: 100 for megatron/core);
- the rewritten modules that imported before and no longer do (a fresh interpreter, the copy first on the path);
- the wall and CPU time of the ``--write`` run and of the ``--check`` run (CPU time too: on a shared machine
  the wall time mostly measures the other jobs);
- the tool's report: every read left in place, with its reason.

Usage: ``python benchmarks/migrate_megatron.py /path/to/Megatron-LM.git [--rev d98e8a64dd]`` or
``python benchmarks/migrate_megatron.py --installed``. Not part of CI (the first needs the repository's history).
``--timings N`` only times ``--write`` N times (the load average with each run).
``benchmarks/migrate_trees.py`` measures megatron/core, Megatron-Bridge and NeMo in one run with ``measure``.

Measured at d98e8a64dd on the shared 2-core machine (Python 3.11.7; docs/measurements/migrate_megatron.txt):

=====================================================  ================  ================  ============
version                                                ``--write`` wall  ``--write`` CPU   ``--check``
=====================================================  ================  ================  ============
libcst metadata, whole-file walks (first version)      minutes           ~200 s (cProfile) n/a
positions per statement with reads                     33.3 s (load 49)  28.0 s            13.1 s CPU
ast positions, member walks, one render, fewer parses  19.0 s (load 2.9) 19.5 s            4.1 s CPU
at 4d4e2e5, measured again 2026-12-03 (load 1.0)    28.0 s            28.9 s            4.9 s wall
skeletons, gc off, two phases on 2 cores (b434bf9)     9.8-10.7 s        16.7-18.0 s       2.9 s wall
the files without reads from a queue (cf142b3)         7.6-9.9 s         13.8-18.1 s       2.3-2.8 s wall
calls through re-exports resolved (7de01da)            8.5-9.4 s         15.5-17.1 s       2.1-2.8 s wall
=====================================================  ================  ================  ============

With the door model (before the in-place fallback helper) the goal (the whole tree under 10 s, idle) was met
(median of five runs 9.1 s); the in-place model's runs so far were on a loaded machine (docs/migrating.md).
libcst parses a skeleton of each file (the definitions no rewrite needs stood in for by placeholders of the same
lines), the files are planned and rewritten on both cores, the files without reads are looked through from a
queue by whichever core is free, and the garbage collector stays off while the trees are alive. The CPU time
varies by a fifth between runs of the same code on this shared host.
"""

from __future__ import annotations

import argparse
import io
import os
import re
import resource
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from git_directories import git_directory  # noqa: E402

from pgregistry._source.config import PRESETS  # noqa: E402
from pgregistry._source.scanner import family_of, scan_source  # noqa: E402
from pgregistry.migrate._style import line_length  # noqa: E402


def _export(git_dir: str, rev: str, into: Path) -> None:
    data = subprocess.run(
        ["git", "-C", git_dir, "archive", rev, "megatron/core"], check=True, capture_output=True, timeout=300
    ).stdout
    with tarfile.open(fileobj=io.BytesIO(data)) as archive:
        archive.extractall(into, filter="data")


def _copy_installed(into: Path) -> str:
    """Copy the installed ``megatron/core`` (its sources, not its bytecode) under ``into``, found without importing
    it; its version (``package_info.py``)."""
    import importlib.util

    spec = importlib.util.find_spec("megatron.core")
    assert spec is not None and spec.submodule_search_locations, "Megatron-Core is not installed"
    source = Path(list(spec.submodule_search_locations)[0])
    shutil.copytree(source, into / "megatron" / "core", ignore=shutil.ignore_patterns("__pycache__"))
    info = (source / "package_info.py").read_text()
    parts = [re.search(rf"^{name} = (\d+)", info, re.M) for name in ("MAJOR", "MINOR", "PATCH")]
    return "megatron-core " + ".".join(p.group(1) if p else "?" for p in parts) + " (installed)"


def _snapshot(root: Path, folder: str) -> dict[str, bytes]:
    """Every Python file of the tree at ``root`` (the package ``folder`` and the top package it lies in, where the
    fallback helper is written), by path relative to ``root``."""
    top = root / folder.split("/")[0]
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(top.rglob("*.py"))}


def _imports_pgregistry(data: bytes) -> bool:
    """Whether a module imports pgregistry outside a ``try`` (the helper's optional import of its warning)."""
    import ast

    tree = ast.parse(data)
    guarded = {id(node) for t in ast.walk(tree) if isinstance(t, ast.Try)
               for statement in t.body for node in ast.walk(statement)}
    return any(
        id(node) not in guarded and any(name.split(".")[0] == "pgregistry" for name in (
            [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]))
        for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))
    )


def _families(root: Path, folder: str) -> Counter[str]:
    counts: Counter[str] = Counter()
    for path in sorted((root / folder).rglob("*.py")):
        result = scan_source(path.read_bytes(), path.relative_to(root).as_posix(), PRESETS["megatron"])
        counts.update(family_of(site) for site in result.sites)
    return counts


def _ruff(root: Path, folder: str) -> Counter[str]:
    out = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--isolated", "--select", "F", "--output-format", "concise",
         folder], cwd=root, capture_output=True, text=True, timeout=300,
    ).stdout
    findings: Counter[str] = Counter()
    for line in out.splitlines():
        parts = line.split(":", 3)
        if len(parts) == 4 and parts[0].endswith(".py"):
            # "Redefinition of unused `x` from line 23": the rewrite moves lines, so the line is not the key
            message = re.sub(r"line \d+", "line N", parts[3].strip())
            findings[f"{parts[0]}: {message}"] += 1
    return findings


def _migrate(root: Path, folder: str, *options: str) -> tuple[int, float, float, str]:
    """(exit code, wall seconds, CPU seconds of the process, its output)."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cpu = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "pgregistry", "migrate", *options, "--isolated", "--preset", "megatron", folder],
        cwd=root, env=env, capture_output=True, text=True, timeout=1800,
    )
    wall = time.perf_counter() - started
    now = resource.getrusage(resource.RUSAGE_CHILDREN)
    used = now.ru_utime - cpu.ru_utime + now.ru_stime - cpu.ru_stime
    return done.returncode, wall, used, done.stdout + done.stderr


#: Run in a fresh interpreter with a tree first on ``sys.path``: imports each module named on stdin (one a line)
#: and prints those that imported.
_IMPORT_EACH = """
import importlib, sys, warnings
warnings.simplefilter("ignore")
for name in sys.stdin.read().split():
    try:
        importlib.import_module(name)
    except BaseException:
        continue
    print(name, flush=True)
"""


def importable(root: Path, modules: list[str]) -> set[str]:
    """Those of ``modules`` that import with the tree at ``root`` first on the path (one interpreter)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), str(REPO)])}
    done = subprocess.run(
        [sys.executable, "-c", _IMPORT_EACH], input="\n".join(modules), cwd=root, env=env, capture_output=True,
        text=True, timeout=1800,
    )
    return set(done.stdout.split())


def _module_name(path: str) -> str:
    parts = Path(path).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@dataclass
class Measured:
    """What one ``--write`` on a copy of a tree did, measured against the untouched copy."""

    folder: str
    before: Counter[str]
    after: Counter[str]
    write_code: int
    write_s: float
    write_cpu: float
    load: float
    compiled: bool
    ruff_before: Counter[str]
    ruff_after: Counter[str]
    check_code: int
    check_s: float
    check_cpu: float
    again_code: int
    changed_again: list[str]
    rewritten: list[str]
    importing: list[str]
    width: int
    long_lines: int
    imported_before: set[str]
    imported_after: set[str]
    report: str

    @property
    def new_findings(self) -> Counter[str]:
        return self.ruff_after - self.ruff_before

    @property
    def no_longer_importing(self) -> list[str]:
        return sorted(self.imported_before - self.imported_after)


def measure(before_root: Path, after_root: Path, folder: str, *, imports: bool = True) -> Measured:
    """Migrate ``folder`` of the copy at ``after_root`` (``--write``, timed), compare it with the same tree at
    ``before_root``, check it once more (``--check``) and write it again (idempotence)."""
    before, ruff_before = _families(before_root, folder), _ruff(before_root, folder)
    old = _snapshot(before_root, folder)
    code, write_s, write_cpu, report = _migrate(after_root, folder, "--write")
    load = os.getloadavg()[0]
    after, ruff_after = _families(after_root, folder), _ruff(after_root, folder)
    written = _snapshot(after_root, folder)
    compiled = subprocess.run(
        [sys.executable, "-m", "compileall", "-q", folder.split("/")[0]], cwd=after_root, capture_output=True,
        timeout=600,
    ).returncode == 0
    check_code, check_s, check_cpu, _ = _migrate(after_root, folder, "--check")
    again_code, _, _, _ = _migrate(after_root, folder, "--write")
    changed_again = [path for path, data in _snapshot(after_root, folder).items() if written.get(path) != data]
    rewritten = {path: data for path, data in written.items() if old.get(path) != data}
    width = line_length(after_root)
    long_lines = sum(
        1 for path, data in rewritten.items()
        for line in set(data.decode().splitlines()) - set(old.get(path, b"").decode().splitlines())
        if len(line) > width
    )
    modules = sorted(_module_name(path) for path in rewritten if path in old)
    imported_before = importable(before_root, modules) if imports else set()
    imported_after = importable(after_root, sorted(imported_before)) if imports else set()
    return Measured(
        folder, before, after, code, write_s, write_cpu, load, compiled, ruff_before, ruff_after, check_code,
        check_s, check_cpu, again_code, changed_again, sorted(rewritten),
        [path for path, data in rewritten.items() if _imports_pgregistry(data)], width, long_lines,
        imported_before, imported_after, report,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "git_dir", nargs="?", type=git_directory, help="a Megatron-LM git directory (a bare mirror will do)"
    )
    parser.add_argument("--rev", default="d98e8a64dd", help="the revision to export (default: d98e8a64dd)")
    parser.add_argument("--installed", action="store_true", help="the installed Megatron-Core's megatron/core")
    parser.add_argument("--timings", type=int, metavar="N", help="only time N runs of --write, each on a fresh copy")
    args = parser.parse_args()
    if (args.git_dir is None) == (not args.installed):
        parser.error("give a Megatron-LM git directory or --installed, not both")
    if args.timings:
        time_writes(args.timings, args.git_dir, args.rev)
        return
    with tempfile.TemporaryDirectory() as temporary:
        before_root, after_root = Path(temporary, "before"), Path(temporary, "after")
        if args.installed:
            what = _copy_installed(before_root)
            _copy_installed(after_root)
        else:
            what = f"Megatron-LM at {args.rev}"
            _export(args.git_dir, args.rev, before_root)
            _export(args.git_dir, args.rev, after_root)
        measured = measure(before_root, after_root, "megatron/core")
    print(f"pgregistry migrate on {what}'s megatron/core (Python {sys.version.split()[0]}, {os.cpu_count()} cores)")
    print_measured(measured)


def time_writes(runs: int, git_dir: str | None, rev: str) -> None:
    """``--write`` on megatron/core ``runs`` times, each on a fresh copy: wall and CPU seconds, the load average
    (1 minute) before and after each, and the medians (the machine may be shared: the CPU time is the figure)."""
    import statistics

    walls, cpus = [], []
    for run in range(1, runs + 1):
        with tempfile.TemporaryDirectory() as temporary:
            root = Path(temporary)
            if git_dir is None:
                _copy_installed(root)
            else:
                _export(git_dir, rev, root)
            load_before = os.getloadavg()[0]
            code, wall, cpu, _ = _migrate(root, "megatron/core", "--write")
            load_after = os.getloadavg()[0]
        walls.append(wall)
        cpus.append(cpu)
        print(f"run {run}: exit {code}, wall {wall:.1f} s, CPU {cpu:.1f} s, load average {load_before:.1f} before, "
              f"{load_after:.1f} after ({os.cpu_count()} cores)", flush=True)
    print(f"median of {runs}: wall {statistics.median(walls):.1f} s, CPU {statistics.median(cpus):.1f} s")


def print_measured(m: Measured) -> None:
    """Every figure of ``m``, one a line, then the tool's report."""
    print(f"{'family':<10}{'before':>8}{'after':>8}")
    for family in ("direct", "global", "fallback", "shim"):
        print(f"{family:<10}{m.before[family]:>8}{m.after[family]:>8}")
    share = m.after["direct"] / m.before["direct"] if m.before["direct"] else 0.0
    print(f"direct reads left: {m.after['direct']} of {m.before['direct']} ({share:.1%}; goal at most 10%)")
    print(f"--write exit code: {m.write_code}; wall time {m.write_s:.1f} s, CPU time {m.write_cpu:.1f} s "
          f"(load average {m.load:.1f} on {os.cpu_count()} cores when done)")
    print(f"every file byte-compiles: {'yes' if m.compiled else 'NO'}")
    print(f"ruff --select F: {sum(m.ruff_before.values())} findings before, {sum(m.ruff_after.values())} after, "
          f"{sum(m.new_findings.values())} new")
    for finding in sorted(m.new_findings):
        print(f"  new: {finding}")
    print(f"--check right after: exit code {m.check_code} (0: nothing left to change); wall time {m.check_s:.1f} s, "
          f"CPU time {m.check_cpu:.1f} s")
    print(f"a second --write: exit code {m.again_code}, {len(m.changed_again)} file(s) changed")
    print(f"{len(m.rewritten)} files rewritten or written (the fallback helper among them); importing pgregistry: "
          f"{len(m.importing)} {m.importing}; new lines over {m.width} columns: {m.long_lines}")
    print(f"rewritten modules that imported before: {len(m.imported_before)}; of them no longer importing: "
          f"{len(m.no_longer_importing)} {m.no_longer_importing}")
    print("the tool's report:")
    print(m.report, end="")


if __name__ == "__main__":
    main()

"""Benchmark on the real tree: ``pgregistry migrate`` over Megatron-LM's ``megatron/core``.

Exports ``megatron/core`` at ``--rev`` (``git archive``, into a temporary directory), or copies the installed
Megatron-Core's (``--installed``: megatron-core 0.19.2 in the project's environment), twice (one copy stays the
baseline), runs ``pgregistry migrate --write --isolated --preset megatron megatron/core`` on one (a fresh
interpreter, timed), and reports in one run:

- reads by family (the ratchet's scan, the same preset) before and after, and the share of direct reads left;
- every file byte-compiles (``python -m compileall -q``);
- ``ruff check --select F`` findings before and after (a finding is keyed by file, code and message, not by line,
  which the rewrite moves); the new ones are listed;
- ``pgregistry migrate --check`` right after exits 0, and a second ``--write`` changes no file (the rewrite is
  idempotent);
- no rewritten file imports pgregistry (the fallback helper is written into the tree), and the rewrite adds no
  line over the tree's 100 columns;
- the wall and CPU time of the ``--write`` run and of the ``--check`` run (CPU time too: on a shared machine
  the wall time mostly measures the other jobs);
- the tool's report: every read left in place, with its reason.

Usage: ``python benchmarks/migrate_megatron.py /path/to/Megatron-LM.git [--rev d98e8a64dd]`` or
``python benchmarks/migrate_megatron.py --installed``. Not part of CI (the first needs the repository's history).

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

The goal (the whole tree under 10 s) is met (median of five runs 9.1 s): libcst parses a skeleton of each file
(the definitions no rewrite needs stood in for by placeholders of the same lines), the files are planned and
rewritten on both cores, the files without reads are looked through from a queue by whichever core is free, and
the garbage collector stays off while the trees are alive. The CPU time varies by a fifth between runs of the
same code on this shared host.
"""

from __future__ import annotations

import argparse
import io
import os
import resource
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from pgregistry.allowlist._config import PRESETS  # noqa: E402
from pgregistry.allowlist._report import family_of  # noqa: E402
from pgregistry.allowlist._scanner import scan_source  # noqa: E402


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
    import re

    spec = importlib.util.find_spec("megatron.core")
    assert spec is not None and spec.submodule_search_locations, "Megatron-Core is not installed"
    source = Path(list(spec.submodule_search_locations)[0])
    shutil.copytree(source, into / "megatron" / "core", ignore=shutil.ignore_patterns("__pycache__"))
    info = (source / "package_info.py").read_text()
    parts = [re.search(rf"^{name} = (\d+)", info, re.M) for name in ("MAJOR", "MINOR", "PATCH")]
    return "megatron-core " + ".".join(p.group(1) if p else "?" for p in parts) + " (installed)"


def _snapshot(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted((root / "megatron").rglob("*.py"))}


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


def _families(root: Path) -> Counter[str]:
    counts: Counter[str] = Counter()
    for path in sorted((root / "megatron" / "core").rglob("*.py")):
        result = scan_source(path.read_bytes(), path.relative_to(root).as_posix(), PRESETS["megatron"])
        counts.update(family_of(site) for site in result.sites)
    return counts


def _ruff(root: Path) -> Counter[str]:
    out = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--isolated", "--select", "F", "--output-format", "concise",
         "megatron/core"], cwd=root, capture_output=True, text=True, timeout=300,
    ).stdout
    findings: Counter[str] = Counter()
    for line in out.splitlines():
        parts = line.split(":", 3)
        if len(parts) == 4 and parts[0].endswith(".py"):
            findings[f"{parts[0]}: {parts[3].strip()}"] += 1
    return findings


def _migrate(root: Path, *options: str) -> tuple[int, float, float, str]:
    """(exit code, wall seconds, CPU seconds of the process, its output)."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cpu = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "pgregistry", "migrate", *options, "--isolated", "--preset", "megatron",
         "megatron/core"], cwd=root, env=env, capture_output=True, text=True, timeout=1800,
    )
    wall = time.perf_counter() - started
    now = resource.getrusage(resource.RUSAGE_CHILDREN)
    used = now.ru_utime - cpu.ru_utime + now.ru_stime - cpu.ru_stime
    return done.returncode, wall, used, done.stdout + done.stderr


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("git_dir", nargs="?", help="a Megatron-LM git directory (a bare mirror will do)")
    parser.add_argument("--rev", default="d98e8a64dd", help="the revision to export (default: d98e8a64dd)")
    parser.add_argument("--installed", action="store_true", help="the installed Megatron-Core's megatron/core")
    args = parser.parse_args()
    if (args.git_dir is None) == (not args.installed):
        parser.error("give a Megatron-LM git directory or --installed, not both")
    with tempfile.TemporaryDirectory() as temporary:
        before_root, after_root = Path(temporary, "before"), Path(temporary, "after")
        if args.installed:
            what = _copy_installed(before_root)
            _copy_installed(after_root)
        else:
            what = f"Megatron-LM at {args.rev}"
            _export(args.git_dir, args.rev, before_root)
            _export(args.git_dir, args.rev, after_root)
        before, ruff_before = _families(before_root), _ruff(before_root)
        old = _snapshot(before_root)
        code, write_s, write_cpu, report = _migrate(after_root, "--write")
        after, ruff_after = _families(after_root), _ruff(after_root)
        written = _snapshot(after_root)
        compiled = subprocess.run(
            [sys.executable, "-m", "compileall", "-q", "megatron/core"], cwd=after_root, capture_output=True,
            timeout=600,
        ).returncode
        check_code, check_s, check_cpu, _ = _migrate(after_root, "--check")
        again_code, _, _, _ = _migrate(after_root, "--write")
        changed_again = [path for path, data in _snapshot(after_root).items() if written.get(path) != data]
        load = os.getloadavg()[0]
    rewritten = {path: data for path, data in written.items() if old.get(path) != data}
    importing = [path for path, data in rewritten.items() if _imports_pgregistry(data)]
    long_lines = sum(
        1 for path, data in rewritten.items()
        for line in set(data.decode().splitlines()) - set(old.get(path, b"").decode().splitlines()) if len(line) > 100
    )
    new = ruff_after - ruff_before
    print(f"pgregistry migrate on {what}'s megatron/core (Python {sys.version.split()[0]}, {os.cpu_count()} cores)")
    print(f"{'family':<10}{'before':>8}{'after':>8}")
    for family in ("direct", "global", "fallback", "shim"):
        print(f"{family:<10}{before[family]:>8}{after[family]:>8}")
    share = after["direct"] / before["direct"] if before["direct"] else 0.0
    print(f"direct reads left: {after['direct']} of {before['direct']} ({share:.1%}; goal at most 10%)")
    print(f"--write exit code: {code}; wall time {write_s:.1f} s, CPU time {write_cpu:.1f} s "
          f"(load average {load:.1f} on {os.cpu_count()} cores when done)")
    print(f"every file byte-compiles: {'yes' if compiled == 0 else 'NO'}")
    print(f"ruff --select F: {sum(ruff_before.values())} findings before, {sum(ruff_after.values())} after, "
          f"{sum(new.values())} new")
    for finding in sorted(new):
        print(f"  new: {finding}")
    print(f"--check right after: exit code {check_code} (0: nothing left to change); wall time {check_s:.1f} s, "
          f"CPU time {check_cpu:.1f} s")
    print(f"a second --write: exit code {again_code}, {len(changed_again)} file(s) changed")
    print(f"{len(rewritten)} files rewritten or written (the fallback helper among them); importing pgregistry: "
          f"{len(importing)} {importing}; new lines over 100 columns: {long_lines}")
    print("the tool's report:")
    print(report, end="")


if __name__ == "__main__":
    main()

"""Benchmark on the real tree: pgregistry's allowlist scan of Megatron-LM against Megatron-LM's own checker.

Megatron-LM's pull request 6258 adds ``tools/check_process_group_usage.py``, a ratchet over ``megatron/core``
keyed by line number. This script exports Megatron-LM at ``--rev`` (``git archive``, into a temporary
directory) together with that checker from the commit that adds it, then reports, in one run:

- sites by family (direct, global, fallback, shim) with the ``megatron`` preset, in ``megatron/core`` and in
  ``megatron/``;
- coverage against the checker on ``megatron/core``: every line it lists, whether pgregistry reports a read
  there, and the reads pgregistry reports that it does not (by accessor);
- speed: the checker (``--stats``, a fresh interpreter) against ``python -m pgregistry.allowlist stats`` cold
  (no cache) and warm (cached), each a fresh interpreter, median of ``--repeat`` runs;
- optionally (``--user PATH``, repeatable: git directories of projects built on Megatron-LM, e.g. NeMo RL,
  Megatron-Bridge): sites by family with the default rule and the preset, the reads only the default rule
  reports (another project's ``parallel_state``, e.g. vLLM's), and the ``is_pipeline_*`` sites.

Usage: ``python benchmarks/allowlist_megatron.py /path/to/Megatron-LM.git [--user /path/to/RL.git]``.
Needs the repositories' git history, so it is not part of CI.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
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

from git_directories import git_directory  # noqa: E402

from pgregistry._source.config import PRESETS, ScanConfig  # noqa: E402
from pgregistry._source.engine import scan_files, scan_sources  # noqa: E402
from pgregistry._source.files import discover_files  # noqa: E402
from pgregistry._source.scanner import (  # noqa: E402
    FAMILIES,
    FileResult,  # noqa: E402
    family_of,
)
from pgregistry.allowlist._baseline import GitTree  # noqa: E402

CHECKER = "tools/check_process_group_usage.py"


def git(repository: Path, *args: str) -> bytes:
    return subprocess.run(["git", "--git-dir", str(repository), *args], capture_output=True, check=True).stdout


def export(repository: Path, rev: str, target: Path, *paths: str) -> None:
    archive = git(repository, "archive", "--format=tar", rev, *paths)
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(target, filter="data")


def scan(root: Path, subtree: str, config: ScanConfig) -> list[FileResult]:
    return scan_files(discover_files([root / subtree], root, ()).files, config, jobs=os.cpu_count() or 1).results


def families(results: list[FileResult]) -> Counter[str]:
    return Counter(family_of(site) for result in results for site in result.sites)


def median_seconds(command: list[str], cwd: Path, repeat: int, before: object = None) -> float:
    times = []
    for _ in range(repeat):
        if callable(before):
            before()
        start = time.perf_counter()
        subprocess.run(command, cwd=cwd, check=True, capture_output=True, env={**os.environ, "PYTHONPATH": str(REPO)})
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def family_table(rows: dict[str, Counter[str]]) -> list[str]:
    names = list(rows)
    lines = [f"{'family':10}" + "".join(f"{name:>22}" for name in names)]
    for family in (*FAMILIES, "total"):
        counts = [sum(rows[n].values()) if family == "total" else rows[n][family] for n in names]
        if any(counts):
            lines.append(f"{family:10}" + "".join(f"{count:>22}" for count in counts))
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "repository", type=git_directory, help="git directory of Megatron-LM (a bare clone or its .git)"
    )
    parser.add_argument("--rev", default="HEAD")
    parser.add_argument(
        "--user",
        type=git_directory,
        action="append",
        default=[],
        help="git directory of a project built on Megatron-LM",
    )
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    preset = PRESETS["megatron"]
    checker_commit = git(args.repository, "log", "--all", "-1", "--format=%H", "--", CHECKER).decode().strip()
    if not checker_commit:
        print(f"{CHECKER} is not in this repository's history", file=sys.stderr)
        return 2
    tip = git(args.repository, "rev-parse", "--short", args.rev).decode().strip()
    with tempfile.TemporaryDirectory() as temporary:
        root = Path(temporary)
        export(args.repository, args.rev, root, "megatron")
        export(args.repository, checker_commit, root, CHECKER)
        core = scan(root, "megatron/core", preset)
        whole = scan(root, "megatron", preset)
        files = len(discover_files([root / "megatron"], root, ()).files)
        print(
            f"Megatron-LM {tip} (megatron/: {files} files), checker {CHECKER} from {checker_commit[:10]}, "
            f"{os.cpu_count()} cores"
        )
        print()
        print("sites by family, preset megatron")
        print("\n".join(family_table({"megatron/core": families(core), "megatron/": families(whole)})))

        # Coverage against the checker: its list, regenerated on this tree, keyed by path and line.
        subprocess.run([sys.executable, CHECKER, "--update"], cwd=root, check=True, capture_output=True)
        listed = json.loads((root / "tools" / "process_group_usage_allowlist.json").read_text())["allowed"]
        theirs = {(path, int(entry.split(":", 1)[0])) for path, entries in listed.items() for entry in entries}
        ours: dict[tuple[str, int], list[str]] = {}
        for result in core:
            for site in result.sites:
                ours.setdefault((result.path, site.line), []).append(site.accessor)
        missed = sorted(theirs - set(ours))
        extra = Counter(accessor for where in set(ours) - theirs for accessor in ours[where])
        print()
        print(
            f"coverage on megatron/core against the checker: it lists {len(theirs)} lines; pgregistry reports a "
            f"read on {len(theirs) - len(missed)} of them; missed {len(missed)}"
        )
        for path, line in missed:
            print(f"  missed {path}:{line}")
        print(f"lines pgregistry reports that the checker does not: {sum(1 for _ in set(ours) - theirs)}; by accessor:")
        for accessor, count in extra.most_common():
            print(f"  {count:4}  {accessor}")

        # Speed, each a fresh interpreter, in this one run.
        cache = root / ".pgregistry_cache"
        ours_command = [
            sys.executable,
            "-m",
            "pgregistry.allowlist",
            "stats",
            "--isolated",
            "--preset",
            "megatron",
            "--cache-dir",
            str(cache),
            "megatron/core",
        ]

        def clear() -> None:
            for entry in cache.glob("*"):
                entry.unlink()

        checker = median_seconds([sys.executable, CHECKER, "--stats"], root, args.repeat)
        cold = median_seconds(ours_command, root, args.repeat, before=clear)
        warm = median_seconds(ours_command, root, args.repeat)
        nothing = median_seconds([sys.executable, "-c", "pass"], root, args.repeat)
        print()
        print(f"speed on megatron/core, fresh interpreter each, median of {args.repeat}")
        print(f"{'run':54}{'seconds':>9}{'vs checker':>12}")
        for label, seconds in (
            ("Megatron-LM checker (--stats)", checker),
            ("pgregistry allowlist stats --preset megatron, cold", cold),
            ("pgregistry allowlist stats --preset megatron, warm", warm),
            ("(python -c pass, for scale)", nothing),
        ):
            print(f"{label:54}{seconds:>9.3f}{seconds / checker:>11.2f}x")
    for user_dir in args.user:
        # Read from git directly: mirrors may lack large non-Python blobs, which `git archive` would need.
        user = GitTree(user_dir, "HEAD")
        sources = sorted(user.python_files(["."]).items())
        default = scan_sources(sources, ScanConfig(), jobs=os.cpu_count() or 1).results
        with_preset = scan_sources(sources, preset, jobs=os.cpu_count() or 1).results
        name = user_dir.parent.name if user_dir.name in (".git", "repo") else user_dir.name
        print()
        print(f"{name} at {user.commit[:10]} ({len(sources)} Python files)")
        for failed in (r for r in with_preset if r.failure is not None):
            print(f"  not parsed by Python {sys.version.split()[0]}: {failed.path}: {failed.failure.message[:90]}")
        print("\n".join(family_table({"default rule": families(default), "preset megatron": families(with_preset)})))
        keyed = {(r.path, s.line, s.accessor) for r in with_preset for s in r.sites}
        dropped = Counter(s.expr for r in default for s in r.sites if (r.path, s.line, s.accessor) not in keyed)
        print("reported by the default rule only (another project's module, or an unqualified name):")
        for expr, count in dropped.most_common(10):
            print(f"  {count:4}  {expr}")
        stages = Counter(s.accessor for r in with_preset for s in r.sites if s.accessor.startswith("is_pipeline_"))
        print("is_pipeline_first/last_stage sites (preset only): " + ", ".join(f"{a} {n}" for a, n in stages.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())

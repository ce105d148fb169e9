"""Benchmark on real trees: ``pgregistry migrate --write`` on megatron/core, Megatron-Bridge and NeMo, one table.

Each tree is copied twice into a temporary directory (one copy stays the baseline) and migrated as a user runs the
tool (``pgregistry migrate --write --isolated --preset megatron <package>``, a fresh interpreter, timed); the
figures are ``benchmarks/migrate_megatron.py``'s (``measure``): reads by family before and after (the ratchet's
scan), every file byte-compiles, ``ruff check --select F`` findings before and after, lines the rewrite added over
the tree's line length (the one the tool reads from the copy's settings: the wheels hold none, so 100), ``--check``
right after, a second ``--write``, rewritten files importing pgregistry, and the rewritten modules that imported
before and no longer do (each imported in a fresh interpreter with the copy first on the path; a module whose
dependencies are not installed is not counted).

The trees: the installed megatron-core 0.19.2's ``megatron/core``; Megatron-Bridge 0.6.2 and NeMo 3.0.0 as their
wheels hold them (``make setup`` unpacks them into ``.venv/corpus/``); with ``--megatron-lm GIT_DIR``, also
Megatron-LM's ``megatron/core`` at ``--rev`` (default d98e8a64dd).

Usage: ``python benchmarks/migrate_trees.py [--megatron-lm /path/to/Megatron-LM.git] [--no-imports]
[--report]``. Minutes on the shared 2-core machine. Not part of CI.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from git_directories import git_directory  # noqa: E402
from migrate_megatron import Measured, _copy_installed, _export, measure, print_measured  # noqa: E402

CORPUS = Path(sys.prefix) / "corpus"


def _copy_corpus(distribution: str, folder: str) -> Callable[[Path], str]:
    def copy(into: Path) -> str:
        shutil.copytree(CORPUS / distribution / folder, into / folder, ignore=shutil.ignore_patterns("__pycache__"))
        return distribution
    return copy


def _trees(git_dir: str | None, rev: str) -> list[tuple[str, str, Callable[[Path], str]]]:
    """(name, package folder, a function copying the tree under a root and saying what it copied)."""
    trees: list[tuple[str, str, Callable[[Path], str]]] = [("megatron-core 0.19.2", "megatron/core", _copy_installed)]
    if git_dir is not None:
        def export(into: Path) -> str:
            _export(git_dir, rev, into)
            return f"Megatron-LM at {rev}"
        trees.append((f"Megatron-LM {rev}", "megatron/core", export))
    trees.append(("Megatron-Bridge 0.6.2", "megatron/bridge", _copy_corpus("megatron_bridge-0.6.2", "megatron/bridge")))
    trees.append(("NeMo 3.0.0", "nemo", _copy_corpus("nemo_toolkit-3.0.0", "nemo")))
    return trees


#: The tool's report of the reads it left: after ``left in place:``, ``  <count> <reason>`` lines, each followed by
#: its reads, ``      <path>:<line> <accessor> (<family>)``.
_REASON = re.compile(r"^  (?P<count>\d+) (?P<reason>.+)$")
_READ = re.compile(r"^      (?P<where>\S+) (?P<accessor>\S+) \((?P<family>\w+)\)$")


def left_reads(report: str) -> dict[str, list[tuple[str, str, str]]]:
    """The reads the tool's report says it left: reason -> [(place, accessor, family)]."""
    left: dict[str, list[tuple[str, str, str]]] = {}
    lines = report.splitlines()
    if "left in place:" not in lines:
        return left
    reason = ""
    for line in lines[lines.index("left in place:") + 1:]:
        if (read := _READ.match(line)) is not None:
            left.setdefault(reason, []).append((read["where"], read["accessor"], read["family"]))
        elif (heading := _REASON.match(line)) is not None:
            reason = heading["reason"]
        else:
            break
    return left


def print_table(rows: list[tuple[str, Measured]]) -> None:
    print("| tree | direct before | after | fallback before | after | files written | compile | ruff F before "
          "/ after / new | lines over length | --check | 2nd --write changed | import pgregistry | modules imported "
          "before / lost | --write wall / CPU (load) |")
    print("|" + "---|" * 14)
    for name, m in rows:
        print(
            f"| {name} | {m.before['direct']} | {m.after['direct']} | {m.before['fallback']} | {m.after['fallback']} "
            f"| {len(m.rewritten)} | {'yes' if m.compiled else 'NO'} | {sum(m.ruff_before.values())} / "
            f"{sum(m.ruff_after.values())} / {sum(m.new_findings.values())} | {m.long_lines} (> {m.width}) "
            f"| exit {m.check_code} | {len(m.changed_again)} | {len(m.importing)} | {len(m.imported_before)} / "
            f"{len(m.no_longer_importing)} | {m.write_s:.1f} s / {m.write_cpu:.1f} s ({m.load:.1f}) |"
        )
    counted = [m for name, m in rows if not name.startswith("Megatron-LM")]  # the three trees of the goal
    before = sum(m.before["direct"] for m in counted)
    after = sum(m.after["direct"] for m in counted)
    share = after / before if before else 0.0
    print(f"\ndirect reads left over megatron-core 0.19.2, Bridge and NeMo together: {after} of {before} "
          f"({share:.1%}; goal at most 10%)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--megatron-lm",
        metavar="GIT_DIR",
        type=git_directory,
        help="also Megatron-LM's megatron/core from this git dir",
    )
    parser.add_argument("--rev", default="d98e8a64dd", help="Megatron-LM's revision (default: d98e8a64dd)")
    parser.add_argument("--no-imports", action="store_true", help="skip the import check of the rewritten modules")
    parser.add_argument("--report", action="store_true", help="print every tree's figures and the tool's report")
    args = parser.parse_args(argv)
    rows: list[tuple[str, Measured]] = []
    for name, folder, copy in _trees(args.megatron_lm, args.rev):
        with tempfile.TemporaryDirectory(prefix="pgregistry-trees-") as temporary:
            before_root, after_root = Path(temporary, "before"), Path(temporary, "after")
            copy(before_root)
            copy(after_root)
            measured = measure(before_root, after_root, folder, imports=not args.no_imports)
        rows.append((name, measured))
        print(f"{name}: done ({measured.write_s:.1f} s)", file=sys.stderr, flush=True)
    print(f"pgregistry migrate on {len(rows)} trees (Python {sys.version.split()[0]}, {os.cpu_count()} cores)\n")
    print_table(rows)
    for name, m in rows:
        print(f"\n## {name}: the direct reads left, by the tool's reason")
        for reason, reads in left_reads(m.report).items():
            direct = [f"{where} {accessor}" for where, accessor, family in reads if family == "direct"]
            if direct:
                print(f"  {len(direct)} {reason}")
                print("".join(f"      {read}\n" for read in direct), end="")
        for finding in sorted(m.new_findings):
            print(f"  new ruff finding: {finding}")
        for module in m.no_longer_importing:
            print(f"  no longer imports: {module}")
        if args.report:
            print_measured(m)
    return 0


if __name__ == "__main__":
    sys.exit(main())

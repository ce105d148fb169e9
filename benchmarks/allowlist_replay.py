"""Replay a repository's history commit by commit as CI would run the allowlist check, and count the failures.

For each first-parent commit that touched the subtree (default: Megatron-LM's ``megatron/core`` over the two
months before the tip), the allowlist is the one ``update`` wrote at the previous such commit (CI keeps it
current), and the check runs on the commit's tree. A failure is classified by what really changed:

- *real new read*: the number of reads of some accessor in some form, over the whole subtree, rose;
- *stale only*: reads were removed and none added (the ratchet asks for ``update``, by design);
- *refactor noise*: the check failed though no accessor's count rose and none fell (renames, moves).

Checks replayed in the same run: keys compared as they are (no pairing of moved reads), pairing without git,
pairing with git's rename detection (stale entries still failing), and ``check --base`` as it runs now: git's
renames plus each key held to what the base read (:func:`~pgregistry.allowlist._baseline.base_limits`), so a
commit that only removes reads passes with "can shrink" notices. The last check is also replayed with a lazy
team: the list is updated only when the check fails (never to shrink it), so stale slack builds up and every
later commit is judged against it; for contrast, the same lazy team with stale entries merely made warnings
(no base limits), where a read re-added within a stale entry's slack goes through. The goal: no failure
without a real new read, and every commit with a real new read still failing.

Needs the repository's git history, so it cannot run in CI (no network there). Fetch it once, e.g.
``git clone --bare https://github.com/NVIDIA/Megatron-LM``, then::

    python benchmarks/allowlist_replay.py /path/to/Megatron-LM.git [--subtree megatron/core] [--months 2]

Trees are read with ``git ls-tree`` / ``git cat-file --batch`` (nothing is checked out) and each blob is
scanned once.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from collections import Counter
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from git_directories import git_directory  # noqa: E402

from pgregistry._source.config import PRESETS, ScanConfig  # noqa: E402
from pgregistry._source.scanner import FileResult, scan_source  # noqa: E402
from pgregistry.allowlist._baseline import FileChanges, base_limits, parse_name_status  # noqa: E402
from pgregistry.allowlist._ratchet import Allowlist, Comparison, compare_counts  # noqa: E402


def git(repository: Path, *args: str, data: bytes | None = None) -> bytes:
    return subprocess.run(
        ["git", "--git-dir", str(repository), *args], input=data, capture_output=True, check=True
    ).stdout


class Trees:
    """Scans of the subtree at any commit, each blob read and scanned once."""

    def __init__(self, repository: Path, subtree: str, config: ScanConfig) -> None:
        self.repository, self.subtree, self.config = repository, subtree, config
        self.scanned: dict[tuple[str, str], FileResult] = {}

    def results(self, commit: str) -> list[FileResult]:
        listing = git(self.repository, "ls-tree", "-r", "-z", commit, "--", self.subtree)
        files = []
        for entry in listing.split(b"\0"):
            if entry:
                meta, _, name = entry.partition(b"\t")
                mode, kind, sha = meta.decode().split()
                if kind == "blob" and mode != "120000" and name.endswith(b".py"):
                    files.append((name.decode(), sha))
        missing = [(path, sha) for path, sha in files if (path, sha) not in self.scanned]
        if missing:
            out = git(self.repository, "cat-file", "--batch", data="".join(f"{sha}\n" for _, sha in missing).encode())
            position = 0
            for path, sha in missing:
                header_end = out.index(b"\n", position)
                size = int(out[position:header_end].split()[2])
                self.scanned[path, sha] = scan_source(out[header_end + 1 : header_end + 1 + size], path, self.config)
                position = header_end + 2 + size
        return [self.scanned[key] for key in files]


def changes(repository: Path, old: str, new: str, subtree: str) -> FileChanges:
    return parse_name_status(git(repository, "diff", "--name-status", "-M", "-z", old, new, "--", subtree))


def reads(results: list[FileResult]) -> Counter[tuple[str, str]]:
    return Counter((site.accessor, site.form) for result in results for site in result.sites)


def check_base(
    current: list[FileResult], allowed: Allowlist, listed_at_base: Allowlist, previous: Allowlist, files: FileChanges
) -> Comparison:
    """``check --base`` of the commit against its parent: ``previous`` holds the counts the parent's code read."""
    old_of = {new: old for old, new in files.renames.items()}
    counts = Allowlist.from_results(current).entries
    limits = base_limits(allowed, listed_at_base, previous.entries, lambda path: old_of.get(path, path), counts)
    return compare_counts(current, allowed, lambda path: True, files.renames, files.added, limits)


LABELS = (
    "keys as they are",
    "pairing moved reads",
    "pairing + git renames",
    "--base",
    "--base, lazy list",
    "stale as warning, lazy",
)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("repository", type=git_directory, help="a git directory (bare clone or .git) of the project")
    parser.add_argument("--rev", default="HEAD", help="the tip to replay up to (default: HEAD)")
    parser.add_argument("--subtree", default="megatron/core")
    parser.add_argument("--months", type=int, default=2, help="how far back from the tip's commit date")
    parser.add_argument("--preset", default="megatron", choices=["none", *PRESETS])
    parser.add_argument("--verbose", action="store_true", help="list every failing commit")
    args = parser.parse_args()
    repository = args.repository
    if (repository / ".git").is_dir():
        repository = repository / ".git"
    config = PRESETS[args.preset] if args.preset != "none" else ScanConfig()
    tip_date = git(repository, "log", "-1", "--format=%cI", args.rev).decode().strip()
    tip = datetime.fromisoformat(tip_date)
    months = tip.year * 12 + tip.month - 1 - args.months
    since = tip.replace(year=months // 12, month=months % 12 + 1, day=min(tip.day, 28)).isoformat()
    commits = (
        git(repository, "rev-list", "--first-parent", "--reverse", f"--since={since}", args.rev, "--", args.subtree)
        .decode()
        .split()
    )
    parent = git(repository, "rev-parse", f"{commits[0]}^").decode().strip()
    trees = Trees(repository, args.subtree, config)
    start = time.perf_counter()
    previous_commit, previous = parent, trees.results(parent)
    lazy = Allowlist.from_results(previous)  # the list of a team that never shrinks it, only grants on failure
    lax = lazy  # the same team, when stale entries are only warnings and nothing holds the allowance down
    rows: Counter[str] = Counter()
    listed: list[str] = []
    for commit in commits:
        current = trees.results(commit)
        allowed = Allowlist.from_results(previous)
        before, after = reads(previous), reads(current)
        real_new = any(after[read] > before[read] for read in after)
        removed = any(after[read] < before[read] for read in before)
        kind = "real new read" if real_new else "stale only" if removed else "no read added or removed"
        rows[f"commits: {kind}"] += 1
        everything = lambda path: True  # noqa: E731
        paired = compare_counts(current, allowed, everything, {})
        raw_fail = bool(paired.mismatches) or bool(paired.moves)  # without pairing, a move is a failure too
        files = changes(repository, previous_commit, commit, args.subtree)
        with_git = compare_counts(current, allowed, everything, files.renames, files.added)
        previous_counts = Allowlist.from_results(previous)
        base = check_base(current, allowed, allowed, previous_counts, files)
        lazy_check = check_base(current, lazy, lazy, previous_counts, files)
        lax_check = compare_counts(current, lax, everything, files.renames, files.added)
        verdicts = (raw_fail, not paired.ok, not with_git.ok, not base.ok, not lazy_check.ok, bool(lax_check.new))
        for label, failed in zip(LABELS, verdicts, strict=True):
            if failed:
                rows[f"{label}: fail, {kind}"] += 1
        rows[f"--base: notices, {kind}"] += bool(base.ok and base.stale)
        if not lazy_check.ok:
            lazy = Allowlist.from_results(current)  # the reviewed `update` that lets the change in
        if lax_check.new:
            lax = Allowlist.from_results(current)
        if args.verbose and (raw_fail or not base.ok or not lazy_check.ok or bool(lax_check.new)):
            subject = git(repository, "log", "-1", "--format=%h %s", commit).decode().strip()[:60]
            listed.append(
                f"  {kind:26} raw={int(raw_fail)} git={int(not with_git.ok)} base={int(not base.ok)} "
                f"lazy={int(not lazy_check.ok)} warn={int(bool(lax_check.new))} new={base.new_sites} "
                f"stale={len(base.stale)} moved={len(base.moves)}  {subject}"
            )
        previous_commit, previous = commit, current
    elapsed = time.perf_counter() - start
    print(
        f"replay of {args.subtree} at {repository.name} {args.rev} ({tip_date[:10]}), {args.months} months: "
        f"{len(commits)} first-parent commits touching it, preset {args.preset}, {elapsed:.1f} s"
    )
    kinds = ("real new read", "stale only", "no read added or removed")
    print(f"{'check':24} " + " ".join(f"{k:>26}" for k in kinds))
    print(f"{'commits':24} " + " ".join(f"{rows[f'commits: {k}']:>26}" for k in kinds))
    for label in LABELS:
        print(f"{label + ': fail':24} " + " ".join(f"{rows[f'{label}: fail, {k}']:>26}" for k in kinds))
    print(f"{'--base: pass, notices':24} " + " ".join(f"{rows[f'--base: notices, {k}']:>26}" for k in kinds))
    if listed:
        print(
        "failing commits (raw: keys as they are; git: pairing + git renames; base / lazy: --base; "
        "warn: stale as warning, lazy):"
    )
        print("\n".join(listed))
    return 0


if __name__ == "__main__":
    sys.exit(main())

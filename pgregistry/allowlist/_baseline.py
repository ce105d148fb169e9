"""What a base revision tells the ratchet: files git saw renamed, the sources as they were, and
which of a key's sites are the added ones.

``check --base REV`` (in CI: the pull request's target branch) pairs stale and new entries across
files git reports renamed, and, when a scope's count rises from 3 to 4, points at the one added site
instead of all four: the file at REV is scanned with the same settings, its lines are matched to
today's with :mod:`difflib`, and the sites on lines that did not exist at REV are the added ones. It
also keeps the allowance tight (:func:`base_limits`): a key may not read more than it did at REV,
plus what this change adds to the allowlist, so a read removed without shrinking the list cannot
come back in a later change. ``stats --since REV`` scans the whole tree as it was at REV. Everything
is read with ``git`` plumbing (``ls-tree``, ``cat-file --batch``, ``diff -M``), never by checking
anything out; a failing git command raises :class:`GitError`.
"""

from __future__ import annotations

import dataclasses
import difflib
import subprocess
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from pgregistry._source.config import ScanConfig
from pgregistry._source.scanner import Site, scan_source
from pgregistry.allowlist._ratchet import Allowlist, Comparison, Mismatch

__all__ = ["FileChanges", "GitError", "GitTree", "base_limits", "mark_added", "parse_name_status"]


class GitError(RuntimeError):
    """A git command failed (not a repository, unknown revision); the message says which and why."""


def _run_git(root: Path, *args: str, data: bytes | None = None) -> bytes:
    try:
        done = subprocess.run(
            ["git", "-C", str(root), *args], input=data, capture_output=True, check=False
        )
    except OSError as error:
        raise GitError(f"cannot run git: {error.strerror or error}") from error
    if done.returncode != 0:
        message = done.stderr.decode("utf-8", "replace").strip().splitlines()
        raise GitError(
            f"git {' '.join(args[:2])} failed: {message[-1] if message else done.returncode}"
        )
    return done.stdout


@dataclass(frozen=True)
class FileChanges:
    """What ``git diff --name-status -M`` reports: renamed files (old -> new) and added files."""

    renames: dict[str, str]
    added: frozenset[str]


def parse_name_status(out: bytes) -> FileChanges:
    """Parse ``git diff --name-status -M -z`` output (paths as git spells them)."""
    fields = out.split(b"\0")
    renames: dict[str, str] = {}
    added: set[str] = set()
    index = 0
    while index < len(fields) - 1:
        status = fields[index].decode()
        paths = [
            field.decode("utf-8", "surrogateescape") for field in fields[index + 1 : index + 3]
        ]
        if status.startswith(("R", "C")):
            if status.startswith("R"):
                renames[paths[0]] = paths[1]
            index += 3
        else:
            if status == "A":
                added.add(paths[0])
            index += 2
    return FileChanges(renames, frozenset(added))


class GitTree:
    """The project at ``root`` inside its git repository, as of revision ``rev``."""

    def __init__(self, root: Path, rev: str) -> None:
        self.root = root
        self.rev = rev
        # Project paths are relative to ``root``; git's are relative to the repository's top level.
        self.prefix = _run_git(root, "rev-parse", "--show-prefix").decode().strip()
        try:
            self.commit = (
                _run_git(root, "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}")
                .decode()
                .strip()
            )
        except (
            GitError
        ):  # --quiet: git says nothing, so the error would name neither the revision nor the cause
            message = (
                f"unknown revision {rev!r}: no commit of that name in the git repository at {root}"
            )
            raise GitError(message) from None

    def _path_in_project(self, git_path: str) -> str | None:
        return git_path[len(self.prefix) :] if git_path.startswith(self.prefix) else None

    def changes(self) -> FileChanges:
        """The files git detects as renamed, and those added, since ``rev`` (work tree included)."""
        out = _run_git(self.root, "diff", "--name-status", "-M", "-z", self.commit, "--", ".")
        changes = parse_name_status(out)
        project = self._path_in_project
        renames = {project(old): project(new) for old, new in changes.renames.items()}
        return FileChanges(
            {old: new for old, new in renames.items() if old is not None and new is not None},
            frozenset(path for path in map(project, changes.added) if path is not None),
        )

    def python_files(self, under: Iterable[str]) -> dict[str, bytes]:
        """Project path -> bytes of each ``*.py`` file at ``rev`` in the project paths ``under``."""
        listing = _run_git(self.root, "ls-tree", "-r", "-z", self.commit, "--", *(under or ["."]))
        blobs: list[tuple[str, str]] = []
        for entry in listing.split(b"\0"):
            if not entry:
                continue
            meta, _, name = entry.partition(b"\t")
            mode, kind, sha = meta.decode().split()
            path = self._path_in_project(
                (self.prefix.encode() + name).decode("utf-8", "surrogateescape")
            )
            if kind == "blob" and mode != "120000" and path is not None and path.endswith(".py"):
                blobs.append((path, sha))
        return dict(
            zip(
                [path for path, _ in blobs],
                self._read_blobs([sha for _, sha in blobs]),
                strict=True,
            )
        )

    def source(self, path: str) -> bytes | None:
        """The bytes of the project path ``path`` at ``rev``; None when it did not exist there."""
        try:
            return _run_git(self.root, "show", f"{self.commit}:./{path}")
        except GitError:
            return None

    def _read_blobs(self, shas: list[str]) -> list[bytes]:
        if not shas:
            return []
        out = _run_git(
            self.root, "cat-file", "--batch", data="".join(f"{sha}\n" for sha in shas).encode()
        )
        contents, position = [], 0
        for _ in shas:
            header_end = out.index(b"\n", position)
            size = int(out[position:header_end].split()[2])
            contents.append(out[header_end + 1 : header_end + 1 + size])
            position = header_end + 1 + size + 1
        return contents


def _sites_on_added_lines(
    item: Mismatch, before: bytes, after: bytes, config: ScanConfig, old_path: str
) -> tuple[Site, ...]:
    """The sites of ``item`` on lines not in ``before`` (lines matched with difflib)."""
    old_sites = scan_source(before, old_path, config).sites
    accessor, form = item.key.split("|")[1:]
    old_lines = {s.line for s in old_sites if (s.accessor, s.form) == (accessor, form)}
    matcher = difflib.SequenceMatcher(None, before.splitlines(), after.splitlines(), autojunk=False)
    kept: set[int] = set()  # today's lines that are a line of ``before`` holding such a read
    for block in matcher.get_matching_blocks():
        kept.update(block.b + k + 1 for k in range(block.size) if block.a + k + 1 in old_lines)
    return tuple(site for site in item.sites if site.line not in kept)


def mark_added(
    comparison: Comparison,
    config: ScanConfig,
    current: Callable[[str], bytes | None],
    base: GitTree,
    renames: dict[str, str],
) -> Comparison:
    """``comparison`` with each new mismatch's ``added`` sites set, where the base tells them apart.

    The base revision tells them apart when there are at least as many sites on new lines as the
    reads that are new; otherwise all its sites stay flagged."""
    old_of = {new: old for old, new in renames.items()}
    marked = []
    for item in comparison.mismatches:
        if item.is_new:
            old_path = old_of.get(item.path, item.path)
            before, after = base.source(old_path), current(item.path)
            if after is not None:
                added = _sites_on_added_lines(item, before or b"", after, config, old_path)
                if len(added) >= item.unexplained:
                    item = dataclasses.replace(item, added=added)
        marked.append(item)
    return dataclasses.replace(comparison, mismatches=tuple(marked))


def base_limits(
    allowlist: Allowlist,
    base_allowlist: Allowlist,
    base_counts: Mapping[str, Mapping[str, int]],
    base_path: Callable[[str], str],
    paths: Iterable[str] = (),
) -> Allowlist:
    """Each key's allowance against a base revision: ``min(listed, read at base + granted here)``.

    ``listed`` is the allowlist's count; ``read at base`` the key's site count in the code at the
    base (``base_counts``, by base path); ``granted here`` how much this change raised the key over
    the base's allowlist (``base_allowlist``): an ``update`` a reviewer saw in the diff. So a commit
    that only removes reads passes with its entries left stale, and a later commit cannot re-add a
    read into that slack: the base's code already read less. ``base_path``: today's path -> the path
    at the base (git renames).

    Reads the base holds under keys the list lacks were moved there by a change that passed without
    rewriting the list; those keys (in today's ``paths``) share what the list's own keys of the same
    accessor and form lost to the rule above, never more, so the total allowance of a read never
    exceeds the list's."""
    limits: dict[str, dict[str, int]] = {}
    lost: Counter[str] = Counter()  # accessor|form -> allowance the listed keys lost
    for path, keys in allowlist.entries.items():
        old = base_path(path)
        counts, listed_at_base = base_counts.get(old, {}), base_allowlist.entries.get(old, {})
        for key, listed in keys.items():
            granted = max(0, listed - listed_at_base.get(key, 0))
            limit = min(listed, counts.get(key, 0) + granted)
            lost[key.split("|", 1)[1]] += listed - limit
            if limit:
                limits.setdefault(path, {})[key] = limit
    # Base reads a listed key already accounts for (under today's path or the one it was renamed
    # from).
    accounted = {(base_path(path), key) for path, keys in allowlist.entries.items() for key in keys}
    for path in sorted(set(paths)):
        old = base_path(path)
        for key, count in sorted(base_counts.get(old, {}).items()):
            read = key.split("|", 1)[1]
            share = min(count, lost[read])
            if share and (old, key) not in accounted:
                accounted.add((old, key))
                limits.setdefault(path, {})[key] = share
                lost[read] -= share
    return Allowlist(limits)

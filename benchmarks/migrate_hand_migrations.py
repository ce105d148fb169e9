"""Benchmark against people: ``pgregistry migrate`` on the parents of Megatron-LM's hand migrations.

Megatron-LM deprecates ``parallel_state`` in a series of hand-written pull requests, each threading a
``pg_collection`` into a few functions and replacing their global reads with the collection's fields. For each
such commit this script exports the parent's ``megatron/`` tree (``git archive``, into a temporary directory),
runs ``pgregistry migrate --write --isolated --preset megatron megatron`` on it as a user would (so the helpers
the touched files call are threaded too, and ``megatron/core/parallel_state.py`` says the release's field table),
and compares the tool's result on the Python files the commit touched with the authors' version of them:

- **reads**: the global process-group reads the project's own scanner (``pgregistry.allowlist``, ``megatron``
  preset) finds in each version, keyed by enclosing function and accessor; those the authors removed, those the
  tool removed, those both removed;
- **fields**: per function where the authors removed a read, the collection fields they now read
  (``pg_collection.dp_cp``, ``self.pg_collection.tp``, a ``group=pg_collection.mp`` given to a helper) and those
  the tool's version reads, itself or in the functions it passes its collection to (where the authors hand a
  helper a field, the tool hands it the collection); a function agrees when the tool reads every field the
  authors do.

How two kinds of read are counted, and said so in the output:

- ``is_pipeline_first/last_stage(ignore_virtual=False, vp_stage=...)``: the tool's version calls
  ``pg_read(c, "pp", "first_stage", ignore_virtual=False, vp_stage=...)``, which reads the pipeline group from the
  collection and the virtual pipeline size from ``parallel_state`` (a schedule setting no collection holds, read
  as the original read it; the scanner ignores ``get_virtual_pipeline_*`` too). It counts as removed by the tool,
  as no process group is read from the global state for it; each such function is listed with how many of these
  calls it holds (the authors took the size from the model config instead).
- a read the authors removed from a function but still make, from ``parallel_state``, in the files they touched (the
  same function, where they removed one of two; a helper they moved it into) is listed with where: removed from
  the function, not from the globals.

The comparison rests on the scanner's sites and on the fields read, not on text, so the tool's formatting (and
the authors' unrelated edits in the same commits) do not enter it.

Usage: ``python benchmarks/migrate_hand_migrations.py /path/to/Megatron-LM.git [--commit SHA ...]``. Needs the
repository's history, so it is not part of CI.
"""

from __future__ import annotations

import argparse
import ast
import io
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from git_directories import git_directory  # noqa: E402

from pgregistry._source.config import PRESETS  # noqa: E402
from pgregistry._source.scanner import scan_source  # noqa: E402
from pgregistry.collection import FIELD_NAMES  # noqa: E402

#: Megatron-LM's hand migrations threading a collection (commit, pull request): ``git log -i --grep=pg_collection
#: --grep=parallel_state``; the M4 task force's two (#3349, #3962) threaded ``grad_comm_pgs`` / ``model_comm_pgs``,
#: the collection's earlier names, and #3962 replays #3892, which was reverted.
HAND_MIGRATIONS: tuple[tuple[str, str], ...] = (
    ("0b3e2066f9", "#3349 M4 Task force: optimizer parallel state update"),
    ("8c1a3f5df0", "#3962 M4: Merge model_comm_pgs, grad_comm_pgs, grad_finalize_pgs into pg_collection"),
    ("de6305c0ae", "#5259 Thread pg_collection into train_step reductions"),
    ("75e382c633", "#5250 Thread pg_collection into get_model DDP bucket sizing"),
    ("eb1c677d7b", "#5328 Thread pg_collection through wrap_model_chunks_with_ddp"),
    ("9f3fe8c925", "#6234 [GTP] Cleanup usage of pg_collection in gtp"),
)
Key = tuple[str, str]  # (enclosing scope, accessor)
#: Calls whose second argument names the field read: ``getattr(c, "expt_dp", ...)`` and the fallback helper's
#: ``pg_group(c, "dp_cp")``, ``pg_rank``, ``pg_size``, ``pg_read(c, "pp", "last_stage")``.
_FIELD_ARGUMENT = frozenset({"getattr", "pg_group", "pg_rank", "pg_size", "pg_read"})


def git(repository: Path, *args: str) -> bytes:
    return subprocess.run(["git", "--git-dir", str(repository), *args], capture_output=True, check=True).stdout


def touched_python_files(repository: Path, commit: str) -> list[str]:
    names = git(repository, "diff-tree", "--no-commit-id", "--name-only", "-r", f"{commit}^", commit).decode()
    return [
        name
        for name in names.split()
        if name.endswith(".py") and name.startswith("megatron/") and "/tests/" not in f"/{name}"
    ]


def export(repository: Path, rev: str, target: Path, paths: list[str]) -> None:
    archive = git(repository, "archive", "--format=tar", rev, *paths)
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(target, filter="data")


def read_keys(data: bytes, path: str) -> Counter[Key]:
    result = scan_source(data, path, PRESETS["megatron"])
    if result.failure is not None:
        raise SystemExit(f"{path}: does not parse: {result.failure}")
    return Counter((site.scope, site.accessor) for site in result.sites)


class _FieldReads(ast.NodeVisitor):
    """Per enclosing scope (the scanner's spelling: ``Class.method``, ``outer.inner``), the collection fields read:
    an attribute named as a field of pgregistry's collection (``pg_collection.dp_cp``, ``self.pg_collection.tp``,
    ``layout_pgs.dp_cp`` after ``layout_pgs = pg_collection or ...``), ``getattr(x, "expt_dp", ...)``, or a
    call of the tool's fallback helper (``pg_group(pg_collection, "dp_cp")``). Names only: the collection may
    reach the function under any local name."""

    def __init__(self) -> None:
        self.scopes: list[str] = []
        self.fields: dict[str, set[str]] = {}
        #: Per scope, the functions (by plain name) its calls pass a ``pg_collection=`` keyword.
        self.passes: dict[str, set[str]] = {}
        #: Per scope, the names it calls (``x.get_data_parallel_group_gloo(...)``: the last name), how often.
        self.calls: Counter[tuple[str, str]] = Counter()
        #: Per (scope, stage accessor), its fallback helper calls that also read the virtual pipeline size from
        #: parallel_state (``pg_read(c, "pp", "first_stage", ignore_virtual=False, ...)``).
        self.virtual_size_reads: Counter[tuple[str, str]] = Counter()

    def _scoped(self, node: ast.AST, name: str) -> None:
        self.scopes.append(name)
        self.generic_visit(node)
        self.scopes.pop()

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self._scoped(node, node.name)

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        self._scoped(node, node.name)

    def visit_AsyncFunctionDef(self, node: ast.AsyncFunctionDef) -> None:
        self._scoped(node, node.name)

    def _read(self, name: str) -> None:
        if name in FIELD_NAMES:
            self.fields.setdefault(".".join(self.scopes) or "<module>", set()).add(name)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        self._read(node.attr)
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        callee = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
        if callee:
            self.calls[(".".join(self.scopes) or "<module>", callee)] += 1
        if callee and any(k.arg == "pg_collection" for k in node.keywords):
            self.passes.setdefault(".".join(self.scopes) or "<module>", set()).add(callee)
        if isinstance(node.func, ast.Name) and node.func.id in _FIELD_ARGUMENT and len(node.args) >= 2:
            name = node.args[1]
            if isinstance(name, ast.Constant) and isinstance(name.value, str):
                self._read(name.value)
            kind = node.args[2] if len(node.args) >= 3 else None
            if any(k.arg == "ignore_virtual" for k in node.keywords) and isinstance(kind, ast.Constant):
                accessor = f"is_pipeline_{str(kind.value).removesuffix('_stage')}_stage"
                self.virtual_size_reads[(".".join(self.scopes) or "<module>", accessor)] += 1
        self.generic_visit(node)


def field_reads(data: bytes) -> _FieldReads:
    """The fields each scope of ``data`` reads, and the functions it passes its collection to."""
    visitor = _FieldReads()
    visitor.visit(ast.parse(data))
    return visitor


def passed_reads(tree: dict[Path, bytes], callees: set[str]) -> dict[str, set[str]]:
    """The fields read by the module-level functions ``callees`` (a scope passes them its collection,
    ``f(x, pg_collection=pg_collection)``), found in the files of ``tree`` that say ``def <name>(``: name -> fields."""
    found: dict[str, set[str]] = {}
    for callee in sorted(callees):
        for text in tree.values():
            if f"def {callee}(".encode() in text:
                found.setdefault(callee, set()).update(field_reads(text).fields.get(callee, set()))
    return found


@dataclass
class Comparison:
    commit: str
    title: str
    files: list[str]
    by_authors: Counter[Key] = field(default_factory=Counter)
    by_tool: Counter[Key] = field(default_factory=Counter)
    functions: list[tuple[str, str, set[str], set[str]]] = field(default_factory=list)  # file, scope, authors, tool
    tool_seconds: float = 0.0
    tool_output: str = ""
    #: (file, scope) -> the functions the tool's version passes its collection to, with the fields they read.
    through: dict[tuple[str, str], dict[str, set[str]]] = field(default_factory=dict)
    #: (file:scope, stage accessor) -> the tool's fallback helper calls there that read the virtual pipeline size
    #: from parallel_state.
    virtual_size_reads: Counter[Key] = field(default_factory=Counter)
    #: The calls of each name in the authors' version of the touched files, the modules the scanner exempts
    #: (``process_groups_config.py``) too: (file:scope, name) -> count.
    calls_by_authors: Counter[Key] = field(default_factory=Counter)

    @property
    def in_both(self) -> Counter[Key]:
        return self.by_authors & self.by_tool

    @property
    def fields_agree(self) -> int:
        return sum(1 for _, _, authors, tool in self.functions if authors <= tool)


def run_tool(root: Path, files: list[str]) -> tuple[float, str]:
    command = [sys.executable, "-m", "pgregistry", "migrate", "--write", "--isolated", "--preset", "megatron", *files]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(REPO)]))}
    start = time.perf_counter()
    done = subprocess.run(command, cwd=root, capture_output=True, text=True, env=env, timeout=300)
    seconds = time.perf_counter() - start
    if done.returncode not in (0, 1):
        raise SystemExit(f"pgregistry migrate exited {done.returncode}:\n{done.stdout}\n{done.stderr}")
    return seconds, done.stdout + done.stderr


def compare(repository: Path, commit: str, title: str) -> Comparison:
    files = touched_python_files(repository, commit)
    comparison = Comparison(commit, title, files)
    with tempfile.TemporaryDirectory(prefix="pgregistry-hand-") as temp:
        root = Path(temp)
        # The parent's whole megatron/ tree, as a user runs the tool: the helpers the touched files call are
        # threaded too, and megatron/core/parallel_state.py says the release's field table. Only the touched
        # files are compared.
        export(repository, f"{commit}^", root, ["megatron"])
        before = {name: (root / name).read_bytes() for name in files}
        comparison.tool_seconds, output = run_tool(root, ["megatron"])
        comparison.tool_output = "\n".join(
            line for line in output.splitlines()
            if not line.startswith("      ") or any(f" {name}:" in f" {line.strip()}" for name in files)
        )
        tree = {path: path.read_bytes() for path in root.rglob("*.py")}  # the tool's version, read once
        for name in files:
            after_tool = tree[root / name]
            after_authors = git(repository, "show", f"{commit}:{name}")
            keys_before = read_keys(before[name], name)
            keys_authors = read_keys(after_authors, name)
            removed_by_authors = keys_before - keys_authors
            comparison.calls_by_authors += Counter(
                {(f"{name}:{s}", a): n for (s, a), n in field_reads(after_authors).calls.items()}
            )
            comparison.by_authors += Counter({(f"{name}:{s}", a): n for (s, a), n in removed_by_authors.items()})
            removed_by_tool = keys_before - read_keys(after_tool, name)
            comparison.by_tool += Counter({(f"{name}:{s}", a): n for (s, a), n in removed_by_tool.items()})
            fields_before = field_reads(before[name]).fields
            fields_authors = field_reads(after_authors).fields
            tool_reads = field_reads(after_tool)
            fields_tool = tool_reads.fields
            comparison.virtual_size_reads += Counter(
                {(f"{name}:{scope}", a): n for (scope, a), n in tool_reads.virtual_size_reads.items()}
            )
            for scope in sorted({scope for scope, _ in removed_by_authors}):
                new_authors = fields_authors.get(scope, set()) - fields_before.get(scope, set())
                through = passed_reads(tree, tool_reads.passes.get(scope, set()))
                tool_fields = fields_tool.get(scope, set()) | {f for fields in through.values() for f in fields}
                comparison.functions.append((name, scope, new_authors, tool_fields))
                comparison.through[(name, scope)] = through
    return comparison


def report(comparisons: list[Comparison]) -> None:
    print("| pull request | files | reads removed by authors | by the tool | by both | authors' only | fields agree |")
    print("|---|---|---|---|---|---|---|")
    for c in comparisons:
        authors = sum(c.by_authors.values())
        tool = sum(c.by_tool.values())
        both = sum(c.in_both.values())
        print(
            f"| {c.title.split()[0]} ({c.commit}) | {len(c.files)} | {authors} | {tool} | {both} | {authors - both} "
            f"| {c.fields_agree} of {len(c.functions)} functions |"
        )
    for c in comparisons:
        print(f"\n## {c.title} ({c.commit}): tool {c.tool_seconds:.2f} s on the parent's megatron/, "
              f"{len(c.files)} file(s) compared")
        for (scope, accessor), count in sorted(c.by_authors.items()):
            mark = "both" if c.by_tool[(scope, accessor)] >= count else "AUTHORS ONLY"
            print(f"  removed {count}x {accessor} in {scope}: {mark}{_how_counted(c, scope, accessor, count, mark)}")
        for (scope, accessor), count in sorted((c.by_tool - c.by_authors).items()):
            print(f"  removed {count}x {accessor} in {scope}: tool only (the authors left it)")
        for name, scope, authors, tool in c.functions:
            verdict = "agree" if authors <= tool else f"MISSING {sorted(authors - tool)}"
            print(f"  fields in {name}:{scope}: authors {sorted(authors)}, tool {sorted(tool)}: {verdict}")
            for callee, fields in sorted(c.through.get((name, scope), {}).items()):
                if fields:
                    print(f"    ({sorted(fields)} read in {callee}, which the tool's version passes the collection to)")
        print("  tool report (of what it left, the lines of the compared files):")
        for line in c.tool_output.strip().splitlines():
            print(f"    {line}")


def _how_counted(c: Comparison, scope: str, accessor: str, count: int, mark: str) -> str:
    """What a removed read's line must say besides its mark: a pipeline-stage read the tool removed whose
    replacement still reads the virtual pipeline size from parallel_state; a read the authors moved elsewhere."""
    notes = []
    virtual = min(count, c.virtual_size_reads[(scope, accessor)])
    if mark == "both" and virtual:
        notes.append(
            f"{virtual} of them counted as removed though the tool's pg_read(..., ignore_virtual=False) for it "
            "still reads the virtual pipeline size, a schedule setting, from parallel_state (in the fallback "
            "helper, as the original did); the pipeline group is the collection's"
        )
    still = sorted(f"{where} ({n}x)" for (where, read), n in c.calls_by_authors.items() if read == accessor)
    if mark != "both" and still:
        notes.append(f"the authors' version still reads it from parallel_state, in {', '.join(still)}")
    return "".join(f"\n    ({note})" for note in notes)


def summary(comparisons: list[Comparison]) -> str:
    """The totals line: reads removed by both, of those the authors removed, and how the special cases count."""
    authors = sum(sum(c.by_authors.values()) for c in comparisons)
    both = sum(sum(c.in_both.values()) for c in comparisons)
    virtual = sum(min(n, c.virtual_size_reads[key]) for c in comparisons for key, n in c.in_both.items())
    moved = sum(
        n
        for c in comparisons
        for (scope, accessor), n in (c.by_authors - c.by_tool).items()
        if any(read == accessor for _, read in c.calls_by_authors)
    )
    return (
        f"{both} of the {authors} reads the authors removed are removed by the tool too ({100 * both / authors:.0f}%); "
        f"{virtual} of those {both} are pipeline-stage reads whose rewrite still reads the virtual pipeline size "
        f"from parallel_state (a schedule setting, no process group); of the {authors - both} the tool leaves, "
        f"{moved} the authors' "
        "version still reads from parallel_state in the files they touched"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("repository", type=git_directory, help="Megatron-LM's git directory (a bare mirror is enough)")
    parser.add_argument("--commit", action="append", help="a hand migration's commit (default: the built-in list)")
    args = parser.parse_args(argv)
    commits = [(sha, sha) for sha in args.commit] if args.commit else list(HAND_MIGRATIONS)
    comparisons = [compare(args.repository, sha, title) for sha, title in commits]
    report(comparisons)
    print(f"\n{summary(comparisons)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

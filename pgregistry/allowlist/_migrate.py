"""``pgregistry migrate``'s engine: the files of a run to their planned rewrites, across the whole tree.

1. Read every file and scan it with the ratchet's scanner and settings (the same reads ``allowlist`` counts).
2. Parse the files with reads with libcst and plan each read (:mod:`~pgregistry.allowlist._migrate_plan`).
3. Parse the other files that mention a function a collection was threaded into, so their calls can pass one.
4. Rewrite (:mod:`~pgregistry.allowlist._migrate_rewrite`) and check that each new text still compiles: a
   rewrite that would not is refused, never written.

Nothing here writes: :mod:`~pgregistry.allowlist._migrate_files` does, once every file has been planned.
libcst is imported here and below only, so ``pgregistry`` and the ratchet run without it.
"""

from __future__ import annotations

import ast
import gc
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from pgregistry.allowlist._config import ScanConfig
from pgregistry.allowlist._engine import scan_sources
from pgregistry.allowlist._files import SourceFile
from pgregistry.allowlist._migrate_files import Change
from pgregistry.allowlist._migrate_idioms import Idiom, idiom
from pgregistry.allowlist._migrate_plan import FilePlan, Read, left_by_site, passes, plan_file, visit_mentions
from pgregistry.allowlist._migrate_rewrite import UnrestorableError, rewrite
from pgregistry.allowlist._migrate_skeleton import needed_by, skeleton
from pgregistry.allowlist._scanner import FileResult, ParseFailure, module_name

__all__ = ["Migration", "migrate"]


@dataclass
class Migration:
    """A run's outcome: the changes to write, every read with its way, the files that could not be read or
    parsed (nothing may be written then), and how many calls now pass a collection."""

    changes: list[Change] = field(default_factory=list)
    reads: list[tuple[str, Read]] = field(default_factory=list)
    failures: list[FileResult] = field(default_factory=list)
    passed: int = 0
    threaded: list[str] = field(default_factory=list)


def _read(source: SourceFile) -> tuple[bytes, int] | FileResult:
    try:
        with open(source.absolute, "rb") as stream:
            return stream.read(), os.fstat(stream.fileno()).st_mtime_ns
    except OSError as error:
        return FileResult(source.path, failure=ParseFailure(f"cannot read: {error.strerror or error}", 1, 1))


@dataclass
class _Parsed:
    """A file's libcst tree (of its skeleton, where it has one), its :mod:`ast` tree and the placeholders."""

    tree: object
    syntax: ast.Module
    kept: dict[str, str]


def _parse(
    path: str, data: bytes, syntax: ast.Module, needed: Callable[[int, int, bool], bool]
) -> _Parsed | FileResult:
    """Parse ``data`` (whose :mod:`ast` tree is ``syntax``) with libcst: its skeleton, each definition that is not
    ``needed`` stood in for by a placeholder."""
    import libcst as cst

    frame = skeleton(data, syntax, needed)
    try:
        tree = cst.parse_module(frame.data if frame is not None else data)
    except cst.ParserSyntaxError as error:
        return FileResult(path, failure=ParseFailure(f"libcst cannot parse it: {error.message}", error.raw_line,
                                                     error.raw_column + 1))
    return _Parsed(tree, syntax, frame.decoded(tree.encoding) if frame is not None else {})


def _module_functions(syntax: ast.Module) -> set[str]:
    """The names of the functions defined at module level (in module-level blocks too: ``if``, ``try``)."""
    names: set[str] = set()
    stack: list[ast.stmt] = list(syntax.body)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif not isinstance(node, ast.ClassDef):
            for value in ast.iter_child_nodes(node):
                if isinstance(value, ast.stmt):
                    stack.append(value)
    return names


def _calls_of(names: set[str]) -> re.Pattern[bytes] | None:
    """A call of one of ``names`` (by its plain name, as :func:`passes` resolves it)."""
    if not names:
        return None
    return re.compile(rb"\b(?:" + b"|".join(re.escape(n.encode()) for n in sorted(names)) + rb")\s*\(")


def migrate(files: Sequence[SourceFile], config: ScanConfig, *, target: str, name: str, jobs: int = 1) -> Migration:
    """Plan and rewrite ``files`` (not written). ``target``: ``megatron`` or ``pgregistry``; ``name``: the
    collection's parameter name. ``ValueError`` for an unknown target or a name that is no identifier.

    The garbage collector is off meanwhile: the trees stay alive until the end and hold no cycles the run
    must free, so its collections would only rescan them (a tenth of the time on a large tree)."""
    if not name.isidentifier():
        raise ValueError(f"--collection-name {name!r} is not a Python identifier")
    idiom_ = idiom(target)
    enabled = gc.isenabled()
    gc.disable()
    try:
        return _migrate(files, config, idiom_, name, jobs)
    finally:
        if enabled:
            gc.enable()


def _migrate(files: Sequence[SourceFile], config: ScanConfig, idiom_: Idiom, name: str, jobs: int) -> Migration:
    import libcst as cst

    read = [(source, _read(source)) for source in files]
    report = scan_sources([(s.path, d if isinstance(d, FileResult) else d[0]) for s, d in read], config, jobs=jobs)
    outcome = Migration(failures=list(report.failures))
    if outcome.failures:
        return outcome
    contents = {source.path: (source, data) for source, data in read if not isinstance(data, FileResult)}
    plans: dict[str, FilePlan] = {}
    #: Files whose reads all stay for reasons their sites give: not parsed with libcst (unless called into).
    left: dict[str, list[Read]] = {}
    planned = []
    for result in report.results:
        reads = left_by_site(result.sites) if result.sites else None
        if reads is not None:
            left[result.path] = reads
        elif result.sites:
            planned.append(result)
    named = re.compile(rb"\b" + re.escape(name.encode()) + rb"\b")
    # Any module-level function holding a read may be threaded: the definitions that call one are parsed too,
    # so that once the threaded ones are known their callers can pass the collection (see visit_mentions).
    syntaxes = {r.path: ast.parse(contents[r.path][1][0]) for r in planned}
    may_thread = _calls_of(set().union(*(
        _module_functions(syntaxes[r.path]) & {s.scope.partition(".")[0] for s in r.sites} for r in planned)))
    for result in planned:
        source, (data, _) = contents[result.path]
        lines = {site.line for site in result.sites}
        parsed = _parse(result.path, data, syntaxes[result.path], needed_by(data, lines, may_thread, named))
        if isinstance(parsed, FileResult):
            outcome.failures.append(parsed)
            continue
        assert isinstance(parsed.tree, cst.Module)
        plans[result.path] = plan_file(result.path, ".".join(module_name(result.path)), parsed.tree, result.sites,
                                       name, data, parsed.syntax)
        plans[result.path].kept = parsed.kept
    if outcome.failures:
        return outcome
    mention = _calls_of({  # only module-level functions are passed a collection (a method may be overridden)
        f.node.name.value for plan in plans.values() for f in plan.functions
        if f.added and f.parent is None and f.method_of is None
    })
    if mention is not None:
        for path, (_, (data, _)) in contents.items():
            if path not in plans and mention.search(data):
                parsed = _parse(path, data, ast.parse(data), needed_by(data, set(), mention, named))
                if not isinstance(parsed, FileResult):  # a file only read for its calls is passed over if libcst balks
                    assert isinstance(parsed.tree, cst.Module)
                    plans[path] = plan_file(path, ".".join(module_name(path)), parsed.tree, (), name, data,
                                            parsed.syntax)
                    plans[path].kept = parsed.kept
        for plan in plans.values():
            visit_mentions(plan, mention)
    ordered = [plans[path] for path in sorted(plans)]
    modules = frozenset(".".join(module_name(source.path)) for source in files)
    outcome.passed = passes(ordered, name)
    every = {**{plan.path: plan.reads for plan in ordered}, **left}
    for path in sorted(every):
        outcome.reads += [(path, r) for r in sorted(every[path], key=lambda r: (r.site.line, r.site.col))]
    for plan in ordered:
        outcome.threaded += [f"{plan.path}: {f.qualname}" for f in plan.functions if f.added]
        source, (data, mtime) = contents[plan.path]
        try:
            text = rewrite(plan, idiom_, modules)
        except UnrestorableError as error:  # a bug of this tool: refuse the run rather than write a mix
            outcome.failures.append(FileResult(plan.path, failure=ParseFailure(
                f"internal error: {error}; please report it", 1, 1)))
            continue
        after = text.encode(plan.wrapper.module.encoding) if text is not None else data
        if after == data:
            continue
        try:
            compile(after, plan.path, "exec", dont_inherit=True)
        except SyntaxError as error:  # a bug of this tool: refuse the whole run rather than write broken code
            message = f"internal error: the rewrite would not compile ({error.msg}); please report it"
            outcome.failures.append(FileResult(plan.path, failure=ParseFailure(message, error.lineno or 1, 1)))
            continue
        outcome.changes.append(Change(plan.path, source.absolute, data, mtime, after))
    return outcome

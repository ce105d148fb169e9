"""``pgregistry migrate``'s engine: a run's files to their planned rewrites, across the whole tree.

1. Read every file and scan it with the ratchet's scanner and settings (the same reads ``allowlist``
   counts); learn what the whole tree says about the functions with reads
   (:mod:`~pgregistry.migrate._tree`).
2. Parse the files with reads with libcst and plan each read (:mod:`~pgregistry.migrate._plan`);
   read every file's facts (:mod:`~pgregistry.migrate._facts`) for the rules decided over the whole
   tree once every file is planned (threading upward, subclasses, spec fields).
3. Parse the other files that mention a function a collection was threaded into, so their calls can
   pass one.
4. Rewrite (:mod:`~pgregistry.migrate._rewrite`) and check that each new text still compiles: a
   rewrite that would not is refused, never written.
5. With ``--target megatron``, add the fallback helper module the rewritten reads call
   (:mod:`~pgregistry.migrate._helper_file`): a new file, or one this tool wrote before; any other
   file at its path is refused.

Steps 2 to 4 are split by file across the cores (:mod:`~pgregistry.migrate._phases`), with one
exchange after step 2: which functions were threaded, and the files' facts the rules read there (so
nothing is parsed again between the phases, while one core works and the other waits). The files
without reads, in steps 2 and 3, are not split in advance but taken from a queue by whichever worker
is free (what the rest of the work costs is only known once it is done). The result does not depend
on the split.

Nothing here writes: :mod:`~pgregistry.migrate._writing` does, once every file has been planned.
libcst is imported here and below only, so ``pgregistry`` and the ratchet run without it.
"""

from __future__ import annotations

import ast
import gc
import os
import re
import warnings
from collections.abc import Callable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Literal

from pgregistry._source.config import ScanConfig
from pgregistry._source.engine import (
    PARALLEL_MIN_BYTES,
    read_source,
    scan_sources,
    split_into_buckets,
)
from pgregistry._source.files import SourceFile
from pgregistry._source.processes import can_fork
from pgregistry._source.scanner import MODULE_SCOPE, FileResult, ParseFailure, Site, module_name
from pgregistry.migrate._facts import FileFacts, TreeIndex, read_file_facts
from pgregistry.migrate._helper_file import MARKER, default_module, helper_path, helper_text
from pgregistry.migrate._idioms import Idiom, idiom_of_target
from pgregistry.migrate._inherited import thread_subclasses
from pgregistry.migrate._megatron_release import ShimGetters, find_installed_shim_getters
from pgregistry.migrate._phases import TaskQueue, two_phases
from pgregistry.migrate._plan import (
    FilePlan,
    Read,
    Way,
    add_reexported_names,
    collect_threaded_classes,
    collect_threaded_functions,
    collect_threaded_methods,
    collection_mentions,
    decide_passes,
    plan_file,
    reads_left_by_site,
    visit_mentions,
)
from pgregistry.migrate._progress import SILENT, Progress
from pgregistry.migrate._rewrite import apply_rewrites
from pgregistry.migrate._skeleton import build_skeleton, make_needed_check
from pgregistry.migrate._spec_fields import SpecCallLeft, SpecFields, decide_spec_fields
from pgregistry.migrate._style import DEFAULT_WIDTH
from pgregistry.migrate._tree import TreeFacts, learn_tree
from pgregistry.migrate._upward import Upward, thread_upward
from pgregistry.migrate._writing import Change

__all__ = ["Migration", "migrate"]


@dataclass
class Migration:
    """A run's outcome: the changes to write, every read with its way, the failures, the passes.

    ``failures``: the files that could not be read or parsed (nothing may be written then);
    ``passed``: how many calls now pass a collection."""

    changes: list[Change] = field(default_factory=list)
    reads: list[tuple[str, Read]] = field(default_factory=list)
    failures: list[FileResult] = field(default_factory=list)
    passed: int = 0
    threaded: list[str] = field(default_factory=list)
    #: Calls of a spec's field left without the collection, with why (:mod:`._spec_fields`).
    spec_calls_left: list[SpecCallLeft] = field(default_factory=list)


@dataclass
class _Parsed:
    """A file's libcst tree (of its skeleton, where it has one) and the placeholders.

    With the original bytes of each definition the placeholders stand in for."""

    tree: object
    kept: dict[str, str]
    stood_in: tuple[bytes, ...] = ()


def _parse_skeleton(
    path: str, data: bytes, syntax: ast.Module, needed: Callable[[int, int, bool], bool]
) -> _Parsed | FileResult:
    """Parse ``data``'s skeleton with libcst: each definition not ``needed`` stood in for.

    ``syntax``: the :mod:`ast` tree of ``data``; a placeholder stands in for a definition."""
    import libcst as cst

    frame = build_skeleton(data, syntax, needed)
    try:
        tree = cst.parse_module(frame.data if frame is not None else data)
    except cst.ParserSyntaxError as error:
        return FileResult(
            path,
            failure=ParseFailure(
                f"libcst cannot parse it: {error.message}", error.raw_line, error.raw_column + 1
            ),
        )
    if frame is None:
        return _Parsed(tree, {})
    return _Parsed(tree, frame.decode_kept(tree.encoding), tuple(frame.kept.values()))


_INTERNAL = "internal error"


def _internal_error(path: str, error: BaseException) -> FileResult:
    """``error``, raised by this tool on ``path`` (a bug), as the file's failure.

    The run writes nothing and exits 2, never 1, which ``--check`` keeps for "would change"."""
    detail = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
    return FileResult(path, failure=ParseFailure(f"{_INTERNAL} ({detail}); please report it", 1, 1))


def _calls_of(names: AbstractSet[str]) -> re.Pattern[bytes] | None:
    """A call of one of ``names`` (by its plain name, as :func:`decide_passes` resolves it).

    The lookahead on their first letters spares trying every name at every word (three times faster
    on megatron/core)."""
    if not names:
        return None
    first = b"".join(sorted({re.escape(n[:1].encode()) for n in names}))
    alternatives = b"|".join(re.escape(n.encode()) for n in sorted(names))
    return re.compile(rb"\b(?=[" + first + rb"])(?:" + alternatives + rb")\s*\(")


@dataclass(frozen=True)
class Helper:
    """Where ``--target megatron``'s fallback helper goes, and what it must know of the code.

    ``module``: where the helper goes (None, the default: the rewritten files' top package);
    ``accessors``: the accessors of the code's Megatron-Core release (none known: 0.19's);
    ``width``: the tree's line length; ``shims``: the getters the release's shims call."""

    module: str | None = None
    accessors: Sequence[str] = ()
    width: int = DEFAULT_WIDTH
    #: What the release's ``use_mpu_process_groups`` calls for each field
    #: (:mod:`._megatron_release`): the installed Megatron-Core's (where this Python imports it
    #: from) unless given; None: not known, every shim stays.
    shims: ShimGetters | Literal["installed"] | None = "installed"
    #: Whether the release's pipeline-stage accessors are the form the helper reproduces for
    #: ``ignore_virtual=False`` (:mod:`._virtual_stages`; default: 0.19's, which are).
    virtual_stages: bool = True


def migrate(
    files: Sequence[SourceFile],
    config: ScanConfig,
    *,
    target: str,
    name: str,
    jobs: int = 1,
    gtp_remat: bool = True,
    helper: Helper = Helper(),
    progress: Progress = SILENT,
) -> Migration:
    """Plan and rewrite ``files`` (not written).

    ``target``: ``megatron`` or ``pgregistry``; ``name``: the collection's parameter name;
    ``gtp_remat``: whether the code's Megatron-Core has GTP remat
    (:mod:`~pgregistry.migrate._megatron_release`); ``helper``: where the fallback helper goes;
    ``progress``: where a long run says how far it is. ``ValueError`` for an unknown target, a name
    that is no identifier or a helper module that is no dotted name.

    The garbage collector is off meanwhile: the trees stay alive until the end and hold no cycles
    the run must free, so its collections would only rescan them (a tenth of the time on a large
    tree)."""
    if not name.isidentifier():
        raise ValueError(f"--collection-name {name!r} is not a Python identifier")
    if helper.module is not None and not all(
        part.isidentifier() for part in helper.module.split(".")
    ):
        raise ValueError(f"--helper-module {helper.module!r} is not a dotted module name")
    idiom_of_target(target)  # an unknown one refused before any work
    enabled = gc.isenabled()
    gc.disable()
    try:
        return _run_migration(files, config, target, name, jobs, gtp_remat, helper, progress)
    finally:
        if enabled:
            gc.enable()


#: Threaded module-level functions: (module, name) -> the parameter that was added.
Threaded = dict[tuple[str, str], str]


@dataclass
class _Planned:
    """A worker's first phase: the files it could not parse, what it threaded, the facts it read.

    ``threaded`` and ``methods``: the functions and methods it threaded; ``classes``: the classes
    whose ``__init__`` it threaded (:func:`~pgregistry.migrate._plan.collect_threaded_classes`);
    ``facts``: the facts of the files it read (:mod:`._facts`: its files with reads, and those
    without it took from the queue)."""

    failures: list[FileResult]
    threaded: Threaded
    methods: Threaded
    classes: Threaded
    facts: dict[str, FileFacts | None] = field(default_factory=dict)


def _file_facts(
    path: str, data: bytes, name: str, syntax: ast.Module | None = None
) -> FileFacts | None:
    """The facts of file ``path`` for the rules between the phases; None when it does not parse.

    ``syntax``: its parsed tree, else it is parsed here. When it does not parse, the scan refused
    the run already."""
    try:
        return read_file_facts(path, data, ast.parse(data) if syntax is None else syntax, name)
    except (SyntaxError, ValueError):
        return None


@dataclass(frozen=True)
class _Instruction:
    """What every worker's second phase needs of the others' first.

    The module-level functions given the parameter (with the names packages re-export them under)
    and what threading upward decided."""

    threaded: Threaded
    upward: Upward = Upward()
    spec_fields: SpecFields = SpecFields()
    #: The ``__init__``s given the parameter to pass it on through ``super().__init__``
    #: (:mod:`._inherited`).
    forwarding: frozenset[tuple[str, str]] = frozenset()
    #: Module -> the names of it the tree reaches (:func:`._facts.names_reached`): its imports stay.
    reached: Mapping[str, frozenset[str]] = field(default_factory=dict)

    def names_reached_in(self, module: str) -> frozenset[str]:
        """The names of ``module`` the tree reaches (``*``: any of its public names).

        Looked up under each dotted tail of ``module`` too (``pkg.k`` for ``src.pkg.k``): a path's
        module and an import's need not start alike, and a name kept for nothing only keeps an
        import."""
        parts = module.split(".")
        return frozenset().union(
            *(self.reached.get(".".join(parts[start:]), ()) for start in range(len(parts)))
        )

    def names(self) -> set[str]:
        """The names of the functions and methods a caller may now pass a collection to.

        And ``build_module``, which builds a spec's field."""
        return (
            {function for _, function in self.threaded}
            | {q.rpartition(".")[2] for _, q in self.upward.functions}
            | set(self.upward.methods)
            | {spec_field for _, _, spec_field in self.spec_fields.passed}
            | {local for _, _, local in self.spec_fields.local_classes}
            | ({"build_module"} if self.spec_fields.passed else set())
        )

    def forwarding_modules(self) -> set[str]:
        """The modules holding an ``__init__`` that forwards the collection.

        It forwards it through ``super().__init__``."""
        return {module for module, _ in self.forwarding}

    def forwarding_names(self, module: str) -> set[str]:
        """``__init__`` where ``module`` holds a forwarding one, else nothing.

        Its ``def`` is walked then."""
        return {"__init__"} if module in self.forwarding_modules() else set()

    def mention(self) -> re.Pattern[bytes] | None:
        """A call of one of :meth:`names`."""
        return _calls_of(self.names())


@dataclass
class _Done:
    """A worker's second phase done: what it rewrote, read, threaded, passed, failed, looked at.

    Its files' rewritten bytes, reads (without their tree nodes), the functions threaded, the calls
    that now pass a collection, the files whose rewrite failed (this tool's bugs), and the files
    without reads it looked through for calls."""

    changes: list[tuple[str, bytes]] = field(default_factory=list)
    reads: list[tuple[str, Read]] = field(default_factory=list)
    threaded: list[str] = field(default_factory=list)
    passed: int = 0
    failures: list[FileResult] = field(default_factory=list)
    looked: list[str] = field(default_factory=list)


@dataclass
class _Worker:
    """Plans, then rewrites, one share of the files with reads; with the others, looks for calls.

    See :mod:`~pgregistry.migrate._phases`. With the others, it reads the facts of the files without
    reads (taking them from ``facts_queue`` in chunks), then looks through them for calls of the
    threaded functions, taking them from ``queue`` (how long the rest takes is not known in advance,
    so they are not split in advance)."""

    files: list[tuple[str, bytes, tuple[Site, ...]]]
    others: list[list[tuple[str, bytes]]]
    facts_queue: TaskQueue
    queue: TaskQueue
    may_thread_names: frozenset[str]
    name: str
    idiom: Idiom
    width: int
    gtp_remat: bool
    progress: Progress
    facts: TreeFacts
    shims: ShimGetters | None
    #: Whether ``ignore_virtual=False`` stage reads are rewritten (``--target megatron`` and a
    #: release of the form its helper reproduces, :mod:`._virtual_stages`).
    virtual_stages: bool = False
    plans: dict[str, FilePlan] = field(default_factory=dict)
    #: The original bytes of the definitions each plan's skeleton stood in for.
    stood_in: dict[str, tuple[bytes, ...]] = field(default_factory=dict)
    #: The :mod:`ast` tree of each file with reads (the first phase's, read again by a re-plan).
    syntax: dict[str, ast.Module] = field(default_factory=dict)
    #: A call of one of ``may_thread_names``.
    may_thread: re.Pattern[bytes] | None = field(init=False)

    def __post_init__(self) -> None:
        self.may_thread = _calls_of(self.may_thread_names)

    def _plan_one_file(
        self,
        path: str,
        data: bytes,
        sites: Sequence[Site],
        calls: re.Pattern[bytes] | None,
        syntax: ast.Module | None = None,
    ) -> FileResult | FilePlan:
        """The plan of file ``path`` (parsed as ``syntax``, else here), or why there is none."""
        import libcst as cst

        try:
            named = collection_mentions(self.name)
            syntax = ast.parse(data) if syntax is None else syntax
            parsed = _parse_skeleton(
                path, data, syntax, make_needed_check(data, {s.line for s in sites}, calls, named)
            )
            if isinstance(parsed, FileResult):
                return parsed
            assert isinstance(parsed.tree, cst.Module)
            plan = plan_file(
                path,
                ".".join(module_name(path)),
                parsed.tree,
                sites,
                self.name,
                data,
                syntax,
                gtp_remat=self.gtp_remat,
                facts=self.facts,
                shims=self.shims,
                virtual_stages=self.virtual_stages,
            )
        except Exception as error:  # a bug of this tool: named, and the run refused (exit 2)
            return _internal_error(path, error)
        plan.kept = parsed.kept
        self.stood_in[path] = parsed.stood_in
        return plan

    def first(self) -> _Planned:
        failures = []
        facts: dict[str, FileFacts | None] = {}
        for done, (path, data, sites) in enumerate(self.files, 1):
            try:
                syntax = self.syntax[path] = ast.parse(data)
            except (SyntaxError, ValueError):
                syntax = None  # the scan refused the run already; named by the plan
            facts[path] = _file_facts(path, data, self.name, syntax) if syntax is not None else None
            planned = self._plan_one_file(path, data, sites, self.may_thread, syntax)
            self.progress("planning the files with reads", done, len(self.files))
            if isinstance(planned, FileResult):
                failures.append(planned)
            else:
                self.plans[path] = planned
        while (task := self.facts_queue.take()) is not None:
            facts.update(self.read_facts(self.others[task]))
            self.progress(
                "reading the other files' definitions (groups of files)",
                task + 1,
                len(self.others),
            )
        plans = self.plans.values()
        return _Planned(
            failures,
            collect_threaded_functions(plans),
            collect_threaded_methods(plans),
            collect_threaded_classes(plans),
            facts,
        )

    def read_facts(self, files: Sequence[tuple[str, bytes]]) -> dict[str, FileFacts | None]:
        """The facts of ``files`` (without reads) for the rules between the phases."""
        return {path: _file_facts(path, data, self.name) for path, data in files}

    def second(self, instruction: _Instruction) -> _Done:
        done = _Done()
        mention = instruction.mention()
        modules = (
            {module for module, _ in instruction.upward.functions}
            | {module for module, _, _ in instruction.spec_fields.passed}
            | {module for module, _, _ in instruction.spec_fields.local_classes}
            | instruction.forwarding_modules()
        )
        # A definition threaded upward, or calling a spec's field or a local assigned classes, or an
        # __init__ forwarding the collection, may be a placeholder: the file is planned again where
        # the wider search for calls finds one in a definition its skeleton stood in for (else the
        # skeleton, so the plan, would be the first phase's).
        for path, data, sites in self.files:
            plan = self.plans.get(path)
            if plan is None or not plan.kept or plan.module not in modules:
                continue
            calls = _calls_of(
                self.may_thread_names
                | instruction.names()
                | instruction.forwarding_names(plan.module)
            )
            if calls is None or not any(calls.search(text) for text in self.stood_in[path]):
                continue
            planned = self._plan_one_file(path, data, sites, calls, self.syntax.get(path))
            if isinstance(planned, FileResult):
                done.failures.append(planned)
            else:
                self.plans[path] = planned
        self.finish([self.plans[path] for path in sorted(self.plans)], instruction, mention, done)
        while (task := self.queue.take()) is not None:
            self.look(self.others[task], instruction, mention, done)
            self.progress(
                "looking through the other files for calls (groups of files)",
                task + 1,
                len(self.others),
            )
        return done

    def look(
        self,
        files: Sequence[tuple[str, bytes]],
        instruction: _Instruction,
        mention: re.Pattern[bytes] | None,
        done: _Done,
    ) -> None:
        """Plan and rewrite those of ``files`` (without reads) that call a threaded function.

        ``mention``: a call of one, None when there is none."""
        done.looked += [path for path, _ in files]
        if mention is None:
            return
        plans = []
        forwarding = instruction.forwarding_modules()
        for path, data in files:
            module = ".".join(module_name(path))
            if module in forwarding or mention.search(
                data
            ):  # a file only read for its calls is passed over if libcst balks
                pattern = (
                    _calls_of(instruction.names() | instruction.forwarding_names(module))
                    if module in forwarding
                    else mention
                )
                planned = self._plan_one_file(path, data, (), pattern)
                if isinstance(planned, FilePlan):
                    plans.append(planned)
                elif planned.failure is not None and planned.failure.message.startswith(_INTERNAL):
                    done.failures.append(planned)
        self.finish(plans, instruction, mention, done)

    def finish(
        self,
        plans: Sequence[FilePlan],
        instruction: _Instruction,
        mention: re.Pattern[bytes] | None,
        done: _Done,
    ) -> None:
        """Thread ``plans``' functions upward, decide the calls that pass the collection, rewrite.

        Into ``done``: the functions of ``plans`` threaded upward, the calls that pass a threaded
        function its collection, and their rewrites."""
        upward = instruction.upward
        try:
            if mention is not None:
                for plan in plans:
                    visit_mentions(plan, mention)
            for plan in plans:
                for function in plan.functions:
                    key = (plan.module, function.qualname)
                    if function.parent is None and key in upward.functions:
                        function.added, function.upward = self.name, True
                    elif function.parent is None and key in instruction.forwarding:
                        function.added = self.name
            done.passed += decide_passes(
                plans,
                self.name,
                instruction.threaded,
                upward.methods,
                instruction.spec_fields.passed,
                instruction.forwarding,
                instruction.spec_fields.local_classes,
            )
        except (
            Exception
        ) as error:  # a bug of this tool: every file whose calls were being decided is named
            done.failures += [_internal_error(plan.path, error) for plan in plans]
            return
        for rewritten, plan in enumerate(plans, 1):
            self.progress("rewriting", rewritten, len(plans))
            done.reads += [(plan.path, replace(r, call=None, function=None)) for r in plan.reads]
            done.threaded += [f"{plan.path}: {f.qualname}" for f in plan.functions if f.added]
            result = self._rewrite_and_compile(plan, instruction.names_reached_in(plan.module))
            if isinstance(result, FileResult):
                done.failures.append(result)
            elif result is not None:
                done.changes.append((plan.path, result))

    def _rewrite_and_compile(
        self, plan: FilePlan, reached: AbstractSet[str]
    ) -> bytes | FileResult | None:
        """The file's new bytes (None: unchanged), checked to compile.

        ``reached``: the names of the file's module that the tree reaches (its imports stay)."""
        assert plan.data is not None
        data = plan.data
        try:
            text = apply_rewrites(plan, self.idiom, self.width, reached, self.facts.modules)
            after = text.encode(plan.wrapper.module.encoding) if text is not None else data
        except Exception as error:  # a bug of this tool: refuse the run rather than write a mix
            return _internal_error(plan.path, error)
        if after == data:
            return None
        try:
            with (
                warnings.catch_warnings()
            ):  # the file's own SyntaxWarnings are not this run's to print
                warnings.simplefilter("ignore")
                compile(after, plan.path, "exec", dont_inherit=True)
        except (
            SyntaxError
        ) as error:  # a bug of this tool: refuse the whole run rather than write broken code
            message = f"{_INTERNAL}: the rewrite would not compile ({error.msg}); please report it"
            return FileResult(plan.path, failure=ParseFailure(message, error.lineno or 1, 1))
        return after


#: The name a ``def`` or ``class`` line defines (up to its parameters, bases or type parameters: a
#: class whose ``__init__`` reads is called by its own name); a line starts after any of Python's
#: line endings (``re.M``'s ``^`` knows only ``\n``, not a CR-only file's ``\r``).
_DEFINED = re.compile(rb"(?:\A|(?<=[\r\n]))[ \t]*(?:(?:async[ \t]+)?def|class)[ \t]+([^\s(\[:]+)")


def _may_thread(planned: Sequence[FileResult], contents: Mapping[str, bytes]) -> frozenset[str]:
    """The names of the functions and classes that may be threaded, from each read's scope.

    A read's enclosing scope whose head some ``def`` or ``class`` names: a superset of the
    module-level functions and classes with reads; the definitions it matches are parsed, not stood
    in for, so that once the threaded ones are known their callers can pass the collection. Each
    file is scanned once for the names it defines (a search per scope would be quadratic in a file's
    size)."""
    names = set()
    for result in planned:
        heads = {s.scope.partition(".")[0] for s in result.sites if s.scope != MODULE_SCOPE}
        defined = set(_DEFINED.findall(contents[result.path]))
        names |= {head for head in heads if head.encode() in defined}
    return frozenset(names)


def _project_root(files: Sequence[SourceFile]) -> Path:
    """The project root the paths of ``files`` are relative to (the current directory if none)."""
    if not files:
        return Path.cwd()
    return files[0].absolute.parents[files[0].path.count("/")]


def _helper_change(
    root: Path, path: str, module: str, helper: Helper, gtp_remat: bool
) -> Change | FileResult | None:
    """The helper module's file: new, rewritten, or a failure naming it.

    ``path``: its path in the project at ``root``. It is new, or rewritten where this tool wrote it
    and it differs; a failure names it when a file this tool did not write is at its path."""
    absolute = root / path
    text = helper_text(helper.accessors, gtp_remat=gtp_remat)
    if not os.path.lexists(absolute):
        return Change(path, absolute, b"", 0, text, created=True)
    read = read_source(SourceFile(path, absolute))  # a FIFO there is refused, not waited on
    if isinstance(read, FileResult):
        assert read.failure is not None
        message = f"the fallback helper module: {read.failure.message}"
        return FileResult(path, failure=ParseFailure(message, 1, 1))
    data, mtime = read
    if MARKER not in data:
        message = (
            f"the fallback helper module {module} is a file pgregistry migrate did not write; name "
            "another module with --helper-module (or [tool.pgregistry.migrate] helper-module)"
        )
        return FileResult(path, failure=ParseFailure(message, 1, 1))
    return Change(path, absolute, data, mtime, text) if data != text else None


def _run_migration(
    files: Sequence[SourceFile],
    config: ScanConfig,
    target: str,
    name: str,
    jobs: int,
    gtp_remat: bool,
    helper: Helper,
    progress: Progress,
) -> Migration:
    read = []
    for source in files:
        read.append((source, read_source(source)))
        progress("reading the files", len(read), len(files))
    report = scan_sources(
        [(s.path, d if isinstance(d, FileResult) else d[0]) for s, d in read], config, jobs=jobs
    )
    outcome = Migration(failures=list(report.failures))
    if outcome.failures:
        return outcome
    sources = {
        source.path: (source, data) for source, data in read if not isinstance(data, FileResult)
    }
    contents = {path: data for path, (_, (data, _)) in sources.items()}
    #: Files whose reads all stay for reasons their sites give: not parsed with libcst (unless
    #: called into).
    left: dict[str, list[Read]] = {}
    planned = []
    for result in report.results:
        reads = reads_left_by_site(result.sites) if result.sites else None
        if reads is not None:
            left[result.path] = reads
        elif result.sites:
            planned.append(result)
    size = sum(len(contents[r.path]) for r in planned)
    count = max(1, min(jobs, len(planned)))
    fork = count > 1 and size >= PARALLEL_MIN_BYTES and can_fork()
    # At least one worker, also with no file to plan: it still looks through the others for calls.
    shares = split_into_buckets(count if fork else 1, [len(contents[r.path]) for r in planned]) or [
        []
    ]
    with_reads = {r.path for r in planned}
    others = [(path, data) for path, data in contents.items() if path not in with_reads]
    chunk = -(-len(others) // TaskQueue.RECORDS)
    chunks = [others[i : i + chunk] for i in range(0, len(others), chunk)] if others else []
    facts_queue, queue = TaskQueue(), TaskQueue()
    facts_queue.fill(len(chunks))
    may_thread = _may_thread(planned, contents)
    root = _project_root(files)
    helper_module = helper.module or default_module(
        [r.path for r in planned], lambda directory: (root / directory / "__init__.py").is_file()
    )
    idiom_ = idiom_of_target(target, helper_module)
    modules = frozenset(".".join(module_name(source.path)) for source in files)
    scoped = {
        part
        for r in planned
        for s in r.sites
        if s.scope != MODULE_SCOPE
        for part in s.scope.split(".")
    }
    facts = tree_facts = learn_tree(
        contents, scoped, name, state_modules=config.modules, modules=modules
    )
    makers = [
        partial(
            _Worker,
            [(planned[i].path, contents[planned[i].path], planned[i].sites) for i in share],
            chunks,
            facts_queue,
            queue,
            may_thread,
            name,
            idiom_,
            helper.width,
            gtp_remat,
            progress,
            facts,
            find_installed_shim_getters() if helper.shims == "installed" else helper.shims,
            helper.virtual_stages and idiom_.megatron_fallback,
        )
        for share in shares
    ]
    threaded: Threaded = {}
    instruction = _Instruction(threaded)

    def thread_between_phases(firsts: list[_Planned]) -> list[_Instruction] | None:
        nonlocal instruction
        outcome.failures += sorted(
            (f for first in firsts for f in first.failures), key=lambda f: f.path
        )
        if outcome.failures:
            return None
        queue.fill(len(chunks))
        facts = {path: found for first in firsts for path, found in first.facts.items()}
        # A file a child that failed took from the queue: read here.
        index = TreeIndex(
            {
                path: facts[path] if path in facts else _file_facts(path, data, name)
                for path, data in contents.items()
            }
        )
        threaded.update({key: value for first in firsts for key, value in first.threaded.items()})
        packages = {p: d for p, d in contents.items() if p.endswith("__init__.py")}
        methods = {key: value for first in firsts for key, value in first.methods.items()}
        upward = thread_upward(
            index,
            contents,
            {**threaded, **methods},
            packages,
            name,
            tree_facts.dropping,
            tree_facts.passed_the_keyword,
        )
        threaded.update({key: name for key in upward.functions if "." not in key[1]})
        # A class is called as a function is: its instantiations pass the collection to its threaded
        # __init__, and those of the subclasses that inherit that __init__ unchanged or forward to
        # it through ``super().__init__`` (given the parameter).
        classes = {key: value for first in firsts for key, value in first.classes.items()}
        subclasses = thread_subclasses(
            index, classes, packages, name, tree_facts.passed_the_keyword
        )
        threaded.update(subclasses.classes)
        threaded.update(add_reexported_names(threaded, packages))
        # A class a spec names is built as ``submodules.X(...)``: passed where every class of X
        # takes it; the same for a local assigned classes (``output_layer_cls(...)``).
        spec_fields = decide_spec_fields(
            index, contents, threaded, name, add_reexported_names(subclasses.classes, packages)
        )
        outcome.spec_calls_left += spec_fields.left
        reached: dict[str, set[str]] = {}
        for found in index.files.values():
            for entry in found.reached:
                module, _, reached_name = entry.partition(":")
                reached.setdefault(module, set()).add(reached_name)
        instruction = _Instruction(
            threaded,
            upward,
            spec_fields,
            subclasses.forwarding,
            {module: frozenset(names) for module, names in reached.items()},
        )
        return [instruction] * len(firsts)

    try:
        _, done = two_phases(makers, thread_between_phases, fork=fork)
    finally:
        facts_queue.close()
        queue.close()
    if done is None:
        return outcome
    looked = {path for part in done for path in part.looked}
    missed = [(path, data) for path, data in others if path not in looked]
    if missed:  # taken by a child that failed after taking them: looked through here
        done.append(_Done())
        makers[0]().look(missed, instruction, instruction.mention(), done[-1])
    every = dict(left)
    for part in done:
        for path, read_ in part.reads:
            every.setdefault(path, []).append(read_)
        outcome.failures += part.failures
        outcome.passed += part.passed
        outcome.threaded += part.threaded
        for path, after in part.changes:
            source, (data, mtime) = sources[path]
            outcome.changes.append(Change(path, source.absolute, data, mtime, after))
    for path in sorted(every):
        outcome.reads += [
            (path, r) for r in sorted(every[path], key=lambda r: (r.site.line, r.site.col))
        ]
    if target == "megatron" and any(
        read.way not in (Way.LEFT, Way.BUILDER) for _, read in outcome.reads
    ):
        path = helper_path(helper_module, lambda directory: (root / directory).is_dir())
        made = _helper_change(root, path, helper_module, helper, gtp_remat)
        if isinstance(made, FileResult):
            outcome.failures.append(made)
        elif made is not None:
            outcome.changes.append(made)
    outcome.changes.sort(key=lambda change: change.path)
    outcome.failures.sort(key=lambda failure: failure.path)
    outcome.threaded.sort(key=lambda entry: entry.partition(": ")[0])
    return outcome

"""Which reads ``pgregistry migrate`` rewrites, and how.

One file's functions, their collections, each read's way.

The scanner (:mod:`~pgregistry._source.scanner`) says where the reads are; this module finds them in
the file's libcst tree (by position), walks the scopes around each, and decides for every read,
first that applies:

0. ``left`` when what it is called on is not ``parallel_state`` itself (a parameter, ``self.mpu``,
   another module's global: libcst's scopes say what the name is bound to, see
   :func:`_not_parallel_state`);
1. ``in-scope``: a collection is in scope (a parameter or a local of the configured name assigned
   above the read, the same in an enclosing function, ``self.<attribute>`` the class assigns a
   collection, or ``<parameter>.<attribute>`` the tree assigns one,
   :mod:`~pgregistry.migrate._tree`): the read becomes its field;
2. ``threaded``: none is: the outermost enclosing function gets an optional keyword-only parameter
   (a name that collides with nothing), unless no caller could pass it (:func:`_cannot_thread`: an
   autograd Function's ``forward``, a hook, a callback, a function passed as a value);
3. ``fallback``: a read that only runs when a value is missing (``if group is None: group = ...``, a
   fallback helper) of a collection that may be ``None``;
4. ``left``: anything else, with the reason.

Each rewritten read becomes, in place, a call of the fallback helper on the collection
(:mod:`._idioms`): the collection's field when it holds it, else the original accessor's value with
the warning, evaluated only where and when the read was. Which calls in the scanned tree pass a
threaded function its collection is decided across files (:func:`decide_passes`). Pure: no I/O.
"""

from __future__ import annotations

import ast
import builtins
import re
from collections.abc import Collection, Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from enum import Enum
from typing import NamedTuple

import libcst as cst
from libcst.helpers import get_full_name_for_node_or_raise
from libcst.metadata import (
    Assignment,
    CodeRange,
    ImportAssignment,
    MetadataWrapper,
    PositionProvider,
    QualifiedNameSource,
    Scope,
    ScopeProvider,
)

from pgregistry._source.config import ScanConfig
from pgregistry._source.fields import GTP_REMAT_DP, FieldChoice, collection_field
from pgregistry._source.scanner import (
    CALL,
    GETATTR,
    HELPER,
    LEGACY,
    MODULE_SCOPE,
    SHIM,
    Site,
    absolute_module,
    attribute_chain,
)
from pgregistry.migrate._captures import match_capture_owner, match_captures
from pgregistry.migrate._caught import CAUGHT_REASON, calls_a_handler_may_catch
from pgregistry.migrate._facts import names_bound_twice, spec_field_of_call
from pgregistry.migrate._shims import Dissolved, dissolve_shim
from pgregistry.migrate._skeleton import (
    definition_span,
    has_line_within,
    line_starts,
    lines_between,
)
from pgregistry.migrate._tree import TreeFacts, names_a_collection

__all__ = [
    "REWRITTEN_WAYS",
    "Way",
    "Call",
    "FilePlan",
    "Function",
    "Read",
    "collection_mentions",
    "decide_passes",
    "plan_file",
    "CALLED_BY_AUTOGRAD",
    "FIXED_SIGNATURE",
    "add_reexported_names",
    "bound_name",
    "collect_threaded_functions",
    "decorator_matches",
    "import_module_text",
    "reads_left_by_site",
    "visit_mentions",
]


class Way(str, Enum):
    """What planning decided for a read: how the collection's field is read, or why it is left.

    ``IN_SCOPE``, ``THREADED``, ``FALLBACK``: the collection's field read through a collection in
    scope, through the threaded parameter, or through the fallback helper where the read is guarded;
    ``BUILDER``, a read assigned into a field of the collection its function builds by hand, read
    from one ``use_mpu_process_groups`` of that class instead (the same groups, one shim in place of
    many reads); ``LEFT``, left with its reason."""

    IN_SCOPE = "in-scope"
    THREADED = "threaded"
    FALLBACK = "fallback"
    BUILDER = "builder"
    LEFT = "left"

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


#: The parts a ``super().__init__(...)`` call is recorded with (only a forwarding ``__init__``
#: passes one).
SUPER_INIT = ("super()", "__init__")

#: The ways a read is rewritten, in the report's order.
REWRITTEN_WAYS = (Way.IN_SCOPE, Way.THREADED, Way.FALLBACK, Way.BUILDER)

#: Decorators that fix a function's signature or key on its arguments: a new parameter would break
#: them. A decorator matches by its last dotted name, or, for the compilers, by containing one.
FIXED_SIGNATURE = (
    "property",
    "setter",
    "getter",
    "deleter",
    "jit",
    "script",
    "compile",
    "cache",
    "lru_cache",
    "overload",
    "fuser",
)
COMPILERS = ("jit", "script", "compile", "fuser")
#: A function that names it (``locals()``, ``dict(locals())``: a config captured from the
#: arguments) would return the collection's parameter too: it gets none. So would ``vars()`` and
#: ``dir()`` called without arguments (:data:`FRAME_READERS`), which count as naming it.
CALLS_LOCALS = "locals"
FRAME_READERS = frozenset({"vars", "dir"})
LOCALS_REASON = (
    "calls locals() (or vars() or dir() without arguments), "
    "which would return the new parameter too"
)
#: What an autograd Function's subclass defines for torch to call (``.apply`` passes positional
#: arguments only).
CALLED_BY_AUTOGRAD = frozenset({"forward", "backward", "setup_context", "jvp", "vjp"})
_AUTOGRAD_FUNCTION = frozenset({"torch.autograd.Function", "torch.autograd.function.Function"})
#: Modules whose classes call back no method of a subclass (abstract bases, typing, enums,
#: dataclasses).
_PLAIN_MODULES = frozenset(
    {"abc", "typing", "typing_extensions", "enum", "dataclasses", "collections", "builtins"}
)
#: Special methods Python calls with its own arguments (``__init__`` and ``__call__`` are called by
#: the code).
_CALLED_BY_CODE = frozenset({"__init__", "__call__", "__new__"})
_LITERALS = (
    cst.SimpleString,
    cst.ConcatenatedString,
    cst.FormattedString,
    cst.Integer,
    cst.Float,
    cst.Imaginary,
    cst.List,
    cst.Dict,
    cst.Set,
    cst.Tuple,
    cst.ListComp,
    cst.DictComp,
    cst.SetComp,
)


@dataclass(eq=False)
class Function:
    """A ``def`` (or ``async def``) with the names bound in it and the collection it may hold."""

    node: cst.FunctionDef
    qualname: str
    parent: Function | None
    method_of: cst.ClassDef | None
    names: set[str] = field(default_factory=set)
    #: The configured name as a parameter: None (not one), or whether it may be None (it has a
    #: default).
    param_optional: bool | None = None
    param_other: bool = False
    #: Top-level statement indexes of ``<name> = value`` with a value that may be a collection.
    local_at: list[int] = field(default_factory=list)
    local_other: bool = False
    #: Other names holding a collection: parameters (statement -1) and locals (the top-level
    #: statement that assigns them) named like one (``model_pg_collection``) or assigned one
    #: (``ProcessGroupCollection(...)``).
    held: list[tuple[str, int]] = field(default_factory=list)
    #: Top-level statement indexes holding ``<name>.field = ...``: there the function fills the
    #: collection, so a read being assigned into it stays (rewritten, it would read the field it is
    #: filling).
    fills_at: list[int] = field(default_factory=list)
    #: ``<name> = ProcessGroupCollection(...)`` in it: with fields filled, the function builds the
    #: collection (from the globals, a shim written by hand), so none of its reads may go through
    #: it.
    constructs: bool = False
    #: The expression of the class it constructs (``ProcessGroupCollection``), for its builder's
    #: shim.
    builder_class: str = ""
    #: Set by planning, for a builder: the shim local its fills read, before which statement, and
    #: its fields.
    shim_name: str = ""
    shim_at: int = 0
    shim_fields: list[str] = field(default_factory=list)
    #: Set by planning: the parameter this tool adds (its name), and whether it is there only to be
    #: passed on (threaded upward, :mod:`~pgregistry.migrate._upward`: the function reads nothing
    #: itself).
    added: str = ""
    upward: bool = False
    #: Index of the module-level statement holding it (the rewrite visits only the statements it
    #: changes).
    top: int = 0
    #: Index in the body of the module-level class holding it (-1: not in one).
    member: int = -1
    #: Locals (or the parameter) assigned ``ProcessGroupCollection(...)`` -> the fields it is given
    #: from something other than a getter's call (``tp=tp_group``; ``*``: positional or ``**``),
    #: which need not be the global groups (:func:`_fields_given`).
    given_fields: dict[str, set[str]] = field(default_factory=dict)

    @property
    def self_name(self) -> str | None:
        params = self.node.params.params or self.node.params.posonly_params
        if (
            self.method_of is None
            or not params
            or _matching_decorator(self.node, ("staticmethod", "classmethod"))
        ):
            return None
        return params[0].name.value


class Assigned(NamedTuple):
    """A collection a class assigns to ``self.<attribute>`` in ``method``, or declares in its body.

    ``statement``: the method's top-level simple statement that assigns it (-1: in a block, or
    declared in the body, ``method`` empty); ``early``: whether it is above any call of a method of
    ``self`` there (which may read it before it is set), and its class is not one whose
    construction may call one first otherwise (:attr:`TreeFacts.set_late`), a declaration
    always."""

    attribute: str
    method: str
    statement: int
    early: bool


@dataclass(eq=False)
class Read:
    """One site of the scanner, with where it is in the tree and what planning decided for it."""

    site: Site
    call: cst.Call | None
    function: Function | None
    statement: int
    choice: FieldChoice | None = None
    way: Way = Way.LEFT
    reason: str = ""
    #: The expression of the collection the replacement reads (its parameter,
    #: ``self.pg_collection``, a shim).
    collection: str = ""
    #: A fallback helper's argument (``tp_group``), tested for None before the collection is read.
    given: str = ""
    #: An argument that picks the group when it is an expression (a fallback helper's
    #: ``is_expert=``, ``get_amax_reduction_group``'s ``tp_only_amax_red=``): field ``when_field``
    #: is read when it is true.
    when: str = ""
    when_field: str = ""
    #: A ``use_mpu_process_groups`` shim read only for the fields it lists: its reads, rewritten in
    #: its place.
    shim: Dissolved | None = None
    top: int = 0
    member: int = -1


@dataclass(eq=False)
class Call:
    """A plain or dotted name's call (a candidate to pass a threaded function its collection)."""

    node: cst.Call
    dotted: list[str]
    function: Function | None
    statement: int
    top: int = 0
    member: int = -1


@dataclass(eq=False)
class FilePlan:
    """One file: its tree, functions, reads, calls, and the import bindings calls resolve via."""

    path: str
    module: str
    package: list[str]
    wrapper: MetadataWrapper
    functions: list[Function]
    reads: list[Read]
    calls: list[Call]
    bindings: dict[str, str]
    top_level: dict[str, str]
    attributes: dict[int, list[Assigned]]
    alone: set[int]
    #: Calls that pass a threaded function its collection: call node -> (keyword, value expression).
    passes: dict[int, tuple[str, str]] = field(default_factory=dict)
    #: The file's bytes, the module-level statements' line spans, and the walk that can visit more
    #: of them.
    data: bytes | None = None
    spans: list[tuple[int, int]] = field(default_factory=list)
    locator: _Locator | None = None
    #: Where such calls are: (module-level statement, member of its class body or -1).
    passing_tops: set[tuple[int, int]] = field(default_factory=set)
    #: The :mod:`ast` statements of each module-level statement (where the names it reads are
    #: counted).
    statements: list[list[ast.stmt]] = field(default_factory=list)
    #: The offset of each line of ``data``.
    line_starts: list[int] = field(default_factory=list)
    #: When the tree is a skeleton: each placeholder's text and the original text it stands for.
    kept: dict[str, str] = field(default_factory=dict)

    def text(self, start: int, end: int) -> bytes:
        """Lines ``start`` to ``end`` (1-based, inclusive) of the file."""
        assert self.data is not None
        return lines_between(self.data, self.line_starts, start, end)


def _attribute_parts(node: cst.BaseExpression) -> list[str] | None:
    parts: list[str] = []
    while isinstance(node, cst.Attribute):
        parts.append(node.attr.value)
        node = node.value
    if not isinstance(node, cst.Name):
        return None
    parts.append(node.value)
    return parts[::-1]


def import_module_text(node: cst.ImportFrom) -> str:
    """The module ``node`` imports from as it is written: with its leading dots (``..x``)."""
    return "." * len(node.relative) + (
        get_full_name_for_node_or_raise(node.module) if node.module else ""
    )


def bound_name(alias: cst.ImportAlias) -> str:
    """The name an import alias binds: its ``as`` name, else its first (``import a.b`` binds a)."""
    return alias.evaluated_alias or alias.evaluated_name.partition(".")[0]


def _decorator_names(node: cst.FunctionDef) -> list[str]:
    names = []
    for decorator in node.decorators:
        expression = decorator.decorator
        if isinstance(expression, cst.Call):
            expression = expression.func
        parts = _attribute_parts(expression)
        names.append(".".join(parts) if parts else "")
    return names


def decorator_matches(last: str, words: Sequence[str]) -> bool:
    """Whether a decorator whose last dotted name is ``last`` is one of ``words``.

    A compiler's name also where ``last`` only contains it: ``torch.jit.script_if_tracing``."""
    return any(word == last or (word in last and word in COMPILERS) for word in words)


def _matching_decorator(node: cst.FunctionDef, words: Sequence[str]) -> str | None:
    for name in _decorator_names(node):
        if decorator_matches(name.rpartition(".")[2], words):
            return name
    return None


def _literal_value(node: cst.BaseExpression) -> object:
    if isinstance(node, cst.Name) and node.value in ("True", "False", "None"):
        return {"True": True, "False": False, "None": None}[node.value]
    if isinstance(node, cst.Integer):
        return int(node.value, 0)
    return ...


def _other_meaning(annotation: cst.Annotation | None) -> bool:
    if annotation is None:
        return False
    return "Collection" not in cst.Module([]).code_for_node(annotation.annotation)


def _another_class(annotation: cst.Annotation | None) -> bool:
    """Whether a parameter named like a collection is annotated as something else.

    A ``MultiModuleProcessGroupCollection`` (a collection of collections) included."""
    code = cst.Module([]).code_for_node(annotation.annotation) if annotation is not None else ""
    return (
        annotation is not None and re.search(r"(?<!\w)(?:ProcessGroup)?Collection\b", code) is None
    )


class _Locator(cst.CSTVisitor):
    """One walk of the tree: functions, call sites, dotted calls, ``self.<name> = ...`` per class.

    The functions with their bindings, the scanner's call sites, every dotted call, and the
    ``self.<name> = ...`` assignments per class."""

    def __init__(
        self, sites: Iterable[Site], name: str, late: frozenset[str] = frozenset()
    ) -> None:
        super().__init__()
        #: Classes whose ``__init__`` may call a method before its collection attribute is set
        #: (:attr:`TreeFacts.set_late`).
        self.late = late
        self.by_position: dict[tuple[int, int], Site] = {
            (site.line, site.col - 1): site for site in sites if site.form == CALL
        }
        self.name = name
        self.functions: list[Function] = []
        self.reads: list[Read] = []
        self.calls: list[Call] = []
        self.stack: list[Function] = []
        self.classes: list[cst.ClassDef] = []
        self.class_names: list[str] = []
        self.statement: list[int] = [0]
        self.in_class_body: list[bool] = [False]
        #: class node -> (attribute, method name, statement index) of each ``self.<attribute> =
        #: ...`` that holds a collection (:func:`_holds_a_collection`); a declaration in the class
        #: body has no method (index -1).
        self.attributes: dict[int, list[Assigned]] = {}
        self.bindings: dict[str, str] = {}
        self.top_level: dict[str, str] = {}
        #: The calls that stand alone (a statement's value, a test, an argument): a comparison put
        #: there needs no parentheses.
        self.alone: set[int] = set()
        self.top = 0
        self.member = -1
        #: The module-level statements to walk at once (those with sites, and every one but a def or
        #: class).
        self.wanted: set[int] = set()
        self.visited: set[int] = set()
        #: Positions of the nodes of the module-level statements with sites, and each one's line
        #: offset (the slow way, when ``order`` does not match the tree).
        self.positions: dict[int, tuple[Mapping[cst.CSTNode, CodeRange], int]] = {}
        #: The fast way: the calls of each module-level statement with sites, from :mod:`ast`, in
        #: the order a walk of the libcst tree meets them (see :func:`_call_order`); how many of
        #: each were met; whether a call met did not match its :mod:`ast` twin (then the file is
        #: located again, the slow way). Keyed by unit: (module-level statement, -1), or (class,
        #: member) for a class walked member by member.
        self.order: dict[tuple[int, int], list[tuple[int, int, str | None]]] = {}
        self.met: dict[tuple[int, int], int] = {}
        #: Module-level classes walked member by member: the members to walk at once (those with
        #: sites or that mention the collection's name); the others are walked later only if they
        #: call a threaded one.
        self.members: dict[int, set[int]] = {}
        self.visited_members: set[tuple[int, int]] = set()
        self.member_spans: dict[int, list[tuple[int, int]]] = {}
        self.mismatch = False

    @property
    def current(self) -> Function | None:
        return self.stack[-1] if self.stack else None

    def visit_Module(self, node: cst.Module) -> bool:
        for index, statement in enumerate(node.body):
            if index in self.wanted or not isinstance(statement, (cst.FunctionDef, cst.ClassDef)):
                self.visit_top(index, statement)
            else:  # walked later only if it mentions a function a collection was threaded into
                self.top_level[statement.name.value] = (
                    "class" if isinstance(statement, cst.ClassDef) else "function"
                )
        return False

    def visit_top(self, index: int, statement: cst.CSTNode) -> None:
        """Walk module-level statement ``index`` (once)."""
        if index not in self.visited:
            self.visited.add(index)
            self.top = index
            statement.visit(self)

    def visit_ClassDef(self, node: cst.ClassDef) -> bool:
        for decorator in node.decorators:
            decorator.visit(self)
        for argument in (*node.bases, *node.keywords):
            argument.visit(self)
        if not self.stack and not self.classes:
            self.top_level[node.name.value] = "class"
        self.classes.append(node)
        self.class_names.append(node.name.value)
        self.in_class_body.append(True)
        self.attributes.setdefault(id(node), [])
        if len(self.classes) == 1 and not self.stack:
            members = self.members.get(self.top)
            for index, statement in enumerate(node.body.body):
                if members is None or index in members:
                    self._walk_member(index, statement)
        else:
            node.body.visit(self)
        self.in_class_body.pop()
        self.class_names.pop()
        self.classes.pop()
        return False

    def _walk_member(self, index: int, statement: cst.CSTNode) -> None:
        self.visited_members.add((self.top, index))
        self.member = index
        statement.visit(self)
        self.member = -1

    def visit_member(self, top: int, node: cst.ClassDef, index: int) -> None:
        """Walk member ``index`` of module-level class ``node`` (statement ``top``).

        A member not walked with its class; once only.
        """
        if (top, index) in self.visited_members:
            return
        self.top = top
        self.classes.append(node)
        self.class_names.append(node.name.value)
        self.in_class_body.append(True)
        self._walk_member(index, node.body.body[index])
        self.in_class_body.pop()
        self.class_names.pop()
        self.classes.pop()

    def visit_FunctionDef(self, node: cst.FunctionDef) -> bool:
        for decorator in node.decorators:
            decorator.visit(self)
        node.params.visit(self)
        if node.returns is not None:
            node.returns.visit(self)
        outer = self.current
        method_of = self.classes[-1] if self.in_class_body[-1] and self.classes else None
        prefix = (
            outer.qualname + "."
            if outer is not None
            else ".".join(self.class_names) + "."
            if self.class_names
            else ""
        )
        if outer is not None and self.class_names and method_of is not None:
            prefix = outer.qualname + "." + ".".join(self.class_names[-1:]) + "."
        function = Function(
            node, prefix + node.name.value, outer, method_of, top=self.top, member=self.member
        )
        if outer is None and not self.classes:
            self.top_level[node.name.value] = "function"
        elif outer is not None:
            outer.names.add(node.name.value)
        params = node.params
        for param in (*params.posonly_params, *params.params, *params.kwonly_params):
            function.names.add(param.name.value)
            if param.name.value == self.name:
                if _other_meaning(param.annotation):
                    function.param_other = True
                else:
                    function.param_optional = param.default is not None
            elif names_a_collection(param.name.value, self.name) and not _another_class(
                param.annotation
            ):
                function.held.append((param.name.value, -1))
        for star in (params.star_arg, params.star_kwarg):
            if isinstance(star, cst.Param):
                function.names.add(star.name.value)
        self.functions.append(function)
        self.stack.append(function)
        self.in_class_body.append(False)
        statements = node.body.body
        for index, statement in enumerate(statements):
            self.statement.append(index)
            statement.visit(self)
            self.statement.pop()
        self.in_class_body.pop()
        self.stack.pop()
        return False

    def visit_Name(self, node: cst.Name) -> None:
        if self.current is not None:
            self.current.names.add(node.value)

    def _at_the_top_of(self, function: Function) -> bool:
        """Whether the statement visited is one of ``function``'s own top-level simple statements.

        Not one in a block of it (``if flag: pg_collection = build()``, a loop, a ``try``, a
        ``with``): a binding there may not have run above a later statement, which would then raise
        ``UnboundLocalError`` reading it where the original code read the global state."""
        return len(self.statement) == 2 and isinstance(
            function.node.body.body[self.statement[-1]], cst.SimpleStatementLine
        )

    def _record_binding(self, target: cst.BaseExpression, value: cst.BaseExpression | None) -> None:
        function = self.current
        if (
            isinstance(target, cst.Name)
            and function is not None
            and isinstance(value, cst.Call)
            and _callee_last_name(value) == "ProcessGroupCollection"
        ):
            function.given_fields.setdefault(target.value, set()).update(_fields_given(value))
        if (
            isinstance(target, cst.Name)
            and function is not None
            and target.value != self.name
            and _holds_a_collection(target.value, value, self.name)
        ):
            function.held.append(
                (
                    target.value,
                    self.statement[-1]
                    if self._at_the_top_of(function)
                    else len(function.node.body.body),
                )
            )  # bound in a block: not known above a read
        if isinstance(target, cst.Name) and function is not None and target.value == self.name:
            if isinstance(value, cst.Call) and _callee_last_name(value) == "ProcessGroupCollection":
                function.constructs = True
                function.builder_class = cst.Module([]).code_for_node(value.func)
            if value is not None and isinstance(value, _LITERALS):
                function.local_other = True
            elif self._at_the_top_of(function) and value is not None:
                function.local_at.append(self.statement[-1])
            else:
                function.local_other = (
                    True  # bound elsewhere (a branch, a loop): not known above every read
                )
        if (
            isinstance(target, cst.Attribute)
            and isinstance(target.value, cst.Name)
            and target.value.value == self.name
            and function is not None
        ):
            function.fills_at.append(self.statement[-1])
        if (
            isinstance(target, cst.Attribute)
            and _holds_a_collection(target.attr.value, value, self.name)
            and isinstance(target.value, cst.Name)
            and function is not None
            and function.method_of is not None
            and target.value.value == function.self_name
        ):
            # Where every later statement finds it set: a top-level simple statement (-1: in a
            # block); early: no code before it may call a method of self, which may read it (the
            # tree's facts tell: TreeFacts.set_late, every call of self.<m>() above it included).
            index = self.statement[-1] if self._at_the_top_of(function) else -1
            early = index >= 0 and function.method_of.name.value not in self.late
            self.attributes[id(function.method_of)].append(
                Assigned(target.attr.value, function.node.name.value, index, early)
            )
        if (  # a field declared in the class body (a dataclass's ``_pg_collection: ... = None``)
            isinstance(target, cst.Name)
            and function is None
            and self.in_class_body[-1]
            and self.classes
            and _holds_a_collection(target.value, value, self.name)
            and _declaration_binds(value, self.classes[-1])
        ):
            self.attributes[id(self.classes[-1])].append(Assigned(target.value, "", -1, True))

    def visit_Assign(self, node: cst.Assign) -> None:
        self._mark_alone(node.value)
        for target in node.targets:
            self._record_binding(target.target, node.value)

    def visit_AnnAssign(self, node: cst.AnnAssign) -> None:
        self._mark_alone(node.value)
        self._record_binding(node.target, node.value)

    def visit_ImportFrom(self, node: cst.ImportFrom) -> None:
        if isinstance(node.names, cst.ImportStar):
            return
        module = import_module_text(node)
        for alias in node.names:
            self.bindings[bound_name(alias)] = f"{module}:{alias.evaluated_name}"

    def visit_Import(self, node: cst.Import) -> None:
        for alias in node.names:
            bound = bound_name(alias)
            self.bindings[bound] = alias.evaluated_name if alias.asname else bound

    def _mark_alone(self, node: cst.BaseExpression | None) -> None:
        if isinstance(node, cst.Call):
            self.alone.add(id(node))

    def visit_If(self, node: cst.If) -> None:
        self._mark_alone(node.test)

    def visit_While(self, node: cst.While) -> None:
        self._mark_alone(node.test)

    def visit_Return(self, node: cst.Return) -> None:
        self._mark_alone(node.value)

    def visit_Arg(self, node: cst.Arg) -> None:
        self._mark_alone(node.value)

    def visit_Assert(self, node: cst.Assert) -> None:
        self._mark_alone(node.test)

    def visit_Call(self, node: cst.Call) -> None:
        function = self.current
        if (
            function is not None
            and isinstance(node.func, cst.Name)
            and node.func.value in FRAME_READERS
            and not node.args
        ):
            function.names.add(CALLS_LOCALS)  # reads the frame's locals, as locals() does
        site = None
        located = self.positions.get(self.top)
        unit = (self.top, self.member if self.top in self.members else -1)
        order = self.order.get(unit)
        # A call on a read's result (``ps.get_model_parallel_group().rank()``) starts where the read
        # does: the site is the inner call, visited next, else the rewrite would drop the
        # ``.rank()``.
        on_a_call = isinstance(node.func, cst.Attribute) and isinstance(node.func.value, cst.Call)
        if (
            located is not None and not on_a_call
        ):  # only the statements with sites have positions (costly)
            ranges, offset = located
            start = ranges[node.func].start
            site = self.by_position.pop((start.line + offset, start.column), None)
        elif order is not None:
            met = self.met.get(unit, 0)
            self.met[unit] = met + 1
            parts = _attribute_parts(node.func)
            if met >= len(order) or order[met][2] != (
                ".".join(parts) if parts is not None else None
            ):
                self.mismatch = True
            elif not on_a_call:
                site = self.by_position.pop(order[met][:2], None)
        index = self.statement[-1]
        if site is not None:
            self.reads.append(
                Read(site, node, self.current, index, top=self.top, member=self.member)
            )
        else:
            parts = _attribute_parts(node.func)
            on_super = (
                isinstance(node.func, cst.Attribute)
                and isinstance(node.func.value, cst.Call)
                and _callee_last_name(node.func.value) == "super"
            )
            if parts is None and isinstance(node.func, cst.Attribute) and not on_super:
                parts = [
                    "",
                    node.func.attr.value,
                ]  # a method of some object: ``self.items[0].m(...)``
            elif on_super and isinstance(node.func, cst.Attribute):
                parts = list(SUPER_INIT) if node.func.attr.value == "__init__" else None
            if parts is not None:
                self.calls.append(
                    Call(node, parts, self.current, index, top=self.top, member=self.member)
                )


def _function_choice(read: Read, gtp_remat: bool, virtual_stages: bool = False) -> FieldChoice:
    """The field of a call site (an accessor or a fallback helper), or why none says what it reads.

    ``gtp_remat``, ``virtual_stages``: see :func:`~pgregistry._source.fields.collection_field`."""
    call = read.call
    assert call is not None
    site = read.site
    accessor = site.accessor
    arguments = list(call.args)
    if site.family == HELPER:
        if (
            not accessor.endswith("_group_if_none")
            or not arguments
            or arguments[0].keyword is not None
        ):
            return FieldChoice(
                reason=f"fallback helper {accessor}: no rule says which field it falls back to"
            )
        given, *rest = arguments
        axis = accessor.removesuffix("_if_none")
        keywords = {a.keyword.value: _literal_value(a.value) for a in rest if a.keyword is not None}
        if any(a.keyword is None for a in rest) or any(a.star for a in rest):
            return FieldChoice(reason=f"{accessor} is given positional arguments after the group")
        expert = keywords.pop("is_expert", False)
        if expert is ...:
            flag = next(
                a.value for a in rest if a.keyword is not None and a.keyword.value == "is_expert"
            )
            if _attribute_parts(flag) is None or axis != "get_tensor_model_parallel_group":
                return FieldChoice(reason="is_expert= is neither a literal nor a plain name")
            read.when, read.when_field = cst.Module([]).code_for_node(flag), "expt_tp"
        elif expert:
            if axis != "get_tensor_model_parallel_group":
                return FieldChoice(
                    reason=f"{accessor}(is_expert=True): no rule says which field it falls back to"
                )
            axis = "get_expert_tensor_parallel_group"
        return collection_field(axis, keywords, gtp_remat=gtp_remat)
    if any(a.keyword is None for a in arguments):
        return FieldChoice(
            reason="positional or star arguments: which group they pick is not known"
        )
    keywords = {
        a.keyword.value: _literal_value(a.value) for a in arguments if a.keyword is not None
    }
    if accessor == "get_amax_reduction_group" and keywords.get("tp_only_amax_red") is ...:
        flag = next(
            a.value
            for a in arguments
            if a.keyword is not None and a.keyword.value == "tp_only_amax_red"
        )
        if _attribute_parts(flag) is None:
            return FieldChoice(reason="tp_only_amax_red= is neither a literal nor a plain name")
        choice = collection_field(
            accessor, {**keywords, "tp_only_amax_red": False}, gtp_remat=gtp_remat
        )
        tp_only = collection_field(
            accessor, {**keywords, "tp_only_amax_red": True}, gtp_remat=gtp_remat
        )
        if not choice.reason and not tp_only.reason:
            read.when, read.when_field = cst.Module([]).code_for_node(flag), tp_only.field
        return choice if not tp_only.reason else tp_only
    return collection_field(accessor, keywords, gtp_remat=gtp_remat, virtual_stages=virtual_stages)


#: The keywords a read's flag is, tested by its replacement (:func:`_function_choice`'s ``when``).
_FLAGS = ("is_expert", "tp_only_amax_red")


def _expression_left_unread(read: Read) -> str | None:
    """Why not, where the replacement would not evaluate a keyword argument the call evaluated.

    The call evaluated each of its arguments once. The replacement tests a flag once and passes on
    the keywords the choice forwards; it drops the others (their literal picked the field), passes
    on ``check_initialized=`` for the ``megatron`` target only, and a fallback helper's keywords
    only where its group is None. A literal or a plain name reads the same unread; an attribute (a
    property), a call or a subscript would no longer run (``vp_stage=self.vp_stage`` beside
    ``ignore_virtual=True``)."""
    assert read.call is not None and read.choice is not None
    passed_on = () if read.site.family == HELPER else read.choice.forwarded
    for argument in read.call.args:
        value = argument.value
        if (
            argument.keyword is None
            or argument.keyword.value in (*_FLAGS, *passed_on)
            or isinstance(value, cst.Name)
            or _literal_value(value) is not ...
        ):
            continue
        return (
            f"{argument.keyword.value}= is an expression the rewrite would not evaluate where the "
            "call did (pass a literal or a plain name)"
        )
    return None


def _call_head_name(read: Read) -> str:
    """The first name of what ``read`` calls (``self`` in ``self.mpu.get_x()``)."""
    assert read.call is not None
    parts = _attribute_parts(read.call.func)
    return parts[0] if parts else ""


def _import_bytes(tree: Sequence[ast.stmt], starts: Sequence[int]) -> list[tuple[int, int]]:
    """The byte ranges of the imports among module-level statements ``tree``.

    In ``if`` / ``try`` blocks too; ``starts``: the file's
    :func:`~pgregistry.migrate._skeleton.line_starts`."""
    spans: list[tuple[int, int]] = []
    stack = list(tree)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            last = node.end_lineno or node.lineno
            spans.append((starts[node.lineno - 1], starts[last] if last < len(starts) else 1 << 62))
        elif isinstance(node, (ast.If, ast.Try)):
            stack += [
                *node.body,
                *node.orelse,
                *(s for h in getattr(node, "handlers", ()) for s in h.body),
            ]
    return spans


def _bound_otherwise(head: str, data: bytes, imports: Sequence[tuple[int, int]]) -> bool:
    """Whether ``data`` may bind ``head`` other than by a module-level import, by its text.

    ``imports``: the imports' byte ranges. Another binding: an assignment, a parameter, a loop or
    ``with`` target, ``global``. A superset, by the text, of where libcst's scopes could find such a
    binding, so that they are resolved only for the reads whose object may be something else than an
    import (a function's scopes cost as much as parsing it)."""
    name = re.escape(head.encode())
    pattern = re.compile(
        rb"\b" + name + rb"[ \t]*(?::[^=\n]*)?(?:[-+*/%&|^@]|//|\*\*|>>|<<)?=(?!=)"
        rb"|(?:[(\[,*]|\b(?:for|as|global|nonlocal|del|lambda|def|class))[ \t\n\\]*"
        + name
        + rb"\b(?![ \t]*[.(])"
        rb"|\b(?:def|class)[ \t]+"
        + name
        + rb"\b"  # a definition of the name: a module's own accessor
    )
    return any(
        not any(start <= match.start() < end for start, end in imports)
        for match in pattern.finditer(data)
    )


def _imports_the_module(
    head: str, bindings: Mapping[str, str], facts: TreeFacts, package: list[str]
) -> bool:
    """Whether an import binds ``head`` to a configured ``parallel_state`` module or a name in one.

    Or nothing does. Then libcst's scopes need not be resolved for it, unless
    :func:`_bound_otherwise`."""
    bound = bindings.get(head)
    if bound is None:
        return True
    module, _, attribute = bound.partition(":")
    module = _absolute_module(module, package)
    target = f"{module}.{attribute}" if attribute else module
    if facts.is_state_module(target) is not None:
        state = target
    elif attribute and facts.is_state_module(module) is not None:
        state = module
    else:
        return False
    # the default names: only Megatron-Core's passes unresolved (:func:`_another_parallel_state`)
    return facts.state_modules != ScanConfig().modules or state in _MEGATRON_STATE


def _statement_scopes(
    source: cst.Module, reads: Sequence[Read], defined: AbstractSet[str]
) -> Mapping[cst.CSTNode, Scope | None]:
    """libcst's scopes of the statements holding ``reads``, resolved on a module of them.

    Of a module-level class, only its members that hold reads (a method does not see its class's
    names); with every module-level statement that is no definition (the imports and globals their
    names may be bound to), and an assignment standing for each module-level definition named in
    ``defined`` (a read's name that the module defines: its own ``get_x`` over a star import's; the
    skeleton stands a placeholder in for it). The whole file's would cost three times its parse."""
    members: dict[int, set[int]] = {}
    for read in reads:
        members.setdefault(read.top, set()).add(read.member)
    body: list[cst.BaseStatement] = []
    for index, statement in enumerate(source.body):
        held = members.get(index)
        if (
            isinstance(statement, cst.ClassDef)
            and held is not None
            and -1 not in held
            and isinstance(statement.body, cst.IndentedBlock)
        ):
            inner = [member for i, member in enumerate(statement.body.body) if i in held]
            body.append(statement.with_changes(body=statement.body.with_changes(body=inner)))
        elif held is not None or isinstance(statement, cst.SimpleStatementLine):
            body.append(statement)
        elif not isinstance(
            statement, (cst.FunctionDef, cst.ClassDef)
        ):  # ``if HAVE_TE:`` and its classes
            stripped = statement.visit(_WithoutDefinitions())
            if isinstance(stripped, cst.BaseStatement):
                body.append(stripped)
    body += [cst.parse_statement(f"{name} = None") for name in sorted(defined)]
    return MetadataWrapper(source.with_changes(body=body), unsafe_skip_copy=True).resolve(
        ScopeProvider
    )


class _WithoutDefinitions(cst.CSTTransformer):
    """A compound statement minus its definitions (they bind no name a read's object can be)."""

    def visit_FunctionDef(self, node: cst.FunctionDef) -> bool:
        return False

    def visit_ClassDef(self, node: cst.ClassDef) -> bool:
        return False

    def leave_FunctionDef(
        self, original_node: cst.FunctionDef, updated_node: cst.FunctionDef
    ) -> cst.RemovalSentinel:
        return cst.RemoveFromParent()

    def leave_ClassDef(
        self, original_node: cst.ClassDef, updated_node: cst.ClassDef
    ) -> cst.RemovalSentinel:
        return cst.RemoveFromParent()


def _module_level_definitions(syntax: ast.Module) -> set[str]:
    """The names the module's ``def`` / ``class`` statements bind (in its ``if`` / ``try`` too)."""
    names: set[str] = set()
    stack: list[ast.AST] = list(syntax.body)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.stmt, ast.excepthandler, ast.match_case)):
            stack.extend(ast.iter_child_nodes(node))
    return names


def _import_target_name(assignment: ImportAssignment, package: list[str]) -> str:
    """The dotted name the import of ``assignment`` names for the name it binds.

    ``a.b.c`` for ``import a.b.c`` and ``from a.b import c``."""
    node = assignment.node
    assert isinstance(node, (cst.Import, cst.ImportFrom)) and not isinstance(
        node.names, cst.ImportStar
    )
    module = ""
    if isinstance(node, cst.ImportFrom):
        module = _absolute_module(import_module_text(node), package)
    for alias in node.names:
        if bound_name(alias) == assignment.name:
            dotted = alias.evaluated_name
            return f"{module}.{dotted}" if module else dotted
    return module


def _owner_of(function: Function | None, node: cst.CSTNode | None) -> str | None:
    """The qualified name of ``node`` if it is ``function`` or encloses it (None for the module)."""
    while function is not None and function.node is not node:
        function = function.parent
    return function.qualname if function is not None else None


#: Megatron-Core's ``parallel_state`` (``megatron.core.mpu`` is the same module): what the fallback
#: helper reads when it falls back.
_MEGATRON_STATE = ("megatron.core.parallel_state", "megatron.core.mpu")
#: The comprehensions: each binds its targets in a scope of its own.
_COMPREHENSIONS = (cst.ListComp, cst.SetComp, cst.DictComp, cst.GeneratorExp)


def _not_parallel_state(
    read: Read, scopes: Mapping[cst.CSTNode, Scope | None], facts: TreeFacts, package: list[str]
) -> str | None:
    """Why the object a ``parallel_state`` read is called on is not the module itself, or None.

    The object, or the bare accessor, is bound to a parameter, a local, a global assigned in the
    file, an attribute of one of them, or an import of another module. None when it is bound to an
    import of a configured ``parallel_state`` module only, or to nothing in the file (the scanner's
    own resolution: a configured alias, a star import)."""
    assert read.call is not None
    func = read.call.func
    target = func.value if isinstance(func, cst.Attribute) else func
    head = target
    while isinstance(head, cst.Attribute):
        head = head.value
    scope = scopes.get(head)
    if not isinstance(head, cst.Name) or scope is None or not scope[head.value]:
        return None
    spelled = cst.Module([]).code_for_node(target)
    what = f"an attribute of `{head.value}`, " if target is not head else ""
    for assignment in scope[head.value]:
        if not isinstance(assignment, ImportAssignment):
            node = getattr(assignment.scope, "node", None)
            owner = _owner_of(read.function, node)
            if isinstance(node, (cst.Lambda, *_COMPREHENSIONS)):  # a scope of their own, unnamed
                inner = "a lambda" if isinstance(node, cst.Lambda) else "a comprehension"
                around = read.function.qualname if read.function is not None else "the module"
                owner = f"{inner} in {around}"
            if isinstance(assignment, Assignment) and isinstance(assignment.node, cst.Param):
                return f"`{spelled}` is {what}a parameter of {owner}, not parallel_state"
            where = f"{owner} assigns" if owner else "the module assigns"
            return f"`{spelled}` is {what}a name {where}, not an import of parallel_state"
    for assignment in scope[head.value]:
        assert isinstance(assignment, ImportAssignment)
        imported = _import_target_name(assignment, package)
        qualified = [
            _absolute_module(q.name, package)
            for q in scope.get_qualified_names_for(func)
            if q.source == QualifiedNameSource.IMPORT
        ]
        modules = [q.rpartition(".")[0] for q in qualified]
        matched = [(m, facts.is_state_module(m)) for m in modules]
        # The configured name must be named by this import, not only by attributes after it:
        # ``groups.mpu`` with ``from deepspeed.utils import groups`` is a global of that module, not
        # a module ``mpu``. Each import binding the name must: ``try: from megatron.core import
        # parallel_state as mpu`` / ``except ImportError: from pkg import fake_mpu as mpu``.
        if not any(
            name is not None and _names_within(imported, m) and len(imported) > len(m) - len(name)
            for m, name in matched
        ):
            return f"`{spelled}` is {what}imported from {imported}, not parallel_state"
        other = _another_parallel_state(imported, matched, facts)
        if other is not None:
            return (
                f"`{spelled}` is {what}imported from {other}, not Megatron-Core's parallel_state, "
                "which the fallback helper would read instead"
            )
    return None


def _why_a_match_may_bind(read: Read, captures: list[tuple[str, ast.AST | None]]) -> str | None:
    """Why the object of ``read`` may be what a ``match`` captured (``case ps:``), or None.

    libcst's scopes miss such a binding (:mod:`~pgregistry.migrate._captures`); ``captures``: the
    file's :func:`~pgregistry.migrate._captures.match_captures`."""
    head = _call_head_name(read)
    owner = match_capture_owner(captures, head, read.site.line) if head else None
    if owner is None:
        return None
    return (
        f"`{head}` is a name a match statement in {owner} captures, not an import of parallel_state"
    )


def _another_parallel_state(
    imported: str, matched: Sequence[tuple[str, str | None]], facts: TreeFacts
) -> str | None:
    """The module named like ``parallel_state`` that an import of ``imported`` binds, or None.

    Only under the default names (``parallel_state``, ``mpu`` anywhere), which also match vLLM's
    ``vllm.distributed.parallel_state`` (NeMo RL imports it), Apex's
    ``apex.transformer.parallel_state`` or a tree's own copy: their globals are not Megatron-Core's,
    which the fallback helper reads. None where the import binds Megatron-Core's (``matched``: the
    read's module and its configured name, per qualified name), or a module the user configured."""
    if facts.state_modules != ScanConfig().modules:
        return None
    bound = {m for m, name in matched if name is not None and _names_within(imported, m)}
    if not bound or bound & set(_MEGATRON_STATE):
        return None
    return min(bound)


def _names_within(imported: str, module: str) -> bool:
    """Whether an import naming ``imported`` binds ``module``, a package of it or a name in it."""
    return (
        imported == module or module.startswith(imported + ".") or imported.startswith(module + ".")
    )


def _fills_a_field(function: Function, read: Read, name: str) -> bool:
    """Whether ``read`` fills a field of a ``ProcessGroupCollection()`` its function builds.

    Whether it is the whole value of ``<name>.field = read`` in a function that builds ``<name>``
    with ``ProcessGroupCollection()``, reading a group the table names: Megatron-Core's
    ``use_mpu_process_groups`` reads the very same group for that field (a pseudo field, which no
    collection has, is none)."""
    if (
        not function.constructs
        or read.choice is None
        or read.choice.kind != "group"
        or read.when
        or read.given
    ):
        return False
    if read.choice.field == GTP_REMAT_DP:
        return False
    body = function.node.body
    if not isinstance(body, cst.IndentedBlock) or read.statement >= len(body.body):
        return False
    statement = body.body[read.statement]
    if not isinstance(statement, cst.SimpleStatementLine) or len(statement.body) != 1:
        return False
    assign = statement.body[0]
    return (
        isinstance(assign, cst.Assign)
        and assign.value is read.call
        and len(assign.targets) == 1
        and isinstance(assign.targets[0].target, cst.Attribute)
        and isinstance(assign.targets[0].target.value, cst.Name)
        and assign.targets[0].target.value.value == name
    )


def _declaration_binds(value: cst.BaseExpression | None, cls: cst.ClassDef) -> bool:
    """Whether a class body's declaration of an attribute makes every instance hold it.

    One with a value does (a class attribute), but a dataclass ``field(...)`` without a default; one
    without (``pg_collection: ProcessGroupCollection``) only in a dataclass, whose ``__init__`` sets
    each field (not with ``init=False``)."""
    if value is not None:
        return not (
            isinstance(value, cst.Call)
            and _callee_last_name(value) == "field"
            and not any(
                a.keyword is not None and a.keyword.value in ("default", "default_factory")
                for a in value.args
            )
        )
    for decorator in cls.decorators:
        expression = decorator.decorator
        call = expression if isinstance(expression, cst.Call) else None
        name = _callee_last_name(call) if call is not None else _last_name_of(expression)
        if name == "dataclass" and not any(
            a.keyword is not None
            and a.keyword.value == "init"
            and isinstance(a.value, cst.Name)
            and a.value.value == "False"
            for a in (call.args if call is not None else ())
        ):
            return True
    return False


def _last_name_of(expression: cst.BaseExpression) -> str | None:
    """``dataclass`` of ``dataclass`` or ``dataclasses.dataclass``; None for another form."""
    if isinstance(expression, cst.Name):
        return expression.value
    return expression.attr.value if isinstance(expression, cst.Attribute) else None


def _collection_in_scope(
    function: Function,
    statement: int,
    attributes: Mapping[int, list[Assigned]],
    name: str,
    collections: frozenset[str] = frozenset(),
) -> tuple[str, bool, bool] | str | None:
    """The collection in scope at top-level statement ``statement`` of ``function``.

    (expression, may be None, read inline) of it; a reason string when a name is bound in a way that
    hides it; None when there is none.

    In order: the function's own ``name`` (a parameter, a local assigned above), an enclosing
    function's (a closure), ``self.<attribute>`` that its class assigns or declares a collection
    (any method but a later statement of ``__init__``), and ``<parameter>.<attribute>`` where the
    tree assigns that very expression (``collections``, see
    :meth:`~pgregistry.migrate._tree.TreeFacts.collections_of`: ``config._pg_collection``), read
    with ``getattr`` (another object may lack it)."""
    if function.fills_at and (function.constructs or statement in function.fills_at):
        return f"builds the collection: assigns fields of {name} (a shim written by hand)"
    if function.param_optional is not None:
        return name, function.param_optional, False
    if any(index < statement for index in function.local_at):
        return name, False, False
    if function.local_at or function.local_other or function.param_other:
        if function.param_other or function.local_other:
            return None  # another meaning (or unknown): thread under another name
        return f"read above the assignment of the local {name}"
    for local, index in function.held:  # the last binding above the read, and none between
        if index < statement and not any(
            other == local and index < at < statement for other, at in function.held
        ):
            return local, True, True
    outer = function.parent
    while outer is not None:
        if outer.param_optional is not None:
            return name, outer.param_optional, True
        if outer.local_at:
            return name, False, True
        if name in outer.names:
            break
        outer = outer.parent
    self_name = function.self_name
    if self_name is not None and function.method_of is not None:
        own = function.node.name.value
        held: dict[str, list[Assigned]] = {}
        for found in attributes.get(id(function.method_of), []):
            held.setdefault(found.attribute, []).append(found)
        for attribute in sorted(held, key=lambda a: (a != name, a)):
            assigned = held[attribute]
            before = any(
                not a.method or a.method == own and 0 <= a.statement < statement for a in assigned
            )
            if before:
                return f"{self_name}.{attribute}", attribute != name, attribute != name
            if own != "__init__" and any(a.method != own for a in assigned):
                # Set by __init__ above anything that could call this method, or declared in the
                # class body: read as it is; else it may not be set yet (a branch, a setup method
                # not called yet, a method __init__ calls first): read with getattr, None then.
                if any(not a.method or a.method == "__init__" and a.early for a in assigned):
                    return f"{self_name}.{attribute}", attribute != name, attribute != name
                return f'getattr({self_name}, "{attribute}", None)', True, True
    parameters = _parameter_names(function)
    for expression in sorted(collections):
        head, *attributes_of = expression.split(".")
        if head in parameters and expression.count(".") >= (2 if head == function.self_name else 1):
            for attribute in (
                attributes_of
            ):  # every step may be missing on another object: None, then the fallback
                head = f'getattr({head}, "{attribute}", None)'
            return head, True, True
    return None


def _chains_tied_to_class(
    chains: frozenset[str], function: Function, facts: TreeFacts
) -> frozenset[str]:
    """The ``chains`` in scope in ``function``'s class; ``self.<a>.<b>`` only where tied to it.

    The class of its outermost function when it is nested. A ``self.<a>.<b>`` chain only where the
    tree ties it to that class (:meth:`TreeFacts.ties_class`), not in every method that has a
    ``self`` (an unrelated class's ``self.<a>`` may be anything, most often missing)."""
    method_of = function.method_of or _outermost_function(function).method_of
    cls = method_of.name.value if method_of is not None else ""
    return frozenset(chain for chain in chains if facts.ties_class(chain, cls))


def _parameter_names(function: Function) -> list[str]:
    params = function.node.params
    return [p.name.value for p in (*params.posonly_params, *params.params, *params.kwonly_params)]


def _outermost_function(function: Function) -> Function:
    """The function ``function`` is nested in, at the outermost (itself when it is not nested)."""
    while function.parent is not None:
        function = function.parent
    return function


def _names_between(function: Function, root: Function) -> set[str]:
    """The names of ``function`` and the functions between it and ``root``.

    ``root`` encloses it; its name is not included.
    """
    names: set[str] = set()
    while function is not root and function.parent is not None:
        names |= function.names
        function = function.parent
    return names


def _enclosing_collection(
    function: Function,
    root: Function,
    attributes: Mapping[int, list[Assigned]],
    name: str,
    collections: frozenset[str],
) -> tuple[str, bool, bool] | str | None:
    """The collection in scope in ``root`` where it defines ``function``, read inline as a closure.

    ``self.<attribute>`` or ``<parameter>.<attribute>``, in scope where the statement of ``root``
    that defines ``function`` runs, read by ``function`` inline as a closure; a reason when
    ``function`` binds a name that hides it."""
    child = function
    while child.parent is not root and child.parent is not None:
        child = child.parent
    body = root.node.body.body if isinstance(root.node.body, cst.IndentedBlock) else ()
    statement = next((i for i, s in enumerate(body) if s is child.node), 0)
    found = _collection_in_scope(root, statement, attributes, name, collections)
    if not isinstance(found, tuple):
        return found
    head = found[0].removeprefix("getattr(").partition(".")[0].partition(",")[0]
    inner = function
    while inner is not root and inner.parent is not None:
        if head in _parameter_names(inner):
            return f"binds {head}, which hides {root.qualname}'s collection"
        inner = inner.parent
    return found[0], True, True


class _Classes:
    """The bases of a file's classes, resolved through its imports: autograd, or outside the tree.

    Which are autograd Functions, and which derive from a class outside the tree (whose methods a
    framework may call back)."""

    def __init__(
        self, syntax: ast.Module, bindings: Mapping[str, str], package: list[str], facts: TreeFacts
    ):
        self.bindings = bindings
        self.package = package
        self.facts = facts
        #: The module-level classes of the file (all of them: the libcst tree may hold
        #: placeholders).
        self.bases: dict[str, list[str | None]] = {
            node.name: [_ast_dotted(base) for base in node.bases]
            for node in syntax.body
            if isinstance(node, ast.ClassDef)
        }

    def _resolve_base(self, base: str) -> str:
        return _resolve_dotted(base.split("."), self.bindings, self.package) or base

    def _with_ancestors(self, bases: list[str | None]) -> list[str | None]:
        """``bases`` with the bases of those defined in the file, transitively (cycles once)."""
        seen: list[str | None] = []
        pending = list(bases)
        while pending:
            base = pending.pop()
            if base in seen:
                continue
            seen.append(base)
            if base is not None and base in self.bases and base not in self.bindings:
                pending += self.bases[base]
        return seen

    def autograd(self, node: cst.ClassDef) -> bool:
        """Whether ``node`` derives from ``torch.autograd.Function``.

        Directly or through classes of the file.
        """
        bases = [
            ".".join(_attribute_parts(a.value) or []) or None
            for a in node.bases
            if a.keyword is None
        ]
        return any(
            b is not None and self._resolve_base(b) in _AUTOGRAD_FUNCTION
            for b in self._with_ancestors(bases)
        )

    def outside(self, node: cst.ClassDef) -> str | None:
        """A base of ``node`` outside the tree that may define framework callbacks, or None."""
        bases = [
            ".".join(_attribute_parts(a.value) or []) or None
            for a in node.bases
            if a.keyword is None
        ]
        for base in self._with_ancestors(bases):
            if base is None or base in self.bases and base not in self.bindings:
                continue  # a subscripted or called base (``Generic[T]``), or a class of the file
            qualified = _resolve_dotted(base.split("."), self.bindings, self.package)
            if qualified is None:  # a builtin (``object``, ``Exception``) or from a star import
                if hasattr(builtins, base):
                    continue
                return base
            module = qualified.rpartition(".")[0]
            if (
                module.split(".")[0] in _PLAIN_MODULES
                or module in self.facts.modules
                or any(module.startswith(m + ".") for m in self.facts.modules)
            ):
                continue
            return qualified
        return None


def _autograd_shaped(function: Function) -> bool:
    """A static ``forward(ctx, ...)`` / ``backward(ctx, ...)``.

    An autograd Function's, whatever its class.
    """
    params = function.node.params.params or function.node.params.posonly_params
    static = bool(_matching_decorator(function.node, ("staticmethod",)))
    return static and bool(params) and params[0].name.value == "ctx"


def _cannot_thread(
    function: Function, classes: _Classes, facts: TreeFacts, rebound: AbstractSet[str]
) -> str | None:
    """Why ``function`` may not get a parameter: no caller could pass it, or one would break it.

    ``rebound``: the module-level ``def`` / ``class`` names the file binds more than once."""
    owner = function.qualname.partition(".")[0]
    if owner in rebound:
        return (
            f"{owner} is bound more than once at module level (a def in each branch, or a def "
            "and an import or assignment): a call may reach one without the parameter"
        )
    decorated = _matching_decorator(function.node, FIXED_SIGNATURE)
    if decorated is not None:
        return f"decorated with @{decorated}, which a new parameter would break"
    decorated = _matching_decorator(function.node, tuple(facts.dropping))
    if decorated is not None:
        return (
            f"decorated with @{decorated}, whose wrapper takes no **kwargs: "
            "a caller's collection would not reach it"
        )
    name = function.node.name.value
    if name.startswith("__") and name.endswith("__") and name not in _CALLED_BY_CODE:
        return f"special method {name}: Python calls it with its own arguments"
    if CALLS_LOCALS in function.names:
        return LOCALS_REASON
    method_of = function.method_of
    called_as = method_of.name.value if method_of is not None and name == "__init__" else name
    if function.node.params.star_kwarg is not None and called_as in facts.passed_the_keyword:
        return (
            f"takes **kwargs, and a call of {called_as} in the tree passes the collection's "
            "keyword into them: a new parameter would take it from them"
        )
    if (
        method_of is not None
        and name in CALLED_BY_AUTOGRAD
        and (classes.autograd(method_of) or _autograd_shaped(function))
    ):
        return (
            f"{name} of an autograd Function: torch calls "
            "it through .apply(...), which takes no keyword"
        )
    if name in facts.hooks:
        return f"a hook (passed to a register_*hook): torch calls {name} with its own arguments"
    if name in facts.values:
        return (
            f"passed as a value ({name} is referenced, never "
            "called, in the tree): no caller can pass it one"
        )
    if method_of is not None and name not in _CALLED_BY_CODE and name not in facts.called:
        base = classes.outside(method_of)
        if base is not None:
            return (
                f"a callback: {method_of.name.value} derives from {base}, "
                f"outside the tree, and the tree never calls {name} by name"
            )
    return None


def _closure_calls_locals(function: Function, root: Function) -> bool:
    """Whether ``function`` or a function between it and ``root`` calls ``locals()``.

    Each would read the collection as a closure, which ``locals()`` then returns too."""
    inner: Function | None = function
    while inner is not None and inner is not root:
        if CALLS_LOCALS in inner.names:
            return True
        inner = inner.parent
    return False


def _free_name(function: Function, name: str, taken: set[str], spare: tuple[str, ...] = ()) -> str:
    """``name`` unless ``function`` or the module binds it.

    Else the first free of ``spare``, ``name_2``, ...
    """
    if name not in function.names and name not in taken:
        return name
    for candidate in (*spare, *(f"{name}_{i}" for i in range(2, 100))):
        if candidate not in function.names and candidate not in taken:
            return candidate
    raise AssertionError("unreachable: a hundred names taken")


def _site_reason(site: Site) -> str | None:
    if site.family == SHIM:
        return "shim: builds a collection from the globals (remove it once every caller passes one)"
    if site.family not in (LEGACY, HELPER):
        return "pgregistry's global grid: read by the fallback on purpose"
    if site.form == GETATTR:
        return "dynamic getattr: the accessor is looked up by name at run time"
    if site.form != CALL:
        return "a module global or a reference to the accessor, not a call of it"
    return None


_MODULE_LEVEL = "module level: runs at import, before any collection exists"


def reads_left_by_site(sites: Sequence[Site]) -> list[Read] | None:
    """The reads of a file whose every site stays for a reason its site alone gives; else None.

    A module-level read or shim, a reference: the way :func:`plan_file` decides them, without a
    libcst tree. None for any other file."""
    reasons = [
        _site_reason(site) or (_MODULE_LEVEL if site.scope == MODULE_SCOPE else None)
        for site in sites
    ]
    if any(
        site.family == SHIM and site.form == CALL and site.scope != MODULE_SCOPE for site in sites
    ):
        return None  # a shim in a function may be dissolved (:mod:`._shims`): that takes its tree
    if any(reason is None for reason in reasons):
        return None
    return [
        Read(site, None, None, 0, reason=reason or "")
        for site, reason in zip(sites, reasons, strict=True)
    ]


def plan_file(
    path: str,
    module: str,
    source: cst.Module,
    sites: Sequence[Site],
    name: str,
    data: bytes | None = None,
    syntax: ast.Module | None = None,
    *,
    gtp_remat: bool = True,
    facts: TreeFacts | None = None,
    shims: Mapping[str, tuple[str, dict[str, object]]] | None = None,
    kept_shims: Mapping[tuple[int, int], str] | None = None,
    virtual_stages: bool = False,
) -> FilePlan:
    """Locate ``sites`` in ``source`` and decide each read's way.

    Threading is decided here, passing by :func:`decide_passes` once every file is planned.
    ``data``: the file's bytes, when at hand (else ``source``'s code), and ``syntax`` their
    :mod:`ast` tree. ``source`` may be their skeleton (:mod:`~pgregistry.migrate._skeleton`): a
    placeholder is never walked, its definition's name is taken from ``syntax``. ``gtp_remat``:
    whether the code's Megatron-Core has GTP remat (which fields its data-parallel reads are, see
    :func:`~pgregistry._source.fields.collection_field`). ``facts``: what the whole tree says
    (:func:`~pgregistry.migrate._tree.learn_tree`; default: the ratchet's default modules, no other
    file). ``shims``: what the release's ``use_mpu_process_groups`` calls for each field
    (:func:`~pgregistry.migrate._megatron_release.shim_getters`; None: not known, every shim stays);
    ``kept_shims``: the shims (line, column) a first planning dissolved but could give no
    collection, and why: planned again with them kept, as their locals are collections to the file's
    other reads then. ``virtual_stages``: whether pipeline-stage reads with ``ignore_virtual=False``
    are rewritten (:func:`~pgregistry._source.fields.virtual_stage_choice`)."""
    facts = facts if facts is not None else TreeFacts()
    wrapper = MetadataWrapper(source, unsafe_skip_copy=True)
    data = data if data is not None else source.bytes
    spans, statements = _statement_spans(source.body, (syntax or ast.parse(data)).body)
    site_lines = sorted({site.line for site in sites})
    wanted = {i for i, (start, end) in enumerate(spans) if has_line_within(site_lines, start, end)}
    call_lines = {site.line for site in sites if site.form == CALL}
    locator = _Locator(sites, name, facts.set_late)
    locator.wanted = wanted
    _skip_placeholders(locator, source.body, statements)
    pattern = collection_mentions(name)
    starts = line_starts(data)
    for i in wanted:
        top, tree = source.body[i], statements[i][0]
        if (
            isinstance(top, cst.ClassDef)
            and isinstance(top.body, cst.IndentedBlock)
            and isinstance(tree, ast.ClassDef)
        ):
            member_spans, groups = _statement_spans(top.body.body, tree.body)
            locator.member_spans[i] = member_spans
            locator.members[i] = {
                m
                for m, (start, end) in enumerate(member_spans)
                if has_line_within(site_lines, start, end)
                or pattern.search(lines_between(data, starts, start, end))
            }
            header = [*tree.decorator_list, *tree.bases, *(k.value for k in tree.keywords)]
            locator.order[(i, -1)] = _call_order(header)
            locator.order.update({(i, m): _call_order(groups[m]) for m in locator.members[i]})
        else:
            locator.order[(i, -1)] = _call_order(statements[i])
    source.visit(locator)
    if locator.mismatch or any(
        locator.met.get(unit, 0) != len(o) for unit, o in locator.order.items()
    ):
        locator = _Locator(
            sites, name, facts.set_late
        )  # the ast's calls are not the tree's: libcst's own positions, slowly
        locator.wanted = wanted
        _skip_placeholders(locator, source.body, statements)
        locator.positions = _node_positions(source, spans, call_lines)
        source.visit(locator)
    reads = list(locator.reads)
    for site in locator.by_position.values():
        reads.append(
            Read(
                site,
                None,
                None,
                0,
                reason="could not be located in the tree (non-ASCII text before it?)",
            )
        )
    located = {id(read.site) for read in reads}
    for site in sites:
        if id(site) not in located:
            reads.append(Read(site, None, None, 0, reason=_site_reason(site) or "not a call"))
    taken: set[str] = set(locator.top_level) | set(locator.bindings)
    package = path.split("/")[:-1]
    module_syntax = syntax or ast.parse(data)
    classes = _Classes(module_syntax, locator.bindings, package, facts)
    rebound = names_bound_twice(module_syntax)
    collections = facts.collections_of(path)
    #: An autograd Function's ctx is made by torch for each call: it holds only what this file
    #: stores on it (another file's ``ctx.pg_collection``, even of a declared field name, says
    #: nothing of it).
    autograd_collections = facts.collections_of(path, own=True)
    legacy = [read for read in reads if read.call is not None and read.site.family == LEGACY]
    imports = _import_bytes((syntax or ast.parse(data)).body, starts) if legacy else []
    heads = {
        head
        for head in {_call_head_name(read) for read in legacy}
        if _bound_otherwise(head, data, imports)
        or not _imports_the_module(head, locator.bindings, facts, package)
    }
    ambiguous = [read for read in legacy if _call_head_name(read) in heads]
    defined = heads & _module_level_definitions(module_syntax) if ambiguous else set()
    scopes = _statement_scopes(source, ambiguous, defined) if ambiguous else {}
    caught = calls_a_handler_may_catch(module_syntax)
    captures = match_captures(module_syntax) if legacy else []
    for read in reads:  # first, as a shim's local named like the collection is no collection then
        if read.call is not None and read.site.family == SHIM and read.function is not None:
            kept = (kept_shims or {}).get((read.site.line, read.site.col))
            if kept is None:
                _dissolve_shim(read, read.function, shims, gtp_remat)
            else:
                read.reason = kept
    for read in reads:
        if read.call is None:
            continue
        reason = _site_reason(read.site) if read.shim is None else None
        if read.site.family == SHIM and read.reason:
            reason = read.reason
        if reason is None and read.site.family == LEGACY:
            reason = _not_parallel_state(read, scopes, facts, package) or _why_a_match_may_bind(
                read, captures
            )
        if reason is None and (read.site.line, read.site.col) in caught:
            reason = CAUGHT_REASON
        if reason is None and read.function is None:
            reason = (
                _MODULE_LEVEL
                if read.site.scope == MODULE_SCOPE
                else "class body: runs when the class is defined, before any collection exists"
            )
        if reason is None and read.shim is None:
            read.choice = _function_choice(read, gtp_remat, virtual_stages)
            reason = read.choice.reason or None
        if reason is None and read.shim is None:
            reason = _expression_left_unread(read)
        if reason is None and read.site.family == HELPER:
            given = read.call.args[0].value
            if _attribute_parts(given) is None and not (
                isinstance(given, cst.Name) and given.value == "None"
            ):
                reason = (
                    "the fallback helper's argument is not a "
                    "plain name (it would be evaluated twice)"
                )
            elif not (isinstance(given, cst.Name) and given.value == "None"):
                read.given = cst.Module([]).code_for_node(given)
        if reason is not None:
            read.way, read.reason = Way.LEFT, reason
            continue
        function = read.function
        assert function is not None
        in_scope = (
            autograd_collections if _autograd_shaped(_outermost_function(function)) else collections
        )
        chains = _chains_tied_to_class(in_scope, function, facts)
        found = _collection_in_scope(function, read.statement, locator.attributes, name, chains)
        if isinstance(found, str) and _fills_a_field(function, read, name):
            if not function.shim_name:
                function.shim_name, function.shim_at = (
                    _free_name(function, "mpu_groups", taken),
                    read.statement,
                )
            assert read.choice is not None
            if read.choice.field not in function.shim_fields:
                function.shim_fields.append(read.choice.field)
            read.way, read.collection = Way.BUILDER, function.shim_name
            continue
        if isinstance(found, str):
            read.way, read.reason = Way.LEFT, found
            continue
        given_by_the_code = _why_a_given_field_stays(function, found, read)
        if given_by_the_code is not None:
            read.way, read.reason = Way.LEFT, given_by_the_code
            continue
        guarded = read.site.guarded or bool(read.given)
        root = _outermost_function(function)
        if (
            found is None and root is not function
        ):  # the enclosing function's collection, as a closure
            if _closure_calls_locals(function, root):
                read.way, read.reason = Way.LEFT, LOCALS_REASON
                continue
            found = _enclosing_collection(function, root, locator.attributes, name, chains)
            if isinstance(found, str):
                read.way, read.reason = Way.LEFT, found
                continue
        if found is None:
            why = _cannot_thread(root, classes, facts, rebound)
            if why is not None:
                read.way, read.reason = (
                    Way.LEFT,
                    why if root is function else f"nested in {root.qualname}: {why}",
                )
                continue
            if not root.added:
                root.added = _free_name(
                    root,
                    name,
                    taken | _names_between(function, root),
                    ("process_group_collection",),
                )
            elif root.added in _names_between(function, root):
                read.way, read.reason = (
                    Way.LEFT,
                    f"binds {root.added}, which hides {root.qualname}'s collection",
                )
                continue
            read.way = Way.FALLBACK if guarded else Way.THREADED
            read.collection = root.added
        else:
            read.collection, optional, _ = found
            read.way = Way.FALLBACK if guarded and optional else Way.IN_SCOPE
    stranded = {
        (read.site.line, read.site.col): read.reason
        for read in reads
        if read.shim and read.way == Way.LEFT
    }
    if stranded:  # a shim that stays after all: its local is what it was to the other reads
        return plan_file(
            path,
            module,
            source,
            sites,
            name,
            data,
            syntax,
            gtp_remat=gtp_remat,
            facts=facts,
            shims=shims,
            kept_shims={**(kept_shims or {}), **stranded},
            virtual_stages=virtual_stages,
        )
    package = path.split("/")[:-1]
    return FilePlan(
        path,
        module,
        package,
        wrapper,
        locator.functions,
        reads,
        locator.calls,
        locator.bindings,
        locator.top_level,
        locator.attributes,
        locator.alone,
        data=data,
        spans=spans,
        locator=locator,
        statements=statements,
        line_starts=starts,
    )


def _dissolve_shim(
    read: Read,
    function: Function,
    shims: Mapping[str, tuple[str, dict[str, object]]] | None,
    gtp_remat: bool,
) -> None:
    """Decide whether shim ``read`` is dissolved into its field reads: set its ``shim`` or reason.

    See :mod:`._shims`. A dissolved shim's local is no collection in scope, and its name is free."""
    assert read.call is not None
    body = function.node.body
    if not isinstance(body, cst.IndentedBlock) or read.statement >= len(body.body):
        read.reason = "shim: not in a function's block"
        return
    parameters = _parameter_names(function)
    found = dissolve_shim(
        read.call, list(body.body), read.statement, parameters, shims, gtp_remat=gtp_remat
    )
    if isinstance(found, str):
        read.reason = found
        return
    read.shim = found
    read.choice = FieldChoice(
        field=found.fields[0], kind="group"
    )  # a read to plan; its fields are found's
    if found.local:
        function.local_at = [at for at in function.local_at if at != read.statement]
        function.held = [
            (name, at) for name, at in function.held if (name, at) != (found.local, read.statement)
        ]
        function.names.discard(found.local)


def _skip_placeholders(
    locator: _Locator, body: Sequence[cst.BaseStatement], statements: list[list[ast.stmt]]
) -> None:
    """Mark a skeleton's placeholders walked (nothing is in them), naming their definitions."""
    for index, (statement, group) in enumerate(zip(body, statements, strict=True)):
        node = group[0]
        if isinstance(
            node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
        ) and not isinstance(statement, (cst.FunctionDef, cst.ClassDef)):
            locator.visited.add(index)
            locator.top_level[node.name] = "class" if isinstance(node, ast.ClassDef) else "function"


def _statement_spans(
    body: Sequence[cst.BaseStatement], tree: Sequence[ast.stmt]
) -> tuple[list[tuple[int, int]], list[list[ast.stmt]]]:
    """The first and last line of each statement of a libcst ``body``, and its ``ast`` statements.

    Those of the same body's ``tree`` (:mod:`ast`): a libcst statement line holds one or more,
    ``a; b``."""
    spans: list[tuple[int, int]] = []
    groups: list[list[ast.stmt]] = []
    position = 0
    for statement in body:
        count = len(statement.body) if isinstance(statement, cst.SimpleStatementLine) else 1
        nodes = tree[position : position + count]
        position += count
        spans.append((definition_span(nodes[0])[0], definition_span(nodes[-1])[1]))
        groups.append(list(nodes))
    return spans, groups


def _ast_dotted(node: ast.expr) -> str | None:
    parts = attribute_chain(node)
    return ".".join(parts) if parts else None


def _call_order(statements: Sequence[ast.AST]) -> list[tuple[int, int, str | None]]:
    """The calls in ``statements`` as (line, column of the callee, dotted callee) in pre-order.

    Source pre-order: by start, the outer of two calls that start together first. A walk of the
    libcst tree meets its calls in that order, so the n-th call it meets is the n-th here (checked
    by the callee's name): the scanner's positions (ast's) locate its sites without libcst's
    PositionProvider, many times slower."""
    calls = [
        node
        for statement in statements
        for node in ast.walk(statement)
        if isinstance(node, ast.Call)
    ]
    calls.sort(
        key=lambda c: (c.lineno, c.col_offset, -(c.end_lineno or 0), -(c.end_col_offset or 0))
    )
    return [(c.func.lineno, c.func.col_offset, _ast_dotted(c.func)) for c in calls]


def _node_positions(
    source: cst.Module, spans: list[tuple[int, int]], lines: set[int]
) -> dict[int, tuple[Mapping[cst.CSTNode, CodeRange], int]]:
    """Node positions of each module-level statement covering one of ``lines``, with an offset.

    For each such statement: its nodes' positions (computed on a module of that statement alone, far
    cheaper than the whole file's) and the line offset that makes them the file's."""
    found: dict[int, tuple[Mapping[cst.CSTNode, CodeRange], int]] = {}
    ordered = sorted(lines)
    for index, (start, end) in enumerate(spans):
        if has_line_within(ordered, start, end):
            statement = source.body[index]
            alone = cst.Module(
                body=[statement],
                default_indent=source.default_indent,
                default_newline=source.default_newline,
            )
            ranges = MetadataWrapper(alone, unsafe_skip_copy=True).resolve(PositionProvider)
            found[index] = (ranges, start - 1 - len(statement.leading_lines))
    return found


def _absolute_module(module: str, package: list[str]) -> str:
    """The absolute name of ``module``, written with its leading dots (``..x``), in ``package``."""
    relative = module.lstrip(".")
    return absolute_module(relative, len(module) - len(relative), package)


def _resolve_dotted(
    dotted: list[str], bindings: Mapping[str, str], package: list[str]
) -> str | None:
    """The dotted name ``dotted`` stands for through the file's imports (``bindings``), or None.

    None when no import binds its first name."""
    bound = bindings.get(dotted[0])
    if bound is None:
        return None
    module, _, attribute = bound.partition(":")
    module = _absolute_module(module, package)
    return ".".join([f"{module}.{attribute}" if attribute else module, *dotted[1:]])


def _module_function_of_call(plan: FilePlan, dotted: list[str]) -> tuple[str, str] | None:
    """(module, name) a call of ``dotted`` in ``plan`` calls, if module-level function or class."""
    head = dotted[0]
    if len(dotted) == 1 and plan.top_level.get(head) in ("function", "class"):
        return plan.module, head
    qualified = _resolve_dotted(dotted, plan.bindings, plan.package)
    if qualified is None or "." not in qualified:
        return None
    module, _, function = qualified.rpartition(".")
    return module, function


def collect_threaded_functions(plans: Iterable[FilePlan]) -> dict[tuple[str, str], str]:
    """The module-level functions a collection was threaded into, with the parameter added.

    (module, name) -> the parameter added. Only those are passed one: a method may be overridden
    where the scan does not look."""
    return {
        (plan.module, function.node.name.value): function.added
        for plan in plans
        for function in plan.functions
        if function.added and function.parent is None and function.method_of is None
    }


def collect_threaded_methods(plans: Iterable[FilePlan]) -> dict[tuple[str, str], str]:
    """The methods of module-level classes a collection was threaded into, with the parameter.

    (module, ``Class.method``) -> the parameter added. Their callers pass it only where every method
    of that name is threaded alike, see :mod:`~pgregistry.migrate._upward`."""
    return {
        (plan.module, function.qualname): function.added
        for plan in plans
        for function in plan.functions
        if function.added
        and function.parent is None
        and function.method_of is not None
        and function.qualname.count(".") == 1
    }


def collect_threaded_classes(plans: Iterable[FilePlan]) -> dict[tuple[str, str], str]:
    """The module-level classes whose own ``__init__`` a collection was threaded into.

    (module, class) -> the parameter added, so that a call of the class itself passes it as a call
    of a threaded function does. Only a class whose instantiation is sure to reach that ``__init__``
    with the keyword: never one with a decorator (it may stand for something else), a metaclass or
    other class keyword (its ``__call__`` may take other arguments), or a ``__new__`` of its own
    (called with the same arguments). A subclass is none of these: its own ``__init__``, or one it
    inherits from a class outside the file, is not known to take the keyword."""
    found = {}
    for plan in plans:
        for function in plan.functions:
            owner = function.method_of
            if not (
                function.added
                and function.parent is None
                and owner is not None
                and function.qualname == f"{owner.name.value}.__init__"
            ):
                continue
            # The class as the file has it (the walked tree may stand in for a member without
            # reads).
            syntax = plan.statements[function.top][0]
            if (
                not isinstance(syntax, ast.ClassDef)
                or syntax.decorator_list
                or syntax.keywords
                or any(
                    isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef)) and m.name == "__new__"
                    for m in syntax.body
                )
            ):
                continue
            found[(plan.module, owner.name.value)] = function.added
    return found


def add_reexported_names(
    threaded: Mapping[tuple[str, str], str], packages: Mapping[str, bytes]
) -> dict[tuple[str, str], str]:
    """``threaded`` with the names packages re-export its functions under.

    ``from .common_utils import f`` in ``pkg/__init__.py`` (``packages``: path -> bytes of such
    files) makes ``pkg.f`` the same function, so a call through the package (``from pkg import f``,
    ``pkg.f(...)``) is passed the collection too; chains of packages are followed. Module-level
    imports only (in ``if`` / ``try`` blocks too), read with :mod:`ast`."""
    found = dict(threaded)
    if not found:
        return found
    named = re.compile(
        rb"\b(?:"
        + b"|".join(re.escape(n.encode()) for n in sorted({f for _, f in found}))
        + rb")\b"
    )
    imports: list[tuple[str, str, str, str]] = []  # (package, bound name, module, name)
    for path, data in packages.items():
        if not named.search(data):
            continue
        parts = path.split("/")[:-1]
        package = ".".join(parts)
        stack: list[ast.stmt] = list(ast.parse(data).body)
        while stack:
            node = stack.pop()
            if isinstance(node, ast.ImportFrom):
                module = absolute_module(node.module or "", node.level, parts)
                imports += [
                    (package, a.asname or a.name, module, a.name)
                    for a in node.names
                    if a.name != "*"
                ]
            elif not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                stack += [
                    child for child in ast.iter_child_nodes(node) if isinstance(child, ast.stmt)
                ]
    changed = True
    while changed:  # a package re-exporting another package's re-export
        changed = False
        for package, bound, module, name in imports:
            added = found.get((module, name))
            if added is not None and (package, bound) not in found:
                found[(package, bound)] = added
                changed = True
    return found


def decide_passes(
    plans: Sequence[FilePlan],
    name: str,
    threaded: Mapping[tuple[str, str], str] | None = None,
    methods: Mapping[str, str] | None = None,
    spec_fields: Mapping[tuple[str, str, str], str] | None = None,
    forwarding: Collection[tuple[str, str]] = (),
    local_classes: Mapping[tuple[str, str, str], str] | None = None,
) -> int:
    """Decide which calls pass a threaded function the caller's collection; return how many do.

    The caller's own collection, or the one threaded into it; fills each plan's ``passes``.
    ``threaded``: every file's :func:`collect_threaded_functions` (default: those of ``plans``);
    ``methods``: method names every ``def`` of which in the tree has the parameter (name ->
    keyword): a call ``obj.m(...)`` on anything no import binds passes it; ``spec_fields``: the
    calls of a spec's field whose every class takes it ((module, function, field) -> keyword,
    :mod:`~pgregistry.migrate._spec_fields`): ``submodules.X(...)``, ``build_module(submodules.X,
    ...)``; ``forwarding``: the ``__init__``s ((module, ``Class.__init__``)) that pass their
    parameter on in their ``super().__init__(...)`` calls (:mod:`~pgregistry.migrate._inherited`);
    ``local_classes``: the calls of a local assigned classes that every one of them takes ((module,
    function, local) -> keyword)."""
    if threaded is None:
        threaded = collect_threaded_functions(plans)
    count = 0
    for plan in plans:
        for call in plan.calls:
            target = _module_function_of_call(plan, call.dotted)
            keyword = threaded.get(target) if target is not None else None
            if (
                keyword is None
                and methods
                and len(call.dotted) > 1
                and (
                    not call.dotted[0]
                    or _resolve_dotted(call.dotted, plan.bindings, plan.package) is None
                )
            ):
                keyword = methods.get(call.dotted[-1])
            if keyword is None and spec_fields:
                keyword = _spec_keyword(plan.module, call, spec_fields)
            caller = call.function
            if keyword is None and caller is not None:
                keyword = _keyword_of_forwarding_or_local_call(
                    plan.module, call, caller.qualname, name, forwarding, local_classes or {}
                )
            if keyword is None or caller is None:
                continue
            if any(
                a.star == "**" or (a.keyword is not None and a.keyword.value == keyword)
                for a in call.node.args
            ):
                continue
            root = _outermost_function(caller)
            # A function threaded upward passes a collection it already holds
            # (``self.pg_collection``), as before.
            found = (
                _collection_in_scope(caller, call.statement, plan.attributes, name)
                if caller.upward
                else None
            )
            if isinstance(found, tuple):
                value = found[0]
            elif caller.added:
                value = caller.added
            else:
                found = _collection_in_scope(caller, call.statement, plan.attributes, name)
                if isinstance(found, tuple):
                    value = found[0]
                elif (
                    found is None and root.added and root.added not in _names_between(caller, root)
                ):
                    value = (
                        root.added
                    )  # a nested function passes the collection threaded into its enclosing one
                else:
                    continue
            plan.passes[id(call.node)] = (keyword, value)
            plan.passing_tops.add((call.top, call.member))
            count += 1
    return count


def _keyword_of_forwarding_or_local_call(
    module: str,
    call: Call,
    qualname: str,
    name: str,
    forwarding: Collection[tuple[str, str]],
    local_classes: Mapping[tuple[str, str, str], str],
) -> str | None:
    """The keyword a forwarding ``super().__init__(...)`` or a local class call passes, or None.

    A ``super().__init__(...)`` of a forwarding ``__init__``, or a call of a local assigned classes;
    None when it is neither."""
    if tuple(call.dotted) == SUPER_INIT:
        return name if (module, qualname) in forwarding else None
    if len(call.dotted) == 1:
        return local_classes.get((module, qualname, call.dotted[0]))
    return None


def _spec_keyword(
    module: str, call: Call, spec_fields: Mapping[tuple[str, str, str], str]
) -> str | None:
    """The keyword a call of a spec's field in ``module`` passes, None when it is none.

    ``spec_fields``: (module, function, field) -> keyword."""

    arguments = call.node.args
    first = (
        _attribute_parts(arguments[0].value)
        if arguments and arguments[0].keyword is None and not arguments[0].star
        else None
    )
    spec_field = spec_field_of_call(call.dotted, first)
    if spec_field is None or call.function is None:
        return None
    return spec_fields.get((module, call.function.qualname, spec_field))


def visit_mentions(plan: FilePlan, pattern: re.Pattern[bytes]) -> None:
    """Walk the module-level statements of ``plan`` not walked yet whose text matches ``pattern``.

    ``pattern``: a call of a function a collection was threaded into; walked so
    :func:`decide_passes` sees their calls."""
    locator = plan.locator
    if locator is None or plan.data is None:
        return
    body = plan.wrapper.module.body
    for index, (start, end) in enumerate(plan.spans):
        statement = body[index]
        if index in locator.members and isinstance(
            statement, cst.ClassDef
        ):  # walked in part: the rest
            for member, (first, last) in enumerate(locator.member_spans[index]):
                if (index, member) not in locator.visited_members and pattern.search(
                    plan.text(first, last)
                ):
                    locator.visit_member(index, statement, member)
        elif index not in locator.visited and pattern.search(plan.text(start, end)):
            locator.visit_top(index, statement)


def collection_mentions(name: str) -> re.Pattern[bytes]:
    """Where a collection may be named or bound: a word containing ``name``, or a construction.

    A word such as ``pg_collection``, ``self._pg_collection``; a construction assigned (the class
    members to walk for ``self.<attribute> = ...``)."""
    return re.compile(
        rb"\w*"
        + re.escape(name.encode())
        + rb"|=[ \t]*[\w.]*\b(?:ProcessGroupCollection|use_mpu_process_groups)[ \t]*\("
    )


def _fields_given(construction: cst.Call) -> set[str]:
    """The fields ``ProcessGroupCollection(...)`` is given other than by a getter's call.

    ``tp=tp_group``, ``dp=None``: a group of the caller's, not known to be the global one; not
    ``tp=parallel_state.get_tensor_model_parallel_group()``. ``*`` for a positional or ``**``
    argument (any field)."""
    given: set[str] = set()
    for argument in construction.args:
        if argument.keyword is None:
            given.add("*")
        elif not (
            isinstance(argument.value, cst.Call)
            and _callee_last_name(argument.value).startswith("get_")
        ):
            given.add(argument.keyword.value)
    return given


def _why_a_given_field_stays(
    function: Function, found: tuple[str, bool, bool] | None, read: Read
) -> str | None:
    """Why ``read`` stays where the collection ``found`` in scope was given its field by the code.

    A local built as ``ProcessGroupCollection(tp=tp_group)`` above the read holds the caller's
    group, which need not be the global one the read reads: through it, the read would read
    another group where no collection was passed. None where it reads through it soundly."""
    if found is None or read.choice is None:
        return None
    given = function.given_fields.get(found[0])
    field = read.choice.field
    uses = {field, "dp", "gtp_remat"} if field == GTP_REMAT_DP else {field}
    if not given or not (uses & given or "*" in given):
        return None
    return (
        f"{found[0]} is built as ProcessGroupCollection({field}=...) from the code's own group, "
        "which need not be the global one the read reads"
    )


def _holds_a_collection(attribute: str, value: cst.BaseExpression | None, name: str) -> bool:
    """Whether assigning ``value`` to ``attribute`` makes it a collection, by its name or value.

    By its name (``_pg_collection``, see :func:`~pgregistry.migrate._tree.names_a_collection`) or by
    its value (``ProcessGroupCollection(...)``, ``use_mpu_process_groups(...)``)."""
    return (
        names_a_collection(attribute, name)
        or isinstance(value, cst.Call)
        and _callee_last_name(value) in ("ProcessGroupCollection", "use_mpu_process_groups")
    )


def _callee_last_name(call: cst.Call) -> str:
    """The last name of what ``call`` calls.

    ``ProcessGroupCollection`` for ``pgc.ProcessGroupCollection()``.
    """
    func = call.func
    if isinstance(func, cst.Attribute):
        return func.attr.value
    return func.value if isinstance(func, cst.Name) else ""

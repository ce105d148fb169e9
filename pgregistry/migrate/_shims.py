"""Which ``use_mpu_process_groups`` shims ``pgregistry migrate`` dissolves into their fields' reads.

A shim builds a collection from the globals for the few fields it lists; where its result is only
read for those fields, each read is the field read itself, and the shim goes:

    group = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["gtp_remat"]).gtp_remat
    ->  group = pg_group(pg_collection, "gtp_remat", check_initialized=False)

    _pg = ProcessGroupCollection.use_mpu_process_groups(
        required_pgs=["gtp_remat", "expt_gtp_remat"]
    )
    group = _pg.expt_gtp_remat if self.is_expert else _pg.gtp_remat
    ->  group = (
            pg_group(..., "expt_gtp_remat", ...)
            if self.is_expert
            else pg_group(..., "gtp_remat", ...)
        )

Without a collection, each read falls back to the very getter the release's
``use_mpu_process_groups`` calls for that field, with its keywords (``check_initialized=False``:
``None`` where parallel_state is not initialised, where the plain getter raises):
:func:`~pgregistry.migrate._megatron_release.shim_getters`. A field is dissolved only when that
getter, less ``check_initialized``, is the one the fallback helper's table holds for the field. The
shim called the getters of every field it lists where it stood; the reads call them later, each
where it is read, so every listed field whose read moves must be read unchecked (such a getter only
returns a global: nothing it does can be seen earlier or later).

Left, with the reason: a shim whose result escapes (passed on, returned, stored, a field it does not
list read, a field assigned, bound again, read in a nested function or above it), one of every field
(``use_mpu_process_groups()``: the default-builder ``if pg_collection is None: pg_collection =
...``), one not at a function's top level. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import libcst as cst

from pgregistry._source.fields import collection_field

__all__ = ["DEFAULT_BUILDER", "Dissolved", "dissolve_shim"]

#: The getter keyword that makes a getter return ``None`` rather than raise when parallel_state is
#: not set up.
CHECK = "check_initialized"
#: Why ``use_mpu_process_groups()`` stays: a collection of every field, the default of a function's
#: callers.
DEFAULT_BUILDER = (
    "shim: builds every field from the globals (remove it once every caller passes a collection)"
)
_ESCAPES = "shim: its collection is used otherwise than read for the fields it lists"
_NOT_LITERAL = "shim: the fields it lists are not a literal list"


@dataclass(eq=False)
class Dissolved:
    """A shim to dissolve: the fields it lists, each field read, and the statement assigning it.

    Each field read is the ``Attribute`` node, with its field and the keywords its fallback passes
    the getter; the statement assigns the shim to a local (None for a shim read inline)."""

    fields: list[str]
    reads: list[tuple[cst.Attribute, str, dict[str, object]]] = field(default_factory=list)
    statement: cst.SimpleStatementLine | None = None
    local: str = ""


def dissolve_shim(
    call: cst.Call,
    body: list[cst.BaseStatement],
    statement: int,
    parameters: list[str],
    getters: Mapping[str, tuple[str, dict[str, object]]] | None,
    *,
    gtp_remat: bool,
) -> Dissolved | str:
    """The :class:`Dissolved` of shim ``call``; a reason when it stays.

    ``call`` is in top-level statement ``statement`` of a function's ``body`` (whose ``parameters``
    are given). ``getters``: the release's
    :func:`~pgregistry.migrate._megatron_release.shim_getters` (None: not known)."""
    listed = _fields_listed(call)
    if isinstance(listed, str):
        return listed
    if getters is None:
        return (
            "shim: which getter use_mpu_process_groups calls for each field is not known (no "
            "megatron/core/process_groups_config.py found)"
        )
    keywords: dict[str, dict[str, object]] = {}
    for name in listed:
        getter = getters.get(name)
        if getter is None:
            return f"shim: this Megatron-Core's use_mpu_process_groups builds no field {name!r}"
        accessor, passed = getter
        choice = collection_field(
            accessor, {k: v for k, v in passed.items() if k != CHECK}, gtp_remat=gtp_remat
        )
        if (choice.field, choice.kind) != (name, "group"):
            return (
                f"shim: use_mpu_process_groups reads {name!r} "
                f"with {accessor}, not the field's own getter"
            )
        keywords[name] = {CHECK: passed[CHECK]} if CHECK in passed else {}
    inline = _read_inline(call, body[statement])
    if inline is not None:
        if inline.attr.value not in listed:
            return f"shim: reads {inline.attr.value!r}, a field it does not list"
        moved = [name for name in listed if name != inline.attr.value]
        return _why_reads_may_not_move(moved, keywords) or Dissolved(
            listed, [(inline, inline.attr.value, keywords[inline.attr.value])]
        )
    local = _local_holding_call(call, body[statement])
    if local is None:
        return _ESCAPES
    if local in parameters:
        return f"shim: rebinds the parameter {local} (the default of callers that pass none)"
    if not _is_lone_assignment(call, body[statement]):
        return f"shim: assigned to {local} inside a block, not at the function's top level"
    reads: list[tuple[cst.Attribute, str, dict[str, object]]] = []
    for index, other in enumerate(body):
        if index == statement:
            continue
        uses = _Uses(local)
        other.visit(uses)
        if uses.reason:
            return uses.reason
        if uses.reads and index < statement:
            return f"shim: {local} is read above the shim"
        for read in uses.reads:
            if read.attr.value not in listed:
                return f"shim: reads {read.attr.value!r}, a field it does not list"
            reads.append((read, read.attr.value, keywords[read.attr.value]))
    assigned = body[statement]
    assert isinstance(assigned, cst.SimpleStatementLine)
    return _why_reads_may_not_move(listed, keywords) or Dissolved(listed, reads, assigned, local)


def _fields_listed(call: cst.Call) -> list[str] | str:
    """The fields ``call`` lists (``required_pgs=[...]``, literal strings), or why unknown."""
    if not call.args:
        return DEFAULT_BUILDER
    if (
        len(call.args) != 1
        or call.args[0].star
        or (call.args[0].keyword is not None and call.args[0].keyword.value != "required_pgs")
    ):
        return _NOT_LITERAL
    value = call.args[0].value
    if not isinstance(value, (cst.List, cst.Tuple)):
        return _NOT_LITERAL
    names: list[str] = []
    for element in value.elements:
        text = (
            element.value.evaluated_value if isinstance(element.value, cst.SimpleString) else None
        )
        if not isinstance(text, str) or isinstance(element, cst.StarredElement):
            return _NOT_LITERAL
        names.append(text)
    return names


def _why_reads_may_not_move(
    names: list[str], keywords: Mapping[str, dict[str, object]]
) -> str | None:
    """Why the getters of ``names``, read after the shim read them, may act otherwise.

    None: they may not.
    """
    checked = [name for name in names if keywords[name].get(CHECK) is not False]
    if checked:
        return (
            f"shim: use_mpu_process_groups reads {', '.join(map(repr, checked))} "
            "checked where it is built (it raises there when parallel_state is "
            "not initialised): its reads may not move"
        )
    return None


def _read_inline(call: cst.Call, statement: cst.BaseStatement) -> cst.Attribute | None:
    """The ``<call>.<field>`` holding ``call`` in ``statement`` (not assigned to), if any."""
    found: list[cst.Attribute] = []

    class _Find(cst.CSTVisitor):
        def visit_Attribute(self, node: cst.Attribute) -> None:
            if node.value is call:
                found.append(node)

    statement.visit(_Find())
    if not found or _is_assigned_in(statement, found[0]):
        return None
    return found[0]


class _Targets(cst.CSTVisitor):
    """The nodes a statement assigns, deletes or binds (by id).

    Assignment, ``for`` and ``with`` targets, each element of a tuple or list of them too."""

    def __init__(self) -> None:
        super().__init__()
        self.targets: set[int] = set()

    def _add_target(self, node: cst.BaseExpression) -> None:
        self.targets.add(id(node))
        if isinstance(node, (cst.Tuple, cst.List)):
            for element in node.elements:
                self._add_target(element.value)

    def visit_AssignTarget(self, node: cst.AssignTarget) -> None:
        self._add_target(node.target)

    def visit_AugAssign(self, node: cst.AugAssign) -> None:
        self._add_target(node.target)

    def visit_AnnAssign(self, node: cst.AnnAssign) -> None:
        self._add_target(node.target)

    def visit_Del(self, node: cst.Del) -> None:
        self._add_target(node.target)

    def visit_For(self, node: cst.For) -> None:
        self._add_target(node.target)

    def visit_WithItem(self, node: cst.WithItem) -> None:
        if node.asname is not None:
            self._add_target(node.asname.name)


def _is_assigned_in(statement: cst.BaseStatement, node: cst.CSTNode) -> bool:
    """Whether ``node`` is assigned or deleted in ``statement``."""
    found = _Targets()
    statement.visit(found)
    return id(node) in found.targets


def _local_holding_call(call: cst.Call, statement: cst.BaseStatement) -> str | None:
    """The local ``<local> = call`` in ``statement`` assigns ``call`` to (at any depth).

    None when ``call`` is not assigned to one name alone."""
    found: list[str] = []

    class _Find(cst.CSTVisitor):
        def visit_Assign(self, assign: cst.Assign) -> None:
            target = assign.targets[0].target
            if assign.value is call and len(assign.targets) == 1 and isinstance(target, cst.Name):
                found.append(target.value)

    statement.visit(_Find())
    return found[0] if found else None


def _is_lone_assignment(call: cst.Call, statement: cst.BaseStatement) -> bool:
    """Whether ``statement`` is ``<local> = call`` and nothing else."""
    if not (isinstance(statement, cst.SimpleStatementLine) and len(statement.body) == 1):
        return False
    assign = statement.body[0]
    return isinstance(assign, cst.Assign) and assign.value is call


class _Uses(_Targets):
    """The reads ``<local>.<field>`` in a statement, or why ``local`` is used otherwise.

    Otherwise: any other use of the name, a field assigned or deleted, a use in a nested function,
    lambda or class. A target is visited before the nodes in it, so it is known as one when they
    are."""

    def __init__(self, local: str) -> None:
        super().__init__()
        self.local = local
        self.reads: list[cst.Attribute] = []
        self.reason = ""
        self.nested = 0
        #: Names that are not uses: attributes after a dot, keyword names, and the heads of the
        #: reads.
        self.not_uses: set[int] = set()

    def visit_Attribute(self, node: cst.Attribute) -> None:
        self.not_uses.add(id(node.attr))
        if isinstance(node.value, cst.Name) and node.value.value == self.local:
            self.not_uses.add(id(node.value))
            if self.nested:
                self.reason = (
                    self.reason
                    or f"shim: {self.local} is read in a nested function, lambda or class"
                )
            elif id(node) in self.targets:
                self.reason = self.reason or f"shim: a field of {self.local} is assigned or deleted"
            else:
                self.reads.append(node)

    def visit_Arg(self, node: cst.Arg) -> None:
        if node.keyword is not None:
            self.not_uses.add(id(node.keyword))

    def visit_Name(self, node: cst.Name) -> None:
        if node.value == self.local and id(node) not in self.not_uses:
            self.reason = (
                self.reason
                or _ESCAPES + f" ({self.local} is passed on, returned, stored or bound again)"
            )

    def _enter_nested(self, node: cst.CSTNode) -> None:
        self.nested += 1

    def _leave_nested(self, node: cst.CSTNode) -> None:
        self.nested -= 1

    visit_FunctionDef = visit_Lambda = visit_ClassDef = _enter_nested
    leave_FunctionDef = leave_Lambda = leave_ClassDef = _leave_nested  # type: ignore[assignment]

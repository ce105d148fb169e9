"""What a read becomes in each target's code: a fallback helper call, in place, and its imports.

Every rewritten read becomes ``pg_group`` / ``pg_rank`` / ``pg_size`` / ``pg_read`` of the
collection in scope and the field (``parallel_state.get_tensor_model_parallel_rank()`` ->
``pg_rank(pg_collection, "tp")``), evaluated where, and only when, the read ran: the collection's
field when it holds it, else the global value with the warning naming the function.

``megatron``: the helper is a module written into the migrated tree
(:mod:`~pgregistry.migrate._fallback_helper`, its name chosen by the run), so the tree needs no
pgregistry; it falls back to Megatron-Core's ``parallel_state`` accessor the read called, with the
read's ``check_initialized=``.

``pgregistry``: the same four functions from :mod:`pgregistry.doors`, on pgregistry's collection,
falling back to pgregistry's global grid.

A read assigned into a field of a collection its function builds by hand reads the shim's field
directly (``mpu_groups.tp``): the shim holds every field it was built with. A
``use_mpu_process_groups`` shim read only for its fields becomes those reads (:mod:`._shims`), each
falling back as the shim read it.
"""

from __future__ import annotations

from dataclasses import dataclass

import libcst as cst

from pgregistry._source.scanner import HELPER
from pgregistry.migrate._plan import Read, Way

__all__ = ["HELPERS", "TARGETS", "Idiom", "idiom_of_target"]

#: The helper's functions: the kinds with one of their own, and ``pg_read`` for the others.
HELPERS = {"group": "pg_group", "rank": "pg_rank", "size": "pg_size"}
_READ = "pg_read"
#: Keyword arguments of a read that the fallback passes on to the accessor (they change what it
#: raises).
_FORWARDED = ("check_initialized",)


@dataclass(frozen=True)
class Idiom:
    """One target: where its helpers come from, and whether they fall back to Megatron-Core.

    When they fall back, the read's own keywords go to them, and a read of a fallback helper falls
    back to that helper."""

    module: str
    megatron_fallback: bool

    def imports(self, code: str) -> list[tuple[str, str]]:
        """The ``from module import name`` pairs ``code`` (a replacement) needs."""
        return [(self.module, name) for name in (*HELPERS.values(), _READ) if f"{name}(" in code]

    def _read_code(self, read: Read, field: str, forwarded: str) -> str:
        assert read.choice is not None
        if read.way == Way.BUILDER:
            return f"{read.collection}.{field}"
        kind = read.choice.kind
        if (
            read.site.family == HELPER and self.megatron_fallback
        ):  # falls back to the helper, as the read did
            kind = "group_if_none"
        function = HELPERS.get(kind)
        arguments = f'{read.collection}, "{field}"' + ("" if function else f', "{kind}"')
        return f"{function or _READ}({arguments}{forwarded})"

    def field_read(self, collection: str, field: str, keywords: dict[str, object]) -> str:
        """A dissolved shim's read of ``field`` (:mod:`._shims`): its group, else the shim's getter.

        Falling back to the getter the shim called, with the shim's ``keywords``
        (``check_initialized=False``) for a Megatron-Core fallback."""
        forwarded = (
            "".join(f", {k}={v!r}" for k, v in keywords.items()) if self.megatron_fallback else ""
        )
        return f'{HELPERS["group"]}({collection}, "{field}"{forwarded})'

    def replacement(self, read: Read) -> tuple[str, bool]:
        """(code, whether it is a conditional that needs parentheses where it is an operand)."""
        choice = read.choice
        assert choice is not None
        if choice.forwarded and not self.megatron_fallback:
            raise ValueError(
                f"{read.site.accessor} needs {', '.join(choice.forwarded)}= passed on, which "
                "only --target megatron's fallback helper takes"
            )
        forwarded = ""
        if self.megatron_fallback and read.call is not None:
            forwarded = "".join(
                f", {a.keyword.value}={cst.Module([]).code_for_node(a.value)}"
                for a in read.call.args
                if a.keyword is not None and a.keyword.value in (*_FORWARDED, *choice.forwarded)
            )
        code, operator = self._read_code(read, choice.field, forwarded), False
        if read.when:
            other = self._read_code(read, read.when_field, forwarded)
            code, operator = f"{other} if {read.when} else {code}", True
        if read.given:
            code, operator = f"{read.given} if {read.given} is not None else {code}", True
        return code, operator


#: The targets by name.
TARGETS = ("megatron", "pgregistry")


def idiom_of_target(target: str, helper_module: str = "") -> Idiom:
    """The :class:`Idiom` of ``target``; ``ValueError`` naming the known ones for another.

    For ``megatron``, its helper is imported from ``helper_module``."""
    if target == "megatron":
        return Idiom(helper_module, megatron_fallback=True)
    if target == "pgregistry":
        return Idiom("pgregistry.doors", megatron_fallback=False)
    raise ValueError(f"unknown target {target!r} (known: {', '.join(TARGETS)})")

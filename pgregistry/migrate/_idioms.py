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

import re
from collections.abc import Mapping
from dataclasses import dataclass

import libcst as cst

from pgregistry._source.scanner import HELPER
from pgregistry.migrate._plan import Read, Way

__all__ = ["HELPERS", "TARGETS", "Idiom", "helper_aliases", "idiom_of_target"]

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
    #: (helper's name, the name a file calls it by) where the file binds the helper's name itself
    #: (``pg_size = group.size()``): see :func:`helper_aliases`.
    aliases: tuple[tuple[str, str], ...] = ()

    def call_name(self, helper: str) -> str:
        """The name the file calls ``helper`` by."""
        return dict(self.aliases).get(helper, helper)

    def imports(self, code: str) -> list[tuple[str, str]]:
        """The ``from module import name`` pairs ``code`` (a replacement) needs.

        An aliased helper's name is ``helper as alias``."""
        return [
            (
                self.module,
                name if self.call_name(name) == name else f"{name} as {self.call_name(name)}",
            )
            for name in (*HELPERS.values(), _READ)
            if f"{self.call_name(name)}(" in code
        ]

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
        return f"{self.call_name(function or _READ)}({arguments}{forwarded})"

    def field_read(self, collection: str, field: str, keywords: dict[str, object]) -> str:
        """A dissolved shim's read of ``field`` (:mod:`._shims`): its group, else the shim's getter.

        Falling back to the getter the shim called, with the shim's ``keywords``
        (``check_initialized=False``) for a Megatron-Core fallback."""
        forwarded = (
            "".join(f", {k}={v!r}" for k, v in keywords.items()) if self.megatron_fallback else ""
        )
        return f'{self.call_name(HELPERS["group"])}({collection}, "{field}"{forwarded})'

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
        # a fallback helper's argument or flag that reading may change is bound once, in a lambda
        parameters = self._lambda_parameter_names(read, forwarded) if _read_once(read) else None
        code, operator = self._read_code(read, choice.field, forwarded), False
        if read.when:
            other = self._read_code(read, read.when_field, forwarded)
            flag = parameters[1] if parameters else read.when
            code, operator = f"{other} if {flag} else {code}", True
        if parameters:
            given, flag = parameters
            names = ", ".join(filter(None, (given, flag)))
            values = ", ".join(filter(None, (read.given, read.when)))
            return f"(lambda {names}: {given} if {given} is not None else {code})({values})", False
        if read.given:
            code, operator = f"{read.given} if {read.given} is not None else {code}", True
        return code, operator

    def _lambda_parameter_names(self, read: Read, forwarded: str) -> tuple[str, str]:
        """The names the lambda binds a fallback helper's argument and flag to ("": no flag).

        The last name of each expression (``self.tp_group`` -> ``tp_group``), suffixed where the
        collection's expression, a forwarded keyword's value or a helper's name uses it (the lambda
        would hide it from them)."""
        used = {
            *_IDENTIFIER.findall(f"{read.collection} {forwarded}"),
            *(self.call_name(name) for name in (*HELPERS.values(), _READ)),
        }
        names = []
        for expression in (read.given, read.when):
            name = _IDENTIFIER.findall(expression)[-1] if expression else ""
            while name and name in used:
                name += "_given"
            used.add(name)
            names.append(name)
        return names[0], names[1]


def _read_once(read: Read) -> bool:
    """Whether a fallback helper's argument or flag must be bound to be read once, in order.

    The helper call read its argument, then its ``is_expert=`` flag, once each. A plain name reads
    the same each time, so ``tp_group if tp_group is not None else ...`` keeps that; an attribute
    (a property, a proxy's lookup) would be read twice, and the flag only where the argument is
    None, so both are passed to a lambda that tests its parameter: the collection is still read
    only where the argument is None."""
    return bool(read.given) and not (
        read.given.isidentifier() and (not read.when or read.when.isidentifier())
    )


#: The targets by name.
TARGETS = ("megatron", "pgregistry")
_WORDS = re.compile(rb"[A-Za-z_][A-Za-z0-9_]*")
_IDENTIFIER = re.compile(_WORDS.pattern.decode())


def helper_aliases(data: bytes, imported: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    """(helper's name, the name to call it by) for each helper name the file binds itself.

    ``data``: the file's bytes; ``imported``: the names its module-level imports of the helper's
    module bind -> the helper's name each stands for. A helper's name that is a word of the file
    (``pg_size = group.size()``, ``def pg_rank(...)``, ``from utils import pg_group``) and not
    bound by such an import means something else there: calling the helper by it would call that
    instead, so it is called by ``_<name>`` (``_<name>_2``, ...), a word the file does not hold,
    or by the alias an import of the helper already binds it to (a second run)."""
    words = {word.decode() for word in _WORDS.findall(data)}
    aliases = []
    for helper in (*HELPERS.values(), _READ):
        if helper not in words or imported.get(helper) == helper:
            continue
        bound = [alias for alias, name in imported.items() if name == helper]
        if bound:
            aliases.append((helper, bound[0]))
            continue
        candidates = (f"_{helper}", *(f"_{helper}_{i}" for i in range(2, 100)))
        aliases.append((helper, next(c for c in candidates if c not in words)))
    return tuple(aliases)


def idiom_of_target(target: str, helper_module: str = "") -> Idiom:
    """The :class:`Idiom` of ``target``; ``ValueError`` naming the known ones for another.

    For ``megatron``, its helper is imported from ``helper_module``."""
    if target == "megatron":
        return Idiom(helper_module, megatron_fallback=True)
    if target == "pgregistry":
        return Idiom("pgregistry.doors", megatron_fallback=False)
    raise ValueError(f"unknown target {target!r} (known: {', '.join(TARGETS)})")

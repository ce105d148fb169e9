"""What a read becomes in each target's idiom: the code of the replacement, the door, and the imports they need.

``megatron``: Megatron-Core's ``ProcessGroupCollection``, whose fields are always groups; ranks and sizes are
written as Megatron-Core's migrated code writes them (``pg_collection.tp.rank()``, ``.size()``), pipeline stages
as ``is_pp_first_stage`` / ``is_pp_last_stage`` compute them (rank 0, rank size - 1 of ``pp``), inline, so no
import of Megatron-Core's pipeline package can close an import cycle. The door is
:func:`pgregistry.doors.resolve_megatron_collection` (``use_mpu_process_groups`` of the fields read, with the
warning).

``pgregistry``: pgregistry's collection, where ``None`` means the axis is off: ranks and sizes through
``group_rank`` / ``group_size``; the door is :func:`pgregistry.doors.resolve_collection` (the global grid,
with the warning).
"""

from __future__ import annotations

from dataclasses import dataclass

from pgregistry.migrate._plan import Read

__all__ = ["TARGETS", "WIDTH", "Idiom", "idiom"]

#: The line length generated doors keep to (Megatron-Core's formatter's); a longer door is split after its
#: opening parenthesis, as black would.
WIDTH = 100


@dataclass(frozen=True)
class Idiom:
    """One target: its resolver, and the imports each kind of replacement needs."""

    name: str
    resolver: str

    def imports(self, code: str) -> list[tuple[str, str]]:
        """The ``from module import name`` pairs ``code`` (a replacement or a door) needs."""
        needed = [("pgregistry.doors", self.resolver)] if self.resolver in code else []
        needed += [("pgregistry.collection", name) for name in ("group_rank", "group_size") if f"{name}(" in code]
        return needed

    def resolved(self, collection: str, owner: str, fields: list[str]) -> str:
        """The call that resolves ``collection`` (None: the global grid, with the warning)."""
        if self.name == "megatron":
            listed = ", ".join(f'"{f}"' for f in fields) + ("," if len(fields) == 1 else "")
            return f'{self.resolver}({collection}, owner="{owner}", fields=({listed}))'
        return f'{self.resolver}({collection}, owner="{owner}")'

    def door(self, name: str, owner: str, fields: list[str], indent: int = 0) -> str:
        """The door's statement; over three lines when, ``indent`` columns in, it would pass :data:`WIDTH`."""
        call = self.resolved(name, owner, fields)
        line = f"{name} = {call}\n"
        if indent + len(line) - 1 <= WIDTH:
            return line
        head, arguments = call.split("(", 1)
        return f"{name} = {head}(\n    {arguments[:-1]}\n)\n"

    def _rank(self, group: str) -> str:
        return f"{group}.rank()" if self.name == "megatron" else f"group_rank({group})"

    def _size(self, group: str) -> str:
        return f"{group}.size()" if self.name == "megatron" else f"group_size({group})"

    def _read(self, read: Read, field: str, owner: str) -> tuple[str, bool]:
        assert read.choice is not None
        collection = read.collection
        if read.mode == "inline":
            collection = self.resolved(collection, owner, [field])
        group = f"{collection}.{field}"
        ranks = f"torch.distributed.get_process_group_ranks({group})"
        kind = read.choice.kind
        if kind == "group":
            return group, False
        if kind in ("rank", "size"):
            return (self._rank(group) if kind == "rank" else self._size(group)), False
        if kind in ("src_rank", "first_rank", "last_rank"):
            return f"{ranks}[{-1 if kind == 'last_rank' else 0}]", False
        if kind in ("next_rank", "prev_rank"):
            step = "+" if kind == "next_rank" else "-"
            return f"{ranks}[({self._rank(group)} {step} 1) % {self._size(group)}]", False
        if kind == "global_ranks":
            return ranks, False
        if kind == "first_stage":
            return f"{self._rank(group)} == 0", True
        return f"{self._rank(group)} == {self._size(group)} - 1", True

    def replacement(self, read: Read, owner: str) -> tuple[str, bool]:
        """(code, whether it is a comparison or conditional that needs parentheses where it is an operand)."""
        choice = read.choice
        assert choice is not None
        code, operator = self._read(read, choice.field, owner)
        if read.when:
            other, _ = self._read(read, read.when_field, owner)
            code, operator = f"{other} if {read.when} else {code}", True
        if read.given:
            code, operator = f"{read.given} if {read.given} is not None else {code}", True
        return code, operator


#: Both collections have every field of the shared table (:mod:`~pgregistry.allowlist._fixes`).
TARGETS: dict[str, Idiom] = {
    "megatron": Idiom("megatron", "resolve_megatron_collection"),
    "pgregistry": Idiom("pgregistry", "resolve_collection"),
}


def idiom(target: str) -> Idiom:
    """The :class:`Idiom` of ``target``; ``ValueError`` naming the known ones for another."""
    if target not in TARGETS:
        raise ValueError(f"unknown target {target!r} (known: {', '.join(sorted(TARGETS))})")
    return TARGETS[target]

"""Telling a refactor from a new read: stale and new entries of the same read, paired up as *moved*.

A class renamed, a read hoisted into a helper, a nested function extracted or a file moved changes
the keys of reads that were already allowed: the old key goes stale and the new key looks new, in
equal numbers. Replaying two months of Megatron-LM's ``megatron/core`` as CI runs, that noise was a
fifth of the failures. A stale entry and a new one are the same read moved when they read the same
accessor in the same form and

- they are in the same file (a scope renamed, a read hoisted or extracted), or
- they keep their scope and the old file was renamed to the new one (``renames``, from git), or has
  no read left at all (a file moved without git's help), or
- the new file was added since the base (``added``, from git): code split out of a module into a new
  one (Megatron-LM: MoE logging moved out of ``moe_utils.py`` into a new ``moe_logging.py``).

Pairing only ever matches a deficit with an excess, so the number of reads of an accessor can never
rise unnoticed: a commit that adds a read still fails, however its other reads moved. Within those
rules, pairs whose scopes end the same way (``Old.forward`` -> ``New.forward``) are taken first,
then the rest in sorted order, so the result never depends on dictionary order.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["Move", "pair_moves"]


@dataclass(frozen=True)
class Move:
    """``count`` reads moved from ``old_key`` in ``old_path`` to ``new_key`` in ``new_path``."""

    old_path: str
    old_key: str
    new_path: str
    new_key: str
    count: int


@dataclass
class _Side:
    path: str
    key: str
    amount: int

    @property
    def scope(self) -> str:
        return self.key.split("|", 1)[0]

    @property
    def read(self) -> str:
        return self.key.split("|", 1)[1]


def _last_scope_part(scope: str) -> str:
    return scope.rpartition(".")[2]


def pair_moves(
    stale: Mapping[tuple[str, str], int],
    new: Mapping[tuple[str, str], int],
    emptied: frozenset[str],
    renames: Mapping[str, str],
    added: frozenset[str] = frozenset(),
) -> list[Move]:
    """The moves among ``stale`` and ``new`` reads.

    ``stale`` maps (path, key) -> reads missing, ``new`` (path, key) -> reads too many.

    ``emptied``: paths with allowlist entries and no read left in the scan. ``renames``: old path ->
    new path. ``added``: paths of files added since the base."""
    olds = [_Side(path, key, amount) for (path, key), amount in sorted(stale.items())]
    news = [_Side(path, key, amount) for (path, key), amount in sorted(new.items())]

    def are_related(old: _Side, fresh: _Side) -> bool:
        if old.read != fresh.read:
            return False
        if old.path == fresh.path:
            return old.scope != fresh.scope
        if renames.get(old.path) == fresh.path or fresh.path in added:
            return True
        return old.path in emptied and old.scope == fresh.scope

    candidates = [(old, fresh) for old in olds for fresh in news if are_related(old, fresh)]
    # Same file first, then same scope ending, then a file rename; sorted for a deterministic
    # result.
    candidates.sort(
        key=lambda pair: (
            pair[0].path != pair[1].path,
            _last_scope_part(pair[0].scope) != _last_scope_part(pair[1].scope),
            pair[0].path,
            pair[0].key,
            pair[1].path,
            pair[1].key,
        )
    )
    moves: list[Move] = []
    for old, fresh in candidates:
        count = min(old.amount, fresh.amount)
        if count:
            moves.append(Move(old.path, old.key, fresh.path, fresh.key, count))
            old.amount -= count
            fresh.amount -= count
    return moves

"""Expert keys of a state dict renamed between rank-local and global expert indices.

Two key styles are renamed, the same way in both directions:

* sequential: ``...local_experts.<i>.<rest>``;
* grouped GEMM: ``...experts.<...>.weight<i>`` and ``bias<i>``, optionally with a ``_w``/``_v``
  suffix (the two halves of SwiGLU), where a segment ``experts`` precedes the last one.

Every other key is left as it is. Unlike Megatron-Core's ``handle_experts_in_state_dict``: a missing
or inconsistent ``num_experts`` raises instead of dropping keys, grouped ``bias<i>`` keys are
renamed too, and the order of the keys is kept. Renaming is strict by default, as the checkpoint
loaders are: each family of expert keys (one key with its expert index left out) must hold exactly
the experts ``num_experts`` gives (a rank's local ones, or every expert of a whole-model state
dict), so a ``num_experts`` too large for the state dict (16 given for a model of 8: rank 1's
experts 4-7 named 8-11) raises instead of renaming into the wrong slots; ``strict=False`` renames a
partial state dict (a few keys) on purpose. This module imports no torch, so it can be used on
checkpoints without it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Final, Literal, TypeVar

import attrs

from pgregistry._runtime.flags import require_flag
from pgregistry._runtime.integers import as_integer, positive_int

__all__ = [
    "expert_owner",
    "global_expert_index",
    "globalize_expert_keys",
    "is_expert_key",
    "localize_expert_keys",
]

V = TypeVar("V")

_INDEX: Final = re.compile(r"[0-9]+")

_GROUPED_TAIL: Final = re.compile(r"(weight|bias)([0-9]+)(_w|_v)?")


def _plain_integer(name: str, value: object) -> int:
    """``value`` as an int (an integer of any type: ``np.int64`` too), else ``ValueError``.

    A bool is no expert index."""
    number = as_integer(value)
    if number is None:
        raise ValueError(f"{name} must be an integer, got {value!r}")
    return number


def _num_local(num_experts: int, ep_size: int) -> int:
    """The experts of one EP rank; ``ValueError`` for sizes that are no positive integers.

    ``ep_size`` is checked here too: :func:`expert_owner` takes no rank to check it with, and a zero
    divided by zero, a negative one answered wrong owners."""
    experts = positive_int(num_experts, "num_experts")
    size = positive_int(ep_size, "ep_size")
    if experts % size:
        raise ValueError(f"ep_size {size} does not divide num_experts {experts}")
    return experts // size


def check_ep(ep_rank: int, ep_size: int) -> tuple[int, int]:
    """``(ep_rank, ep_size)`` as ints: integers, ``0 <= ep_rank < ep_size``; else ``ValueError``."""
    rank, size = _plain_integer("ep_rank", ep_rank), _plain_integer("ep_size", ep_size)
    if size < 1 or not 0 <= rank < size:
        raise ValueError(f"ep_rank {rank} is not a rank of an expert-parallel group of size {size}")
    return rank, size


def global_expert_index(local_index: int, num_experts: int, ep_rank: int, ep_size: int) -> int:
    """The global index of an EP rank's local expert.

    It is ``ep_rank * (num_experts // ep_size) + local_index``.

    Args:
        local_index: the expert's index on its EP rank.
        num_experts: the experts of the whole model.
        ep_rank: the rank in the EP group.
        ep_size: the EP group's size.

    Returns:
        The expert's index in the whole model.

    Raises:
        ValueError: an index or rank that is no integer or out of range, or an ``ep_size`` that
            does not divide ``num_experts``.

    Example:
        >>> global_expert_index(1, num_experts=8, ep_rank=2, ep_size=4)
        5
    """
    ep_rank, ep_size = check_ep(ep_rank, ep_size)
    num_local = _num_local(num_experts, ep_size)
    local_index = _plain_integer("local_index", local_index)
    if not 0 <= local_index < num_local:
        raise ValueError(
            f"local expert index {local_index} is out of range: {num_experts} "
            f"experts over {ep_size} EP ranks leave {num_local} per rank"
        )
    return ep_rank * num_local + local_index


def expert_owner(global_index: int, num_experts: int, ep_size: int) -> tuple[int, int]:
    """``(ep_rank, local_index)`` of the rank holding global expert ``global_index``.

    The inverse of :func:`global_expert_index`.

    Args:
        global_index: the expert's index in the whole model.
        num_experts: the experts of the whole model.
        ep_size: the EP group's size.

    Returns:
        The EP rank holding it and its index there.

    Raises:
        ValueError: ``global_index`` not an integer or out of range, an ``ep_size`` that is no
            positive integer or does not divide ``num_experts``.

    Example:
        >>> expert_owner(5, num_experts=8, ep_size=4)
        (2, 1)
    """
    num_local = _num_local(num_experts, ep_size)
    global_index = _plain_integer("global_index", global_index)
    if not 0 <= global_index < num_local * ep_size:
        raise ValueError(
            f"global expert index {global_index} is out of range for {num_experts} experts"
        )
    return divmod(global_index, num_local)


@attrs.frozen(slots=True)
class ExpertSlot:
    """An expert key split around its expert index."""

    head: str
    index: int
    tail: str

    def with_index(self, index: int) -> str:
        return f"{self.head}{index}{self.tail}"


def _parse_index(text: str, key: str) -> int:
    if text != str(int(text)):
        raise ValueError(f"expert index {text!r} in key {key!r} is not in canonical form")
    return int(text)


def expert_slot(key: str) -> ExpertSlot | None:
    """Where the expert index sits in ``key``, or ``None`` when ``key`` names no expert.

    ``TypeError`` for a key that is no str."""
    if not isinstance(key, str):
        raise TypeError(f"a state-dict key must be a str, got {key!r} ({type(key).__name__})")
    segments = key.split(".")
    for j, segment in enumerate(segments[:-1]):
        if segment == "local_experts" and _INDEX.fullmatch(segments[j + 1]):
            head = ".".join(segments[: j + 1]) + "."
            rest = segments[j + 2 :]
            return ExpertSlot(
                head, _parse_index(segments[j + 1], key), "." + ".".join(rest) if rest else ""
            )
    match = _GROUPED_TAIL.fullmatch(segments[-1])
    if match is None or "experts" not in segments[:-1]:
        return None
    head = ".".join(segments[:-1]) + "." + match.group(1)
    return ExpertSlot(head, _parse_index(match.group(2), key), match.group(3) or "")


def is_expert_key(key: str) -> bool:
    """Whether ``key`` names an expert's tensor in one of the two key styles (module docstring).

    Args:
        key: a state-dict key.

    Returns:
        ``True`` for ``...local_experts.<i>...`` and grouped GEMM's ``...experts...weight<i>`` keys.

    Raises:
        TypeError: ``key`` no str.

    Example:
        >>> is_expert_key("decoder.layers.0.mlp.experts.local_experts.3.linear_fc1.weight")
        True
        >>> is_expert_key("embedding.word_embeddings.weight")
        False
    """
    return expert_slot(key) is not None


def global_key(key: str, slot: ExpertSlot, num_experts: int, ep_rank: int, ep_size: int) -> str:
    """``key`` (expert index at ``slot``) with that index made global; errors name ``key``."""
    try:
        return slot.with_index(global_expert_index(slot.index, num_experts, ep_rank, ep_size))
    except ValueError as exc:
        raise ValueError(f"key {key!r}: {exc}") from None


def globalize_expert_keys(
    state_dict: Mapping[str, V],
    num_experts: int | None,
    ep_rank: int,
    ep_size: int,
    *,
    strict: bool = True,
) -> dict[str, V]:
    """A new dict with the expert keys of this EP rank renamed from local to global expert indices.

    Key order and values are kept; non-expert keys are unchanged.

    Args:
        state_dict: this EP rank's state dict.
        num_experts: the experts of the whole model (``None`` only without expert keys).
        ep_rank: the rank in the EP group.
        ep_size: the EP group's size.
        strict: each family of expert keys must hold every local expert ``0 .. num_experts //
            ep_size - 1`` (see the module docstring).

    Returns:
        The renamed dict.

    Raises:
        ValueError: an expert key present and ``num_experts`` ``None``; an ``ep_size`` that does not
            divide ``num_experts``; a key's local index not below ``num_experts // ep_size``; with
            ``strict``, a family of expert keys missing a local expert.
        TypeError: ``state_dict`` no mapping, or a key of it no str; ``strict`` not ``True`` or
            ``False`` (``None`` was read as false).

    Example:
        >>> local = {"local_experts.0.w": "a", "local_experts.1.w": "b", "embedding.w": "c"}
        >>> globalize_expert_keys(local, num_experts=8, ep_rank=1, ep_size=4)
        {'local_experts.2.w': 'a', 'local_experts.3.w': 'b', 'embedding.w': 'c'}
    """
    ep_rank, ep_size = check_ep(ep_rank, ep_size)
    strict = require_flag(strict, "strict")
    renamed = _rename_expert_keys(
        state_dict, num_experts, lambda key, slot, n: global_key(key, slot, n, ep_rank, ep_size)
    )
    if strict and num_experts is not None:
        num_local = _num_local(num_experts, ep_size)
        _refuse_incomplete(
            state_dict,
            range(num_local),
            f"{num_experts} experts over {ep_size} EP ranks leave {num_local} local ones per rank",
        )
    return renamed


def localize_expert_keys(
    state_dict: Mapping[str, V],
    num_experts: int | None,
    ep_rank: int,
    ep_size: int,
    *,
    foreign: Literal["raise", "skip"] = "raise",
    strict: bool = True,
) -> dict[str, V]:
    """A new dict with expert keys renamed from global to this EP rank's local indices.

    The inverse of :func:`globalize_expert_keys`.

    Args:
        state_dict: a state dict keyed by global expert indices.
        num_experts: the experts of the whole model (``None`` only without expert keys).
        ep_rank: the rank in the EP group.
        ep_size: the EP group's size.
        foreign: what a key of an expert held by another EP rank does: ``"raise"`` (default), or
            ``"skip"`` to leave it out (to pick this rank's experts out of a whole-model state
            dict).
        strict: each family of expert keys must hold exactly this rank's experts
            (``foreign="raise"``) or every expert ``0 .. num_experts - 1`` (``foreign="skip"``, a
            whole-model state dict).

    Returns:
        The renamed dict.

    Raises:
        ValueError: a key of another rank's expert with ``foreign="raise"``; ``foreign`` neither
            value; the errors of :func:`globalize_expert_keys`, with global indices checked against
            ``num_experts``.
        TypeError: as :func:`globalize_expert_keys`.

    Example:
        >>> whole = {f"local_experts.{index}.w": index for index in range(4)}
        >>> localize_expert_keys(whole, num_experts=4, ep_rank=1, ep_size=2, foreign="skip")
        {'local_experts.0.w': 2, 'local_experts.1.w': 3}
    """
    ep_rank, ep_size = check_ep(ep_rank, ep_size)
    strict = require_flag(strict, "strict")
    if foreign not in ("raise", "skip"):
        raise ValueError(f"foreign must be 'raise' or 'skip', got {foreign!r}")

    def rename_key(key: str, slot: ExpertSlot, num_experts: int) -> str | None:
        try:
            owner, local = expert_owner(slot.index, num_experts, ep_size)
        except ValueError as exc:
            raise ValueError(f"key {key!r}: {exc}") from None
        if owner != ep_rank:
            if foreign == "skip":
                return None
            raise ValueError(
                f"key {key!r} names expert {slot.index}, held by EP rank {owner}, not {ep_rank}"
            )
        return slot.with_index(local)

    renamed = _rename_expert_keys(state_dict, num_experts, rename_key)
    if strict and num_experts is not None:
        num_local = _num_local(num_experts, ep_size)
        if foreign == "skip":
            _refuse_incomplete(
                state_dict, range(num_experts), f"a whole-model state dict of {num_experts} experts"
            )
        else:
            mine = range(ep_rank * num_local, (ep_rank + 1) * num_local)
            _refuse_incomplete(
                state_dict,
                mine,
                f"EP rank {ep_rank} of {ep_size} holds experts "
                f"{_format_span(mine)} of {num_experts}",
            )
    return renamed


def _refuse_incomplete(state_dict: Mapping[str, object], expected: range, why: str) -> None:
    """``ValueError`` naming the first family of expert keys with wrong indices.

    The keys are those of ``state_dict``; the right indices are ``expected``.
    """
    families: dict[str, set[int]] = {}
    for key in state_dict:
        slot = expert_slot(key)
        if slot is not None:
            families.setdefault(f"{slot.head}<i>{slot.tail}", set()).add(slot.index)
    for family, indices in families.items():
        if indices != set(expected):
            raise ValueError(
                f"expert keys {family!r} hold experts {_format_span(sorted(indices))}, "
                f"but {why} ({_format_span(expected)}): is num_experts the model's? "
                "Pass strict=False to rename a partial state dict on purpose"
            )


def _format_span(indices: range | list[int]) -> str:
    """``4-7`` for consecutive indices, else the list."""
    listed = list(indices)
    if listed and listed == list(range(listed[0], listed[-1] + 1)):
        return str(listed[0]) if len(listed) == 1 else f"{listed[0]}-{listed[-1]}"
    return str(listed)


def _rename_expert_keys(
    state_dict: Mapping[str, V],
    num_experts: int | None,
    rename_expert: Callable[[str, ExpertSlot, int], str | None],
) -> dict[str, V]:
    """``state_dict`` with each expert key renamed by ``rename_expert(key, slot, num_experts)``.

    ``None`` leaves the entry out; the other keys are kept, in order; ``ValueError`` when two keys
    get one name; ``TypeError`` for a ``state_dict`` that is no mapping, or a key that is no str."""
    if not isinstance(state_dict, Mapping):
        raise TypeError(
            "state_dict must be a mapping of key -> value (a state dict), "
            f"got {type(state_dict).__name__}"
        )
    out: dict[str, V] = {}
    for key, value in state_dict.items():
        slot = expert_slot(key)
        if slot is None:
            new_key: str | None = key
        elif num_experts is None:
            raise ValueError(f"key {key!r} names an expert but num_experts is not given")
        else:
            new_key = rename_expert(key, slot, num_experts)
        if new_key is None:
            continue
        if new_key in out:
            raise ValueError(f"two keys map to {new_key!r} (the second is {key!r})")
        out[new_key] = value
    return out

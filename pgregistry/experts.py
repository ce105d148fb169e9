"""Expert-parallel ranks, and parameter names that do not depend on the parallel layout.

With expert parallelism (EP) each rank holds ``num_experts // ep_size`` experts and numbers them from 0, so a
rank-local name such as ``layers.3.mlp.experts.local_experts.0.linear_fc1.weight`` means a different expert on
every EP rank; saved under local names, the experts of all ranks overwrite each other (KempnerForge#202) and
cannot be reloaded at another EP size. A *global* name numbers experts over the whole model
(``ep_rank * (num_experts // ep_size) + local_index``) and layers over the whole pipeline, so it is the same on
every layout. On the standard grid (EP 1, PP 1) global names equal local ones: existing checkpoints keep loading.

Two key styles are renamed, the same way in both directions:

* sequential: ``...local_experts.<i>.<rest>``;
* grouped GEMM: ``...experts.<...>.weight<i>`` and ``bias<i>``, optionally with a ``_w``/``_v`` suffix (the two
  halves of SwiGLU), where a segment ``experts`` precedes the last one.

Every other key is left as it is. Unlike Megatron-Core's ``handle_experts_in_state_dict``: a missing or
inconsistent ``num_experts`` raises instead of dropping keys, grouped ``bias<i>`` keys are renamed too, and the
order of the keys is kept.

The EP rank and size come from a :class:`~pgregistry.collection.ProcessGroupCollection` (``get_ep_rank_and_size``)
or from the collection attached to a model (``get_model_ep_rank_and_size``). This module imports no torch at
load, so the key functions can be used on checkpoints without it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final, Literal, TypeVar

import attrs

from pgregistry.collection import ProcessGroupCollection, group_rank, group_size
from pgregistry.fallback import resolve_process_groups

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = [
    "expert_owner",
    "get_ep_rank_and_size",
    "get_global_unique_param_name",
    "get_model_ep_rank_and_size",
    "global_expert_index",
    "global_param_name_fn",
    "globalize_expert_keys",
    "is_expert_key",
    "localize_expert_keys",
    "model_collection",
    "named_global_parameters",
]

V = TypeVar("V")

_INDEX: Final = re.compile(r"[0-9]+")
_GROUPED_TAIL: Final = re.compile(r"(weight|bias)([0-9]+)(_w|_v)?")
_LAYER: Final = re.compile(r"(?:^|(?<=\.))layers\.([0-9]+)(?=\.|$)")


# --------------------------------------------------------------------------------------------------- ranks


def get_ep_rank_and_size(pg_collection: ProcessGroupCollection | None) -> tuple[int, int]:
    """``(ep_rank, ep_size)`` from the collection's ``ep`` group.

    No collection, or ``ep`` set to ``None`` (EP off), is ``(0, 1)``. An UNSET ``ep`` reads the global grid with a
    :class:`~pgregistry.fallback.ProcessGroupFallbackWarning`.
    """
    if pg_collection is None:
        return 0, 1
    return _ep_of(pg_collection, "get_ep_rank_and_size")


def get_model_ep_rank_and_size(model_or_chunks: nn.Module | Sequence[nn.Module]) -> tuple[int, int]:
    """``(ep_rank, ep_size)`` from the collection attached to the model (:func:`pgregistry.registry.attach`).

    Each model reads its own collection, so models on different grids in one process get their own EP layout. A
    model without an attached collection reads the global grid with a fallback warning.
    """
    return _ep_of(model_collection(model_or_chunks), "get_model_ep_rank_and_size")


def _ep_of(collection: ProcessGroupCollection | None, owner: str) -> tuple[int, int]:
    """Rank and size in the collection's ``ep`` group (the global grid's, with a warning, when not set)."""
    group = resolve_process_groups(collection, ("ep",), owner=owner)["ep"]
    return group_rank(group), group_size(group)


def model_collection(model_or_chunks: nn.Module | Sequence[nn.Module]) -> ProcessGroupCollection | None:
    """The collection attached to a model or its chunks (or to a module they wrap), or ``None``.

    Wrappers are looked through via their ``module`` attribute (DDP, mixed-precision wrappers). Chunks carrying
    different collections raise ``ValueError``.
    """
    from pgregistry import registry

    found: ProcessGroupCollection | None = None
    for chunk in _as_chunks(model_or_chunks):
        for module in _wrapper_chain(chunk):
            collection = registry.collection_of(module, None)
            if collection is None:
                continue
            if found is not None and collection != found:
                raise ValueError("the model chunks carry different process-group collections; attach one to all")
            found = collection
            break
    return found


# --------------------------------------------------------------------------------------------------- indices


def _num_local(num_experts: int, ep_size: int) -> int:
    if not isinstance(num_experts, int) or isinstance(num_experts, bool) or num_experts < 1:
        raise ValueError(f"num_experts must be a positive integer, got {num_experts!r}")
    if num_experts % ep_size:
        raise ValueError(f"ep_size {ep_size} does not divide num_experts {num_experts}")
    return num_experts // ep_size


def _check_ep(ep_rank: int, ep_size: int) -> None:
    for name, value in (("ep_rank", ep_rank), ("ep_size", ep_size)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise ValueError(f"{name} must be an integer, got {value!r}")
    if ep_size < 1 or not 0 <= ep_rank < ep_size:
        raise ValueError(f"ep_rank {ep_rank} is not a rank of an expert-parallel group of size {ep_size}")


def global_expert_index(local_index: int, num_experts: int, ep_rank: int, ep_size: int) -> int:
    """``ep_rank * (num_experts // ep_size) + local_index``; ``ValueError`` for an index or rank out of range or
    an ``ep_size`` that does not divide ``num_experts``."""
    _check_ep(ep_rank, ep_size)
    num_local = _num_local(num_experts, ep_size)
    if not 0 <= local_index < num_local:
        raise ValueError(
            f"local expert index {local_index} is out of range: {num_experts} experts over {ep_size} EP ranks "
            f"leave {num_local} per rank"
        )
    return ep_rank * num_local + local_index


def expert_owner(global_index: int, num_experts: int, ep_size: int) -> tuple[int, int]:
    """``(ep_rank, local_index)`` of the rank holding global expert ``global_index``."""
    num_local = _num_local(num_experts, ep_size)
    if not 0 <= global_index < num_experts:
        raise ValueError(f"global expert index {global_index} is out of range for {num_experts} experts")
    return divmod(global_index, num_local)


# --------------------------------------------------------------------------------------------------- keys


@attrs.frozen(slots=True)
class _ExpertSlot:
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


def _expert_slot(key: str) -> _ExpertSlot | None:
    """Where the expert index sits in ``key``, or ``None`` when ``key`` names no expert."""
    segments = key.split(".")
    for j, segment in enumerate(segments[:-1]):
        if segment == "local_experts" and _INDEX.fullmatch(segments[j + 1]):
            head = ".".join(segments[: j + 1]) + "."
            rest = segments[j + 2 :]
            return _ExpertSlot(head, _parse_index(segments[j + 1], key), "." + ".".join(rest) if rest else "")
    match = _GROUPED_TAIL.fullmatch(segments[-1])
    if match is None or "experts" not in segments[:-1]:
        return None
    head = ".".join(segments[:-1]) + "." + match.group(1)
    return _ExpertSlot(head, _parse_index(match.group(2), key), match.group(3) or "")


def is_expert_key(key: str) -> bool:
    """Whether ``key`` names an expert's tensor in one of the two key styles."""
    return _expert_slot(key) is not None


def _global_key(key: str, slot: _ExpertSlot, num_experts: int, ep_rank: int, ep_size: int) -> str:
    """``key`` (whose expert index is at ``slot``) with that index made global; errors name ``key``."""
    try:
        return slot.with_index(global_expert_index(slot.index, num_experts, ep_rank, ep_size))
    except ValueError as exc:
        raise ValueError(f"key {key!r}: {exc}") from None


def globalize_expert_keys(
    state_dict: Mapping[str, V], num_experts: int | None, ep_rank: int, ep_size: int
) -> dict[str, V]:
    """A new dict with the expert keys of this EP rank renamed from local to global expert indices.

    Key order and values are kept; non-expert keys are unchanged. ``ValueError`` when an expert key is present
    and ``num_experts`` is ``None``, when ``ep_size`` does not divide ``num_experts``, or when a key's local index
    is not below ``num_experts // ep_size``.
    """
    _check_ep(ep_rank, ep_size)
    return _renamed(state_dict, num_experts, lambda key, slot, n: _global_key(key, slot, n, ep_rank, ep_size))


def localize_expert_keys(
    state_dict: Mapping[str, V],
    num_experts: int | None,
    ep_rank: int,
    ep_size: int,
    *,
    foreign: Literal["raise", "skip"] = "raise",
) -> dict[str, V]:
    """A new dict with expert keys renamed from global to this EP rank's local indices (inverse of
    :func:`globalize_expert_keys`).

    A key of an expert held by another EP rank raises ``ValueError``, or is left out with ``foreign="skip"``
    (to pick this rank's experts out of a whole-model state dict). The other errors are those of
    :func:`globalize_expert_keys`, with global indices checked against ``num_experts``.
    """
    _check_ep(ep_rank, ep_size)
    if foreign not in ("raise", "skip"):
        raise ValueError(f"foreign must be 'raise' or 'skip', got {foreign!r}")

    def rename(key: str, slot: _ExpertSlot, num_experts: int) -> str | None:
        try:
            owner, local = expert_owner(slot.index, num_experts, ep_size)
        except ValueError as exc:
            raise ValueError(f"key {key!r}: {exc}") from None
        if owner != ep_rank:
            if foreign == "skip":
                return None
            raise ValueError(f"key {key!r} names expert {slot.index}, held by EP rank {owner}, not {ep_rank}")
        return slot.with_index(local)

    return _renamed(state_dict, num_experts, rename)


def _renamed(
    state_dict: Mapping[str, V],
    num_experts: int | None,
    rename_expert: Callable[[str, _ExpertSlot, int], str | None],
) -> dict[str, V]:
    """``state_dict`` with each expert key renamed by ``rename_expert(key, slot, num_experts)`` (``None`` leaves
    the entry out) and the other keys kept, in order; ``ValueError`` when two keys get one name."""
    out: dict[str, V] = {}
    for key, value in state_dict.items():
        slot = _expert_slot(key)
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


# --------------------------------------------------------------------------------------------------- names


def _as_chunks(model_or_chunks: nn.Module | Sequence[nn.Module]) -> list[nn.Module]:
    if isinstance(model_or_chunks, Sequence):
        return list(model_or_chunks)
    return [model_or_chunks]


def _wrapper_chain(module: nn.Module) -> Iterator[nn.Module]:
    """``module``, then what it wraps through ``.module`` attributes (DDP and mixed-precision wrappers)."""
    seen: set[int] = set()
    current: Any = module
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = getattr(current, "module", None)


def _chain_attribute(module: nn.Module, name: str) -> Any:
    for inner in _wrapper_chain(module):
        value = getattr(inner, name, None)
        if value is not None:
            return value
    return None


class _GlobalNamer:
    """Renames the parameter names of model chunks to global names; see :func:`named_global_parameters`."""

    def __init__(
        self,
        chunks: list[nn.Module],
        *,
        pg_collection: ProcessGroupCollection | None,
        ep_rank: int | None,
        ep_size: int | None,
        num_experts: int | None,
        layer_offsets: Sequence[int] | None,
    ) -> None:
        if (ep_rank is None) != (ep_size is None):
            raise ValueError("pass both ep_rank and ep_size, or neither (then the model's collection is read)")
        if ep_rank is not None and ep_size is not None:
            _check_ep(ep_rank, ep_size)
        if layer_offsets is not None and len(layer_offsets) != len(chunks):
            raise ValueError(f"layer_offsets has {len(layer_offsets)} entries for {len(chunks)} model chunks")
        self._chunks = chunks
        self._pg_collection = pg_collection
        self._ep = (ep_rank, ep_size) if ep_rank is not None and ep_size is not None else None
        self._num_experts = num_experts
        self._layer_offsets = layer_offsets
        self._offsets: dict[int, int] = {}

    def name(self, chunk_index: int, local_name: str) -> str:
        name = local_name
        match = _LAYER.search(name)
        if match is not None:
            layer = self._offset(chunk_index) + int(match.group(1))
            name = f"{name[: match.start(1)]}{layer}{name[match.end(1) :]}"
        slot = _expert_slot(name)
        if slot is None:
            return name
        ep_rank, ep_size = self._ep_rank_and_size()
        return _global_key(name, slot, self._experts(chunk_index, local_name), ep_rank, ep_size)

    def _ep_rank_and_size(self) -> tuple[int, int]:
        if self._ep is None:
            self._ep = _ep_of(self._collection(), "get_model_ep_rank_and_size")
        return self._ep

    def _collection(self) -> ProcessGroupCollection | None:
        """``pg_collection``, else the collection attached to the chunks (looked up only when a name needs EP or
        PP, so a model that needs neither is never asked for one)."""
        return self._pg_collection if self._pg_collection is not None else model_collection(self._chunks)

    def _experts(self, chunk_index: int, local_name: str) -> int:
        if self._num_experts is not None:
            return self._num_experts
        chunk = self._chunks[chunk_index]
        value = _chain_attribute(chunk, "num_experts")
        if value is None:
            value = getattr(_chain_attribute(chunk, "config"), "num_moe_experts", None)
        if value is None:
            raise ValueError(
                f"parameter {local_name!r} belongs to an expert but the number of experts is unknown: pass "
                "num_experts, or set num_experts (or config.num_moe_experts) on the model chunk"
            )
        return int(value)

    def _offset(self, chunk_index: int) -> int:
        if chunk_index in self._offsets:
            return self._offsets[chunk_index]
        if self._layer_offsets is not None:
            offset = self._layer_offsets[chunk_index]
        else:
            offset = _chain_attribute(self._chunks[chunk_index], "layer_offset")
        if offset is None:
            offset = self._offset_without_pipeline(chunk_index)
        if not isinstance(offset, int) or isinstance(offset, bool) or offset < 0:
            raise ValueError(f"layer offset of model chunk {chunk_index} must be a non-negative integer: {offset!r}")
        self._offsets[chunk_index] = offset
        return offset

    def _offset_without_pipeline(self, chunk_index: int) -> int:
        """0 when one chunk holds every layer (PP off); otherwise the offset is unknown and this raises."""
        if len(self._chunks) == 1:
            pp = resolve_process_groups(self._collection(), ("pp",), owner="get_global_unique_param_name")["pp"]
            if group_size(pp) == 1:
                return 0
        raise ValueError(
            f"model chunk {chunk_index} has layers but no first global layer index: with pipeline or virtual "
            "pipeline stages set chunk.layer_offset on each chunk, or pass layer_offsets"
        )


def named_global_parameters(
    model_chunks: nn.Module | Sequence[nn.Module],
    *,
    pg_collection: ProcessGroupCollection | None = None,
    ep_rank: int | None = None,
    ep_size: int | None = None,
    num_experts: int | None = None,
    layer_offsets: Sequence[int] | None = None,
) -> list[tuple[str, nn.Parameter]]:
    """``(global name, parameter)`` for every parameter of the chunks, each once, in chunk order.

    The name is the chunk's ``named_parameters()`` name with the first ``layers.<n>`` renumbered to
    ``layer_offset + n`` and expert indices made global. ``layer_offset`` is the chunk's first global layer index:
    ``layer_offsets[i]``, else a ``layer_offset`` attribute on the chunk (or a module it wraps); it may be left out
    only with one chunk and pipeline parallelism off. EP rank and size are ``ep_rank``/``ep_size`` or come from
    the ``ep`` group of ``pg_collection``, read only when a name belongs to an expert; the ``pp`` group, read only
    to tell that pipeline parallelism is off, comes from it too. ``pg_collection`` defaults to the collection
    attached to the model (:func:`model_collection`); without either the global grid is read, with a fallback
    warning.
    ``num_experts`` defaults to the chunk's ``num_experts`` or ``config.num_moe_experts``.
    """
    chunks = _as_chunks(model_chunks)
    namer = _GlobalNamer(
        chunks,
        pg_collection=pg_collection,
        ep_rank=ep_rank,
        ep_size=ep_size,
        num_experts=num_experts,
        layer_offsets=layer_offsets,
    )
    seen: set[int] = set()
    out: list[tuple[str, nn.Parameter]] = []
    for index, chunk in enumerate(chunks):
        for local_name, param in chunk.named_parameters():
            if id(param) in seen:
                continue
            seen.add(id(param))
            out.append((namer.name(index, local_name), param))
    return out


def get_global_unique_param_name(
    model_chunks: nn.Module | Sequence[nn.Module],
    param: torch.Tensor,
    *,
    pg_collection: ProcessGroupCollection | None = None,
    ep_rank: int | None = None,
    ep_size: int | None = None,
    num_experts: int | None = None,
    layer_offsets: Sequence[int] | None = None,
) -> str:
    """The global name of ``param`` (found by identity; ``ValueError`` when no chunk holds it).

    Same rules as :func:`named_global_parameters`: names are unique across pipeline stages and virtual chunks,
    experts are numbered globally, and on the standard grid the name is the ``named_parameters()`` one.
    """
    chunks = _as_chunks(model_chunks)
    namer = _GlobalNamer(
        chunks,
        pg_collection=pg_collection,
        ep_rank=ep_rank,
        ep_size=ep_size,
        num_experts=num_experts,
        layer_offsets=layer_offsets,
    )
    for index, chunk in enumerate(chunks):
        for local_name, candidate in chunk.named_parameters():
            if candidate is param:
                return namer.name(index, local_name)
    raise _not_held(param, len(chunks))


def _not_held(param: torch.Tensor, count: int) -> ValueError:
    return ValueError(f"parameter of shape {tuple(param.shape)} is not held by any of the {count} model chunks")


def global_param_name_fn(
    model_chunks: nn.Module | Sequence[nn.Module],
    *,
    pg_collection: ProcessGroupCollection | None = None,
    ep_rank: int | None = None,
    ep_size: int | None = None,
    num_experts: int | None = None,
    layer_offsets: Sequence[int] | None = None,
) -> Callable[[torch.Tensor], str]:
    """A function from parameter to global name (:func:`named_global_parameters`), with every name computed once.

    Meant for optimizers that key their state by a ``param_name_fn`` (the pgregistry optimizers do): keyed by
    global names, the state reloads under another EP or PP layout. The function raises ``ValueError`` for a
    parameter the chunks do not hold.
    """
    # Holding the parameters keeps their ids from being reused by other tensors.
    names = {
        id(param): (param, name)
        for name, param in named_global_parameters(
            model_chunks,
            pg_collection=pg_collection,
            ep_rank=ep_rank,
            ep_size=ep_size,
            num_experts=num_experts,
            layer_offsets=layer_offsets,
        )
    }
    count = len(_as_chunks(model_chunks))

    def name_of(param: torch.Tensor) -> str:
        entry = names.get(id(param))
        if entry is None or entry[0] is not param:
            raise _not_held(param, count)
        return entry[1]

    return name_of

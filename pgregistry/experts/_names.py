"""Global parameter names: alike on any layout, so checkpoints and optimizer state reload anywhere.

A global name numbers experts over the whole model (``ep_rank * (num_experts // ep_size) +
local_index``) and layers over the whole pipeline. On the standard grid (EP 1, PP 1) global names
equal ``named_parameters()`` names: existing checkpoints keep loading.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final, TypedDict

from pgregistry._runtime.integers import as_integer
from pgregistry._runtime.resolve import normalise_model, resolve_pg_collection
from pgregistry.attachments import wrapper_chain
from pgregistry.collection import GroupName, ProcessGroupCollection, group_size
from pgregistry.experts._ep import ep_rank_and_size
from pgregistry.experts._keys import expert_slot, global_key

if TYPE_CHECKING:
    import torch
    from torch import nn
    from typing_extensions import Unpack

__all__ = ["get_global_unique_param_name", "global_param_name_fn", "named_global_parameters"]

_LAYER: Final = re.compile(r"(?:^|(?<=\.))layers\.([0-9]+)(?=\.|$)")
_MTP: Final = "mtp"


class NamingOptions(TypedDict, total=False):
    """Keywords that say where a model's parameters sit globally, each optional.

    They are those of every function that names them (here and in :mod:`pgregistry.checkpoint`).

    ``pg_collection`` is the model's collection: its ``ep`` group gives the EP rank and size (read
    only when a name belongs to an expert) and its ``pp`` group tells that pipeline parallelism is
    off (read only when a chunk has no layer offset). It defaults to the collection attached to the
    model; without either the global grid is read, with a fallback warning. ``num_experts`` defaults
    to the chunk's ``num_experts`` or ``config.num_moe_experts``. ``layer_offsets`` holds each
    chunk's first global layer index; it defaults to a ``layer_offset`` attribute on each chunk (or
    a module it wraps), and may be left out altogether only with one chunk and pipeline parallelism
    off.
    """

    pg_collection: ProcessGroupCollection | None
    num_experts: int | None
    layer_offsets: Sequence[int] | None


_NAMING_FALLBACK: Final[tuple[GroupName, ...]] = ("ep", "pp")


def check_naming_options(options: Mapping[str, object], owner: str) -> None:
    """``TypeError`` naming a keyword that is not a :class:`NamingOptions` one.

    ``**options`` would otherwise swallow a misspelled or removed keyword, and name the parameters
    on the wrong layout."""
    unknown = sorted(set(options) - set(NamingOptions.__annotations__))
    if unknown:
        raise TypeError(
            f"{owner} got unexpected keyword argument(s) {unknown}; the "
            f"naming keywords are {sorted(NamingOptions.__annotations__)} "
            "(EP ranks come from pg_collection's 'ep' group)"
        )


class GlobalNamer:
    """Renames model chunks' parameter names to global names; see :func:`named_global_parameters`.

    ``collection`` gives the chunks' resolved collection; it is called at most once, and only when a
    name needs EP or PP, so a model that needs neither is never asked for one."""

    def __init__(
        self,
        chunks: Sequence[nn.Module],
        collection: Callable[[], ProcessGroupCollection],
        *,
        num_experts: int | None = None,
        layer_offsets: Sequence[int] | None = None,
    ) -> None:
        if layer_offsets is not None and (
            not isinstance(layer_offsets, Sequence) or isinstance(layer_offsets, str)
        ):
            raise TypeError(
                "layer_offsets must be a sequence of ints, one per model chunk (a list), "
                f"got {type(layer_offsets).__name__}"
            )
        if layer_offsets is not None and len(layer_offsets) != len(chunks):
            raise ValueError(
                f"layer_offsets has {len(layer_offsets)} entries for {len(chunks)} model chunks"
            )
        self._chunks = chunks
        self._resolve = collection
        self._num_experts = num_experts
        self._layer_offsets = layer_offsets
        self._offsets: dict[int, int] = {}
        # (chunk, expert key with its index left out, num_experts) -> the local indices named
        self._local_experts: dict[tuple[int, str, int], set[int]] = {}

    @classmethod
    def at_the_door(
        cls,
        model_chunks: nn.Module | Sequence[nn.Module],
        owner: str,
        **options: Unpack[NamingOptions],
    ) -> GlobalNamer:
        """A namer for an entry point given ``model_chunks`` and the naming keywords.

        The collection is resolved (explicit, else attached, else the global grid with a warning)
        when first needed."""
        check_naming_options(options, owner)
        chunks = normalise_model(model_chunks, owner).chunks
        pg_collection = options.get("pg_collection")

        def resolve_naming_collection() -> ProcessGroupCollection:
            return resolve_pg_collection(
                pg_collection, chunks, owner=owner, fallback=_NAMING_FALLBACK
            )

        return cls(
            chunks,
            resolve_naming_collection,
            num_experts=options.get("num_experts"),
            layer_offsets=options.get("layer_offsets"),
        )

    @property
    def chunks(self) -> Sequence[nn.Module]:
        """The model chunks named."""
        return self._chunks

    def name(self, chunk_index: int, local_name: str) -> str:
        name = local_name
        # Multi-token-prediction layers keep their own numbering, as in Megatron-Core (which
        # renumbers no name that contains "mtp"): the MTP block sits on the last stage whatever the
        # pipeline, so offsetting it would give one parameter a different name at PP 2 than at PP 1.
        match = None if _MTP in name else _LAYER.search(name)
        if match is not None:
            layer = self._layer_offset(chunk_index) + int(match.group(1))
            name = f"{name[: match.start(1)]}{layer}{name[match.end(1) :]}"
        slot = expert_slot(name)
        if slot is None:
            return name
        ep_rank, ep_size = self._ep_rank_and_size()
        num_experts = self._num_experts_in(chunk_index, local_name)
        family = f"{slot.head}<i>{slot.tail}"
        self._local_experts.setdefault((chunk_index, family, num_experts), set()).add(slot.index)
        return global_key(name, slot, num_experts, ep_rank, ep_size)

    def name_with_its_family(self, chunk_index: int, local_name: str) -> str:
        """:meth:`name`, and for an expert the other experts of its family in its chunk named too.

        So :meth:`check_expert_counts` sees whether they number ``num_experts`` over EP: 16 given
        for a model of 8 at EP 2 named rank 1's local expert 0 as 8, not 4, without a word."""
        name = self.name(chunk_index, local_name)
        slot = expert_slot(local_name)
        if slot is None:
            return name
        family = (slot.head, slot.tail)
        for other, _ in self._chunks[chunk_index].named_parameters():
            other_slot = expert_slot(other)
            if other_slot is not None and (other_slot.head, other_slot.tail) == family:
                self.name(chunk_index, other)
        self.check_expert_counts()
        return name

    def check_expert_counts(self) -> None:
        """``ValueError`` when a chunk holds fewer local experts than ``num_experts`` over EP.

        Over the EP size, its global indices would leave gaps (16 experts over EP 2 with 4 local
        ones per rank: experts 0-3 and 8-11, while 4-7 and 12-15 exist nowhere), and a checkpoint
        would be stored with them. More local experts than that are refused as each is named
        (:func:`~pgregistry.experts._keys.global_expert_index`)."""
        for (chunk_index, key, num_experts), indices in self._local_experts.items():
            ep_size = self._ep_rank_and_size()[1]
            if len(indices) * ep_size != num_experts:
                held = len(indices)
                raise ValueError(
                    f"num_experts is {num_experts}, but model chunk {chunk_index} "
                    f"holds {held} local experts ({key!r}) with EP size {ep_size}, "
                    f"{held * ep_size} experts in all: the global expert indices "
                    f"would leave gaps; pass num_experts={held * ep_size}, or "
                    f"build {num_experts // ep_size} local experts per rank"
                )

    def _ep_rank_and_size(self) -> tuple[int, int]:
        return ep_rank_and_size(self._collection)

    @functools.cached_property
    def _collection(self) -> ProcessGroupCollection:
        return self._resolve()

    def _num_experts_in(self, chunk_index: int, local_name: str) -> int:
        if self._num_experts is not None:
            return self._num_experts
        chunk = self._chunks[chunk_index]
        value = _chain_attribute(chunk, "num_experts")
        if value is None:
            value = getattr(_chain_attribute(chunk, "config"), "num_moe_experts", None)
        if value is None:
            raise ValueError(
                f"parameter {local_name!r} belongs to an expert but the "
                "number of experts is unknown: pass num_experts, or set "
                "num_experts (or config.num_moe_experts) on the model chunk"
            )
        return _expert_count(value, chunk_index)

    def _layer_offset(self, chunk_index: int) -> int:
        if chunk_index in self._offsets:
            return self._offsets[chunk_index]
        if self._layer_offsets is not None:
            offset = self._layer_offsets[chunk_index]
        else:
            offset = _chain_attribute(self._chunks[chunk_index], "layer_offset")
        if offset is None:
            offset = self._offset_without_pipeline(chunk_index)
        number = as_integer(offset)  # np.int64(2) (a config read with NumPy) is offset 2
        if number is None or number < 0:
            raise ValueError(
                f"layer offset of model chunk {chunk_index} "
                f"must be a non-negative integer: {offset!r}"
            )
        self._offsets[chunk_index] = number
        return number

    def _offset_without_pipeline(self, chunk_index: int) -> int:
        """0 when one chunk holds every layer (PP off); else the offset is unknown: this raises."""
        if len(self._chunks) == 1:
            if group_size(self._collection.get("pp")) == 1:
                return 0
        raise ValueError(
            f"model chunk {chunk_index} has layers but no first global "
            "layer index: with pipeline or virtual pipeline stages set "
            "chunk.layer_offset on each chunk, or pass layer_offsets"
        )


def named_global_parameters(
    model_chunks: nn.Module | Sequence[nn.Module],
    **options: Unpack[NamingOptions],
) -> list[tuple[str, nn.Parameter]]:
    """``(global name, parameter)`` for every parameter of the chunks, each once, in chunk order.

    The name is the chunk's ``named_parameters()`` name with the first ``layers.<n>`` renumbered to
    ``layer_offset + n`` (not in multi-token-prediction names, those containing ``mtp``, as in
    Megatron-Core) and expert indices made global.

    Args:
        model_chunks: the model, or its pipeline chunks.
        **options: ``pg_collection``, ``num_experts``, ``layer_offsets`` (:class:`NamingOptions`,
            which says what each defaults to). ``layer_offsets[i]`` is chunk ``i``'s first global
            layer index, else a ``layer_offset`` attribute on the chunk (or a module it wraps); it
            may be left out only with one chunk and pipeline parallelism off.

    Returns:
        The pairs, the same names on every layout.

    Raises:
        ValueError: a chunk's local experts not numbering ``num_experts`` over the EP size (global
            indices with gaps, or past ``num_experts``), naming both numbers; two parameters with
            one global name (chunks given the same layer offset), naming both.

    Example:
        On every rank of a 2-rank world (as :func:`pgregistry.testing.run_world` starts it), EP
        over both ranks, each holding two of a layer's four experts (named as Megatron-Core's
        ``local_experts``):

        >>> import torch
        >>> from torch import nn
        >>> from pgregistry import ParallelLayout, build
        >>> pg = build(ParallelLayout(num_ranks=2, ep=2))
        >>> def chunk():  # one layer of four experts, two of them here
        ...     experts = nn.ModuleList([nn.Linear(2, 2, bias=False) for _ in range(2)])
        ...     layers = nn.ModuleList([nn.ModuleDict({"local_experts": experts})])
        ...     model = nn.ModuleDict({"layers": layers})
        ...     model.num_experts = 4  # else Megatron-Core's config.num_moe_experts, or an option
        ...     return model
        >>> chunks = [chunk(), chunk()]  # two pipeline chunks, the second from layer 12
        >>> named = named_global_parameters(chunks, pg_collection=pg, layer_offsets=[0, 12])
        >>> every_rank = [None, None]
        >>> torch.distributed.all_gather_object(every_rank, [name for name, _ in named])
        >>> for name in every_rank[0]:
        ...     print(name)
        layers.0.local_experts.0.weight
        layers.0.local_experts.1.weight
        layers.12.local_experts.0.weight
        layers.12.local_experts.1.weight
        >>> for name in every_rank[1]:  # EP rank 1's local experts 0, 1: the layer's 2, 3
        ...     print(name)
        layers.0.local_experts.2.weight
        layers.0.local_experts.3.weight
        layers.12.local_experts.2.weight
        layers.12.local_experts.3.weight
    """
    return global_names(GlobalNamer.at_the_door(model_chunks, "named_global_parameters", **options))


def global_names(namer: GlobalNamer) -> list[tuple[str, nn.Parameter]]:
    """``(global name, parameter)`` per parameter of ``namer``'s chunks, once, in chunk order.

    ``ValueError`` when two parameters get one global name (chunks given the same layer offset):
    a checkpoint or an optimizer's state keyed by it would hold one of them under both."""
    seen: set[int] = set()
    holders: dict[str, tuple[int, str]] = {}
    out: list[tuple[str, nn.Parameter]] = []
    for index, chunk in enumerate(namer.chunks):
        for local_name, param in chunk.named_parameters():
            if id(param) in seen:
                continue
            seen.add(id(param))
            name = namer.name(index, local_name)
            if name in holders:
                raise _one_name_twice(name, holders[name], (index, local_name))
            holders[name] = (index, local_name)
            out.append((name, param))
    namer.check_expert_counts()
    return out


def _one_name_twice(name: str, first: tuple[int, str], second: tuple[int, str]) -> ValueError:
    return ValueError(
        f"parameters {first[1]!r} of model chunk {first[0]} and {second[1]!r} of model chunk "
        f"{second[0]} both have the global name {name!r}: is each chunk's layer offset its "
        "first global layer (layer_offsets, or chunk.layer_offset)? A checkpoint or optimizer "
        "state keyed by it would hold one of them under both"
    )


def get_global_unique_param_name(
    model_chunks: nn.Module | Sequence[nn.Module],
    param: torch.Tensor,
    **options: Unpack[NamingOptions],
) -> str:
    """The global name of ``param``, found by identity.

    Same rules as :func:`named_global_parameters`: names are unique across pipeline stages and
    virtual chunks, experts are numbered globally, and on the standard grid the name is the
    ``named_parameters()`` one.

    Args:
        model_chunks: the model, or its pipeline chunks.
        param: a parameter one of the chunks holds.
        **options: ``pg_collection``, ``num_experts``, ``layer_offsets`` (:class:`NamingOptions`).

    Returns:
        Its global name.

    Raises:
        ValueError: no chunk holds ``param``; an expert's ``num_experts`` that its chunk's local
            experts (of ``param``'s family) do not number over the EP size, as
            :func:`named_global_parameters` refuses it (naming ``param`` alone answered a wrong
            expert index).

    Example:
        >>> import torch
        >>> def chunk():  # two of a model's four layers: one of its two pipeline chunks
        ...     layers = torch.nn.ModuleList([torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)])
        ...     return torch.nn.ModuleDict({"layers": layers})
        >>> first, second = chunk(), chunk()
        >>> weight = second.layers[0].weight
        >>> get_global_unique_param_name([first, second], weight, layer_offsets=[0, 2])
        'layers.2.weight'
    """
    namer = GlobalNamer.at_the_door(model_chunks, "get_global_unique_param_name", **options)
    for index, chunk in enumerate(namer.chunks):
        for local_name, candidate in chunk.named_parameters():
            if candidate is param:
                return namer.name_with_its_family(index, local_name)
    raise _not_held(param, len(namer.chunks))


def _chain_attribute(module: nn.Module, name: str) -> Any:
    """The first non-None ``name`` attribute of ``module`` or a module it wraps, else None.

    Wrappers such as DDP and FSDP are followed.
    """
    for inner in wrapper_chain(module):
        value = getattr(inner, name, None)
        if value is not None:
            return value
    return None


def _expert_count(value: object, chunk_index: int) -> int:
    """A chunk's own expert count as an int; ``ValueError`` unless a positive integer.

    ``int()`` would truncate 8.5 to 8 without a word, and read ``True`` as one expert."""
    count = as_integer(value)
    if count is None or count < 1:
        raise ValueError(
            f"num_experts of model chunk {chunk_index} must be a positive integer, got {value!r} "
            "(its num_experts or config.num_moe_experts): set it, or pass num_experts"
        )
    return count


def _not_held(param: object, count: int) -> Exception:
    """Why ``param`` has no name: no chunk holds it (``ValueError``), or it is no tensor."""
    import torch

    if not isinstance(param, torch.Tensor):
        return TypeError(
            f"param must be a parameter of the model chunks, got {type(param).__name__}"
        )
    return ValueError(
        f"parameter of shape {tuple(param.shape)} is not held by any of the {count} model chunks"
    )


def global_param_name_fn(
    model_chunks: nn.Module | Sequence[nn.Module],
    **options: Unpack[NamingOptions],
) -> Callable[[torch.Tensor], str]:
    """A function from parameter to global name (:func:`named_global_parameters`), cached.

    Meant for optimizers that key their state by a ``param_name_fn`` (the pgregistry optimizers do):
    keyed by global names, the state reloads under another EP or PP layout.

    Args:
        model_chunks: the model, or its pipeline chunks.
        **options: ``pg_collection``, ``num_experts``, ``layer_offsets`` (:class:`NamingOptions`).

    Returns:
        The function; it raises ``ValueError`` for a parameter the chunks do not hold.

    Raises:
        ValueError: as :func:`named_global_parameters`.

    Example:
        On every rank of a 2-rank world (as :func:`pgregistry.testing.run_world` starts it), EP
        over both ranks, each holding two of a layer's four experts (named as Megatron-Core's
        ``local_experts``):

        >>> import torch
        >>> from torch import nn
        >>> from pgregistry import ParallelLayout, build
        >>> pg = build(ParallelLayout(num_ranks=2, ep=2))
        >>> def chunk():  # one layer of four experts, two of them here
        ...     experts = nn.ModuleList([nn.Linear(2, 2, bias=False) for _ in range(2)])
        ...     layers = nn.ModuleList([nn.ModuleDict({"local_experts": experts})])
        ...     model = nn.ModuleDict({"layers": layers})
        ...     model.num_experts = 4  # else Megatron-Core's config.num_moe_experts, or an option
        ...     return model
        >>> from pgregistry import attach, build_optimizer
        >>> from pgregistry.params import mark_expert
        >>> model = chunk()
        >>> for param in model.parameters():
        ...     _ = mark_expert(param)
        >>> attach(model, pg)
        >>> optimizer = build_optimizer(model, pg, param_name_fn=global_param_name_fn(model))
        >>> every_rank = [None, None]
        >>> name = global_param_name_fn(model)(model.layers[0].local_experts[1].weight)
        >>> torch.distributed.all_gather_object(every_rank, name)
        >>> every_rank
        ['layers.0.local_experts.1.weight', 'layers.0.local_experts.3.weight']
    """
    namer = GlobalNamer.at_the_door(model_chunks, "global_param_name_fn", **options)
    # Holding the parameters keeps their ids from being reused by other tensors.
    names = {id(param): (param, name) for name, param in global_names(namer)}
    count = len(namer.chunks)

    def name_of(param: torch.Tensor) -> str:
        entry = names.get(id(param))
        if entry is None or entry[0] is not param:
            raise _not_held(param, count)
        return entry[1]

    return name_of

"""Checkpoints keyed by global parameter names, so they reload under another expert- or pipeline-parallel layout.

Every parameter and its optimizer state are stored under the parameter's global name
(:func:`pgregistry.experts.named_global_parameters`): experts numbered over the whole model, layers over the
whole pipeline. A checkpoint written with EP 4 and PP 2 therefore reloads with EP 2, EP 1 or PP 1: each rank
asks for the names it holds now. Megatron-Core's optimizer state, keyed by rank-local parameter order, does not.

Each tensor is written exactly once: a dense parameter by data-parallel (``dp_cp``) rank 0 of its replicas, an
expert parameter by expert-data-parallel (``expt_dp``) rank 0. Tensors are stored whole, so tensor-parallel and
GTP-remat sharding must be off (``tp``, ``expt_tp``, ``gtp_remat``, ``expt_gtp_remat`` of size 1); resharding
tensor-parallel shards is not done here.

Two storage back-ends share the same keys (``model/<name>`` and ``optimizer/<name>/<state key>``):

* :func:`save_rank_files` / :func:`load_rank_files`: one ``torch.save`` file per rank in a directory; the loader
  memory-maps every file and takes the tensors it needs;
* :func:`save_distributed` / :func:`load_distributed`: ``torch.distributed.checkpoint``.

Optimizer hyper-parameters (learning rate, betas, ...) are not stored: they come from the optimizer loaded into.

A sharded (distributed) optimizer stores pieces of flattened parameters instead; keyed by global names (give it
:func:`pgregistry.experts.global_param_name_fn`), its pieces from every rank of one layout are joined by
:func:`merge_optimizer_shards` and cut for another layout by :func:`cut_optimizer_shards`.
:func:`save_optimizer_shards` / :func:`load_optimizer_shards` do both through per-rank files
(``optimizer-rank-<rank>.pt``, beside the parameters' ``rank-<rank>.pt``), so its state reloads under another EP
or data-parallel size.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Final

import attrs
import torch
import torch.distributed as dist
from torch import nn

from pgregistry.collection import ProcessGroupCollection, group_rank, group_size
from pgregistry.experts import is_expert_key, model_collection, named_global_parameters
from pgregistry.fallback import resolve_process_groups
from pgregistry.optim.chained import ChainedOptimizer
from pgregistry.optim.sharded import ShardedOptimizer

__all__ = [
    "cut_optimizer_shards",
    "load_distributed",
    "load_optimizer_state_by_name",
    "load_optimizer_shards",
    "load_rank_files",
    "merge_optimizer_shards",
    "save_distributed",
    "save_optimizer_shards",
    "save_rank_files",
    "state_by_name",
]

_MODEL: Final = "model/"
_OPTIMIZER: Final = "optimizer/"
_FORMAT: Final = 1
_PARAMS_FILE: Final = "rank-"
_OPTIMIZER_FILE: Final = "optimizer-rank-"
_SHARDED_AXES: Final = ("tp", "expt_tp", "gtp_remat", "expt_gtp_remat")


@attrs.frozen(slots=True)
class _Model:
    """One rank's view: its parameters by global name, and which of them it writes."""

    params: dict[str, nn.Parameter]
    writes_dense: bool
    writes_experts: bool

    def writes(self, name: str) -> bool:
        return self.writes_experts if is_expert_key(name) else self.writes_dense


def _model(
    model_chunks: nn.Module | Sequence[nn.Module],
    pg_collection: ProcessGroupCollection | None,
    num_experts: int | None,
    layer_offsets: Sequence[int] | None,
    owner: str,
) -> _Model:
    collection = pg_collection if pg_collection is not None else model_collection(model_chunks)
    groups = resolve_process_groups(collection, ("ep", "dp_cp", "expt_dp", *_SHARDED_AXES), owner=owner)
    sharded = [name for name in _SHARDED_AXES if group_size(groups[name]) > 1]
    if sharded:
        raise ValueError(
            f"{owner} stores whole tensors, but the model's {', '.join(sharded)} axis has more than one rank; "
            "tensor-parallel and GTP-remat shards are not resharded by pgregistry.checkpoint"
        )
    named = named_global_parameters(
        model_chunks,
        pg_collection=collection,
        ep_rank=group_rank(groups["ep"]),
        ep_size=group_size(groups["ep"]),
        num_experts=num_experts,
        layer_offsets=layer_offsets,
    )
    params: dict[str, nn.Parameter] = {}
    for name, param in named:
        if name in params:
            raise ValueError(f"two parameters of the model have the global name {name!r}")
        params[name] = param
    return _Model(params, group_rank(groups["dp_cp"]) == 0, group_rank(groups["expt_dp"]) == 0)


def _optimizer_names(optimizer: torch.optim.Optimizer, model: _Model) -> list[tuple[str, nn.Parameter]]:
    by_id = {id(param): name for name, param in model.params.items()}
    out: list[tuple[str, nn.Parameter]] = []
    for group in optimizer.param_groups:
        for param in group["params"]:
            if id(param) not in by_id:
                raise ValueError(f"the optimizer holds a parameter of shape {tuple(param.shape)} not in the model")
            out.append((by_id[id(param)], param))
    return out


def _flat_state(model: _Model, optimizer: torch.optim.Optimizer | None, *, primary_only: bool) -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for name, param in model.params.items():
        if not primary_only or model.writes(name):
            flat[_MODEL + name] = param.detach()
    if optimizer is not None:
        for name, param in _optimizer_names(optimizer, model):
            if primary_only and not model.writes(name):
                continue
            for key, value in optimizer.state.get(param, {}).items():
                flat[f"{_OPTIMIZER}{name}/{key}"] = value.detach() if isinstance(value, torch.Tensor) else value
    return flat


def _split_optimizer_key(key: str) -> tuple[str, str]:
    """``(parameter name, state key)`` of a flat ``optimizer/<name>/<state key>`` key."""
    name, state_key = key[len(_OPTIMIZER) :].rsplit("/", 1)
    return name, state_key


def _nested(flat: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """``{"model": {name: tensor}, "optimizer": {name: {state key: value}}}`` from flat checkpoint keys."""
    out: dict[str, dict[str, Any]] = {"model": {}, "optimizer": {}}
    for key, value in flat.items():
        if key.startswith(_MODEL):
            out["model"][key[len(_MODEL) :]] = value
        elif key.startswith(_OPTIMIZER):
            name, state_key = _split_optimizer_key(key)
            out["optimizer"].setdefault(name, {})[state_key] = value
    return out


def state_by_name(
    model_chunks: nn.Module | Sequence[nn.Module],
    optimizer: torch.optim.Optimizer | None = None,
    *,
    pg_collection: ProcessGroupCollection | None = None,
    num_experts: int | None = None,
    layer_offsets: Sequence[int] | None = None,
    primary_only: bool = False,
) -> dict[str, dict[str, Any]]:
    """This rank's parameters and optimizer state by global name: ``{"model": {name: tensor},
    "optimizer": {name: {state key: value}}}`` (tensors alias the live ones).

    ``primary_only`` keeps only what this rank writes (one replica of each tensor). ``pg_collection`` defaults to
    the collection attached to the model; ``num_experts`` and ``layer_offsets`` are as in
    :func:`pgregistry.experts.named_global_parameters`.
    """
    model = _model(model_chunks, pg_collection, num_experts, layer_offsets, "state_by_name")
    return _nested(_flat_state(model, optimizer, primary_only=primary_only))


def _apply(model: _Model, optimizer: torch.optim.Optimizer | None, lookup: Mapping[str, Any]) -> None:
    """Copy every parameter (all required) and optimizer state (where present) from flat ``lookup``."""
    nested = _nested(lookup)
    missing = [name for name in model.params if name not in nested["model"]]
    if missing:
        shown = ", ".join(repr(n) for n in missing[:5])
        raise ValueError(f"the checkpoint lacks {len(missing)} of this rank's parameters, e.g. {shown}")
    with torch.no_grad():
        for name, param in model.params.items():
            source = nested["model"][name]
            if tuple(source.shape) != tuple(param.shape):
                raise ValueError(
                    f"parameter {name!r} has shape {tuple(param.shape)} but the checkpoint holds "
                    f"{tuple(source.shape)}"
                )
            param.copy_(source)
    if optimizer is not None:
        _load_optimizer(optimizer, model, nested["optimizer"])


def load_optimizer_state_by_name(
    optimizer: torch.optim.Optimizer,
    model_chunks: nn.Module | Sequence[nn.Module],
    state: Mapping[str, Mapping[str, Any]],
    *,
    pg_collection: ProcessGroupCollection | None = None,
    num_experts: int | None = None,
    layer_offsets: Sequence[int] | None = None,
) -> None:
    """Load optimizer ``state`` keyed by global name (``{name: {state key: value}}``, as in the ``"optimizer"``
    part of :func:`state_by_name`, saved under any layout) into ``optimizer``.

    Parameters without an entry get an empty state (as before their first step). The values are copied and go
    through ``optimizer.load_state_dict``, which casts floating state to each parameter's dtype and device.
    """
    model = _model(model_chunks, pg_collection, num_experts, layer_offsets, "load_optimizer_state_by_name")
    _load_optimizer(optimizer, model, state)


def _load_optimizer(
    optimizer: torch.optim.Optimizer, model: _Model, state: Mapping[str, Mapping[str, Any]]
) -> None:
    current = optimizer.state_dict()
    # state_dict() numbers the parameters in param_groups order, the order _optimizer_names walks them in.
    ids = [pid for group in current["param_groups"] for pid in group["params"]]
    named = _optimizer_names(optimizer, model)
    current["state"] = {
        pid: {key: _copy(value) for key, value in state[name].items()}
        for pid, (name, _) in zip(ids, named, strict=True)
        if state.get(name)
    }
    optimizer.load_state_dict(current)


# --------------------------------------------------------------------------------------------------- rank files


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def save_rank_files(
    directory: str | Path,
    model_chunks: nn.Module | Sequence[nn.Module],
    optimizer: torch.optim.Optimizer | None = None,
    *,
    pg_collection: ProcessGroupCollection | None = None,
    num_experts: int | None = None,
    layer_offsets: Sequence[int] | None = None,
) -> Path:
    """Write this rank's share (each tensor once over all ranks) to ``directory/rank-<rank>.pt``.

    Every rank must call it, with a fresh directory per checkpoint: :func:`load_rank_files` refuses a directory
    whose files come from different saves. Returns the file written.
    """
    model = _model(model_chunks, pg_collection, num_experts, layer_offsets, "save_rank_files")
    return _write_rank_file(directory, _PARAMS_FILE, _flat_state(model, optimizer, primary_only=True))


def _write_rank_file(directory: str | Path, prefix: str, content: Any) -> Path:
    """``torch.save`` this rank's ``content`` to ``directory/<prefix><rank>.pt``, stamped with the save's world."""
    rank, world_size = _world()
    path = Path(directory) / f"{prefix}{rank:05d}.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"format": _FORMAT, "rank": rank, "world_size": world_size, "state": content}, path)
    return path


def _read_rank_contents(directory: Path, prefix: str) -> list[tuple[Path, Any]]:
    """``(file, content)`` of every ``<prefix><rank>.pt`` file in ``directory``, in rank order (memory-mapped).

    ``ValueError`` unless the files are those of every rank of one save, in this format.
    """
    pattern = re.compile(re.escape(prefix) + r"[0-9]{5}\.pt")
    files = sorted(p for p in directory.iterdir() if pattern.fullmatch(p.name))
    if not files:
        raise ValueError(f"no {prefix}<rank>.pt files in {directory}")
    payloads = [torch.load(p, map_location="cpu", weights_only=True, mmap=True) for p in files]
    world_sizes = {payload["world_size"] for payload in payloads}
    ranks = sorted(payload["rank"] for payload in payloads)
    if len(world_sizes) != 1 or ranks != list(range(next(iter(world_sizes)))):
        raise ValueError(
            f"{directory} does not hold exactly one checkpoint: {prefix}<rank>.pt files of ranks {ranks} from "
            f"saves with world sizes {sorted(world_sizes)}"
        )
    for path, payload in zip(files, payloads, strict=True):
        if payload["format"] != _FORMAT:
            raise ValueError(f"{path} has format {payload['format']!r}; this pgregistry reads format {_FORMAT}")
    return [(path, payload["state"]) for path, payload in zip(files, payloads, strict=True)]


def _read_rank_files(directory: Path) -> dict[str, Any]:
    merged: dict[str, Any] = {}
    for path, state in _read_rank_contents(directory, _PARAMS_FILE):
        for key, value in state.items():
            if key in merged:
                raise ValueError(f"{key!r} is stored more than once in {directory} (again in {path.name})")
            merged[key] = value
    return merged


def load_rank_files(
    directory: str | Path,
    model_chunks: nn.Module | Sequence[nn.Module],
    optimizer: torch.optim.Optimizer | None = None,
    *,
    pg_collection: ProcessGroupCollection | None = None,
    num_experts: int | None = None,
    layer_offsets: Sequence[int] | None = None,
) -> None:
    """Load this rank's parameters (and optimizer state) from :func:`save_rank_files` files of any layout.

    ``ValueError`` when a parameter is missing, a key is stored twice or the files mix checkpoints.
    """
    model = _model(model_chunks, pg_collection, num_experts, layer_offsets, "load_rank_files")
    _apply(model, optimizer, _read_rank_files(Path(directory)))


# --------------------------------------------------------------------------------------------------- DCP


def save_distributed(
    directory: str | Path,
    model_chunks: nn.Module | Sequence[nn.Module],
    optimizer: torch.optim.Optimizer | None = None,
    *,
    pg_collection: ProcessGroupCollection | None = None,
    num_experts: int | None = None,
    layer_offsets: Sequence[int] | None = None,
) -> None:
    """Save with ``torch.distributed.checkpoint`` (collective over the default group); each tensor once."""
    import torch.distributed.checkpoint as dcp

    model = _model(model_chunks, pg_collection, num_experts, layer_offsets, "save_distributed")
    dcp.save(_flat_state(model, optimizer, primary_only=True), checkpoint_id=str(directory))


def load_distributed(
    directory: str | Path,
    model_chunks: nn.Module | Sequence[nn.Module],
    optimizer: torch.optim.Optimizer | None = None,
    *,
    pg_collection: ProcessGroupCollection | None = None,
    num_experts: int | None = None,
    layer_offsets: Sequence[int] | None = None,
) -> None:
    """Load a :func:`save_distributed` checkpoint of any layout (collective over the default group)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    model = _model(model_chunks, pg_collection, num_experts, layer_offsets, "load_distributed")
    metadata = dcp.FileSystemReader(str(directory)).read_metadata().state_dict_metadata
    destination: dict[str, Any] = {}
    for name, param in model.params.items():
        if _MODEL + name in metadata:
            destination[_MODEL + name] = torch.empty_like(param.detach())
    if optimizer is not None:
        wanted = {name for name, _ in _optimizer_names(optimizer, model)}
        for key, entry in metadata.items():
            if key.startswith(_OPTIMIZER) and _split_optimizer_key(key)[0] in wanted:
                if isinstance(entry, TensorStorageMetadata):
                    destination[key] = torch.empty(entry.size, dtype=entry.properties.dtype)
                else:
                    destination[key] = None  # a non-tensor value: DCP replaces the placeholder
    dcp.load(destination, checkpoint_id=str(directory))
    _apply(model, optimizer, destination)


# --------------------------------------------------------------------------------------------------- optimizer shards


def merge_optimizer_shards(shards: Iterable[Mapping[str, Mapping[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Whole flat per-parameter state from the pieces a sharded optimizer saved on every rank of one layout.

    Each item of ``shards`` is one rank's ``name -> {"offset", "numel", "main", "state"}`` (the ``"shards"`` part
    of a sharded optimizer's state dict, as pgregistry's ``ShardedOptimizer`` writes it): the piece
    ``[offset, offset + numel)`` of the flattened parameter ``name``, its main copy and its optimizer state. A
    state tensor of shape ``(numel,)`` is a piece of an elementwise state (Adam's moments); any other value (Adam's
    0-d ``step``) belongs to the whole parameter and must be equal in every piece.

    Returns ``name -> {"main": flat tensor, "state": {key: flat tensor or value}}``. ``ValueError`` when the
    pieces of a parameter overlap, leave a gap, or disagree on their state keys or per-parameter values.
    """
    pieces: dict[str, list[Mapping[str, Any]]] = {}
    for rank_shards in shards:
        for name, piece in rank_shards.items():
            pieces.setdefault(name, []).append(piece)
    return {name: _merge_pieces(name, sorted(found, key=lambda p: p["offset"])) for name, found in pieces.items()}


def _elementwise(value: Any, numel: int) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() == numel


def _merge_pieces(name: str, pieces: list[Mapping[str, Any]]) -> dict[str, Any]:
    end = 0
    for piece in pieces:
        if piece["offset"] != end:
            problem = "overlap" if piece["offset"] < end else "leave a gap"
            raise ValueError(f"the saved pieces of {name!r} {problem} at element {min(end, piece['offset'])}")
        end += piece["numel"]
    keys = {tuple(sorted(piece["state"])) for piece in pieces}
    if len(keys) > 1:
        raise ValueError(f"the saved pieces of {name!r} hold different optimizer state keys: {sorted(keys)}")
    state: dict[str, Any] = {}
    for key in next(iter(keys)):
        values = [piece["state"][key] for piece in pieces]
        if all(_elementwise(v, piece["numel"]) for v, piece in zip(values, pieces, strict=True)):
            state[key] = torch.cat([v.reshape(-1) for v in values])
            continue
        first = values[0]
        if not all(_same_value(first, v) for v in values[1:]):
            raise ValueError(f"the saved pieces of {name!r} disagree on the per-parameter state {key!r}")
        state[key] = first
    return {"main": torch.cat([piece["main"].reshape(-1) for piece in pieces]), "state": state}


def _same_value(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a, b))
    return bool(a == b)


def cut_optimizer_shards(
    whole: Mapping[str, Mapping[str, Any]], template: Mapping[str, Mapping[str, Any]]
) -> dict[str, dict[str, Any]]:
    """This rank's pieces, cut from :func:`merge_optimizer_shards` output, for the layout of ``template``.

    ``template`` is the ``"shards"`` part of the state dict of the optimizer to load into (it says which pieces
    this rank holds now); the result replaces it before ``optimizer.load_state_dict``. Tensors are copies.
    ``ValueError`` when a piece's parameter is missing or too short.
    """
    out: dict[str, dict[str, Any]] = {}
    for name, piece in template.items():
        if name not in whole:
            raise ValueError(f"the saved optimizer state lacks parameter {name!r}")
        start, numel = piece["offset"], piece["numel"]
        source = whole[name]
        total = source["main"].numel()
        if start + numel > total:
            raise ValueError(
                f"{name!r}: this rank's piece [{start}, {start + numel}) exceeds the saved {total} elements"
            )
        out[name] = {
            "offset": start,
            "numel": numel,
            "main": _cut(source["main"], start, numel),
            "state": {
                key: _cut(value, start, numel) if _elementwise(value, total) else _copy(value)
                for key, value in source["state"].items()
            },
        }
    return out


def _cut(tensor: torch.Tensor, start: int, numel: int) -> torch.Tensor:
    return tensor[start : start + numel].clone()


def _copy(value: Any) -> Any:
    return value.clone() if isinstance(value, torch.Tensor) else value


def _sharded_children(optimizer: ChainedOptimizer | ShardedOptimizer, owner: str) -> list[ShardedOptimizer]:
    children = optimizer.chained_optimizers if isinstance(optimizer, ChainedOptimizer) else [optimizer]
    sharded: list[ShardedOptimizer] = []
    for index, child in enumerate(children):
        if not isinstance(child, ShardedOptimizer):
            raise ValueError(
                f"{owner} handles sharded optimizers (build_optimizer(..., sharded=True)); child {index} is a "
                f"{type(child).__name__}, whose state_dict() is keyed by parameter name already"
            )
        sharded.append(child)
    return sharded


def save_optimizer_shards(directory: str | Path, optimizer: ChainedOptimizer | ShardedOptimizer) -> Path:
    """Write this rank's pieces of a sharded optimizer to ``directory/optimizer-rank-<rank>.pt``.

    The pieces are the ``"shards"`` of every child's state dict, keyed by the names the optimizer was built with:
    give it :func:`pgregistry.experts.global_param_name_fn` names and :func:`load_optimizer_shards` reloads them
    under another EP, PP or data-parallel size. Every rank must call it, with a fresh directory per checkpoint
    (it may be the one :func:`save_rank_files` writes the parameters to). Hyper-parameters are not stored. The
    pieces must be whole-tensor pieces held by one rank each, so TP and GTP-remat must be off, as for the other
    savers here; the loader refuses overlapping pieces. Returns the file written.
    """
    shards: dict[str, Any] = {}
    for child in _sharded_children(optimizer, "save_optimizer_shards"):
        for name, piece in child.state_dict()["shards"].items():
            if name in shards:
                raise ValueError(f"two parameters of the optimizer are named {name!r}; give it unique names")
            shards[name] = piece
    return _write_rank_file(directory, _OPTIMIZER_FILE, shards)


def load_optimizer_shards(directory: str | Path, optimizer: ChainedOptimizer | ShardedOptimizer) -> None:
    """Load :func:`save_optimizer_shards` files written under any layout into a sharded optimizer.

    Each child's pieces are joined from every saved rank by name (:func:`merge_optimizer_shards`, which refuses
    gaps, overlaps and disagreeing per-parameter state) and cut for the shards this rank holds now
    (:func:`cut_optimizer_shards`); main copies and optimizer state are restored, and the parameters get the
    main copies. Collective over each child's shard group: every rank must call it. Only the saved pieces of
    parameters this rank holds are read (the files are memory-mapped), but each is joined whole, so a rank holds
    the whole state of those parameters for a moment. Hyper-parameters stay those of ``optimizer``.
    ``ValueError`` when a parameter of the optimizer is not in the checkpoint or the files mix checkpoints.
    """
    saved = [shards for _, shards in _read_rank_contents(Path(directory), _OPTIMIZER_FILE)]
    for child in _sharded_children(optimizer, "load_optimizer_shards"):
        current = child.state_dict()
        template = current["shards"]
        whole = merge_optimizer_shards(
            {name: piece for name, piece in shards.items() if name in template} for shards in saved
        )
        pieces = cut_optimizer_shards(whole, template)
        child.load_state_dict({"param_groups": current["param_groups"], "shards": pieces})

"""One ``torch.save`` file per rank in a directory; the loader memory-maps every file and takes what it needs.

Files are ``<prefix><rank>.pt`` (``rank-`` for parameters, ``optimizer-rank-`` for sharded optimizer state),
each stamped with the format and the world of its save, so a directory mixing two saves is refused. What a user
saved is never lost or half-written:

* a save into a directory already holding ``<prefix><rank>.pt`` files is refused on every rank before any rank
  writes, so an earlier checkpoint is never overwritten file by file;
* each file is written under a temporary name, flushed to disk and renamed, so a crash leaves no truncated file
  under a checkpoint's name;
* a file that cannot be read (truncated, corrupt, not a checkpoint) is named in the error;
* loading is strict: a parameter of the checkpoint that no rank's model holds (an 8-expert checkpoint loaded
  into a 4-expert model, an unrelated extra key) is an error naming it, as is one the model lacks.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import torch
import torch.distributed as dist
from torch import nn

from pgregistry.checkpoint.by_name import (
    Optimizer,
    RankModel,
    apply_flat_state,
    flat_state,
    param_name_of_key,
    rank_model,
    shape_mismatches,
)
from pgregistry.experts.names import NamingOptions
from pgregistry.grad_stats import backend_device

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["load_rank_files", "save_rank_files"]

_FORMAT: Final = 1

_PARAMS_FILE: Final = "rank-"


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def max_over_ranks(values: list[int]) -> list[int]:
    """The element-wise maximum of ``values`` over every rank (``values`` itself outside a distributed world).

    Every rank must call it with as many values; the checks built on it therefore raise on every rank alike.
    """
    if _world()[1] == 1:
        return values
    tensor = torch.tensor(values, dtype=torch.int64, device=backend_device(None))
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return [int(v) for v in tensor.tolist()]


def save_rank_files(
    directory: str | Path,
    model_chunks: nn.Module | Sequence[nn.Module],
    optimizer: Optimizer | None = None,
    **naming: Unpack[NamingOptions],
) -> Path:
    """Write this rank's share (each tensor once over all ranks) to ``directory/rank-<rank>.pt``.

    Collective: every rank must call it, with a fresh directory per checkpoint. A directory that already holds
    ``rank-<rank>.pt`` files is refused (``ValueError`` on every rank, nothing written): remove the old checkpoint
    first or save elsewhere. Returns the file written.
    """
    model = rank_model(model_chunks, "save_rank_files", **naming)
    return write_rank_file(directory, _PARAMS_FILE, flat_state(model, optimizer, primary_only=True))


def write_rank_file(directory: str | Path, prefix: str, content: Any) -> Path:
    """``torch.save`` this rank's ``content`` to ``directory/<prefix><rank>.pt``, stamped with the save's world.

    Collective: refuses an existing checkpoint first (:func:`_refuse_existing`) and returns once every rank's file
    is in place; each file appears under its name only once completely on disk, and when any rank fails to write,
    every rank removes its file and raises.
    """
    rank, world_size = _world()
    directory = Path(directory)
    _refuse_existing(directory, prefix)
    path = directory / f"{prefix}{rank:05d}.pt"
    try:
        _write_atomically(path, {"format": _FORMAT, "rank": rank, "world_size": world_size, "state": content})
        error = None
    except Exception as exc:  # noqa: BLE001 - reported to every rank below, then re-raised here
        error = exc
    if max_over_ranks([int(error is not None)])[0]:  # also the barrier: every file is in place on return
        path.unlink(missing_ok=True)  # a save that failed anywhere leaves none of its files
        if error is not None:
            raise error
        raise RuntimeError(f"another rank failed to write its file of the checkpoint in {directory} (see its error)")
    return path


def _write_atomically(path: Path, payload: dict[str, Any]) -> None:
    """``torch.save`` to a temporary name beside ``path``, flush it to disk, rename it to ``path``."""
    partial = path.with_name(f".{path.name}.partial-{os.getpid()}")
    try:
        with open(partial, "wb") as file:
            torch.save(payload, file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
    _fsync_directory(path.parent)


def _refuse_existing(directory: Path, prefix: str) -> None:
    """Make ``directory``; ``ValueError`` on every rank when any rank sees ``<prefix><rank>.pt`` files in it.

    Every rank looks before any rank writes (the look is followed by one all-reduce), so ranks of the save
    itself are never mistaken for an old checkpoint. A rank that cannot make or list the directory raises its
    ``OSError``, and every other rank ``RuntimeError``, after that all-reduce (none waits in it for ever).
    """
    try:
        directory.mkdir(parents=True, exist_ok=True)
        found, error = _rank_file_paths(directory, prefix), None
    except OSError as exc:
        found, error = [], exc
    existing, failed = max_over_ranks([len(found), int(error is not None)])
    if error is not None:
        raise error
    if failed:
        raise RuntimeError(f"another rank could not make or list the checkpoint directory {directory} (see its error)")
    if existing == 0:
        return
    seen = f"e.g. {', '.join(p.name for p in found[:3])}" if found else "seen by another rank"
    raise ValueError(
        f"{directory} already holds a checkpoint ({prefix}<rank>.pt files, {seen}); pgregistry does not "
        "overwrite one: save to a new directory, or remove the old checkpoint first"
    )


def _fsync_directory(directory: Path) -> None:
    """Make the renames in ``directory`` durable (where the platform lets a directory be opened)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _rank_file_paths(directory: Path, prefix: str) -> list[Path]:
    pattern = re.compile(re.escape(prefix) + r"[0-9]{5}\.pt")
    return sorted(p for p in directory.iterdir() if pattern.fullmatch(p.name))


def _load_payload(path: Path) -> dict[str, Any]:
    """The payload of one rank file (memory-mapped); ``ValueError`` naming the file when it cannot be read."""
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:  # noqa: BLE001 - torch raises many types for a damaged file; all name it now
        raise ValueError(
            f"cannot read checkpoint file {path} (truncated, corrupt or not a pgregistry rank file): "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    if not isinstance(payload, dict) or not {"format", "rank", "world_size", "state"} <= payload.keys():
        raise ValueError(f"{path} is not a pgregistry rank file (no format/rank/world_size/state record)")
    return payload


def read_rank_contents(directory: Path, prefix: str) -> list[tuple[Path, Any]]:
    """``(file, content)`` of every ``<prefix><rank>.pt`` file in ``directory``, in rank order (memory-mapped).

    ``ValueError`` unless ``directory`` exists and its files are those of every rank of one save, in this format.
    """
    if not directory.is_dir():
        raise ValueError(f"no checkpoint directory {directory}")
    files = _rank_file_paths(directory, prefix)
    if not files:
        raise ValueError(f"no {prefix}<rank>.pt files in {directory}")
    payloads = [_load_payload(p) for p in files]
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
    for path, state in read_rank_contents(directory, _PARAMS_FILE):
        for key, value in state.items():
            if key in merged:
                raise ValueError(f"{key!r} is stored more than once in {directory} (again in {path.name})")
            merged[key] = value
    return merged


def load_rank_files(
    directory: str | Path,
    model_chunks: nn.Module | Sequence[nn.Module],
    optimizer: Optimizer | None = None,
    *,
    strict: bool = True,
    **naming: Unpack[NamingOptions],
) -> None:
    """Load this rank's parameters (and optimizer state) from :func:`save_rank_files` files of any layout.

    Collective in a distributed world: every rank must call it, on the same directory. ``ValueError`` on every
    rank, before anything is copied, when a parameter of a rank's model is missing from the checkpoint, or (with
    ``strict``, the default) when the checkpoint holds a parameter no rank's model holds or a key that is no
    parameter: loading experts 0-7 into a model of 4 experts, or a checkpoint of another model, is never a partial
    success. ``strict=False`` loads a subset on purpose, ignoring those keys. Also ``ValueError`` when a key is
    stored twice, the files mix checkpoints, or a file cannot be read (the file is named).
    """
    model = rank_model(model_chunks, "load_rank_files", **naming)
    stored = _read_on_every_rank(Path(directory))
    _check_keys_over_ranks(Path(directory), stored, model, strict)
    apply_flat_state(model, optimizer, stored)


def _read_on_every_rank(directory: Path) -> dict[str, Any]:
    """:func:`_read_rank_files`, raising on every rank when any rank cannot read the checkpoint or reads another
    one than its peers (one all-reduce of a failure flag and a digest of the keys read), so that no rank waits in
    a later collective for a rank that has already raised."""
    try:
        stored, error = _read_rank_files(directory), None
    except (ValueError, OSError) as exc:  # OSError: a directory this rank may not list
        stored, error = {}, exc
    digest = int(hashlib.sha256("\n".join(sorted(stored)).encode()).hexdigest()[:15], 16)
    failed, largest, negated_smallest = max_over_ranks([int(error is not None), digest, -digest])
    if error is not None:
        raise error
    if failed:
        raise ValueError(f"another rank could not read the checkpoint {directory} (see its error)")
    if largest != -negated_smallest:
        raise ValueError(f"ranks read different checkpoints: every rank must load the same directory ({directory})")
    return stored


def _check_keys_over_ranks(directory: Path, stored: dict[str, Any], model: RankModel, strict: bool) -> None:
    """Raise on every rank unless each rank's parameters are all stored in their shapes and (``strict``) each
    stored parameter is held by some rank: one all-reduce of a flag per stored key (every rank read the same keys,
    checked by :func:`_read_on_every_rank`) and of whether a rank misses parameters or holds one of another shape."""
    held = set(model.params)
    keys = sorted(stored)
    names = [param_name_of_key(key) for key in keys]
    missing = sorted(held - {name for name in names if name is not None})
    mismatched = shape_mismatches(model, stored)
    *union, lacking, misfit = max_over_ranks([*(int(name in held) for name in names), len(missing), len(mismatched)])
    if lacking:
        if missing:
            shown = ", ".join(repr(n) for n in missing[:5])
            raise ValueError(f"the checkpoint lacks {len(missing)} of this rank's parameters, e.g. {shown}")
        raise ValueError(f"the checkpoint {directory} lacks parameters of another rank's model (see its error)")
    if misfit:
        if mismatched:
            raise ValueError(mismatched[0])
        raise ValueError(f"the checkpoint {directory} does not fit another rank's model (see its error)")
    unexpected = [key for key, used in zip(keys, union, strict=False) if not used]
    if strict and unexpected:
        shown = ", ".join(repr(k) for k in unexpected[:5])
        raise ValueError(
            f"the checkpoint {directory} holds {len(unexpected)} keys no rank's model has, e.g. {shown} (another "
            "model, or more experts than this model's?); pass strict=False to load a subset on purpose"
        )

"""One ``torch.save`` file per rank in a directory; the loader memory-maps every file and takes what it needs.

Files are ``<prefix><rank>.pt`` (``rank-`` for parameters, ``optimizer-rank-`` for sharded optimizer state),
each stamped with the format and the world of its save, so a directory mixing two saves is refused.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

import torch
import torch.distributed as dist
from torch import nn

from pgregistry.checkpoint.by_name import Optimizer, _apply, _flat_state, _model
from pgregistry.collection import ProcessGroupCollection

__all__ = ["load_rank_files", "save_rank_files"]

_FORMAT: Final = 1

_PARAMS_FILE: Final = "rank-"


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def save_rank_files(
    directory: str | Path,
    model_chunks: nn.Module | Sequence[nn.Module],
    optimizer: Optimizer | None = None,
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
    optimizer: Optimizer | None = None,
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

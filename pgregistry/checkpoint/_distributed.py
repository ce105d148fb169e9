"""Checkpoints by global name through ``torch.distributed.checkpoint`` (DCP), collective over the default group."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from pgregistry.checkpoint._by_name import (
    MODEL_PREFIX,
    OPTIMIZER_PREFIX,
    Optimizer,
    agreed_rank_model,
    apply_flat_state,
    flat_state,
    split_optimizer_key,
)
from pgregistry.experts._names import NamingOptions

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["load_distributed", "save_distributed"]


def save_distributed(
    directory: str | Path,
    model_chunks: nn.Module | Sequence[nn.Module],
    optimizer: Optimizer | None = None,
    **naming: Unpack[NamingOptions],
) -> None:
    """Save with ``torch.distributed.checkpoint`` (collective over the default group); each tensor once."""
    import torch.distributed.checkpoint as dcp

    model = agreed_rank_model(model_chunks, "save_distributed", naming)
    dcp.save(flat_state(model, optimizer, primary_only=True), checkpoint_id=str(directory))


def load_distributed(
    directory: str | Path,
    model_chunks: nn.Module | Sequence[nn.Module],
    optimizer: Optimizer | None = None,
    **naming: Unpack[NamingOptions],
) -> None:
    """Load a :func:`save_distributed` checkpoint of any layout (collective over the default group)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    model = agreed_rank_model(model_chunks, "load_distributed", naming)
    metadata = dcp.FileSystemReader(str(directory)).read_metadata().state_dict_metadata
    destination: dict[str, Any] = {}
    for name, param in model.params.items():
        if MODEL_PREFIX + name in metadata:
            destination[MODEL_PREFIX + name] = torch.empty_like(param.detach())
    if optimizer is not None:
        wanted = set(model.params)
        for key, entry in metadata.items():
            if key.startswith(OPTIMIZER_PREFIX) and split_optimizer_key(key)[0] in wanted:
                if isinstance(entry, TensorStorageMetadata):
                    destination[key] = torch.empty(entry.size, dtype=entry.properties.dtype)
                else:
                    destination[key] = None  # a non-tensor value: DCP replaces the placeholder
    dcp.load(destination, checkpoint_id=str(directory))
    apply_flat_state(model, optimizer, destination)

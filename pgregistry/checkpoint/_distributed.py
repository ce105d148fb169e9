"""Checkpoints by global name through ``torch.distributed.checkpoint`` (DCP), collective over the
ranks of the model's collection: the default group, or the span of a module's layout (whose
checkpoint then records the module's name and span under :data:`IDENTITY_KEY`, and loads into that
module on those ranks only)."""

from __future__ import annotations

import json
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from pgregistry.checkpoint._agreement import (
    Scope,
    name_lost_ranks,
    refuse_another_scope,
    run_agreed_step,
)
from pgregistry.checkpoint._by_name import (
    MODEL_PREFIX,
    OPTIMIZER_PREFIX,
    Optimizer,
    agree_on_rank_model,
    checkpoint_scope,
    flat_state,
    param_name_of_key,
    prepare_flat_state_load,
)
from pgregistry.checkpoint._directory import checkpoint_path, refuse_an_existing_dcp_checkpoint
from pgregistry.checkpoint._strict import Stored, check_strict, refuse_misfits
from pgregistry.experts._names import NamingOptions

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["IDENTITY_KEY", "load_distributed", "save_distributed"]

IDENTITY_KEY = "pgregistry/module"
"""Where a module's DCP checkpoint records the module's name and span.

A checkpoint of the world records none.
"""


def save_distributed(
    directory: str | Path,
    model_chunks: nn.Module | Sequence[nn.Module],
    optimizer: Optimizer | None = None,
    **naming: Unpack[NamingOptions],
) -> None:
    """Save with ``torch.distributed.checkpoint``: each tensor once, TP-sharded ones whole.

    Collective over the ranks of the model's collection: the world, or a module's span.

    Args:
        directory: a fresh directory for this checkpoint (made if missing).
        model_chunks: the model, or its pipeline chunks.
        optimizer: its optimizer, whose state is saved too (default: parameters only).
        **naming: ``pg_collection``, ``num_experts``, ``layer_offsets``
            (:class:`~pgregistry.experts._names.NamingOptions`).

    Raises:
        TypeError: ``directory`` no path.
        ValueError: an empty ``directory``; on every rank, nothing written: a model
            :func:`state_by_name` refuses, a ``directory`` that already holds a checkpoint (save to
            a new directory, or remove the old checkpoint first) or is no directory.
        RuntimeError: a rank lost, stuck or killed in one of the call's collectives: the call, the
            directory and the ranks that did not answer named.

    Example::

        save_distributed("ckpt/dcp-100", model, optimizer)
    """
    import torch.distributed.checkpoint as dcp

    directory = checkpoint_path(directory, "save_distributed")
    scope = checkpoint_scope(model_chunks, naming)
    with name_lost_ranks("save_distributed", directory, scope):
        model = agree_on_rank_model(model_chunks, "save_distributed", naming, scope)
        # Every rank looks before any rank writes: the look is followed by one all-reduce.
        run_agreed_step(
            lambda: refuse_an_existing_dcp_checkpoint(directory),
            ValueError(f"another rank refused the checkpoint directory {directory}"),
            scope,
        )
        state = run_agreed_step(
            lambda: flat_state(model, optimizer, "save_distributed", primary_only=True),
            ValueError("save_distributed: another rank's state cannot be checkpointed"),
            scope,
        )
        if scope.span is not None:
            state[IDENTITY_KEY] = json.dumps(
                scope.identity()
            )  # a string: DCP would flatten a dict into its items
        dcp.save(state, checkpoint_id=str(directory), process_group=_dcp_group(scope))


def load_distributed(
    directory: str | Path,
    model_chunks: nn.Module | Sequence[nn.Module],
    optimizer: Optimizer | None = None,
    *,
    strict: bool = True,
    **naming: Unpack[NamingOptions],
) -> None:
    """Load a :func:`save_distributed` checkpoint of any layout.

    Collective over the ranks of the model's collection; a checkpoint of another module, or of other
    ranks, is refused on every rank. Strict as :func:`~pgregistry.checkpoint.load_rank_files` is,
    from DCP's metadata before any tensor is read (:mod:`~pgregistry.checkpoint._strict`).

    Args:
        directory: the directory :func:`save_distributed` wrote.
        model_chunks: the model, or its pipeline chunks, on any layout.
        optimizer: its optimizer, whose state is loaded too (default: parameters only).
        strict: refuse dtypes that differ and stored keys no rank's model has (default); ``False``
            loads a subset on purpose.
        **naming: ``pg_collection``, ``num_experts``, ``layer_offsets``
            (:class:`~pgregistry.experts._names.NamingOptions`).

    Raises:
        ValueError: on every rank: a parameter the checkpoint lacks or stores in another shape, or
            (``strict``) in another dtype; stored keys no rank's model has (a checkpoint of more
            layers or experts); ``optimizer`` given, optimizer state missing or of parameters it
            does not update; a directory a rank cannot read.
        RuntimeError: a rank lost, stuck or killed in one of the call's collectives: the call, the
            directory and the ranks that did not answer named.

    Example::

        load_distributed("ckpt/dcp-100", model, optimizer)
    """
    import torch.distributed.checkpoint as dcp

    directory = checkpoint_path(directory, "load_distributed")
    check_strict(strict, "load_distributed")
    scope = checkpoint_scope(model_chunks, naming)
    with name_lost_ranks("load_distributed", directory, scope):
        model = agree_on_rank_model(model_chunks, "load_distributed", naming, scope)
        metadata = run_agreed_step(
            lambda: _read_metadata(directory),
            ValueError(f"another rank could not read the checkpoint {directory}"),
            scope,
        )
        if IDENTITY_KEY in metadata or scope.span is not None:
            _check_identity(directory, scope, metadata)
        stored = {
            key: _describe_entry(entry) for key, entry in metadata.items() if key != IDENTITY_KEY
        }
        refuse_misfits(f"the checkpoint {directory}", stored, model, optimizer, strict, scope)
        # The optimizer's state only with an optimizer; ``optimized/`` markers serve the strict
        # check alone.
        read = (MODEL_PREFIX,) if optimizer is None else (MODEL_PREFIX, OPTIMIZER_PREFIX)
        destination: dict[str, Any] = {}
        for key, entry in stored.items():
            if param_name_of_key(key) not in model.params or not key.startswith(read):
                continue
            # In the stored dtype: the copy into the parameter casts (strict=False) after DCP has
            # read it.
            destination[key] = (
                None if entry.shape is None else torch.empty(entry.shape, dtype=entry.dtype)
            )
        dcp.load(destination, checkpoint_id=str(directory), process_group=_dcp_group(scope))
        prepare_flat_state_load(
            model, optimizer, destination, scope, f"load_distributed of {directory}"
        )()


def _describe_entry(entry: Any) -> Stored:
    """What DCP's metadata says of one entry: a tensor's shape and dtype, or that it is none."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    if isinstance(entry, TensorStorageMetadata):
        return Stored(tuple(entry.size), entry.properties.dtype)
    return Stored()


def _read_metadata(directory: str | Path) -> Any:
    """The entries of the DCP checkpoint in ``directory`` by key.

    ``ValueError`` naming the directory when it holds none.
    """
    import torch.distributed.checkpoint as dcp

    try:
        return dcp.FileSystemReader(str(directory)).read_metadata().state_dict_metadata
    except Exception as exc:  # noqa: BLE001
        # A missing directory, a missing or damaged .metadata: all name it now.
        raise ValueError(
            f"cannot read the checkpoint {directory} (no such directory, or no "
            f"torch.distributed.checkpoint metadata in it): {type(exc).__name__}: {exc}"
        ) from exc


def _dcp_group(scope: Scope) -> Any:
    """The process group DCP runs over: the module's span, else ``None`` (DCP's default group)."""
    return scope.group if scope.span is not None else None


def _check_identity(directory: str | Path, scope: Scope, metadata: Any) -> None:
    """``ValueError`` on every rank of ``scope`` unless the checkpoint records the loader.

    That is, the module and span loading it.
    """
    import torch.distributed.checkpoint as dcp

    def check_saved_identity() -> None:
        saved: dict[str, Any] = {}
        if IDENTITY_KEY in metadata:
            holder: dict[str, Any] = {IDENTITY_KEY: ""}
            with warnings.catch_warnings():  # no_dist: this rank reads the record alone, on purpose
                warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
                dcp.load(holder, checkpoint_id=str(directory), no_dist=True)
            saved = json.loads(holder[IDENTITY_KEY])
        refuse_another_scope(directory, saved, scope)

    run_agreed_step(
        check_saved_identity, ValueError(f"another rank refused the checkpoint {directory}"), scope
    )

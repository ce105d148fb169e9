"""One ``torch.save`` file per rank in a directory.

The loader memory-maps every file and takes what it needs.

Files are ``<prefix><rank>.pt`` (``rank-`` for parameters, ``optimizer-rank-`` for sharded optimizer
state), each stamped with the format, the world of its save and the save's id (drawn by rank 0, the
same in every file of one save), and holding the CRC-32 of each of its tensors. What a user saved is
never lost, half-written or mixed:

* a save into a directory already holding ``<prefix><rank>.pt`` files is refused on every rank
  before any rank writes, so an earlier checkpoint is never overwritten file by file;
* each file is written under a temporary name and flushed to disk, and the files are renamed into
  place only once every rank's is complete (:mod:`~pgregistry.checkpoint._disk`): a save that fails
  or is killed half-way leaves no file under a checkpoint's name, and a failed write names the file
  and its disk;
* a file that cannot be read (truncated, corrupt, not a checkpoint), files of two different saves,
  and a tensor whose bytes no longer match their checksum are errors naming the files (and the
  tensor);
* loading is strict: a parameter of the checkpoint that no rank's model holds (an 8-expert
  checkpoint loaded into a 4-expert model, an unrelated extra key) is an error naming it, as is one
  the model lacks.

Every check raises on every rank alike (:mod:`~pgregistry.checkpoint._agreement`): no rank is left
waiting. The ranks are those of the model's collection: the world, or the span of one module of a
job (its files are numbered from 0 over the span and record the module's name and span; loading
refuses another module's or span's).
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import attrs
import torch
from torch import nn

from pgregistry.checkpoint._agreement import (
    Scope,
    max_over_ranks,
    name_lost_ranks,
    raise_on_every_rank,
    refuse_another_scope,
    run_agreed_step,
)
from pgregistry.checkpoint._by_name import (
    MODEL_PREFIX,
    Optimizer,
    RankModel,
    agree_on_rank_model,
    checkpoint_scope,
    flat_state,
    param_name_of_key,
    prepare_flat_state_load,
)
from pgregistry.checkpoint._directory import (
    checkpoint_path,
    kind_of_non_directory,
    refuse_a_file,
)
from pgregistry.checkpoint._disk import partial_path, rename_durably, write_partial
from pgregistry.checkpoint._integrity import checksums_of, find_damaged_tensors
from pgregistry.checkpoint._strict import Stored, check_strict, refuse_misfits
from pgregistry.experts._names import NamingOptions

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["load_rank_files", "prepare_rank_files_load", "save_rank_files"]

_FORMAT: Final = 2
"""Format 2 added the save id and the per-tensor checksums."""

_PARAMS_FILE: Final = "rank-"

_RECORD: Final = frozenset({"format", "rank", "world_size", "state"})

_RECORD_SINCE_2: Final = frozenset({"save_id", "checksums"})


@attrs.frozen(slots=True)
class RankFile:
    """One rank file as read: its path, the state it holds, and the checksums stored with it."""

    path: Path
    state: Any
    checksums: Any

    def verify(self, key: str) -> None:
        """``ValueError`` naming this file and a tensor of ``state[key]`` that fails its checksum.

        Only the tensors read are checked, so a memory-mapped file is never read whole."""
        damaged = find_damaged_tensors(self.state[key], self.checksums.get(key), key)
        if damaged:
            more = f" (and {len(damaged) - 1} more under {key!r})" if len(damaged) > 1 else ""
            raise ValueError(
                f"{self.path} is damaged: the bytes of tensor {damaged[0]!r}{more} do not "
                "match the checksum stored when it was saved; restore the file from a copy"
            )


def save_rank_files(
    directory: str | Path,
    model_chunks: nn.Module | Sequence[nn.Module],
    optimizer: Optimizer | None = None,
    **naming: Unpack[NamingOptions],
) -> Path:
    """Write this rank's share (each tensor once over all ranks) to ``directory/rank-<rank>.pt``.

    Collective over the ranks of the model's collection (the world, or the span of a module's
    layout, whose files are numbered from 0 and record the module's name and span): every rank of
    them must call it, with a fresh directory per checkpoint. TP-sharded parameters are stored whole
    (gathered over their TP group). Each rank's file is renamed into place only once every rank's is
    complete on disk.

    Args:
        directory: a fresh directory for this checkpoint (made if missing).
        model_chunks: the model, or its pipeline chunks.
        optimizer: its optimizer, whose state is saved too (default: parameters only).
        **naming: ``pg_collection``, ``num_experts``, ``layer_offsets``
            (:class:`~pgregistry.experts._names.NamingOptions`).

    Returns:
        The path of the file this rank wrote.

    Raises:
        TypeError: ``directory`` no path.
        ValueError: an empty ``directory``; on every rank, nothing written: ``directory`` already
            holds ``rank-<rank>.pt`` files (remove the old checkpoint first or save elsewhere), a
            model :func:`state_by_name` refuses, or a rank failing to write (its error names the
            file and the disk; every rank removes its file).
        OSError: ``directory`` no directory (a regular file: ``NotADirectoryError`` naming it) or
            one this rank cannot make; every other rank ``RuntimeError``.
        RuntimeError: a rank lost, stuck or killed in one of the call's collectives: the call, the
            directory and the ranks that did not answer named.

    Example::

        save_rank_files("ckpt/step-100", model, optimizer)
        load_rank_files("ckpt/step-100", model_on_another_layout, its_optimizer)
    """
    directory = checkpoint_path(directory, "save_rank_files")
    scope = checkpoint_scope(model_chunks, naming)
    with name_lost_ranks("save_rank_files", directory, scope):
        model = agree_on_rank_model(model_chunks, "save_rank_files", naming, scope)
        content = run_agreed_step(
            lambda: flat_state(model, optimizer, "save_rank_files", primary_only=True),
            ValueError("save_rank_files: another rank's state cannot be checkpointed"),
            scope,
        )
        return write_rank_file(directory, _PARAMS_FILE, content, scope)


def write_rank_file(directory: str | Path, prefix: str, content: Any, scope: Scope) -> Path:
    """``torch.save`` this rank's ``content`` to ``directory/<prefix><rank>.pt``, stamped.

    Stamped with the save's world (the ranks of ``scope``, and the module's name and span for a
    module's) and id, and holding the checksum of each of its tensors.

    Collective over ``scope``: refuses an existing checkpoint first (:func:`_refuse_existing`); each
    rank's file is renamed into place only once every rank's is complete on disk, and the call
    returns once every rank's file is in place. When any rank fails to write (its error names the
    file and the disk), every rank removes its file and raises.
    """
    rank, world_size = scope.rank, scope.size
    directory = Path(directory)
    _refuse_existing(directory, prefix, scope)
    stamp = {
        "format": _FORMAT,
        "save_id": _new_save_id(scope),
        "rank": rank,
        "world_size": world_size,
        **scope.identity(),
    }
    path = directory / f"{prefix}{rank:05d}.pt"
    failed = RuntimeError(f"another rank failed to write its file of the checkpoint in {directory}")
    try:
        # The checksums inside the agreed step too: a tensor that cannot be read fails every rank,
        # not one.
        partial = run_agreed_step(
            lambda: write_partial(
                path, {**stamp, "state": content, "checksums": checksums_of(content)}
            ),
            failed,
            scope,
        )
        # also the barrier: every file is in place on return
        run_agreed_step(lambda: rename_durably(partial, path), failed, scope)
    except BaseException:
        # Whatever stopped the save here (another rank's failure, a lost peer), it leaves none of
        # its files.
        partial_path(path).unlink(missing_ok=True)
        path.unlink(missing_ok=True)
        raise
    return path


def _new_save_id(scope: Scope) -> int:
    """A random id of this save, drawn by rank 0 and the same on every rank (one all-reduce).

    Every rank file of the save carries it: a directory mixing files of two saves is then refused
    instead of loaded."""
    drawn = secrets.randbits(62) + 1 if scope.rank == 0 else 0
    return max_over_ranks([drawn], scope)[0]


def _refuse_existing(directory: Path, prefix: str, scope: Scope) -> None:
    """Make ``directory``.

    ``ValueError`` on every rank when any rank sees ``<prefix><rank>.pt`` files in it.

    Every rank looks before any rank writes (the look is followed by one all-reduce), so ranks of
    the save itself are never mistaken for an old checkpoint. A rank that cannot make or list the
    directory raises its ``OSError``, and every other rank ``RuntimeError``, after that all-reduce
    (none waits in it for ever).
    """
    try:
        refuse_a_file(directory)
        directory.mkdir(parents=True, exist_ok=True)
        found, error = _rank_file_paths(directory, prefix), None
    except OSError as exc:
        found, error = [], exc
    raise_on_every_rank(
        error,
        RuntimeError(f"another rank could not make or list the checkpoint directory {directory}"),
        scope,
    )
    (existing,) = max_over_ranks([len(found)], scope)
    if existing == 0:
        return
    seen = f"e.g. {', '.join(p.name for p in found[:3])}" if found else "seen by another rank"
    raise ValueError(
        f"{directory} already holds a checkpoint ({prefix}<rank>.pt files, {seen}); pgregistry "
        "does not overwrite one: save to a new directory, or remove the old checkpoint first"
    )


def _rank_file_paths(directory: Path, prefix: str) -> list[Path]:
    pattern = re.compile(re.escape(prefix) + r"[0-9]{5}\.pt")
    return sorted(p for p in directory.iterdir() if pattern.fullmatch(p.name))


def _load_payload(path: Path) -> dict[str, Any]:
    """The payload of one rank file (memory-mapped).

    ``ValueError`` naming the file when it cannot be read or is not a rank file of this format."""
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:  # noqa: BLE001
        # Torch raises many types for a damaged file; all name it now.
        raise ValueError(
            f"cannot read checkpoint file {path} (truncated, corrupt or "
            f"not a pgregistry rank file): {type(exc).__name__}: {exc}"
        ) from exc
    if not isinstance(payload, dict) or not _RECORD <= payload.keys():
        raise ValueError(
            f"{path} is not a pgregistry rank file (no format/rank/world_size/state record)"
        )
    if payload["format"] != _FORMAT:
        raise ValueError(
            f"{path} has format {payload['format']!r}; this pgregistry reads "
            f"format {_FORMAT} (format 1 files, without checksums or save ids, "
            "load with the pgregistry that wrote them: load and save them again)"
        )
    if not _RECORD_SINCE_2 <= payload.keys():
        raise ValueError(
            f"{path} is not a pgregistry rank file of "
            f"format {_FORMAT} (no save_id/checksums record)"
        )
    return payload


def read_rank_contents(directory: Path, prefix: str, scope: Scope) -> list[RankFile]:
    """Every ``<prefix><rank>.pt`` file in ``directory``, in rank order (memory-mapped).

    Checksums not yet checked: :meth:`RankFile.verify` checks what is read.

    ``ValueError`` unless ``directory`` exists and its files are those of every rank of one save, in
    this format, and saved by the ranks this load runs over (``scope``): a module's checkpoint loads
    into that module on that span only, and a checkpoint of the whole world only over the whole
    world.
    """
    if not directory.is_dir():
        kind = kind_of_non_directory(directory)
        raise ValueError(
            f"no checkpoint directory {directory}"
            + (f" (it is {kind}, not a directory)" if kind is not None else "")
        )
    paths = _rank_file_paths(directory, prefix)
    if not paths:
        raise ValueError(f"no {prefix}<rank>.pt files in {directory}")
    payloads = [_load_payload(path) for path in paths]
    _refuse_a_mix(directory, paths, payloads)
    _refuse_another_scope(directory, payloads[0], scope)
    world_sizes = {payload["world_size"] for payload in payloads}
    ranks = sorted(payload["rank"] for payload in payloads)
    if len(world_sizes) != 1 or ranks != list(range(next(iter(world_sizes)))):
        raise ValueError(
            f"{directory} does not hold exactly one checkpoint: {prefix}<rank>.pt "
            f"files of ranks {ranks} from saves with world sizes {sorted(world_sizes)}"
        )
    return [
        RankFile(path, payload["state"], payload["checksums"])
        for path, payload in zip(paths, payloads, strict=True)
    ]


def _refuse_a_mix(directory: Path, paths: list[Path], payloads: list[dict[str, Any]]) -> None:
    """``ValueError`` naming the files of each save when the files come from more than one save.

    Such as a rank file copied from another checkpoint, or two saves of one world into one
    directory."""
    by_save: dict[int, list[str]] = {}
    for path, payload in zip(paths, payloads, strict=True):
        by_save.setdefault(payload["save_id"], []).append(path.name)
    if len(by_save) > 1:
        saves = "; ".join(
            f"save {save_id:#x}: {', '.join(names)}" for save_id, names in by_save.items()
        )
        raise ValueError(
            f"{directory} mixes the files of {len(by_save)} different "
            f"saves ({saves}): a rank file copied from another checkpoint? "
            "Every rank file of a checkpoint must come from one save"
        )


def _refuse_another_scope(directory: Path, payload: dict[str, Any], scope: Scope) -> None:
    """``ValueError`` naming both when the checkpoint was saved by another module or span.

    Another module, or over another span, than the one loading it (all the files of one save record
    the same)."""
    refuse_another_scope(
        directory,
        {key: payload[key] for key in ("module", "span") if key in payload},
        scope,
        world=f"the whole world ({payload['world_size']} ranks)",
    )


def _read_rank_files(directory: Path, scope: Scope) -> dict[str, RankFile]:
    """The rank file holding each stored key."""
    holder: dict[str, RankFile] = {}
    for rank_file in read_rank_contents(directory, _PARAMS_FILE, scope):
        for key in rank_file.state:
            if key in holder:
                raise ValueError(
                    f"{key!r} is stored more than once in "
                    f"{directory} (again in {rank_file.path.name})"
                )
            holder[key] = rank_file
    return holder


def load_rank_files(
    directory: str | Path,
    model_chunks: nn.Module | Sequence[nn.Module],
    optimizer: Optimizer | None = None,
    *,
    strict: bool = True,
    **naming: Unpack[NamingOptions],
) -> None:
    """Load this rank's parameters (and optimizer state) from :func:`save_rank_files` files.

    Collective over the ranks of the model's collection (the world, or a module's span): every rank
    of them must call it, on the same directory; a checkpoint saved by another module, or over other
    ranks, is refused. Every check runs on every rank before anything is copied: loading experts 0-7
    into a model of 4 experts, or a checkpoint of another model, is never a partial success
    (:mod:`~pgregistry.checkpoint._strict`).

    Args:
        directory: the directory :func:`save_rank_files` wrote.
        model_chunks: the model, or its pipeline chunks, on any layout.
        optimizer: its optimizer, whose state is loaded too (default: parameters only).
        strict: refuse dtypes that differ and keys the model or the optimizer has no use for
            (default); ``False`` loads a subset on purpose, ignoring those keys, casting dtypes and
            keeping the fresh state of an optimizer the checkpoint has none for.
        **naming: ``pg_collection``, ``num_experts``, ``layer_offsets``
            (:class:`~pgregistry.experts._names.NamingOptions`).

    Raises:
        TypeError: ``directory`` no path, ``strict`` no bool.
        ValueError: an empty ``directory``; on every rank, before anything is copied: a parameter
            of a rank's model missing
            from the checkpoint or stored in another shape, or (``strict``) in another dtype; a
            parameter no rank's model holds or a key that is no parameter (``strict``);
            ``optimizer`` given, no optimizer state for a parameter it updates (saved without an
            optimizer) or state for one it does not update (``strict``); a key stored twice; files
            that mix checkpoints or saves; a file that cannot be read (named); a tensor that does
            not match its checksum (the file and the tensor named).
        RuntimeError: a rank lost, stuck or killed in one of the call's collectives: the call, the
            directory and the ranks that did not answer named.

    Example::

        load_rank_files("ckpt/step-100", model, optimizer)
    """
    prepare_rank_files_load(directory, model_chunks, optimizer, strict=strict, **naming)()


def prepare_rank_files_load(
    directory: str | Path,
    model_chunks: nn.Module | Sequence[nn.Module],
    optimizer: Optimizer | None,
    *,
    strict: bool,
    **naming: Unpack[NamingOptions],
) -> Callable[[], None]:
    """Every check of :func:`load_rank_files`, and the copy left once they all passed, uncalled.

    The checks are collective, raising on every rank alike. A job loading several modules checks
    them all before it copies into any (:func:`pgregistry.modules.load_checkpoint`)."""
    directory = checkpoint_path(directory, "load_rank_files")
    check_strict(strict, "load_rank_files")
    scope = checkpoint_scope(model_chunks, naming)
    with name_lost_ranks("load_rank_files", directory, scope):
        model = agree_on_rank_model(model_chunks, "load_rank_files", naming, scope)
        holders = _read_on_every_rank(directory, scope)
        stored = {key: rank_file.state[key] for key, rank_file in holders.items()}
        described = {key: Stored.of(value) for key, value in stored.items()}
        refuse_misfits(f"the checkpoint {directory}", described, model, optimizer, strict, scope)
        run_agreed_step(
            lambda: _verify_loaded(holders, model, optimizer is not None),
            ValueError(f"another rank found a damaged tensor in the checkpoint {directory}"),
            scope,
        )
        apply = prepare_flat_state_load(
            model, optimizer, stored, scope, f"load_rank_files of {directory}"
        )

    def copy_loaded_state() -> None:
        with name_lost_ranks(
            "load_rank_files", directory, scope
        ):  # a sharded optimizer's load is collective
            apply()

    return copy_loaded_state


def _verify_loaded(holders: dict[str, RankFile], model: RankModel, with_optimizer: bool) -> None:
    """Check the checksum of every tensor loading into ``model`` reads.

    Its parameters and (``with_optimizer``) their optimizer state."""
    for key, rank_file in holders.items():
        if param_name_of_key(key) in model.params and (
            with_optimizer or key.startswith(MODEL_PREFIX)
        ):
            rank_file.verify(key)


def _read_on_every_rank(directory: Path, scope: Scope) -> dict[str, RankFile]:
    """:func:`_read_rank_files`, raising on every rank when any rank cannot read the checkpoint.

    One all-reduce of a failure flag, so that no rank waits in a later collective for a rank that
    has already raised."""
    try:
        holders, error = _read_rank_files(directory, scope), None
    except (ValueError, OSError) as exc:  # OSError: a directory this rank may not list
        holders, error = {}, exc
    raise_on_every_rank(
        error, ValueError(f"another rank could not read the checkpoint {directory}"), scope
    )
    return holders

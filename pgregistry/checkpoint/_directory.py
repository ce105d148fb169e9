"""The ``directory`` argument of every save and load: a path, not empty, not a file.

An empty string is ``Path('')``, the current directory: ``save_rank_files(os.environ.get("CKPT",
""), model)`` with the variable unset wrote ``rank-00000.pt`` into wherever the job was started. A
path that names a regular file made a save fail with ``[Errno 17] File exists`` (rank files) or
torch's ``CheckpointException``, a ``BaseException`` that passes every ``except Exception``
(``torch.distributed.checkpoint``). And ``torch.distributed.checkpoint`` overwrites the checkpoint
a directory holds, where rank files refuse to: an earlier checkpoint was lost, or half-replaced by a
save that failed. These checks name the argument and the fix instead.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = [
    "DCP_METADATA",
    "checkpoint_path",
    "kind_of_non_directory",
    "refuse_a_file",
    "refuse_an_existing_dcp_checkpoint",
]

DCP_METADATA = ".metadata"
"""The file ``torch.distributed.checkpoint`` writes last, once every rank's data is written."""


def checkpoint_path(directory: object, owner: str) -> Path:
    """``directory`` as a ``Path``: ``TypeError`` unless a path, ``ValueError`` when it is empty.

    Local and the same on every rank given the same argument: checked before any collective."""
    if not isinstance(directory, (str, os.PathLike)):
        raise TypeError(
            f"{owner}: directory must be a path (a str or os.PathLike), got {directory!r} "
            f"({type(directory).__name__})"
        )
    if isinstance(directory, str) and not directory.strip():
        raise ValueError(
            f"{owner}: directory is empty (an unset variable?), which would mean the current "
            "directory: name the checkpoint's directory"
        )
    return Path(directory)


def kind_of_non_directory(path: Path) -> str | None:
    """What ``path`` is when it exists and is no directory (``"a regular file"``), else ``None``."""
    if not path.exists() or path.is_dir():
        return None
    return "a regular file" if path.is_file() else "no regular file (a device, a FIFO or a socket)"


def refuse_a_file(directory: Path) -> None:
    """``NotADirectoryError`` naming what ``directory`` is when it exists and is no directory."""
    kind = kind_of_non_directory(directory)
    if kind is not None:
        raise NotADirectoryError(
            f"the checkpoint directory {directory} is {kind}, not a directory: name a directory "
            "(a save makes it when missing)"
        )


def refuse_an_existing_dcp_checkpoint(directory: Path) -> None:
    """Refuse a save into ``directory`` when it is no directory or already holds a DCP checkpoint.

    ``ValueError`` for an existing checkpoint (its ``.metadata``), as rank files refuse an existing
    one."""
    refuse_a_file(directory)
    if (directory / DCP_METADATA).exists():
        raise ValueError(
            f"{directory} already holds a checkpoint (torch.distributed.checkpoint's "
            f"{DCP_METADATA}); pgregistry does not overwrite one: save to a new directory, or "
            "remove the old checkpoint first"
        )

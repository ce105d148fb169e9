"""What the rank-file checkpoint tests share: a small MoE model, fills, snapshots, and damaging a stored tensor.

Imported as ``checkpoint_support`` (the directory of the tests is on ``sys.path``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from pgregistry import ProcessGroupCollection, attach
from pgregistry.checkpoint import (
    load_distributed,
    load_rank_files,
    save_distributed,
    save_rank_files,
)

__all__ = ["LOAD", "SAVE", "MoE", "alone", "filled", "flip_a_byte_of", "snapshot"]

_OFF: dict[str, Any] = dict(
    ep=None, dp_cp=None, expt_dp=None, tp=None, expt_tp=None, gtp_remat=None, expt_gtp_remat=None, pp=None
)


class MoE(nn.Module):
    """A dense norm and ``num_experts // ep_size`` local experts, numbered from 0 on each EP rank."""

    def __init__(self, num_experts: int, ep_size: int = 1, *, extra: bool = False) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.norm = nn.LayerNorm(2)
        self.experts = nn.Module()
        self.experts.local_experts = nn.ModuleList(nn.Linear(2, 2) for _ in range(num_experts // ep_size))
        if extra:
            self.extra = nn.Linear(2, 1)


def filled(model: nn.Module, value: float) -> nn.Module:
    """``model`` with its i-th parameter filled with ``value + i``."""
    with torch.no_grad():
        for index, param in enumerate(model.parameters()):
            param.fill_(value + index)
    return model


def alone(model: nn.Module) -> nn.Module:
    """``model`` with a collection attached in which every axis is off (one process, no world)."""
    attach(model, ProcessGroupCollection(**_OFF))
    return model


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: param.detach().clone() for name, param in model.named_parameters()}


def flip_a_byte_of(path: Path, tensor: torch.Tensor) -> None:
    """Flip one bit inside the stored bytes of ``tensor`` in the file ``path`` (found by its bytes, which must
    occur once in the file), as a bad disk or a damaged copy would."""
    data = bytearray(path.read_bytes())
    stored = tensor.detach().contiguous().numpy().tobytes()
    where = data.find(stored)
    assert where >= 0 and data.find(stored, where + 1) < 0, "the tensor's bytes must occur exactly once in the file"
    data[where + len(stored) // 2] ^= 0x10
    path.write_bytes(bytes(data))


SAVE: dict[str, Any] = {"dcp": save_distributed, "files": save_rank_files}
"""The two storage back-ends' saves, by short name."""

LOAD: dict[str, Any] = {"dcp": load_distributed, "files": load_rank_files}
"""Their loads."""

"""The device a grad statistic is computed and reduced on.

Where the grads are, or what the group's backend needs.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

__all__ = ["backend_device", "reduction_device"]


def backend_device(group: ProcessGroup | None) -> torch.device:
    """The device collectives over ``group`` need: CUDA for NCCL, else CPU.

    Args:
        group: a process group, or ``None`` for the default group.

    Returns:
        The device.

    Example:
        On a rank of a gloo world (one rank, as :func:`pgregistry.testing.run_world` starts it):

        >>> import torch.distributed as dist
        >>> backend_device(dist.group.WORLD)  # on an NCCL group: this rank's current CUDA device
        device(type='cpu')
    """
    if dist.is_initialized() and "nccl" in str(dist.get_backend(group)):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def reduction_device(
    grads: Iterable[torch.Tensor], groups: Iterable[ProcessGroup | None]
) -> torch.device:
    """Where statistics of ``grads`` are computed and reduced.

    Args:
        grads: this rank's grads.
        groups: the groups the statistics are reduced over.

    Returns:
        The first grad's device; with no grads on this rank, the device the first NCCL group among
        ``groups`` needs (``None`` skipped), else CPU.

    Example:
        >>> import torch
        >>> reduction_device([torch.zeros(2)], [None]), reduction_device([], [None])
        (device(type='cpu'), device(type='cpu'))
    """
    for grad in grads:
        return grad.device
    for group in groups:
        if group is not None and (device := backend_device(group)).type == "cuda":
            return device
    return torch.device("cpu")

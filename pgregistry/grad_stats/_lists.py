"""Norms, zero counts and clipping of grads already filtered and keyed by reduction group
(Megatron-Core's ``get_grad_norm_fp32`` / ``count_zeros_fp32`` / ``clip_grads`` shape): the one
reduction path (:mod:`pgregistry.grad_stats._reductions`) over lists of tensors read by
:mod:`pgregistry.grad_stats._local`.

The reductions issue one all-reduce per distinct group, in an order every rank agrees on, and leave
the result on the grads' device with no host sync, so optimizers and training loops can call them
every step; only a norm other than the 1-, 2- and inf-norm reads its value on the host, whether it
is exact (a device sync on CUDA; see :func:`~pgregistry.grad_stats._reductions.reduce_shares`). See
``docs/design/grad_stats_api.md``.
"""

from __future__ import annotations

import torch

from pgregistry.grad_stats._arguments import total_norm_as_tensor
from pgregistry.grad_stats._devices import reduction_device
from pgregistry.grad_stats._local import add_parts, by_kind, scale_kind
from pgregistry.grad_stats._reductions import (
    Clipping,
    GradsByGroup,
    Shares,
    Wanted,
    check_max_norm,
    clip_coefficient,
    reduce_shares,
)

__all__ = ["clip_grads_", "norm_of_grads", "scale_grads_", "zeros_of_grads"]


def _shares_of_groups(grads_by_group: GradsByGroup, wanted: Wanted) -> Shares:
    device = reduction_device(
        (grad for grads in grads_by_group.values() for grad in grads), grads_by_group
    )
    shares = Shares(wanted, device, grads_by_group)
    for group, grads in grads_by_group.items():
        add_parts(shares, group, grads)
    return shares


def norm_of_grads(grads_by_group: GradsByGroup, norm_type: float = 2.0) -> torch.Tensor:
    """The ``norm_type``-norm of already-filtered grads, each group's share summed over its group.

    One all-reduce per distinct group (SUM of ``|g|^p``, MAX for the inf-norm), issued in an order
    every rank agrees on (by the group's ranks); ``None`` and single-rank groups issue none. Exact
    where ``sum |g|^p`` leaves the float range: the 1-, 2- and inf-norm in the one reduction, with
    no host sync; another ``p`` reads the norm on the host once and, only there, the grads twice
    more (:func:`~pgregistry.grad_stats._reductions.reduce_shares`).

    Args:
        grads_by_group: reduction group -> the grads counted on this rank. Every rank of a group
            must pass that group as a key, with an empty list when it holds no grads for it.
        norm_type: a positive number, or ``inf`` for the max-norm.

    Returns:
        A 0-dim tensor on the grads' device (float64 when a grad is float64, else float32); 0 for an
        empty mapping or empty lists.

    Example::

        grads = classify_grads(model.parameters(), groups)
        norm = norm_of_grads(grads)
    """

    def read_shares(wanted: Wanted) -> Shares:
        return _shares_of_groups(grads_by_group, wanted)

    return reduce_shares(read_shares(Wanted.of(norm_type, zeros=False)), reread=read_shares).norm


def zeros_of_grads(grads_by_group: GradsByGroup) -> torch.Tensor:
    """The number of zero elements in already-filtered grads, summed over each group.

    Args:
        grads_by_group: as for :func:`norm_of_grads`.

    Returns:
        A 0-dim int64 tensor.
    """
    zeros = reduce_shares(_shares_of_groups(grads_by_group, Wanted.zeros_only())).zeros
    assert zeros is not None
    return zeros


def clip_grads_(
    grads: list[torch.Tensor] | tuple[torch.Tensor, ...],
    max_norm: float,
    total_norm: torch.Tensor | float,
    *,
    error_if_nonfinite: bool = False,
) -> torch.Tensor:
    """Scale ``grads`` in place by ``max_norm / (total_norm + 1e-6)`` where that is below 1.

    The coefficient is clamped at 1 as a tensor, so nothing waits on the device; scaling by exactly
    1 leaves a grad unchanged (and is skipped). A NaN or infinite ``total_norm`` (an overflow, one
    NaN grad anywhere in the world) leaves every grad unscaled: its coefficient would be NaN, or 0
    for an infinite norm, and would poison or erase the finite grads too; the caller sees the
    non-finite norm and skips the step.

    Args:
        grads: the grads to scale, every copy of them (duplicates too, so replicas stay identical).
        max_norm: the norm to clip to: positive and finite.
        total_norm: the global norm of the grads: 0 or more, NaN or inf (a number, or a
            one-element tensor; on its own device, else on the grads').
        error_if_nonfinite: raise on a non-finite norm (as ``torch.nn.utils.clip_grad_norm_``),
            which waits for the norm on the host.

    Returns:
        The coefficient applied (a 0-dim float32 tensor).

    Raises:
        TypeError: a grad that is no tensor (``None``); ``max_norm`` not a real number;
            ``total_norm`` neither a real number nor a one-element real tensor.
        ValueError: ``max_norm`` not positive and finite; ``total_norm`` negative (read on the
            host only; a negative norm on a device leaves the grads unscaled, as NaN does).
        RuntimeError: with ``error_if_nonfinite``, a NaN or infinite ``total_norm``.

    Example::

        norm = norm_of_grads(grads_by_group)
        clip_grads_([p.grad for p in model.parameters()], 1.0, norm)
    """
    check_max_norm(max_norm)
    for index, grad in enumerate(grads):
        if not isinstance(grad, torch.Tensor):
            raise TypeError(
                f"grads[{index}] is {grad!r} ({type(grad).__name__}), not a tensor: pass the grads "
                "that are set (skip a parameter whose .grad is None)"
            )
    norm = total_norm_as_tensor(total_norm, grads[0].device if grads else None)
    check_finite(norm, error_if_nonfinite)
    coeff = clip_coefficient(max_norm, norm)
    scale_grads_(grads, coeff)
    return coeff.to(torch.float32)


def check_finite(norm: torch.Tensor, error_if_nonfinite: bool, *, which: str = "total") -> None:
    """With ``error_if_nonfinite``, ``RuntimeError`` for a NaN or infinite ``norm`` (host sync).

    ``which`` names the norm in the message: ``total``, or ``job-wide`` over a job's modules."""
    if error_if_nonfinite and not bool(torch.isfinite(norm)):
        raise RuntimeError(
            f"the {which} grad norm is {float(norm)}, not finite, so the grads "
            "cannot be clipped (they are left as they are); pass "
            "error_if_nonfinite=False to leave them unscaled without raising"
        )


def scale_grads_(
    grads: list[torch.Tensor] | tuple[torch.Tensor, ...], coeff: torch.Tensor | Clipping
) -> None:
    """Multiply ``grads`` (any devices and dtypes) in place by ``coeff``, one call per kind.

    ``coeff`` is 0-dim, at most 1; or clipping's, which the one-read kernel makes on the device from
    the norm."""
    for same_kind in by_kind(grads).values():
        scale_kind(same_kind, None, coeff)

"""The norm and the zero count of some grads, read off one reduction of their statistics.

A :class:`~pgregistry.optim._grad_buffer.GradBuffer` (its spans) and an optimizer (its flat
optimizers' buffers) each compute :class:`~pgregistry.grad_stats._reductions.Reduced` statistics
their own way; what the user asks of them, a norm, a zero count or both from one read, is the same
three calls on top. :class:`GradStatistics` holds them once, under private names each class
publishes under its own: the buffer as ``grad_norm``, ``count_zeros`` and ``norm_and_zeros``, the
optimizers as Megatron-Core's ``get_grad_norm``, ``count_zeros`` and ``get_grad_norm_and_zeros``.
"""

from __future__ import annotations

import abc

import torch

from pgregistry.grad_stats._arguments import Given, arguments_of_call
from pgregistry.grad_stats._reductions import (
    Reduced,
    Wanted,
    check_arguments_after,
    zero_count_after,
)


class GradStatistics(abc.ABC):
    """Base of what reduces grad statistics: the norm, the zero count and both, on top of one call.

    A subclass implements :meth:`statistics`.
    """

    @abc.abstractmethod
    def statistics(self, wanted: Wanted, given: Given | None = None) -> Reduced:
        """The ``wanted`` statistics of the grads, each part reduced over its group.

        ``given``: the call's checked arguments, a refused one's shares NaN
        (:func:`~pgregistry.grad_stats._reductions.reduce_shares`)."""

    def _reduce_with_norm_type(self, norm_type: object, zeros: bool) -> Reduced:
        """The statistics with the ``norm_type``-norm, a refused ``norm_type`` raised after them.

        This rank joins the reduction with a NaN share before raising its refusal, so its peers
        get a NaN norm instead of waiting in the all-reduce for it."""
        given = arguments_of_call(norm_type, None, clip=False, zeros=zeros)
        reduced = self.statistics(Wanted(given.p, zeros=zeros), given)
        check_arguments_after(reduced, given, f"{type(self).__name__}'s grad norm")
        return reduced

    def _grad_norm(self, norm_type: float = 2.0) -> torch.Tensor:
        """The ``norm_type``-norm of the counted grads, reduced over their groups (0-dim).

        Float64 for float64 grads, else float32; NaN or infinite when any grad is, uncounted ones
        (duplicates) included. Exact where ``sum |g|^p`` leaves the float range; no host sync for
        the 1-, 2- and inf-norm, one host read of the norm for another ``p``
        (:func:`~pgregistry.grad_stats._reductions.reduce_shares`).

        Args:
            norm_type: ``p``, positive, or ``inf``.

        Returns:
            The norm, a 0-dim tensor on the reduction device.

        Raises:
            TypeError: ``norm_type`` is no real number (``None``, a str, a bool).
            ValueError: ``norm_type`` is 0, negative or NaN (after the reduction, which this rank
                joins with a NaN share: its peers get a NaN norm).
        """
        return self._reduce_with_norm_type(norm_type, zeros=False).norm

    def _count_zeros(self) -> torch.Tensor:
        """How many zeros the counted grads hold, reduced over their groups (0-dim int64).

        Each distinct grad element is counted once: duplicates and shared copies are not.

        Returns:
            The count, a 0-dim int64 tensor on the reduction device; -1 on a GPU where another
            rank of a group computes a norm instead (no host sync: nothing is raised there).

        Raises:
            ValueError: where the grads are on the CPU, on every rank of a group where another
                rank computes a norm instead (:meth:`_grad_norm`, a clip, :meth:`_norm_and_zeros`:
                their rows carry other arguments), naming both, after the reduction.
        """
        reduced = self.statistics(Wanted.zeros_only())
        return zero_count_after(reduced, f"{type(self).__name__}.count_zeros")

    def _norm_and_zeros(self, norm_type: float = 2.0) -> tuple[torch.Tensor, torch.Tensor]:
        """The norm and the zero count together, from one reduction: one all-reduce per group.

        On CUDA, for the 2-norm of float32, bf16 or fp16 grads with triton importable, each span is
        read once for both (:mod:`pgregistry.grad_stats._fused`).

        Args:
            norm_type: ``p``, positive, or ``inf``.

        Returns:
            ``(norm, zeros)``, as the norm and the zero count alone give them.

        Raises:
            TypeError: ``norm_type`` is no real number (``None``, a str, a bool).
            ValueError: ``norm_type`` is 0, negative or NaN (after the reduction, as for the norm).
        """
        reduced = self._reduce_with_norm_type(norm_type, zeros=True)
        assert reduced.zeros is not None
        return reduced.norm, reduced.zeros

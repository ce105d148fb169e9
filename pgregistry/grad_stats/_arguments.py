"""The arguments every clip and norm entry point takes, checked by one set of functions:
``max_norm``, ``norm_type`` and ``error_if_nonfinite``.

Every public path (:func:`~pgregistry.grad_stats.clip_grad_norm_`,
:func:`~pgregistry.grad_stats.clip_grads_`, a pgregistry optimizer's ``clip_grad_norm``,
:class:`~pgregistry.modules.MultiModuleOptimizer`) refuses a bad value before any collective, naming
the argument and the value: a string such as ``'1'`` would otherwise reach a comparison with a
number and raise Python's bare ``TypeError``, or (``float('2')``) be taken silently. The ``*_error``
forms return the fault instead of raising it, for callers that agree on it across ranks first.

A fault on some ranks only must not leave the others waiting in the norm's reduction, nor may ranks
given different ``max_norm`` or ``norm_type`` values clip by different coefficients (or different
``error_if_nonfinite``: a non-finite norm raising on some ranks, returned on the others):
:func:`arguments_of_call` holds a rank's fault instead of raising it, the rank joins the reduction
with it, and :func:`agreement_columns` puts what it was given at the end of every reduction row with
peers, a plain norm's too (``max_norm`` 0.0), and in a clip's verdict: rows the call reduces anyway
(no collective more); :class:`Agreement` reads the result (see its docstring for what each rank
does). What the call reduces rides with them (:class:`Statistic`): a zero count alone makes rows of
a norm's width and carries its own arguments (:data:`ZEROS_ALONE`), so a zero count on some ranks
beside a norm on others is told as a disagreement too, not a collective of another size.
"""

from __future__ import annotations

import enum
import functools
import math
import numbers
import struct
from typing import Final

import attrs
import torch

from pgregistry._runtime.flags import flag_error

__all__ = [
    "AGREEMENT_BYTES",
    "AGREEMENT_WIDTH_MAX",
    "AGREEMENT_WIDTH_SUM",
    "CLIP_EPSILON",
    "Agreement",
    "Given",
    "Statistic",
    "ZEROS_ALONE",
    "agreement_columns",
    "arguments_of_call",
    "check_max_norm",
    "norm_type_as_float",
    "max_norm_error",
    "max_norm_scalar",
    "norm_type_error",
    "real_number",
    "total_norm_as_tensor",
]


CLIP_EPSILON = 1e-6
"""Added to the total norm before dividing, as Megatron-Core does.

``coeff = max_norm / (norm + 1e-6)``.
"""


def real_number(value: object) -> float | None:
    """``value`` as a float when it is a real number, not a bool; else ``None``.

    A real number is a Python or NumPy number, or a one-element real tensor. One beyond float's
    range (an int such as ``10**400``, a ``Fraction``) is an infinity of its sign: ``float()``
    raised a bare ``OverflowError`` before any collective, on the ranks given it alone."""
    if isinstance(value, torch.Tensor):
        return float(value.item()) if _one_real_element(value) else None
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        try:
            return float(value)
        except OverflowError:
            return math.inf if value > 0 else -math.inf  # type: ignore[operator]  # a real
    return None


def _one_real_element(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` holds one real number: one element, neither complex nor bool."""
    return tensor.numel() == 1 and not tensor.is_complex() and tensor.dtype != torch.bool


def norm_type_error(norm_type: object) -> Exception | None:
    """Why ``norm_type`` is no norm type, or ``None``.

    ``TypeError`` for no real number (a string, a bool), ``ValueError`` unless positive (inf is the
    max-norm; NaN is none)."""
    p = real_number(norm_type)
    if p is None:
        return TypeError(
            "norm_type must be a positive number or inf, "
            f"got {norm_type!r} ({type(norm_type).__name__})"
        )
    return None if p > 0 else ValueError(f"norm_type must be positive (or inf), got {norm_type!r}")


def max_norm_error(max_norm: object) -> Exception | None:
    """Why ``max_norm`` cannot be clipped to, or ``None``.

    ``TypeError`` for no real number (a string such as ``'1.0'``, a bool, ``None``), ``ValueError``
    unless positive and finite (0, negative, NaN, inf)."""
    number = real_number(max_norm)
    if number is None:
        kind = type(max_norm).__name__
        return TypeError(
            f"max_norm must be a positive, finite number (a float), got {max_norm!r} ({kind})"
        )
    if number > 0 and math.isfinite(number):
        return None
    return ValueError(f"max_norm must be a positive, finite number, got {max_norm!r}")


def check_max_norm(max_norm: object) -> None:
    """Raise :func:`max_norm_error`'s fault, if any."""
    error = max_norm_error(max_norm)
    if error is not None:
        raise error


def max_norm_scalar(max_norm: float) -> float:
    """A checked ``max_norm``, a one-element tensor of any shape made 0-dim (its fault raised).

    A ``[1]``-shaped ``max_norm`` would make the coefficient ``[1]``-shaped, which the scaling
    kernels refuse after the norm's reduction; a 0-dim tensor stays on its device (no host sync),
    detached: one that requires grad (a parameter, a schedule's output) made every grad it scaled
    part of its autograd graph, kept alive and grown at each step (torch's clip runs without
    grad)."""
    check_max_norm(max_norm)
    return max_norm.detach().reshape(()) if isinstance(max_norm, torch.Tensor) else max_norm


def norm_type_as_float(norm_type: object) -> float:
    """``norm_type`` as a float; raise :func:`norm_type_error`'s fault, if any."""
    error = norm_type_error(norm_type)
    if error is not None:
        raise error
    p = real_number(norm_type)
    assert p is not None  # a real number: norm_type_error found none
    return p


def total_norm_as_tensor(total_norm: object, device: torch.device | None) -> torch.Tensor:
    """A given ``total_norm`` as a 0-dim float64 tensor on ``device`` (its own, for a tensor).

    ``TypeError`` for no real number or one-element real tensor (a string, ``None``, a bool, a
    complex or two-element tensor); ``ValueError`` for a negative one, whose coefficient would flip
    every grad's sign. A tensor off the CPU is not read back (no host sync): its sign is checked on
    the device by :func:`~pgregistry.grad_stats._reductions.clip_coefficient`. NaN and inf pass:
    they mean "leave the grads unscaled"."""
    if isinstance(total_norm, torch.Tensor):
        if _one_real_element(total_norm):
            norm = total_norm.detach().reshape(()).to(torch.float64)
            if norm.device.type == "cpu":  # a device's is checked there (no host sync)
                _refuse_negative(total_norm, float(norm))
            return norm
    else:
        number = real_number(total_norm)
        if number is not None:
            _refuse_negative(total_norm, number)
            return torch.tensor(number, dtype=torch.float64, device=device)
    raise TypeError(
        "total_norm must be a real number or a one-element real tensor, "
        f"got {total_norm!r} ({type(total_norm).__name__})"
    )


def _refuse_negative(total_norm: object, value: float) -> None:
    if value < 0:
        raise ValueError(
            "total_norm must be a norm: 0 or more (NaN or inf: the grads are left unscaled), "
            f"got {total_norm!r}"
        )


class Statistic(enum.IntEnum):
    """What a call reduces, carried beside its arguments: ranks reducing together must agree on it.

    A zero count alone beside a norm (``count_zeros`` on one pipeline stage, ``grad_norm`` on the
    other) sums shares of neither; a norm without a zero count beside one with it leaves the
    latter's count without that rank's zeros. Each value is a byte of :func:`agreement_columns`
    (0, 1 or 2: from its sum and sum of squares over ``n`` ranks, how many ranks reduce each)."""

    NORM = 0
    NORM_AND_ZEROS = 1
    ZEROS = 2

    def action(self) -> str:
        """What a rank reducing this statistic does, for messages."""
        return _ACTIONS[self]

    def calls(self) -> str:
        """:meth:`action` and the entry points that do it, for messages."""
        return f"{_ACTIONS[self]} ({_CALLS[self]})"


_ACTIONS: Final = {
    Statistic.NORM: "computes a norm without a zero count",
    Statistic.NORM_AND_ZEROS: "computes a norm and the zero count together",
    Statistic.ZEROS: "counts zeros alone",
}

_CALLS: Final = {
    Statistic.NORM: "grad_norm, clip_grad_norm_, norm_of_grads, an optimizer's get_grad_norm or "
    "clip_grad_norm",
    Statistic.NORM_AND_ZEROS: "grad_norm_and_zeros, an optimizer's get_grad_norm_and_zeros",
    Statistic.ZEROS: "count_zeros, zeros_of_grads, an optimizer's count_zeros, "
    "pgregistry.modules.count_zeros",
}


@attrs.frozen(slots=True)
class Given:
    """A call's ``norm_type``, ``max_norm`` and ``error_if_nonfinite`` on this rank: checked, held.

    ``refusal`` is the first fault (``max_norm``'s, ``norm_type``'s, ``error_if_nonfinite``'s): the
    rank still joins the reduction, its norm poisoned and its refusal in the clip's verdict, and
    raises it afterwards, so a value refused on some ranks only leaves none of their peers waiting
    in the reduction. ``p`` is the norm type, 2.0 (the default, the row its peers most likely make)
    where refused; ``max_norm`` the checked value as a float (``None`` without a clip or where
    refused); ``error_if_nonfinite`` whether a clip raises on a non-finite norm (``False`` without a
    clip, which does not read it, or where refused); ``statistic`` what the call reduces (a zero
    count alone: :data:`ZEROS_ALONE`)."""

    p: float
    clip: bool
    max_norm: float | None
    refusal: Exception | None
    error_if_nonfinite: bool
    statistic: Statistic = Statistic.NORM

    def columns(self, *, summed: bool, device: torch.device) -> torch.Tensor:
        """These arguments as :func:`agreement_columns` (made once per value and device).

        A call that does not clip carries ``max_norm`` 0.0, which no clip is given: a clip on some
        ranks beside a plain norm on others differs in it."""
        if self.refusal is not None:
            return agreement_columns(None, self.p, False, self.statistic, summed, device)
        max_norm = self.max_norm if self.clip else 0.0
        flag = self.error_if_nonfinite
        return agreement_columns(max_norm, self.p, flag, self.statistic, summed, device)


ZEROS_ALONE: Final = Given(0.0, False, None, None, False, Statistic.ZEROS)
"""A zero count's arguments: it takes none, and carries these (``norm_type`` 0.0, which no norm is
given, and :attr:`Statistic.ZEROS`) in its rows with peers, as a norm carries its own."""


def arguments_of_call(
    norm_type: object,
    max_norm: object,
    *,
    clip: bool,
    error_if_nonfinite: object = False,
    zeros: bool = False,
) -> Given:
    """``norm_type`` and (with ``clip``) ``max_norm`` checked, their fault held: :class:`Given`.

    A tensor ``max_norm`` is read on the host here, as :func:`check_max_norm` reads it.
    ``error_if_nonfinite`` must be a bool: a string such as ``'False'`` (from a configuration) was
    true, and raised on a non-finite norm where the caller meant to skip the step. A clip's rides in
    the verdict beside the two numbers: given ``True`` on some ranks only, a non-finite norm raised
    there and was returned on the others. ``zeros``: the call counts zeros beside the norm
    (:attr:`Statistic.NORM_AND_ZEROS`)."""
    max_norm_fault = max_norm_error(max_norm) if clip else None
    norm_type_fault = norm_type_error(norm_type)
    flag_fault = flag_error(error_if_nonfinite, "error_if_nonfinite")
    p = real_number(norm_type) if norm_type_fault is None else None
    refusal = max_norm_fault or norm_type_fault or flag_fault
    value = real_number(max_norm) if clip and refusal is None else None
    raises = clip and refusal is None and error_if_nonfinite is True
    statistic = Statistic.NORM_AND_ZEROS if zeros else Statistic.NORM
    return Given(2.0 if p is None else p, clip, value, refusal, raises, statistic)


ARGUMENTS: Final = ("max_norm", "norm_type", "error_if_nonfinite", "statistic")
"""What ranks must agree on, in the order of :func:`agreement_columns`' values: the arguments, then
the statistic the call reduces (:class:`Statistic`)."""

_ARGUMENT_BYTES: Final = (8, 8, 1, 1)
"""Each argument's bytes in the summed form: a float64's eight, the flag's one (0 or 1), the
statistic's one (0, 1 or 2)."""

AGREEMENT_BYTES: Final = sum(_ARGUMENT_BYTES)
"""The arguments' bytes, each a column of the summed form (the finishing kernel reads them)."""

AGREEMENT_WIDTH_SUM: Final = 1 + 2 * AGREEMENT_BYTES
"""The summed form's width: ``[refused, c_0 .. c_17, c_0**2 .. c_17**2]``, ``c_k`` the bytes."""

AGREEMENT_WIDTH_MAX: Final = 1 + 2 * len(ARGUMENTS)
"""The maximum's form's width: ``[refused, max_norm, norm_type, flag, statistic, -max_norm,
-norm_type, -flag, -statistic]``, the flag ``error_if_nonfinite`` as 0 or 1."""


@functools.lru_cache(maxsize=16)
def agreement_columns(
    max_norm: float | None,
    norm_type: float,
    error_if_nonfinite: bool,
    statistic: Statistic,
    summed: bool,
    device: torch.device,
) -> torch.Tensor:
    """What a rank was given, as columns of its rows and a clip's verdict (float64, on ``device``).

    ``max_norm`` ``None`` is a refusal (of any argument), 0.0 a plain norm's (no clip). Summed
    over ``n`` ranks (a row reduced with SUM): ``[refused, c_k.., c_k**2..]``, ``c_k`` the 18 bytes
    of :data:`ARGUMENTS`: the two float64s' bits, then the flag (0 or 1) and the statistic (0, 1 or
    2): every rank was given the same bits exactly when each byte's ``n * sum(c**2) == sum(c)**2``
    (equal terms, by Cauchy-Schwarz); every sum is a whole number below 2**53, the test exact for
    ``n`` up to 2**23. Reduced with MAX: ``[refused, max_norm, norm_type, flag, statistic,
    -max_norm, -norm_type, -flag, -statistic]`` (``-inf`` but ``refused`` where refused): the
    largest and the negated smallest. A refusal carries no statistic (every byte 0). Made once per
    value and device, so a clip called every step with the same arguments adds no operation but the
    concatenation (no copy to the device)."""
    flag = 1.0 if error_if_nonfinite else 0.0
    kind = float(statistic)
    if summed:
        if max_norm is None:
            values = [1.0] + [0.0] * (2 * AGREEMENT_BYTES)
        else:
            chunks = [float(byte) for byte in struct.pack("<2d", max_norm, norm_type)]
            chunks += [flag, kind]
            values = [0.0, *chunks, *(chunk * chunk for chunk in chunks)]
    elif max_norm is None:
        values = [1.0] + [-math.inf] * (2 * len(ARGUMENTS))
    else:
        values = [0.0, max_norm, norm_type, flag, kind, -max_norm, -norm_type, -flag, -kind]
    return torch.tensor(values, dtype=torch.float64).to(device, non_blocking=True)


@attrs.frozen(slots=True)
class Agreement:
    """A call's arguments reduced over every rank holding grads: was one refused, do they differ.

    ``columns`` are :func:`agreement_columns` reduced: the summed form over a group of ``ranks``
    ranks, or the maximum's form (``ranks`` 0). Where either holds, the norm is NaN on every rank
    (:meth:`disagrees`, on the device: no host sync), so no rank scales a grad. Every rank then
    raises where the verdict can be read without a device sync (:meth:`fault`); a rank that refused
    its argument raises that fault in any case."""

    columns: torch.Tensor
    ranks: int

    def disagrees(self) -> torch.Tensor:
        """Whether a rank refused its argument or the arguments differ (0-dim bool)."""
        return (self.columns[0] > 0) | self._differing_columns().any()

    def differing(self) -> torch.Tensor:
        """Which of :data:`ARGUMENTS` differ across the ranks (bool, one each; no host sync)."""
        if not self.ranks:
            return self._differing_columns()
        by_argument = self._differing_columns().split(_ARGUMENT_BYTES)
        return torch.stack([columns.any() for columns in by_argument])

    def _differing_columns(self) -> torch.Tensor:
        """Which columns differ: each argument's (the maximum's form), else each byte's (bool)."""
        if not self.ranks:
            count = len(ARGUMENTS)
            return self.columns[1 : 1 + count] != -self.columns[1 + count :]
        sums = self.columns[1 : 1 + AGREEMENT_BYTES].to(torch.int64)
        squares = self.columns[1 + AGREEMENT_BYTES :].to(torch.int64)
        return squares * self.ranks != sums * sums

    def as_maximum_form(self, given: Given) -> torch.Tensor:
        """The summed form as the maximum's, to be reduced with MAX over further groups.

        ``given`` this rank's arguments (the group's where they agree); an argument that differs
        (every one, where a rank refused) is kept as the range ``[-inf, inf]``: known to differ,
        its values not."""
        local = given.columns(summed=False, device=self.columns.device)
        refused = self.columns[:1] > 0
        # the largest values, then the negated least
        unknown = (self.differing() | refused).repeat(2)
        return torch.cat([refused.to(torch.float64), torch.where(unknown, math.inf, local[1:])])

    def fault(self, given: Given, owner: str) -> ValueError | None:
        """The error every rank raises, or ``None``: reads the columns on the host (a device sync).

        ``None`` too where this rank refused its argument: it raises its own fault, naming it. A
        call without a clip names the ranks its norm is reduced over, and a NaN norm. Ranks that
        reduce different statistics (:class:`Statistic`) are told first: their arguments differ
        because their calls do."""
        if given.refusal is not None:
            return None
        values = self.columns.tolist()
        if given.statistic == Statistic.ZEROS:  # every peer that differs computes a norm
            if values[0] > 0 or self._differing_columns().any():
                return _statistics_fault(owner, given.statistic, _ANY_NORM)
            return None
        if given.clip:
            this = (
                f"max_norm={given.max_norm!r}, norm_type={given.p!r}, "
                f"error_if_nonfinite={given.error_if_nonfinite!r}"
            )
            peers, outcome = "holding grads", "no grad was scaled on any rank"
        else:
            this = f"norm_type={given.p!r} and no max_norm (no clip)"
            peers, outcome = "reducing this norm", "the norm is NaN on every rank"
        if values[0] > 0:
            return ValueError(
                f"{owner}: another rank {peers} refused its max_norm, norm_type or "
                f"error_if_nonfinite (it raises naming the value); this rank was given {this}; "
                f"{outcome}: pass the same valid arguments on every rank"
            )
        if not self._differing_columns().any():  # every call that agrees: no spread to tell
            return None
        others = [kind for kind in self._statistics_present(values) if kind != given.statistic]
        if others:
            return _statistics_fault(
                owner, given.statistic, " and another ".join(map(Statistic.calls, others))
            )
        spreads = dict(zip(ARGUMENTS[:-1], self._argument_spreads(values), strict=True))
        if not given.clip and spreads["max_norm"] is not None:
            spreads["max_norm"] += " (this rank does not clip; another does)"
        differ = [f"{name}{spread}" for name, spread in spreads.items() if spread is not None]
        if not given.clip:
            why = "their shares are not of one norm"
        elif spreads["max_norm"] is None and spreads["norm_type"] is None:
            why = "a non-finite norm would raise on some ranks and be returned on the others"
        else:
            why = "each rank would clip by its own coefficient and the replicas would drift apart"
        return ValueError(
            f"{owner}: {' and '.join(differ)} "
            f"{'differs' if len(differ) == 1 else 'differ'} across the ranks {peers}; this rank "
            f"was given {this}: {why}, so {outcome}: pass the same values on every rank"
        )

    def _statistics_present(self, values: list[float]) -> list[Statistic]:
        """The statistics some rank reduces (a refusing rank's a norm's), from the reduced columns.

        Summed over ``n`` ranks, the statistic's byte (0, 1 or 2) gives how many ranks reduce each:
        ``(sum(c**2) - sum(c)) / 2`` the zero count alone, ``sum(c)`` less twice that the norm with
        it, the rest the norm alone. The maximum's form gives the least and the largest."""
        count = len(ARGUMENTS)
        if not self.ranks:
            present = {values[count], -values[2 * count]}
            return [kind for kind in Statistic if float(kind) in present]
        total, squares = values[AGREEMENT_BYTES], values[2 * AGREEMENT_BYTES]
        alone = (squares - total) / 2
        with_norm = total - 2 * alone
        ranks = {
            Statistic.NORM: self.ranks - with_norm - alone,
            Statistic.NORM_AND_ZEROS: with_norm,
            Statistic.ZEROS: alone,
        }
        return [kind for kind, ranks_of_kind in ranks.items() if ranks_of_kind > 0]

    def _argument_spreads(self, values: list[float]) -> list[str | None]:
        """Each argument's spread over the ranks (``''`` where unknown), ``None`` where equal.

        The flag's, where it differs, is known from either form: true on some ranks only."""
        count = len(ARGUMENTS)
        if not self.ranks:
            spreads = [
                self._range_text(high, -negated_least)
                for high, negated_least in zip(
                    values[1 : 1 + count], values[1 + count :], strict=True
                )
            ]
        else:
            spreads = ["" if differs else None for differs in self.differing().tolist()]
        spreads = spreads[:-1]  # the statistic's is told first (fault)
        if spreads[-1] is not None:
            spreads[-1] = " (True on some ranks, False on others)"
        return spreads

    @staticmethod
    def _range_text(high: float, least: float) -> str | None:
        """``None`` where every rank was given one value; else its range, ``''`` where unknown."""
        if high == least:
            return None
        if least == -math.inf:
            return ""
        return f" (from {'0.0, no clip,' if least == 0.0 else repr(least)} to {high!r})"


_ANY_NORM: Final = (
    "computes a norm (grad_norm, clip_grad_norm_, grad_norm_and_zeros, norm_of_grads, an "
    "optimizer's get_grad_norm, get_grad_norm_and_zeros or clip_grad_norm)"
)
"""What a zero count's peer that differs does, for its message (a refusing rank's is unknown)."""


def _statistics_fault(owner: str, this: Statistic, others: str) -> ValueError:
    """The error of ranks reducing different statistics together: ``others`` is what peers do."""
    return ValueError(
        f"{owner}: another rank reducing with this one {others}, where this rank "
        f"{this.action()}: the shares summed are of no one statistic, so the norm is NaN and the "
        "zero count -1 on every rank (nothing is scaled): call the same statistics on every rank"
    )

"""The checks of :func:`pgregistry.optim.build_optimizer`'s and :func:`inner_factory`'s options.

torch's optimizers check some of their numbers and not others: ``torch.optim.SGD`` takes an ``lr``,
``momentum`` or ``weight_decay`` of NaN (its checks are ``lr < 0.0``, false for NaN) and every rule
takes an infinite one, so the first step turns every parameter into NaN without a word; ``lr=None``
or ``'0.1'`` fails in a comparison naming no option; ``lr=True`` is taken as 1. A flag given as a
string (``sharded='no'``) reads as true, and a ``bucket_numel`` of ``True`` all-reduces the grads
one element at a time. So every option is checked here first, before any buffer or collective, and
a fault names the option, its value and its range. :mod:`pgregistry.modules` checks each module's
options with the same rules on every rank.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import attrs

from pgregistry._runtime.agreement import combine_faults, verdict_of, world_device
from pgregistry._runtime.flags import flag_error
from pgregistry.collection import group_size
from pgregistry.grad_stats._arguments import real_number

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = [
    "OPTIMIZER_NAMES",
    "Replicas",
    "agree_options",
    "check_options",
    "describe_options",
    "option_error",
    "refuse_ignored_options",
    "structure_of",
]

OPTIMIZER_NAMES = ("adam", "adamw", "sgd")
"""The update rules :func:`pgregistry.optim.build_optimizer` names."""

_NON_NEGATIVE = ("lr", "weight_decay", "eps", "momentum")
_FLAGS = ("mixed_precision", "sharded")


def option_error(option: str, value: Any) -> Exception | None:
    """Why ``build_optimizer`` refuses ``value`` for its keyword ``option``, or ``None``.

    The numbers of the update rules must be finite and within torch's ranges (``betas`` each in
    [0, 1)), the flags ``True`` or ``False``, ``bucket_numel`` a positive integer or ``None``,
    ``optimizer`` a rule's name or a factory; options without a rule here pass."""
    shown = f"{value!r} ({type(value).__name__})"
    if option in _NON_NEGATIVE:
        number = real_number(value)
        if number is None:
            return TypeError(f"{option} must be a number, got {shown}")
        return (
            None
            if number >= 0 and math.isfinite(number)
            else ValueError(f"{option} must be a non-negative, finite number, got {value!r}")
        )
    if option == "betas":
        pair = list(value) if isinstance(value, (tuple, list)) else None
        if pair is None or len(pair) != 2 or any(real_number(b) is None for b in pair):
            return TypeError(f"betas must be a pair of numbers, got {shown}")
        return (
            None
            if all(0 <= real_number(b) < 1 for b in pair)  # type: ignore[operator]
            else ValueError(f"betas must each be in [0, 1), got {value!r}")
        )
    if option in _FLAGS:
        return flag_error(value, option)
    if option == "bucket_numel" and value is not None:
        if not isinstance(value, numbers.Integral) or isinstance(value, bool):
            return TypeError(
                f"bucket_numel must be a whole number of elements or None, got {shown}"
            )
        return (
            None if int(value) > 0 else ValueError(f"bucket_numel must be positive, got {value!r}")
        )
    if option == "optimizer" and not callable(value) and value not in OPTIMIZER_NAMES:
        return ValueError(
            f"optimizer must be one of {list(OPTIMIZER_NAMES)} or a factory, got {value!r}"
        )
    if option == "param_name_fn" and value is not None and not callable(value):
        return TypeError(f"param_name_fn must be a function of a parameter or None, got {shown}")
    return None


_RULE_OPTIONS = {
    "adam": ("lr", "weight_decay", "betas", "eps"),
    "adamw": ("lr", "weight_decay", "betas", "eps"),
    "sgd": ("lr", "weight_decay", "momentum"),
}
"""The options each named rule reads; a factory reads none of them."""


def refuse_ignored_options(
    optimizer: object, options: Mapping[str, Any], defaults: Mapping[str, Any]
) -> None:
    """``ValueError`` naming the options given (not their defaults) that ``optimizer`` ignores.

    ``build_optimizer(optimizer=functools.partial(torch.optim.AdamW), lr=3e-4)`` stepped with
    AdamW's own ``lr`` of 1e-3: a factory carries its own hyperparameters. Likewise ``momentum``
    for Adam, ``betas`` and ``eps`` for SGD."""
    if isinstance(optimizer, str) and optimizer not in _RULE_OPTIONS:
        return  # an unknown name: option_error names it
    reads = _RULE_OPTIONS[optimizer] if isinstance(optimizer, str) else ()
    ignored = [
        name
        for name in ("lr", "weight_decay", "betas", "eps", "momentum")
        if name in options
        and name not in reads
        and _differs_from_default(options[name], defaults[name])
    ]
    if not ignored:
        return
    if isinstance(optimizer, str):
        raise ValueError(
            f"{', '.join(ignored)} given, which {optimizer!r} does not read (it reads "
            f"{', '.join(_RULE_OPTIONS[optimizer])}): leave them out, or name the rule that reads "
            "them"
        )
    raise ValueError(
        f"{', '.join(ignored)} given with a factory as optimizer, which carries its own "
        "hyperparameters (these would be ignored): give them to the factory "
        "(functools.partial(torch.optim.AdamW, lr=3e-4)), or name a rule ('adam', 'adamw', 'sgd')"
    )


def _differs_from_default(value: object, default: object) -> bool:
    """Whether ``value`` is not its ``default`` (an array compared elementwise counts as given)."""
    try:
        return bool(value != default)
    except (TypeError, ValueError, RuntimeError):
        return True


def check_options(options: Mapping[str, Any]) -> None:
    """Raise the faults :func:`option_error` finds in ``options``, all of them in one exception."""
    fault = combine_faults(*(option_error(option, value) for option, value in options.items()))
    if isinstance(fault, Exception):
        raise fault
    if fault is not None:
        raise ValueError(fault)


def describe_options(options: Mapping[str, Any]) -> str:
    """``options`` as a text every rank given the same ones writes alike.

    Values that are plain data by their repr, code (a factory, a ``param_name_fn``) by its type,
    whose repr would carry an address that differs by process."""
    return (
        "{"
        + ", ".join(
            f"{option}={_describe_value(value)}" for option, value in sorted(options.items())
        )
        + "}"
    )


def _describe_value(value: Any) -> str:
    if value is None or isinstance(value, (bool, int, float, str)):
        return repr(value)
    if isinstance(value, (tuple, list)):
        return "(" + ", ".join(_describe_value(item) for item in value) + ")"
    return f"<{type(value).__qualname__}>"


@attrs.frozen(slots=True)
class Replicas:
    """Parameters every rank of ``replicas`` must hold alike, then ``across``, the rest of the grid.

    ``structure`` describes this rank's (names, shapes, dtypes); ``what`` names them in messages."""

    replicas: ProcessGroup | None
    across: ProcessGroup | None
    structure: str
    what: str


def agree_options(options: Mapping[str, Any], chains: Sequence[Replicas]) -> None:
    """``ValueError`` on every rank when the optimizer's ranks differ in options or replicas.

    That is, given different ``options``, or replicas holding different parameters. Replicas given
    different learning rates step alike grads into different parameters, silently; ranks given
    different ``sharded`` or ``mixed_precision`` issue different collectives and wait for each
    other; and replicas holding other parameters (a model built otherwise on one rank, a parameter
    frozen on one rank only) all-reduce unrelated grads, whose flat buffers are padded to the same
    length. One MAX all-reduce per group: for each chain, the digests of the options and of the
    structure over ``replicas`` (where the structure must agree), then the options and the verdict
    over ``across`` (which, with ``replicas``, spans the grid, so every rank learns it)."""
    described = describe_options(options)
    digest, negated, _ = verdict_of({"options": described}, None)
    values = [digest, negated] + [0] * len(chains)  # the options, then each chain's verdict
    for index, chain in enumerate(chains):
        # The structure only over its replicas: across them (other stages, other experts) it
        # differs.
        shape_digest, shape_negated, _ = verdict_of({"structure": chain.structure}, None)
        *values, top, negated_bottom = _max_over(
            values + [shape_digest, shape_negated], chain.replicas
        )
        values[2 + index] = max(values[2 + index], int(top != -negated_bottom))
        values = _max_over(values, chain.across)
    if values[0] != -values[1]:  # every rank of the grid sees the same maximum pair
        raise ValueError(
            "build_optimizer was given different options on the ranks of one optimizer (replicas "
            f"would step alike grads differently); this rank's: {described}: give every rank the "
            "same options"
        )
    for index, chain in enumerate(chains):
        if values[2 + index]:
            raise ValueError(
                f"the data-parallel replicas of this optimizer's {chain.what} parameters hold "
                "different ones (a model built otherwise on one rank, or a parameter frozen on one "
                "rank only; their grads would be summed as if alike); this rank's: "
                f"{chain.structure[:300]}: build the same model on every replica"
            )


def _max_over(values: list[int], group: ProcessGroup | None) -> list[int]:
    """``values`` MAX all-reduced over ``group`` (as they are when it has one rank)."""
    import torch
    import torch.distributed as dist

    if group is None or group_size(group) == 1:
        return values
    reduced = torch.tensor(values, dtype=torch.int64, device=world_device(group))
    dist.all_reduce(reduced, op=dist.ReduceOp.MAX, group=group)
    return [int(value) for value in reduced.tolist()]


def structure_of(named: Sequence[tuple[str, Any]]) -> str:
    """The trainable parameters ``named`` as a text replicas holding the same ones write alike."""
    return "; ".join(f"{name} {tuple(p.shape)} {p.dtype}" for name, p in named) or "none"

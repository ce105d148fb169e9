"""Flags given to the public API: ``True`` or ``False``, never a truthy stand-in.

``seed_plan(layout, seed, data_parallel_random_init="no")`` read the string as true and listed
seeds with the data-parallel offsets, which a job seeded without them never draws;
``globalize_expert_keys(..., strict=None)`` renamed a partial state dict as ``strict=False`` does.
Torch-free.
"""

from __future__ import annotations

__all__ = ["flag_error", "require_flag"]


def flag_error(value: object, name: str) -> TypeError | None:
    """The ``TypeError`` naming ``name`` and ``value`` unless it is ``True`` or ``False``.

    ``None`` for a flag. For checks that gather every argument's fault before raising (alike on
    every rank)."""
    if isinstance(value, bool):
        return None
    return TypeError(f"{name} must be True or False, got {value!r} ({type(value).__name__})")


def require_flag(value: object, name: str) -> bool:
    """``value`` when it is ``True`` or ``False``, else ``TypeError`` naming ``name`` and value."""
    error = flag_error(value, name)
    if error is not None:
        raise error
    return bool(value)

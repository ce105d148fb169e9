"""Flags given to the public API: ``True`` or ``False``, never a truthy stand-in.

``seed_plan(layout, seed, data_parallel_random_init="no")`` read the string as true and listed
seeds with the data-parallel offsets, which a job seeded without them never draws;
``globalize_expert_keys(..., strict=None)`` renamed a partial state dict as ``strict=False`` does.
Torch-free.
"""

from __future__ import annotations

__all__ = ["require_flag"]


def require_flag(value: object, name: str) -> bool:
    """``value`` when it is ``True`` or ``False``, else ``TypeError`` naming ``name`` and value."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r} ({type(value).__name__})")
    return value

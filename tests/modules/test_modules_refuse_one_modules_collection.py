"""Every entry point of ``pgregistry.modules`` given one collection where the job's ``MultiModuleCollection``
belongs (the likely slip: a module's own collection) raises ``TypeError`` naming itself and what it got, before any
collective, so no world is needed.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from pgregistry import modules as mm
from pgregistry.collection import FIELD_NAMES, ProcessGroupCollection

ONE_MODULES = ProcessGroupCollection(**dict.fromkeys(FIELD_NAMES))

CALLS: dict[str, Callable[[Path], Any]] = {
    "pgregistry.modules.grad_norm": lambda _: mm.grad_norm({}, ONE_MODULES),  # type: ignore[arg-type]
    "pgregistry.modules.count_zeros": lambda _: mm.count_zeros({}, ONE_MODULES),  # type: ignore[arg-type]
    "pgregistry.modules.clip_grad_norm_": lambda _: mm.clip_grad_norm_({}, 1.0, ONE_MODULES),  # type: ignore[arg-type]
    "pgregistry.modules.save_checkpoint": lambda path: mm.save_checkpoint(path, {}, ONE_MODULES),  # type: ignore[arg-type]
    "pgregistry.modules.load_checkpoint": lambda path: mm.load_checkpoint(path, {}, ONE_MODULES),  # type: ignore[arg-type]
    "seed_modules": lambda _: mm.seed_modules(1234, ONE_MODULES),  # type: ignore[arg-type]
    "build_optimizer": lambda _: mm.build_optimizer({}, ONE_MODULES),  # type: ignore[arg-type]
    "MultiModuleOptimizer": lambda _: mm.MultiModuleOptimizer({}, ONE_MODULES),  # type: ignore[arg-type]
}


@pytest.mark.parametrize("owner", sorted(CALLS))
def test_one_modules_collection_is_refused_naming_the_call_and_what_it_got(owner: str, tmp_path: Path) -> None:
    message = f"{owner} takes the job's MultiModuleCollection, got ProcessGroupCollection"
    with pytest.raises(TypeError) as refused:
        CALLS[owner](tmp_path / "checkpoint")
    assert str(refused.value) == message

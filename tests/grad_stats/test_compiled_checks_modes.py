"""``PGREGISTRY_COMPILED_CHECKS`` decides whether the compiled steady-state checks are built, and nothing is silent.

A machine without a compiler gets the Python checks and a warning naming the error (``auto``), or an error naming the
fix (``required``); ``off`` asks for no build; an unknown value is refused by name. A build that answers its probe
wrongly is refused in every mode. The build is replaced here by one that fails, or by a module whose answers are
wrong: what these tests check is what ``steady_checks`` does with each.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from pgregistry.grad_stats import _compiled


@pytest.fixture(autouse=True)
def _fresh_answer() -> Iterator[None]:
    """Each test asks anew (the answer is cached per process); the suite's own answer is restored after."""
    _compiled.steady_checks.cache_clear()
    yield
    _compiled.steady_checks.cache_clear()


def _no_compiler() -> object:
    raise OSError("no C++ compiler found")


def test_off_builds_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(_compiled.ENV, "off")
    monkeypatch.setattr(_compiled, "_build", _no_compiler)
    assert _compiled.steady_checks() is None


def test_auto_without_a_compiler_runs_the_python_checks_and_says_why(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv(_compiled.ENV, raising=False)
    monkeypatch.setattr(_compiled, "_build", _no_compiler)
    with caplog.at_level(logging.WARNING, logger=_compiled.__name__):
        assert _compiled.steady_checks() is None
    assert "compiled_checks_unavailable" in caplog.text
    assert "no C++ compiler found" in caplog.text


def test_required_without_a_compiler_raises_naming_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(_compiled.ENV, "required")
    monkeypatch.setattr(_compiled, "_build", _no_compiler)
    with pytest.raises(RuntimeError, match=r"could not be built: OSError\('no C\+\+ compiler found'\).*ninja"):
        _compiled.steady_checks()


def test_an_unknown_mode_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(_compiled.ENV, "yes")
    with pytest.raises(ValueError, match=r"PGREGISTRY_COMPILED_CHECKS='yes' is not one of auto, off, required"):
        _compiled.steady_checks()


@pytest.mark.parametrize("mode", ["auto", "required"])
def test_a_build_that_answers_wrongly_is_refused(monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    monkeypatch.setenv(_compiled.ENV, mode)
    wrong = SimpleNamespace(
        planned_pieces=lambda params, planned: list(params),  # every grad taken for the planned one
        same_holders=lambda empty, dicts, held: True,
        same_roles=lambda bare, roleless, blocks, keys, held: True,
    )
    monkeypatch.setattr(_compiled, "_build", lambda: wrong)
    with pytest.raises(RuntimeError, match="answered wrongly: planned_pieces .the planned grad., planned_pieces"):
        _compiled.steady_checks()


def test_a_lock_left_by_a_build_that_died_is_refused_by_name_not_waited_on(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """torch waits without end for a build lock; a process killed while building leaves one, and every later
    process would hang at its first grad statistic. The test's build folder is its own (``TORCH_EXTENSIONS_DIR``)."""
    monkeypatch.setenv(_compiled.ENV, "required")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    lock = tmp_path / _compiled.library_name() / "lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    lock.touch()
    old = time.time() - _compiled.STALE_LOCK_S - 60
    os.utime(lock, (old, old))
    with pytest.raises(RuntimeError, match=rf"{lock} is \d+ s old: a build .* died holding it.*remove it"):
        _compiled.steady_checks()


def test_a_lock_released_while_waiting_lets_the_build_go_on(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    lock = tmp_path / "lock"
    lock.touch()
    threading.Timer(1.0, lock.unlink).start()
    start = time.monotonic()
    _compiled._wait_for_other_builds(lock)
    assert 0.9 < time.monotonic() - start < 10


def test_a_built_library_is_imported_without_the_lock_and_a_broken_one_is_left_to_the_builder(tmp_path: Path) -> None:
    """Once built, the checks load without torch's build lock (which a rank killed while holding it would leave
    behind); a library that does not import (a build killed while linking) is not used."""
    assert _compiled._import_built("pgregistry_steady_checks_missing", tmp_path / "missing.so") is None
    broken = tmp_path / "pgregistry_steady_checks_broken.so"
    broken.write_bytes(b"not a library")
    assert _compiled._import_built("pgregistry_steady_checks_broken", broken) is None
    built = _compiled.steady_checks()
    if built is None:
        pytest.skip("the compiled checks are not built here")
    library = Path(built.__file__)
    again = _compiled._import_built(built.__name__, library)
    assert again is not None and callable(again.planned_pieces)

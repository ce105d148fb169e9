"""``PGREGISTRY_COMPILED_CHECKS`` decides whether the compiled steady-state checks are built, and nothing is silent.

A machine without a compiler gets the Python checks and a warning naming the error (``auto``), or an error naming the
fix (``required``); ``off`` asks for no build; an unknown value is refused by name. A build that answers its probe
wrongly is refused in every mode. The build is replaced here by one that fails, or by a module whose answers are
wrong: what these tests check is what ``steady_checks`` does with each.

Builders of one machine take turns through an ``flock`` beside torch's build folder: a live one is waited for, and a
torch lock left by one that died (a plain file torch would wait on without end) is removed. Those tests run torch's
own load, lock and import in subprocesses, in a private ``TORCH_EXTENSIONS_DIR``, the compiler's work replaced by a
copy of the library this session built.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
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
        planned_pieces=lambda params, planned, kept=None: list(params),  # every grad taken for the planned one
        same_holders=lambda empty, dicts, held: True,
        same_roles=lambda bare, roleless, blocks, keys, held: True,
        same_kinds_where_moved=lambda tensors, moved, held: True,  # every moved piece taken for its kind
    )
    monkeypatch.setattr(_compiled, "_build", lambda: wrong)
    with pytest.raises(RuntimeError, match="answered wrongly: planned_pieces .the planned grad., planned_pieces.*"
                       "same_kinds_where_moved .another shape."):
        _compiled.steady_checks()


HOLDER = """
import fcntl, shutil, sys
from pathlib import Path
from pgregistry.grad_stats import _compiled
folder, library = Path(sys.argv[1]), sys.argv[2]
with _compiled.builder_lock(folder).open("a") as held:
    fcntl.flock(held, fcntl.LOCK_EX)
    (folder / "lock").touch()  # torch's build lock, as its load takes it
    print("held", flush=True)
    sys.stdin.readline()  # building, until told to finish (or killed)
    shutil.copy(library, folder / (folder.name + ".so"))
    kept = (folder / "lock").exists()
    (folder / "lock").unlink(missing_ok=True)
sys.exit(0 if kept else 3)
"""
"""A builder: holds the flock and torch's lock until a line comes on its stdin, then leaves the library and releases
both; exit 3 where its torch lock was taken from it while it lived."""

BUILDER = """
import json, logging, shutil, sys
from pathlib import Path
from torch.utils import cpp_extension
from pgregistry.grad_stats import _compiled
logging.basicConfig(level=logging.INFO)
library = sys.argv[1]
compiled = []
def link(name, build_directory, **_):  # the compiler's work: the library this session built
    compiled.append(name)
    shutil.copy(library, Path(build_directory) / (name + ".so"))
cpp_extension._write_ninja_file_and_build_library = link
module = _compiled._build()
_compiled._require_right_answers(module)
print(json.dumps(compiled))
"""
"""``_build`` under torch's own load, lock and import, its compiler replaced by a copy of the library this session
built (a real build takes 25-66 s): prints the names compiled."""


@pytest.fixture
def built_library() -> str:
    built = _compiled.steady_checks()
    if built is None:
        pytest.skip("the compiled checks are not built here")
    return str(built.__file__)


@pytest.fixture
def started() -> Iterator[list[subprocess.Popen[str]]]:
    """The test's subprocesses, killed after it (a builder left waiting in torch's lock would wait without end)."""
    processes: list[subprocess.Popen[str]] = []
    yield processes
    for process in processes:
        if process.poll() is None:
            process.kill()
        process.communicate(timeout=60)


def _started(
    started: list[subprocess.Popen[str]], script: str, *args: str, env: dict[str, str]
) -> subprocess.Popen[str]:
    pipe = subprocess.PIPE
    command = [sys.executable, "-c", script, *args]
    started.append(
        subprocess.Popen(command, env=env, stdin=pipe, stdout=pipe, stderr=pipe, text=True)
    )
    return started[-1]


def _builder_waiting_on_a_holder(
    tmp_path: Path, library: str, started: list[subprocess.Popen[str]]
) -> tuple[subprocess.Popen[str], subprocess.Popen[str], Path, str]:
    """In a private ``TORCH_EXTENSIONS_DIR``: a holder of the build's flock and torch's lock, and a builder started
    after it, with the builder's log up to its wait for the flock (all of it where it did not wait)."""
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path)}
    folder = tmp_path / _compiled.library_name()
    folder.mkdir()
    holder = _started(started, HOLDER, str(folder), library, env=env)
    assert holder.stdout is not None and holder.stdout.readline() == "held\n", holder.communicate(
        timeout=60
    )
    builder = _started(started, BUILDER, library, env=env)
    assert builder.stderr is not None
    log = ""
    while "compiled_checks_waiting_for_another_build" not in log:
        line = builder.stderr.readline()
        if not line:  # it ended without waiting
            break
        log += line
    return holder, builder, folder, log


def test_a_lock_left_by_a_builder_that_died_is_removed_and_the_build_completes(
    tmp_path: Path, built_library: str, started: list[subprocess.Popen[str]]
) -> None:
    """A process takes the flock and torch's lock, then is killed while building; torch's lock stays (a plain file),
    the flock goes with its holder. The process waiting for the flock finds torch's lock, knows its maker dead,
    removes it (saying so) and builds: torch would have waited on it without end."""
    holder, builder, folder, log = _builder_waiting_on_a_holder(tmp_path, built_library, started)
    holder.kill()
    holder.communicate(timeout=60)
    out, err = builder.communicate(
        timeout=45
    )  # torch's wait on the lock, had it stayed, has no end
    assert builder.returncode == 0, log + err
    assert json.loads(out) == [folder.name], out
    assert "compiled_checks_dead_build_lock_removed" in err and str(folder / "lock") in err, (
        log + err
    )
    assert not (folder / "lock").exists()


def test_a_live_builder_is_waited_for_and_its_library_imported(
    tmp_path: Path, built_library: str, started: list[subprocess.Popen[str]]
) -> None:
    """A process building (the flock and torch's lock held) is waited for, its lock left alone; what it built is
    then imported, without a build of this process's own."""
    holder, builder, _, log = _builder_waiting_on_a_holder(tmp_path, built_library, started)
    assert "compiled_checks_waiting_for_another_build" in log, (
        log + builder.communicate(timeout=60)[1]
    )
    holder.communicate("finish\n", timeout=60)
    out, err = builder.communicate(timeout=60)
    assert holder.returncode == 0, "the live builder's torch lock was removed"
    assert builder.returncode == 0, log + err
    assert json.loads(out) == [], out
    assert "compiled_checks_dead_build_lock_removed" not in err, log + err


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

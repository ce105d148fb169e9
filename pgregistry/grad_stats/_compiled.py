"""The kept plan's steady-state checks compiled (``_steady_checks.cpp``), built once per machine.

Why: at 20,000 parameters a steady-state call is bound by its host work, and the checks that keep a
plan sound (the parameter set, the roles, each grad the one planned for at its address) cost 1.9x
the host floor in Python, each a C-speed ``map`` that still makes and drops a Python reference per
object (``docs/performance.md``). One compiled pass reads the same objects without that traffic,
and reads each grad as autograd holds it (no Python attribute lookup). The Python checks in
:mod:`pgregistry.grad_stats._plan` stay: they run wherever this cannot be built, and tests hold the
two to the same answers.

Built with torch's own C++ extension builder (a C++ compiler and ``ninja``, ``pip install
pgregistry[compiled]``) into torch's extension cache (``TORCH_EXTENSIONS_DIR``, by default under
``~/.cache/torch_extensions``): 22-66 s the first time on a machine (the 2-core machine, idle and
loaded), then imported directly, without any lock (:func:`_import_built`). Ranks of one machine
building at once wait for one build: each builds only while holding an ``flock`` of a file beside
torch's build folder (:func:`_sole_builder`), which the kernel releases when its holder dies.
torch's own build lock is a plain file that a killed build leaves behind, and torch waits on it
without end; the ``flock``'s holder knows that any such file is a dead build's (a live builder
would hold the ``flock``) and removes it, with a warning.

``PGREGISTRY_COMPILED_CHECKS`` chooses: ``auto`` (unset: build where a compiler and ninja are, else
the Python checks, with a warning saying why), ``off`` (the Python checks), ``required`` (raise
where it cannot be built). A build that works but answers a probe wrongly raises in every mode: a
check that answers wrongly must not run.
"""

from __future__ import annotations

import contextlib
import enum
import fcntl
import functools
import hashlib
import importlib.util
import operator
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Final

__all__ = ["ENV", "builder_lock", "library_name", "steady_checks"]

ENV: Final = "PGREGISTRY_COMPILED_CHECKS"


class _Mode(enum.Enum):
    """What :data:`ENV` asks for: the compiled checks where they build, never, or without fail."""

    AUTO = "auto"
    OFF = "off"
    REQUIRED = "required"


_SOURCE: Final = Path(__file__).with_name("_steady_checks.cpp")
_LOCKING: Final = b"builders hold an flock beside the build folder"
"""Part of the build's name: a build folder whose every builder takes :func:`_sole_builder`'s
``flock`` (a pgregistry that did not would share the folder and have its live lock removed)."""


def _mode_from_environment() -> _Mode:
    """The mode :data:`ENV` asks for (``auto`` where unset), refused by name where unknown."""
    value = os.environ.get(ENV) or _Mode.AUTO.value
    try:
        return _Mode(value)
    except ValueError:
        known = ", ".join(mode.value for mode in _Mode)
        raise ValueError(f"{ENV}={value!r} is not one of {known}") from None


@functools.cache
def steady_checks() -> ModuleType | None:
    """The compiled checks, built and probed once per process, or ``None`` (the Python checks).

    ``None`` where :data:`ENV` is ``off``, or where the build fails under ``auto`` (a warning names
    the error); the build's error where it is ``required``. ``RuntimeError`` where the built module
    answers the probe wrongly."""
    mode = _mode_from_environment()
    if mode is _Mode.OFF:
        return None
    try:
        module = _build()
    except Exception as error:  # no compiler, no ninja, no headers: the Python checks, said so
        if mode is _Mode.REQUIRED:
            raise RuntimeError(
                f"{ENV}=required, but pgregistry's compiled checks could not be built: {error!r}; "
                "install a C++ compiler and ninja (pip install pgregistry[compiled]), or unset it"
            ) from error
        from pgregistry._runtime.logger import get_logger

        get_logger(__name__).warning(
            "compiled_checks_unavailable",
            error=repr(error),
            fix=f"install a C++ compiler and ninja (pip install pgregistry[compiled]); {ENV}=off "
            "chooses the Python checks without trying",
        )
        return None
    _require_right_answers(module)
    return module


def _build() -> ModuleType:
    """Build (or load from torch's extension cache) :data:`_SOURCE`.

    Named by a hash of the source and torch's version: two copies of pgregistry that differ (a
    newer release, a planted bug in ``scripts/mutants.py``'s copy) or two torches never share a
    build, so none loads what another built."""
    from torch.utils import cpp_extension

    name = library_name()
    folder = Path(cpp_extension._get_build_directory(name, verbose=False))
    library = folder / f"{name}.so"
    built = _import_built(name, library)
    if built is not None:
        return built
    with _sole_builder(folder):
        built = _import_built(name, library)  # the build this process waited for
        if built is not None:
            return built
        with _ninja_on_path():
            return cpp_extension.load(
                name=name,
                sources=[str(_SOURCE)],
                extra_cflags=["-O2"],
                verbose=False,
            )


def library_name() -> str:
    """The build's name: a hash of :data:`_SOURCE`, torch's version and :data:`_LOCKING`.

    See :func:`_build`."""
    import torch

    named = _SOURCE.read_bytes() + torch.__version__.encode() + _LOCKING
    return f"pgregistry_steady_checks_{hashlib.sha256(named).hexdigest()[:16]}"


def builder_lock(folder: Path) -> Path:
    """The file whose ``flock`` a process holds while it builds into torch's build ``folder``."""
    return folder.with_name(f"{folder.name}.builder.lock")


def _import_built(name: str, library: Path) -> ModuleType | None:
    """The module ``name`` imported from ``library`` where a build left it, else ``None``.

    Its name holds its source's hash and torch's version, so a library of that name is this build:
    imported as torch's builder imports it, without a lock, which every process of a job would
    otherwise take in turn at its first grad statistic. A library that does not import (a build
    killed while linking it) is left to torch's builder, which makes it again."""
    if not library.is_file():
        return None
    spec = importlib.util.spec_from_file_location(name, library)
    if spec is None or spec.loader is None:
        return None
    try:
        module = importlib.util.module_from_spec(spec)  # an extension is opened here
        spec.loader.exec_module(module)
    except ImportError:
        return None
    return module


@contextlib.contextmanager
def _sole_builder(folder: Path) -> Iterator[None]:
    """Hold :func:`builder_lock`'s ``flock``, waiting for a live holder; remove a dead build's lock.

    torch takes its build lock, ``folder / "lock"``, a plain file, for every load, built or not, and
    waits for it without end: a process killed while building (a job stopped in its first minute)
    leaves it, and every later process would wait at its first grad statistic. The ``flock`` has an
    owner: the kernel releases it when its holder dies, and every builder holds it around torch's
    load. So the holder that finds torch's lock knows its maker is dead, and removes it."""
    from pgregistry._runtime.logger import get_logger

    logger = get_logger(__name__)
    with builder_lock(folder).open("a") as held:
        try:
            fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("compiled_checks_waiting_for_another_build", lock=str(held.name))
            fcntl.flock(held, fcntl.LOCK_EX)
        torch_lock = folder / "lock"
        if torch_lock.exists():
            torch_lock.unlink()
            logger.warning(
                "compiled_checks_dead_build_lock_removed",
                lock=str(torch_lock),
                why="a build died holding it (a live one would hold the flock of "
                f"{held.name}); torch would have waited on it without end",
            )
        yield  # closing the file releases the flock


@contextlib.contextmanager
def _ninja_on_path() -> Iterator[None]:
    """Put the ``ninja`` of this environment on ``PATH`` for the build, where ``PATH`` lacks one.

    torch's builder runs ``ninja`` from ``PATH``; a virtual environment that was not activated has
    it in its own ``bin`` only. ``PATH`` is restored after."""
    old = os.environ.get("PATH")
    folder = str(Path(sys.executable).parent)
    if shutil.which("ninja") is None and shutil.which("ninja", path=folder) is not None:
        os.environ["PATH"] = os.pathsep.join(filter(None, [folder, old]))
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("PATH", None)
        else:
            os.environ["PATH"] = old


def _require_right_answers(module: ModuleType) -> None:
    """Ask each check questions of known answers; ``RuntimeError`` naming any answered wrongly."""
    import torch

    param = torch.nn.Parameter(torch.zeros(2))
    grad = param.grad = torch.ones(2)
    planned = torch.tensor([[grad._cdata, grad.data_ptr()]], dtype=torch.int64)
    moved = torch.tensor([[grad._cdata, grad.data_ptr() + 4]], dtype=torch.int64)
    other = torch.nn.Parameter(torch.zeros(3))
    other_grad = other.grad = torch.ones(3)
    both = torch.tensor([*planned.tolist(), [other_grad._cdata, other_grad.data_ptr()]])
    second_moved = torch.tensor([*planned.tolist(), [other_grad._cdata, 8]])
    first_kept = torch.tensor([True, False])
    held = {"a": param}
    end = object()
    answers = {
        "planned_pieces (the planned grad)": _same_list(
            module.planned_pieces([param], planned), [grad]
        ),
        "planned_pieces (a grad moved)": module.planned_pieces([param], moved) is None,
        "planned_pieces (the first kept)": _same_list(
            module.planned_pieces([param, other], both, first_kept), [grad, None]
        ),
        "planned_pieces (the first kept, the second moved)": module.planned_pieces(
            [param, other], second_moved, first_kept
        )
        is None,
        "same_holders (the same)": module.same_holders([{}], [held], [param, end]),
        "same_holders (one more)": not module.same_holders([{}], [held], [end]),
        "same_roles (the same)": module.same_roles([{}], [{}], [[{"k": 1}]], ("k",), [[1]]),
        "same_roles (another value)": not module.same_roles([], [], [[{"k": 1}]], ("k",), [[2]]),
        "same_kinds_where_moved (the same)": module.same_kinds_where_moved(
            [grad], [True], [grad.device, grad.shape]
        )
        is True,
        "same_kinds_where_moved (another shape)": module.same_kinds_where_moved(
            [grad], [True], [grad.device, torch.Size([1, 2])]
        )
        is False,
    }
    wrong = [question for question, right in answers.items() if not right]
    if wrong:
        raise RuntimeError(
            f"pgregistry's compiled checks answered wrongly: {', '.join(wrong)}; set {ENV}=off "
            "and report it"
        )


def _same_list(got: object, want: list[object]) -> bool:
    return isinstance(got, list) and len(got) == len(want) and all(map(operator.is_, got, want))

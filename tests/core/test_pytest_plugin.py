"""Every documented way to turn fallbacks into errors fails a pytest test that falls back (docs/migrating.md).

Each case runs a real pytest in a subprocess on a two-test file in a fresh directory: one test falls back
through the public warning function, the other does not. Before the pytest plugin, ``python -W`` and
``PYTHONWARNINGS`` gave "2 passed, 1 warning": pytest runs every test inside ``warnings.catch_warnings``, which
dropped the filter pgregistry re-applies when imported at collection.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

_ERROR_FLAG = "error::pgregistry.ProcessGroupFallbackWarning"

_TESTS = """
    import pytest
    from pgregistry.fallback import warn_fallback


    def test_falls_back():
        warn_fallback("my_consumer", "tp")


    def test_does_not_fall_back():
        pass


    @pytest.mark.filterwarnings("ignore::pgregistry.ProcessGroupFallbackWarning")
    def test_falls_back_where_a_mark_ignores_it():
        warn_fallback("marked_consumer", "dp")
"""


def _run_pytest(
    tmp_path: Path, *, python_flags: tuple[str, ...] = (), pytest_flags: tuple[str, ...] = (),
    ini: str = "", env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    (tmp_path / "test_fallback_user.py").write_text(textwrap.dedent(_TESTS))
    (tmp_path / "pytest.ini").write_text("[pytest]\n" + ini)
    environment = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHONWARNINGS", "PYTEST_"))}
    environment.update(env or {})
    return subprocess.run(
        [sys.executable, *python_flags, "-m", "pytest", "-q", "-p", "no:cacheprovider", *pytest_flags],
        cwd=tmp_path, env=environment, capture_output=True, text=True, timeout=90,
    )


def _assert_only_the_fallback_failed(done: subprocess.CompletedProcess[str]) -> None:
    output = done.stdout + done.stderr
    assert done.returncode == 1, output
    assert "1 failed, 2 passed" in output, output
    assert "FAILED test_fallback_user.py::test_falls_back " in output, output
    assert "ProcessGroupFallbackWarning: my_consumer was not given process group 'tp'" in output, output


def test_without_a_filter_the_fallback_only_warns(tmp_path: Path) -> None:
    done = _run_pytest(tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "3 passed, 1 warning" in done.stdout


@pytest.mark.parametrize(
    "way",
    [
        "python -W", "PYTHONWARNINGS", "pytest -W", "pytest filterwarnings ini", "python -W, plugin autoload off",
        "PYTHONWARNINGS without the package prefix",
    ],
)
def test_each_documented_way_fails_the_test_that_falls_back(tmp_path: Path, way: str) -> None:
    if way == "python -W":
        done = _run_pytest(tmp_path, python_flags=("-W", _ERROR_FLAG))
    elif way == "PYTHONWARNINGS":
        done = _run_pytest(tmp_path, env={"PYTHONWARNINGS": _ERROR_FLAG})
    elif way == "PYTHONWARNINGS without the package prefix":
        done = _run_pytest(tmp_path, env={"PYTHONWARNINGS": "error::ProcessGroupFallbackWarning"})
    elif way == "pytest -W":
        done = _run_pytest(tmp_path, pytest_flags=("-W", _ERROR_FLAG))
    elif way == "pytest filterwarnings ini":
        done = _run_pytest(tmp_path, ini=f"filterwarnings =\n    {_ERROR_FLAG}\n")
    else:
        done = _run_pytest(
            tmp_path, python_flags=("-W", _ERROR_FLAG), pytest_flags=("-p", "pgregistry.testing._pytest_plugin"),
            env={"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"},
        )
    _assert_only_the_fallback_failed(done)


def test_a_later_interpreter_option_keeps_its_precedence(tmp_path: Path) -> None:
    """``-W error::...ProcessGroupFallbackWarning -W ignore::UserWarning``: the later option wins, as in Python."""
    done = _run_pytest(tmp_path, python_flags=("-W", _ERROR_FLAG, "-W", "ignore::UserWarning"))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "3 passed in" in done.stdout


def test_the_ini_file_overrides_the_interpreter_option(tmp_path: Path) -> None:
    """pytest's own filters take precedence over the interpreter's, for this category as for any other."""
    ini = "filterwarnings =\n    ignore::pgregistry.ProcessGroupFallbackWarning\n"
    done = _run_pytest(tmp_path, python_flags=("-W", _ERROR_FLAG), ini=ini)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "3 passed in" in done.stdout

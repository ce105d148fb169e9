"""The pre-commit hook installs and imports only what the scanner needs: no torch, no attrs, no structlog.

The scanner's dependencies are poisoned (a module of that name on ``sys.path`` that raises on import), so a
hook that reached any of them fails here, whatever is installed in the test environment."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from fixtures.scan_projects import Project

REPO = Path(__file__).resolve().parents[2]
HOOK = REPO / "tools" / "allowlist_hook.py"


def _poisoned(directory: Path, *names: str) -> dict[str, str]:
    for name in names:
        package = directory / name
        package.mkdir(parents=True)
        (package / "__init__.py").write_text(f"raise ImportError('the allowlist scanner imported {name}')\n")
    return {**os.environ, "PYTHONPATH": str(directory)}


def _run(arguments: list[str], project: Project, environment: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *arguments], cwd=project.root, env=environment, text=True, capture_output=True, timeout=90
    )


def _hook_entry() -> tuple[str, str]:
    """(language, entry) of the ``pgregistry-allowlist`` hook, read from .pre-commit-hooks.yaml."""
    text = (REPO / ".pre-commit-hooks.yaml").read_text()
    block = text.split("- id: pgregistry-allowlist\n", 1)[1].split("\n- id:", 1)[0]
    fields = dict(line.strip().split(": ", 1) for line in block.splitlines() if ": " in line)
    return fields["language"], fields["entry"]


def test_the_hook_installs_nothing_and_runs_with_the_standard_library(
    project: Project, tmp_path_factory: pytest.TempPathFactory
) -> None:
    language, entry = _hook_entry()
    assert language == "script"  # pre-commit installs nothing for it (a python hook would pip-install torch)
    script, *arguments = entry.split()
    assert (REPO / script).resolve() == HOOK and os.access(HOOK, os.X_OK)
    project.write("src/pkg/model.py", "import megatron.core.parallel_state as ps\nps.get_data_parallel_group()\n")
    environment = _poisoned(tmp_path_factory.mktemp("poison"), "torch", "attrs", "structlog")
    update = _run([str(HOOK), "update"], project, environment)
    assert update.returncode == 0, update.stderr
    check = _run([str(HOOK), *arguments], project, environment)
    assert check.returncode == 0, check.stderr
    assert "allowlist check passed: 1 allowed read" in check.stdout


def test_python_m_pgregistry_allowlist_never_imports_torch(
    project: Project, tmp_path_factory: pytest.TempPathFactory
) -> None:
    project.write("src/pkg/model.py", "import megatron.core.parallel_state as ps\nps.get_data_parallel_group()\n")
    environment = _poisoned(tmp_path_factory.mktemp("poison"), "torch")
    environment["PYTHONPATH"] += os.pathsep + str(REPO)
    done = _run(["-m", "pgregistry.allowlist", "stats"], project, environment)
    assert done.returncode == 0, done.stderr
    assert "1 read of global process-group state" in done.stdout

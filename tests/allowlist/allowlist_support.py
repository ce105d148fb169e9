"""Helpers shared by the allowlist tests: sources scanned in memory, and throw-away projects on disk.

Imported by the test modules beside it (pytest puts this directory on ``sys.path``); the ``project`` fixture
is re-exported by ``conftest.py``."""

from __future__ import annotations

import subprocess
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from pgregistry.allowlist._config import ScanConfig
from pgregistry.allowlist._scanner import FileResult, scan_source

PYPROJECT = """\
[tool.pgregistry.allowlist]
roots = ["src"]
allowlist = "allowlist.json"
"""


def scan(source: str, path: str = "pkg/mod.py", config: ScanConfig | None = None) -> FileResult:
    """Scan dedented ``source`` as if it were the file ``path``."""
    return scan_source(textwrap.dedent(source).encode(), path, config or ScanConfig())


def keys(source: str, path: str = "pkg/mod.py", config: ScanConfig | None = None) -> list[str]:
    """The sorted allowlist keys of ``source``'s sites; fails the test if it does not parse."""
    result = scan(source, path, config)
    assert result.failure is None, result.failure
    return sorted(site.key for site in result.sites)


class Project:
    """A project directory with a ``pyproject.toml``; the test runs with it as the working directory."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def write(self, path: str, text: str) -> Path:
        target = self.root / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(textwrap.dedent(text))
        return target

    def read(self, path: str) -> str:
        return (self.root / path).read_text()


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Project]:
    monkeypatch.chdir(tmp_path)
    result = Project(tmp_path)
    result.write("pyproject.toml", PYPROJECT)
    result.write("src/pkg/__init__.py", "")
    yield result


def git(project: Project, *args: str) -> None:
    """Run git in the project (a throw-away identity for commits)."""
    subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=project.root, check=True, capture_output=True,
        timeout=60,
    )


#: A function with three reads of ``get_data_parallel_group`` (lines 5, 7, 8) and one of the TP rank (line 6).
THREE = """
import megatron.core.parallel_state as ps

def step():
    a = ps.get_data_parallel_group()
    b = ps.get_tensor_model_parallel_rank()
    c = ps.get_data_parallel_group()
    d = ps.get_data_parallel_group()
    return a, b, c, d
"""

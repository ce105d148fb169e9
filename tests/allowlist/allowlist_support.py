"""Helpers shared by the allowlist tests: sources scanned in memory, and throw-away projects on disk.

Imported by the test modules beside it (pytest puts this directory on ``sys.path``); the ``project`` fixture
is re-exported by ``conftest.py``."""

from __future__ import annotations

import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from pgregistry.allowlist.config import ScanConfig
from pgregistry.allowlist.scanner import FileResult, scan_source

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

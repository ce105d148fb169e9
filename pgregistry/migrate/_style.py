"""The migrated tree's own settings: its line length (from its formatter's and linters'
configuration) and ``[tool.pgregistry.migrate]`` in its ``pyproject.toml``.

The line length is the first of: ruff's ``line-length`` (``ruff.toml``, ``.ruff.toml``,
``[tool.ruff]``), black's (``[tool.black]``), flake8's ``max-line-length`` (``.flake8``,
``setup.cfg``, ``tox.ini``); else 100 (Megatron-Core's).
"""

from __future__ import annotations

import configparser
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pgregistry._source.config import ConfigError
from pgregistry._source.config import read_toml as _read_toml
from pgregistry._source.files import read_regular_file

__all__ = ["DEFAULT_WIDTH", "line_length", "migrate_settings"]

DEFAULT_WIDTH = 100


def _positive_int(value: object, where: str) -> int:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, str))
        or not str(value).strip().isdigit()
    ):
        raise ConfigError(f"{where} must be a positive whole number, not {value!r}")
    return int(value)


def _tool_table(data: Mapping[str, Any], *names: str) -> Mapping[str, Any]:
    node: Any = data
    for name in ("tool", *names):
        node = node.get(name, {}) if isinstance(node, Mapping) else {}
    return node if isinstance(node, Mapping) else {}


def line_length(root: Path) -> int:
    """The line length the project at ``root`` keeps to (see the module docstring)."""
    for name in ("ruff.toml", ".ruff.toml"):
        if (root / name).is_file():
            data = _read_toml(root / name)
            if "line-length" in data:
                return _positive_int(data["line-length"], f"{root / name}: line-length")
    pyproject = root / "pyproject.toml"
    data = _read_toml(pyproject) if pyproject.is_file() else {}
    for tool in ("ruff", "black"):
        table = _tool_table(data, tool)
        if "line-length" in table:
            return _positive_int(table["line-length"], f"{pyproject}: [tool.{tool}] line-length")
    for name in (".flake8", "setup.cfg", "tox.ini"):
        parser = configparser.ConfigParser(interpolation=None)
        try:
            text, _ = read_regular_file(root / name)  # a FIFO there is passed over, not waited on
        except OSError:  # none there (or no regular file): as configparser passes one over
            continue
        try:
            parser.read_string(text.decode("utf-8"), str(root / name))
        except (configparser.Error, UnicodeDecodeError) as error:
            raise ConfigError(f"{root / name} cannot be read: {error}") from None
        if parser.has_option("flake8", "max-line-length"):
            return _positive_int(
                parser.get("flake8", "max-line-length"), f"{root / name}: [flake8] max-line-length"
            )
    return DEFAULT_WIDTH


def migrate_settings(root: Path) -> Mapping[str, Any]:
    """``[tool.pgregistry.migrate]`` of ``root``'s ``pyproject.toml`` (empty when there is none).

    A key other than ``helper-module`` is refused (``ConfigError`` naming it)."""
    pyproject = root / "pyproject.toml"
    table = (
        _tool_table(_read_toml(pyproject), "pgregistry", "migrate") if pyproject.is_file() else {}
    )
    unknown = sorted(set(table) - {"helper-module"})
    if unknown:
        raise ConfigError(
            f"{pyproject}: [tool.pgregistry.migrate] has no "
            f"setting {unknown[0]!r} (known: helper-module)"
        )
    module = table.get("helper-module")
    if module is not None and not isinstance(module, str):
        raise ConfigError(
            f"{pyproject}: [tool.pgregistry.migrate] helper-module must be a dotted module name"
        )
    return table

"""The ``pgregistry`` command table: every command and option is documented, and loading it imports no torch."""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections.abc import Iterator

from pgregistry.cli import _build_parser as build_parser


def _parsers(parser: argparse.ArgumentParser, path: str) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    """``parser`` and every sub-command parser below it, with the command path that reaches it."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, f"{path} {name}")


def _undocumented(parser: argparse.ArgumentParser) -> list[str]:
    return [
        "/".join(action.option_strings) or action.dest
        for action in parser._actions
        if not isinstance(action, argparse._SubParsersAction) and not (action.help or "").strip()
    ]


def test_every_option_of_every_command_has_help() -> None:
    parsers = list(_parsers(build_parser(), "pgregistry"))
    commands = {path for path, _ in parsers}
    assert {"pgregistry layout", "pgregistry seed-plan", "pgregistry verify", "pgregistry allowlist check"} <= commands
    missing = {path: names for path, parser in parsers if (names := _undocumented(parser))}
    assert missing == {}


def test_the_walk_finds_an_option_without_help() -> None:
    parser = argparse.ArgumentParser()
    parser.add_subparsers().add_parser("sub").add_argument("--bare")
    found = {path: _undocumented(sub) for path, sub in _parsers(parser, "top")}
    assert found == {"top": [], "top sub": ["--bare"]}


def test_every_command_has_a_help_line() -> None:
    for action in build_parser()._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: (choice.help or "").strip() for choice in action._choices_actions}
            assert helps and all(helps.values()), helps


def test_building_the_command_table_imports_no_torch() -> None:
    code = "import sys; from pgregistry.cli import _build_parser; _build_parser(); assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)

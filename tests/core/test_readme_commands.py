"""The README's ``pgregistry layout`` commands ("Seeing the layout") run, each with the exit code it
states (``# exit 1: ...``; else 0), and the picture command writes its picture.

The commands are run as the README prints them, in-process through :func:`pgregistry.cli.main`, the
picture's file put in a temporary directory.
"""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from pgregistry.cli import main

ROOT = Path(__file__).resolve().parents[2]


def readme_layout_commands(readme: str) -> list[tuple[list[str], int]]:
    """(arguments after ``pgregistry``, stated exit code) of each line of the "Seeing the layout" block."""
    section = readme.split("## Seeing the layout", 1)[1]
    block = section.split("```\n", 2)[1]
    commands = []
    for line in block.splitlines():
        command, _, comment = line.partition("   #")
        words = shlex.split(command)
        assert words[0] == "pgregistry", line
        commands.append((words[1:], 1 if comment.strip().startswith("exit 1") else 0))
    return commands


def test_the_readme_shows_three_layout_commands_one_of_them_failing_its_check() -> None:
    commands = readme_layout_commands((ROOT / "README.md").read_text(encoding="utf-8"))
    assert len(commands) == 3 and [code for _, code in commands] == [1, 0, 0]


@pytest.mark.parametrize("index", range(3))
def test_each_readme_layout_command_exits_as_the_readme_says(
    index: int, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    arguments, stated = readme_layout_commands((ROOT / "README.md").read_text(encoding="utf-8"))[index]
    picture = tmp_path / "layout.svg"
    arguments = [str(picture) if word == "layout.svg" else word for word in arguments]
    assert main(arguments) == stated, capsys.readouterr().err
    if "--svg" in arguments:
        assert "<svg " in picture.read_text(encoding="utf-8")

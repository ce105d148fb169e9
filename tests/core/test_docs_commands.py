"""The ``pgregistry`` commands the README and docs/ show name only options their command has, and the
README's command list runs.

A command line in a page (a line of a code block, or an inline code span, that calls ``pgregistry``)
is matched to its command (``layout``, ``allowlist check``, ...) in the real command table; each
``--option`` it names must be one of that command's. An option renamed or dropped in the code, or
misspelled in a page, leaves a reader a command that exits 2: this finds it. The one line a page
shows on purpose with an option its command lacks (to say it is refused) is listed here and must
stay refused.

The README's "Command line" list gives each command as a template (``[--json]`` optional,
``FILE`` a placeholder); each item of a command that computes from its options alone (``layout``,
``seed-plan``; the others read a tree or need a world) with nothing left to fill in once its
optional parts are dropped runs, without them and with those that need no value, and exits 0.
"""

from __future__ import annotations

import argparse
import re
import shlex
from collections.abc import Iterator
from pathlib import Path

import pytest

from pgregistry.cli import _build_parser as build_parser
from pgregistry.cli import main

ROOT = Path(__file__).resolve().parents[2]
PAGES = ["README.md", "CONTRIBUTING.md"] + sorted(
    str(path.relative_to(ROOT)) for path in (ROOT / "docs").glob("*.md")
)
REFUSED_ON_PURPOSE = {
    # docs/reliability.md: an option is spelled in full, never taken for a longer one it starts
    "pgregistry seed-plan --num-ranks 8 --seed 1 --rank 2": "--rank",
}
_COMMAND = re.compile(
    r"(?:^|[\s(])(?:python3? -m |torchrun .*-m )?pgregistry((?: [a-z][a-z-]*)+.*)$"
)
_OPTION = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")


def _command_lines(text: str) -> Iterator[str]:
    """Each line of a code block, then each inline code span outside them."""
    for block in re.finditer(r"```[^\n]*\n(.*?)```", text, re.DOTALL):
        yield from block.group(1).splitlines()
    for span in re.finditer(r"`([^`\n]+)`", re.sub(r"```.*?```", "", text, flags=re.DOTALL)):
        yield span.group(1)


def _commands(
    parser: argparse.ArgumentParser, path: tuple[str, ...] = ()
) -> Iterator[tuple[tuple[str, ...], set[str]]]:
    """Every command path of the table (``()``, ``("allowlist", "check")``, ...) with its options."""
    yield path, {option for action in parser._actions for option in action.option_strings}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _commands(sub, (*path, name))


def unknown_options(text: str, table: dict[tuple[str, ...], set[str]]) -> list[str]:
    """``option (line)`` for each option a command line of ``text`` names that its command lacks."""
    unknown = []
    for line in _command_lines(text):
        found = _COMMAND.search(line)
        if found is None:
            continue
        path: tuple[str, ...] = ()
        for word in found.group(1).split():
            if (*path, word) not in table:
                break
            path = (*path, word)
        for option in _OPTION.findall(found.group(1)):
            if option not in table[path] and REFUSED_ON_PURPOSE.get(line.strip()) != option:
                unknown.append(f"{option} ({line.strip()})")
    return unknown


def _table() -> dict[tuple[str, ...], set[str]]:
    return dict(_commands(build_parser()))


def test_every_option_a_page_gives_a_command_is_one_of_its_options() -> None:
    table = _table()
    faults = {
        page: found
        for page in PAGES
        if (found := unknown_options((ROOT / page).read_text(), table))
    }
    assert faults == {}


def test_a_misspelled_option_and_an_option_of_another_command_are_found() -> None:
    text = (
        "```\npgregistry layout --num-ranks 8 --expt-tp 1 --etp 2\n```\n"
        "`pgregistry allowlist stats --since main --base main`, `pgregistry seed-plan --seed 1 --rank 2`"
    )
    assert unknown_options(text, _table()) == [
        "--etp (pgregistry layout --num-ranks 8 --expt-tp 1 --etp 2)",
        "--base (pgregistry allowlist stats --since main --base main)",
        "--rank (pgregistry seed-plan --seed 1 --rank 2)",
    ]


@pytest.mark.parametrize("line", sorted(REFUSED_ON_PURPOSE))
def test_the_line_shown_refused_is_refused(line: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as refused:
        main(shlex.split(line)[1:])
    assert refused.value.code == 2
    assert REFUSED_ON_PURPOSE[line] in capsys.readouterr().err


def readme_list_commands(readme: str) -> list[list[str]]:
    """The README "Command line" items of ``layout`` and ``seed-plan`` with nothing to fill in once
    their ``[...]`` parts are dropped: each without those parts, then with those that take no value."""
    section = readme.split("## Command line", 1)[1].split("\n## ", 1)[0]
    runs = []
    for item in re.findall(r"^- `pgregistry ([^`]+)`", section, re.MULTILINE):
        required = re.sub(r"\s*\[[^\]]*\]", "", item)
        if (
            required.split()[0] not in ("layout", "seed-plan")
            or "..." in required
            or re.search(r"\b[A-Z]+\b|\|", required)
        ):
            continue
        flags = [
            part for part in re.findall(r"\[([^\]]*)\]", item) if re.fullmatch(r"--[a-z-]+", part)
        ]
        runs += [shlex.split(required), shlex.split(required) + flags]
    return runs


def test_the_readme_command_list_holds_runnable_items() -> None:
    runs = readme_list_commands((ROOT / "README.md").read_text(encoding="utf-8"))
    assert [run[0] for run in runs] == ["layout", "layout", "seed-plan", "seed-plan"]
    assert "--json" in runs[1] and "--check" in runs[3]


@pytest.mark.parametrize("index", range(4))
def test_each_runnable_readme_list_item_exits_0(
    index: int, capsys: pytest.CaptureFixture[str]
) -> None:
    arguments = readme_list_commands((ROOT / "README.md").read_text(encoding="utf-8"))[index]
    assert main(arguments) == 0, capsys.readouterr().err

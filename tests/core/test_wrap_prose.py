"""scripts/wrap_prose.py rewraps long prose and keeps its structure (issue 39).

The lead re-runs it after merges, so a second run must change nothing, and what it must never
move (doctests, literal blocks, tables, pragmas) is checked here on one docstring and one comment
block that hold each kind.
"""

from __future__ import annotations

from pathlib import Path

from fixtures.module_files import module_from_file

ROOT = Path(__file__).resolve().parents[2]


WRAP = module_from_file("pgregistry_wrap_prose", ROOT / "scripts" / "wrap_prose.py")
WORDS = " ".join(f"word{index}" for index in range(30))
LONG_DOCTEST = ">>> " + " + ".join(["1"] * 40)
DOCTEST_OUTPUT = "output " + WORDS
# Two words that fill a row to 96 or 97 columns: the word after them must start the next row.
FILLER = "a" * 40 + " " + "b" * 49
SOURCE = f'''
def f(x):
    """Summary.

    {WORDS} Megatron-
    Core {WORDS}

    - a bullet {WORDS}
    * another

    {FILLER}bbb >>> is the prompt and - a dash

    Args:
        x: the first entry {WORDS}
        y: short.

    Returns:
        {WORDS}

    {LONG_DOCTEST}
    {DOCTEST_OUTPUT}

    Example::

        call({WORDS})

    | a table row {WORDS} |
    """
    # a comment {WORDS} type: ignore noqa
    # - a bullet {WORDS}
    # {FILLER} type: ignore
    # {FILLER} - a dash
    return x  # type: ignore[no-any-return]  # a trailing comment {WORDS}
'''


def test_rewraps_long_prose_keeping_its_structure() -> None:
    wrapped = WRAP.wrap_source(SOURCE).text
    lines = wrapped.split("\n")
    kept = {
        LONG_DOCTEST,
        DOCTEST_OUTPUT,
        f"call({WORDS})",
        f"| a table row {WORDS} |",
        "return x  # type: ignore",
    }
    for line in lines:
        if not any(verbatim in line for verbatim in kept):
            assert len(line) <= 100, line
    # What must not move stays on its line, as it was; the doctest's output too.
    for verbatim in kept:
        assert any(line.strip().startswith(verbatim) for line in lines), verbatim
    assert f"    {LONG_DOCTEST}\n    {DOCTEST_OUTPUT}\n" in wrapped
    # Bullets, entries and comments keep their hanging indents; no continuation starts a bullet.
    assert "    - a bullet word0" in wrapped and "\n    * another\n" in wrapped
    assert "\n      word" in wrapped  # the bullet's continuation
    assert "        x: the first entry word0" in wrapped and "\n            word" in wrapped
    assert "\n        y: short.\n" in wrapped
    assert "\n    # - a bullet word0" in wrapped and "\n    #   word" in wrapped
    # A word hyphenated at a line's end is joined; a pragma word never starts a comment line.
    assert "Megatron-Core" in wrapped
    assert not any(line.lstrip().startswith(("# type:", "# noqa", "# - a dash")) for line in lines)
    assert not any(line.lstrip().startswith((">>> is", "- a dash")) for line in lines)
    assert "\n    " + "b" * 52 + " >>> is the prompt" in wrapped
    assert WRAP.normalized_dump(wrapped) == WRAP.normalized_dump(SOURCE)
    assert WRAP.comment_words(wrapped) == WRAP.comment_words(SOURCE)


def test_a_second_run_changes_nothing() -> None:
    once = WRAP.wrap_source(SOURCE).text
    assert WRAP.wrap_source(once).text == once


def test_check_sees_a_changed_string_but_not_rewrapped_docstrings() -> None:
    assert WRAP.normalized_dump('"""a b\n  c"""\nx = "s"') == WRAP.normalized_dump(
        '"""a b c"""\nx = "s"'
    )
    assert WRAP.normalized_dump('x = "a" "b"') == WRAP.normalized_dump('x = "ab"')
    assert WRAP.normalized_dump('x = "a b"') != WRAP.normalized_dump('x = "a  b"')


def test_finds_a_docstring_whose_last_line_holds_non_ascii() -> None:
    # ``ast`` counts columns in UTF-8 bytes, tokenize in characters: ``±`` makes them differ.
    source = f'def g():\n    """{WORDS} {WORDS}\n    ±2."""\n'
    wrapped = WRAP.wrap_source(source).text
    assert max(len(line) for line in wrapped.split("\n")) <= 100
    assert WRAP.normalized_dump(wrapped) == WRAP.normalized_dump(source)


STRINGS = f"""
ADVICE = "every rank must build {WORDS}"


def f(name, parser):
    parser.add_argument(
        "--x",
        help="first part {WORDS} "
        "second part",
    )
    raise ValueError(
        f"{{name!r}} is {{ {{'a': 1, 'b': 2}}['a'] + 1 }} {WORDS} and {{{{braces}}}}"
    )
    raise TypeError(f"{"x" * 50} {{name if name else 'y' + ' ' + 'z'}}{"w" * 30}")
"""


def test_splits_long_strings_into_parts_of_the_same_value() -> None:
    split = WRAP.wrap_source(STRINGS, split_strings=True).text
    assert max(len(line) for line in split.split("\n")) <= 100
    assert WRAP.normalized_dump(split) == WRAP.normalized_dump(STRINGS)
    assert "ADVICE = (\n" in split and "help=(\n" in split  # a lone or mixed part: parenthesized
    assert "raise TypeError(\n" in split  # a call's one argument: in the call's parentheses
    assert "{ {'a': 1, 'b': 2}['a'] + 1 }" in split  # a replacement field is never cut
    # Parts without a replacement field are plain strings, their braces unescaped.
    assert all("{" in line for line in split.split("\n") if line.strip().startswith('f"'))
    assert ' and {braces}"' in split
    assert WRAP.wrap_source(split, split_strings=True).text == split
    assert WRAP.wrap_source(STRINGS).text == STRINGS  # only asked for

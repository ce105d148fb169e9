"""Every function name in the package says what it does or returns (scripts/names.py's check, issue 39).

A one-word name (``_each``, ``_table``) or a past participle used as a function (``agreed``, ``checked_groups``:
they read as values) is flagged; names docs/api.md lists are the public API's and kept. Every module of
``pgregistry/`` is checked, none left out.
"""

from __future__ import annotations

from pathlib import Path

from fixtures.module_files import module_from_file

ROOT = Path(__file__).resolve().parents[2]


NAMES = module_from_file("pgregistry_names", ROOT / "scripts" / "names.py")


def _unclear(paths: list[Path]) -> list[str]:
    """``path:line name (why)`` for each flagged function of ``paths`` that the public API does not keep."""
    public = NAMES.public_names()
    return [
        f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}:{line} {name} ({why})"
        for path in paths
        for line, name, why in NAMES.unclear_names(path)
        if name not in public
    ]


def test_every_function_name_says_what_it_does() -> None:
    checked = NAMES.python_files(["pgregistry"])
    assert len(checked) > 100  # the whole package, not an empty glob
    unclear = _unclear(checked)
    assert unclear == [], "rename these after what they do or return (scripts/names.py):\n" + "\n".join(unclear)


def test_the_check_flags_a_one_word_name_and_a_participle(tmp_path: Path) -> None:
    module = tmp_path / "planted.py"
    module.write_text(
        "def _each(xs):\n    return xs\n\n\ndef agreed(x):\n    return x\n\n\ndef read_layout(path):\n    return path\n"
    )
    assert _unclear([module]) == [f"{module}:1 _each (one word)", f"{module}:5 agreed (participle)"]

"""The planted-bug list (scripts/mutants.py) stays true to the code, and its runner judges mutants as it says.

Every ``make test`` checks that each mutant's snippet occurs exactly once in its file and that each test listed to
catch it exists, without running any mutant (``make mutants`` runs them: minutes). The runner itself is run on a
small repository made here: a mutant its test catches, one no test sees, and a stale one.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from fixtures.module_files import module_from_file

ROOT = Path(__file__).resolve().parents[2]


MUTANTS = module_from_file("pgregistry_mutants", ROOT / "scripts" / "mutants.py")


def test_every_snippet_occurs_once_and_every_listed_test_exists() -> None:
    assert MUTANTS.stale(MUTANTS.MUTANTS, ROOT) == []
    assert 10 <= len(MUTANTS.MUTANTS) <= 280


def _toy_repository(tmp_path: Path) -> Path:
    repo = tmp_path / "toy"
    files = {
        "pgregistry/__init__.py": "def add(a, b):\n    return a + b\n\n\ndef unused():\n    return 1\n",
        "pgregistry/testing/_pytest_plugin.py": "",  # the installed package's pytest11 entry point imports it
        "tests/test_add.py": "from pgregistry import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n",
    }
    for relative, text in files.items():
        (repo / relative).parent.mkdir(parents=True, exist_ok=True)
        (repo / relative).write_text(text)
    subprocess.run(["git", "init", "-q", str(repo)], check=True, timeout=60)
    return repo


def test_the_runner_reports_caught_survived_and_stale(tmp_path: Path) -> None:
    repo = _toy_repository(tmp_path)
    mutant = MUTANTS.Mutant
    caught = mutant("sum-is-difference", "add subtracts", "pgregistry/__init__.py", "a + b", "a - b",
                    ("tests/test_add.py::test_add",))
    unseen = mutant("unused-changed", "no test reads it", "pgregistry/__init__.py", "return 1", "return 2",
                    ("tests/test_add.py::test_add",))
    lines: list[str] = []
    assert MUTANTS.run([caught, unseen], repo, sys.executable, lines.append) == 1
    text = "\n".join(lines)
    assert "sum-is-difference: caught" in text and "unused-changed: SURVIVED" in text
    assert "1 of 2 mutants caught; SURVIVED: unused-changed" in text
    assert (repo / "pgregistry/__init__.py").read_text().count("a + b") == 1  # the working tree is never mutated

    lines.clear()
    assert MUTANTS.run([caught], repo, sys.executable, lines.append) == 0
    assert lines[-1] == "1 of 1 mutants caught"

    stale = mutant("gone", "its code moved", "pgregistry/__init__.py", "a * b", "a / b",
                   ("tests/test_add.py::test_mul",))
    lines.clear()
    assert MUTANTS.run([caught, stale], repo, sys.executable, lines.append) == 2
    assert lines[1:] == [
        "  gone: its snippet occurs 0 times in pgregistry/__init__.py, not once",
        "  gone: tests/test_add.py defines no test 'test_mul'",
    ]

"""What the docs point at exists: every file path of this repository they name, every test
(``tests/x.py::test_name``, or ``::test_name`` after one) and every dotted ``pgregistry.`` name.
The package's own docstrings and comments are held to the same (a module folded away was still
named in two docstrings).

A module moved, a test renamed or a name dropped leaves a doc pointing at nothing; this finds it.
A path is the repository's (``scripts/gpu8.sh``) or, in docs/architecture.md's map, the package's
(``allowlist/_ratchet.py``).
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGES = ["README.md", "CONTRIBUTING.md"] + sorted(
    str(path.relative_to(ROOT)) for path in (ROOT / "docs").rglob("*.md")
)
NOT_OURS = {
    "tools/check_process_group_usage.py",  # Megatron-LM's checker (docs/allowlist.md)
    "tools/process_group_usage_allowlist.json",  # Megatron-LM's list
    "tests/unit/test_version_check.py",  # NeMo RL's file the 3.11 scan cannot parse
    "scripts/megatron_gpu_step.py",  # the README says it was folded into megatron_parity.py
}
_PATH = re.compile(
    r"(?<![\w./-])((?:pgregistry|scripts|benchmarks|examples|tools|docs|allowlist|tests)/[\w./-]+"
    r"\.(?:py|md|sh|txt|json|svg|toml))"
)
_TEST = re.compile(r"(?:(tests/[\w/]+\.py))?::(test_\w+)")
_DOTTED = re.compile(r"\bpgregistry(?:\.\w+)+(?![\w*])")


def missing_paths(text: str, root: Path) -> list[str]:
    """The paths ``text`` names that are neither the repository's nor the package's files."""
    return [
        path
        for path in dict.fromkeys(_PATH.findall(text))
        if path not in NOT_OURS and not (root / path).exists() and not (root / "pgregistry" / path).exists()
    ]


def missing_tests(text: str, root: Path) -> list[str]:
    """The tests ``text`` names (``file::test`` or ``::test`` after a file) that no test file defines."""
    missing = []
    last_file = None
    for found in _TEST.finditer(text):
        test_file, name = found.group(1) or last_file, found.group(2)
        last_file = test_file
        defined = (root / test_file).read_text(encoding="utf-8") if test_file and (root / test_file).exists() else ""
        if not re.search(rf"^\s*(async )?def {name}\(", defined, re.MULTILINE):
            missing.append(f"{test_file}::{name}")
    return missing


def unresolved_names(text: str) -> list[str]:
    """The dotted ``pgregistry.`` names of ``text`` that are no module, nor an attribute of one."""
    unresolved = []
    for name in dict.fromkeys(_DOTTED.findall(text)):
        parts = name.split(".")
        for cut in range(len(parts), 0, -1):
            try:
                found: object = importlib.import_module(".".join(parts[:cut]))
            except ImportError:
                continue
            for attribute in parts[cut:]:
                found = getattr(found, attribute, None)
            if found is None:
                unresolved.append(name)
            break
    return unresolved


def test_every_path_test_and_name_the_docs_give_exists() -> None:
    faults = {}
    for page in PAGES:
        text = (ROOT / page).read_text(encoding="utf-8")
        found = missing_paths(text, ROOT) + missing_tests(text, ROOT) + unresolved_names(text)
        if found:
            faults[page] = found
    assert faults == {}


def test_every_path_test_and_name_the_package_docstrings_give_exists() -> None:
    faults = {}
    for path in sorted((ROOT / "pgregistry").rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        found = missing_paths(text, ROOT) + missing_tests(text, ROOT) + unresolved_names(text)
        if found:
            faults[str(path.relative_to(ROOT))] = found
    assert faults == {}


def test_a_moved_file_a_renamed_test_and_a_dropped_name_are_found() -> None:
    text = (
        "`pgregistry/_runtime/flags.py`, `allowlist/_ratchet.py` (the map's), `pgregistry/_flags.py`; "
        "`tests/core/test_layout.py::test_num_ranks_is_bounded_by_what_torch_distributed_can_address`, "
        "`::test_world_size_is_bounded`; `pgregistry.layout.ParallelLayout`, `pgregistry.params.mark_*`, "
        "`pgregistry.layout.shrink_layout`, `pgregistry.nothing`."
    )
    assert missing_paths(text, ROOT) == ["pgregistry/_flags.py"]
    assert missing_tests(text, ROOT) == ["tests/core/test_layout.py::test_world_size_is_bounded"]
    assert unresolved_names(text) == ["pgregistry.layout.shrink_layout", "pgregistry.nothing"]

"""List function names that do not say what they do: one word (``_on``) or a participle.

    python scripts/names.py                          # the whole package
    python scripts/names.py pgregistry/layout.py pgregistry/cli   # some files or folders
    python scripts/names.py --count                  # only the totals

A function is flagged when its first word, leading underscores stripped, is a past participle
(``agreed``, ``checked_groups`` read as values, not as what a call does), or when its name is one
word (no ``_`` inside) and it is not a method the receiver explains (``tracker.fork()``; a private
method like ``self._raw()`` is still flagged) nor one of the entry points below. Properties name
values and are skipped, as are dunder methods and methods whose name a base class fixes
(``forward``, ``step``, ``visit_Call``). Prints ``path:line  name  (why)``; a name docs/api.md
lists (``pgregistry.place``) is the public API's, kept, and counted apart.
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# Entry points whose one word is the convention (``main``) or the public API's (``build``).
ONE_WORD_ENTRY_POINTS = frozenset("main build attach install".split())
# Names a base class or protocol fixes (torch.nn.Module, Optimizer, argparse, logging, ...).
FIXED_BY_BASE = frozenset(
    "forward step zero_grad state_dict load_state_dict extra_repr reset_parameters default emit "
    "filter format "
    "close flush fileno write read readline keys values items get".split()
)
IRREGULAR_PARTICIPLES = frozenset(
    "seen given chosen written known taken shown done gone begun broken driven fallen "
    "forgotten frozen hidden spoken thrown worn built kept left lost made meant met paid said "
    "sent sold spent told found held".split()
)
REGULAR_NOT_PARTICIPLES = frozenset(
    "need embed shed seed bed feed speed red bleed breed proceed exceed".split()
)


def is_participle(word: str) -> bool:
    """Whether ``word`` reads as a past participle (``agreed``, ``checked``, ``seen``).

    >>> [is_participle(w) for w in ("agreed", "checked", "seen", "seed", "build")]
    [True, True, True, False, False]
    """
    if word in IRREGULAR_PARTICIPLES:
        return True
    return word.endswith("ed") and len(word) > 3 and word not in REGULAR_NOT_PARTICIPLES


def why_unclear(name: str, public_method: bool = False) -> str | None:
    """Why function name ``name`` does not say what it does, or None when it does.

    >>> [why_unclear(name) for name in ("_on", "agreed", "_checked_groups", "read_layout")]
    ['one word', 'participle', 'participle', None]
    >>> why_unclear("fork", public_method=True), why_unclear("_raw", public_method=False)
    (None, 'one word')
    """
    if name.startswith("__") and name.endswith("__"):
        return None
    words = name.lstrip("_").split("_")
    if is_participle(words[0]):
        return "participle"
    if len(words) == 1 and not public_method and words[0] not in ONE_WORD_ENTRY_POINTS:
        return "one word"
    return None


def _is_property(node: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    for decorator in node.decorator_list:
        name = getattr(decorator, "attr", None) or getattr(decorator, "id", "")
        if name in ("property", "cached_property", "setter"):
            return True
    return False


def unclear_names(path: Path) -> Iterator[tuple[int, str, str]]:
    """Yield ``(line, name, why)`` for each function of ``path`` that :func:`why_unclear` flags."""
    tree = ast.parse(path.read_text(), filename=str(path))
    methods = {
        id(item)
        for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef)
        for item in node.body
        if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef)
    }
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        method = id(node) in methods
        fixed = node.name in FIXED_BY_BASE or node.name.startswith("visit_")
        if _is_property(node) or (method and fixed):
            continue
        why = why_unclear(node.name, public_method=method and not node.name.startswith("_"))
        if why is not None:
            yield node.lineno, node.name, why


def public_names() -> frozenset[str]:
    """The names docs/api.md lists in backticks: renaming one would break users' code."""
    return frozenset(re.findall(r"`(\w+)`", (REPO / "docs" / "api.md").read_text()))


def python_files(paths: list[str]) -> list[Path]:
    """The ``.py`` files at or under ``paths`` (the package when empty), sorted."""
    roots = [REPO / p for p in paths] or [REPO / "pgregistry"]
    found = {f for r in roots for f in ([r] if r.is_file() else r.rglob("*.py"))}
    return sorted(found)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="*", help="files or folders, relative to the repository")
    parser.add_argument("--count", action="store_true", help="print only the totals")
    args = parser.parse_args(argv)
    counts = {"one word": 0, "participle": 0}
    public = public_names()
    kept = 0
    for path in python_files(args.paths):
        for line, name, why in unclear_names(path):
            if name in public:
                kept += 1
                why += ", public API: kept"
            else:
                counts[why] += 1
            if not args.count:
                print(f"{path.relative_to(REPO)}:{line}  {name}  ({why})")
    print(
        f"{sum(counts.values())} names: {counts['one word']} one word, "
        f"{counts['participle']} participles; {kept} more of the public API (docs/api.md) kept"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

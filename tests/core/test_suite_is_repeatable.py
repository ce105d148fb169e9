"""The suite runs the same way every time: hypothesis draws the same examples, and every deadline a test sets
ends before pytest-timeout's, so a hung world or subprocess fails with its own diagnosis, never killed blind.

Before: hypothesis drew new examples on every CI run (a failure seen once might never come back); the per-test
timeout (120 s) was shorter than several ``run_world`` deadlines (180 to 300 s), so a hung world was killed by
pytest-timeout before ``run_world`` could name the stuck ranks and where they were; some subprocesses had no
timeout at all. The deadlines are read from the test sources (their ``ast``), the per-test timeout from
``pyproject.toml`` or a module's ``pytestmark``.
"""

from __future__ import annotations

import ast
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import settings

from pgregistry import testing

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[2]
MARGIN_S = 30.0  # between a deadline and the per-test timeout: the stack dumps, the clean-up, a loaded machine
RUN_WORLD_DEFAULT_S = 60.0
SUBPROCESS_CALLS = {"run", "check_call", "check_output", "call", "communicate"}


def _per_test_timeout() -> float:
    with open(ROOT / "pyproject.toml", "rb") as file:
        return float(tomllib.load(file)["tool"]["pytest"]["ini_options"]["timeout"])


def _literal(node: ast.AST | None) -> float | None:
    return float(node.value) if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) else None


def _module_timeout(tree: ast.Module) -> float | None:
    """``N`` of a module-level ``pytestmark = pytest.mark.timeout(N)``."""
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in node.targets):
            call = node.value
            if isinstance(call, ast.Call) and getattr(call.func, "attr", "") == "timeout" and call.args:
                return _literal(call.args[0])
    return None


def _calls(tree: ast.AST) -> Iterator[tuple[str, ast.Call]]:
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            name = getattr(node.func, "id", None) or getattr(node.func, "attr", "")
            yield name, node


def _timeout_of(call: ast.Call) -> ast.AST | None:
    return next((keyword.value for keyword in call.keywords if keyword.arg == "timeout"), None)


def _sources() -> Iterator[tuple[Path, ast.Module, float]]:
    """Every test module, and every example module a test module imports (its worlds run inside that test), each
    with the per-test timeout it runs under."""
    default = _per_test_timeout()
    for path in sorted((ROOT / "tests").rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        allowed = _module_timeout(tree) or default
        yield path, tree, allowed
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("examples."):
                example = ROOT / (node.module or "").replace(".", "/")
                example = example.with_suffix(".py")
                yield example, ast.parse(example.read_text(), str(example)), allowed


def test_hypothesis_draws_the_same_examples_on_every_run() -> None:
    if os.environ.get("HYPOTHESIS_PROFILE", "repeatable") != "repeatable":
        pytest.skip("another hypothesis profile was asked for (HYPOTHESIS_PROFILE)")
    assert settings.default.derandomize and settings.default.database is None


def test_every_run_world_deadline_ends_before_the_per_test_timeout() -> None:
    late = []
    for path, tree, allowed in _sources():
        for name, call in _calls(tree):
            if name != "run_world":
                continue
            given = _timeout_of(call)
            deadline = RUN_WORLD_DEFAULT_S if given is None else _literal(given)
            worst = None if deadline is None else deadline + testing._STARTUP_GRACE_S
            if worst is None or worst + MARGIN_S > allowed:
                late.append(f"{path.relative_to(ROOT)}:{call.lineno}: run_world deadline {deadline} (at worst "
                            f"{worst} s with start-up), per-test timeout {allowed} s")
    assert late == []


def test_every_subprocess_has_a_timeout_that_ends_before_the_per_test_timeout() -> None:
    late = []
    for path, tree, allowed in _sources():
        for name, call in _calls(tree):
            if name not in SUBPROCESS_CALLS or (name != "communicate" and getattr(call.func, "value", None) is None):
                continue
            if name != "communicate" and getattr(call.func.value, "id", "") != "subprocess":  # type: ignore[attr-defined]
                continue
            timeout = _literal(_timeout_of(call))
            if timeout is None or timeout + MARGIN_S > allowed:
                late.append(f"{path.relative_to(ROOT)}:{call.lineno}: {name}(timeout={timeout}), per-test timeout "
                            f"{allowed} s")
    assert late == []

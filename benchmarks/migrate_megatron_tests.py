"""The project's Megatron-Core tests on a Megatron-Core that ``pgregistry migrate`` rewrote.

Copies the installed Megatron-Core's ``megatron/`` package (``make setup`` unpacks megatron-core 0.19.2 into the
venv) to a temporary directory, rewrites its ``megatron/core`` with ``pgregistry migrate --write --isolated
--preset megatron``, and runs ``tests/megatron`` with the copy first on ``PYTHONPATH`` (``megatron`` is a
namespace package, so the copy's ``megatron.core`` is the one imported), three times:

1. **one grid**: the rewritten functions are called without a collection, as every caller in a job with one
   global grid calls them; each falls back through ``ProcessGroupFallbackWarning``, shown
   (``-W default::pgregistry.ProcessGroupFallbackWarning``, overriding the suite's warnings-as-errors for this
   category only): nothing may fail;
2. **migration mode** (``-W error::pgregistry.ProcessGroupFallbackWarning``): each failure names a rewritten
   function whose caller still passes no collection; the script prints those functions, most frequent first, and
   for each the call that passed none (the frame above the reading function in the failure's traceback), so a
   fallback left is seen to be one whose caller has no collection to pass;
3. **migration mode, every caller passing its collection**: the same, on a copy of ``tests/`` where the one call of
   the rewritten Megatron-Core that a test makes without its collection in reach,
   ``optimizer.get_grad_norm()`` in ``test_megatron_custom_process_groups.py`` (Megatron-Core's own optimizer,
   built with the test's collection ``theirs``), passes it: ``get_grad_norm(pg_collection=theirs)`` (the variant
   :data:`CALLERS_PASSING` names; the tool threads ``get_grad_norm`` upward, so it takes one). The test module
   is the project's, not a tree the tool migrates, so the edit is made here, named and checked to apply.

Usage: ``python benchmarks/migrate_megatron_tests.py [--pytest-args ...]``; minutes (tests/megatron runs twice).
Not part of CI.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

#: pgregistry's fallback warning names the function it warns for: ``<owner> fell back ...``-style messages
#: carry it after "ProcessGroupFallbackWarning: ".
_WARNING = re.compile(r"ProcessGroupFallbackWarning: (?P<message>[^\n]+)")


#: A frame of a traceback (pytest may prefix the line with ``E``).
_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<name>\S+)')


def _short(frame: re.Match[str]) -> str:
    """``path:line function``, the path from its ``megatron/`` or ``tests/`` on."""
    path = frame["file"]
    for root in ("/megatron/", "/tests/"):
        if root in path:
            path = root[1:] + path.rpartition(root)[2]
            break
    return f"{path}:{frame['line']} {frame['name']}"


def fallback_callers(output: str) -> Counter[tuple[str, str]]:
    """(the function that fell back, the call that passed it no collection) of each traceback in ``output`` that
    reaches the fallback helper, counted: the two frames above the helper's first."""
    found: Counter[tuple[str, str]] = Counter()
    frames: list[re.Match[str]] = []
    done = False
    for line in output.splitlines():
        if "Traceback (most recent call last)" in line:
            frames, done = [], False
        frame = _FRAME.search(line)
        if frame is None or done:
            continue
        if frame["file"].endswith("_process_group_fallback.py") and len(frames) >= 2:
            found[(_short(frames[-1]), _short(frames[-2]))] += 1
            done = True
        frames.append(frame)
    return found


def installed_megatron() -> Path:
    import megatron.core

    return Path(megatron.core.__file__).resolve().parent.parent


def env_with(*paths: Path) -> dict[str, str]:
    """This environment with ``paths`` on ``PYTHONPATH``: before this repository, after what it already holds for
    the package (so a ``pgregistry`` given there is the one the rewritten code imports)."""
    entries = [*map(str, paths[:-1]), os.environ.get("PYTHONPATH", ""), str(paths[-1])]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, entries))}


def rewrite(copy_root: Path) -> tuple[float, str]:
    command = [sys.executable, "-m", "pgregistry", "migrate", "--write", "--isolated", "--preset", "megatron"]
    start = time.perf_counter()
    done = subprocess.run(
        [*command, "megatron/core"], cwd=copy_root, capture_output=True, text=True, env=env_with(REPO), timeout=600
    )
    if done.returncode not in (0, 1):
        raise SystemExit(f"pgregistry migrate exited {done.returncode}:\n{done.stdout}\n{done.stderr}")
    return time.perf_counter() - start, done.stdout + done.stderr


def run_tests(copy_root: Path, action: str, extra: list[str], tests: Path = REPO / "tests") -> tuple[int, str, float]:
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-W",
        f"{action}::pgregistry.ProcessGroupFallbackWarning",
        str(tests / "megatron"),
        # A copy of the tests elsewhere still runs under this repository's settings (warnings as errors, ...).
        *(["-c", str(REPO / "pyproject.toml"), "--rootdir", str(REPO)] if tests != REPO / "tests" else []),
        *extra,
    ]
    start = time.perf_counter()
    # A Megatron-Core that does not import must fail the run, not skip it (tests/megatron skip without one).
    env = {**env_with(copy_root, REPO), "PGREGISTRY_REQUIRE_MEGATRON": "1"}
    older = sorted(Path(sys.prefix).glob("megatron-core-*/megatron/core"))  # as ``make test`` sets it
    if older and "PGREGISTRY_OLDER_MEGATRON" not in env:
        env["PGREGISTRY_OLDER_MEGATRON"] = str(older[-1].parent.parent)
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, env=env, timeout=1800)
    return done.returncode, done.stdout + done.stderr, time.perf_counter() - start


#: The variant of the project's tests in which every caller passes its collection: (file, call as written,
#: call passing the collection the test built).
CALLERS_PASSING = (
    ("tests/megatron/test_megatron_custom_process_groups.py", 'out["megatron"] = float(optimizer.get_grad_norm())',
     'out["megatron"] = float(optimizer.get_grad_norm(pg_collection=theirs))'),
)


def tests_with_callers_passing(into: Path) -> Path:
    """A copy of ``tests/`` under ``into`` with each call of :data:`CALLERS_PASSING` passing its collection."""
    copied = into / "tests"
    for folder in ("tests", "examples"):  # the tests load the examples beside them
        shutil.copytree(REPO / folder, into / folder, ignore=shutil.ignore_patterns("__pycache__"))
    for path, call, passing in CALLERS_PASSING:
        text = (into / path).read_text()
        if text.count(call) != 1:
            raise SystemExit(f"{path} no longer holds {call!r} once: update CALLERS_PASSING")
        (into / path).write_text(text.replace(call, passing))
    return copied


def summary_line(output: str) -> str:
    lines = [line for line in output.splitlines() if re.search(r"\d+ (passed|failed|errors?|skipped)", line)]
    return lines[-1].strip("= ") if lines else "(no pytest summary)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pytest-args", nargs=argparse.REMAINDER, default=[], help="passed on to pytest")
    args = parser.parse_args(argv)
    source = installed_megatron()
    with tempfile.TemporaryDirectory(prefix="pgregistry-rewritten-megatron-") as temp:
        copy_root = Path(temp)
        shutil.copytree(source, copy_root / "megatron", ignore=shutil.ignore_patterns("__pycache__"))
        seconds, report = rewrite(copy_root)
        print(f"rewrote {source}/core in {seconds:.1f} s; the tool's report:")
        print("\n".join(f"    {line}" for line in report.strip().splitlines()))
        compiled = subprocess.run(
            [sys.executable, "-m", "compileall", "-q", str(copy_root / "megatron")], capture_output=True, text=True
        )
        print(f"compileall of the rewritten package: exit {compiled.returncode} {compiled.stdout.strip()}")

        code, output, seconds = run_tests(copy_root, "default", args.pytest_args)
        warned = Counter(m.group("message") for m in _WARNING.finditer(output))
        print(f"\none grid (fallback warnings shown): exit {code}, {summary_line(output)} in {seconds:.0f} s")
        print(f"  {sum(warned.values())} fallback warnings, {len(warned)} distinct")
        if code != 0:
            print(output[-6000:])

        code, output, seconds = run_tests(copy_root, "error", args.pytest_args)
        print(f"\nmigration mode (-W error::...): exit {code}, {summary_line(output)} in {seconds:.0f} s")
        failing = Counter(m.group("message") for m in _WARNING.finditer(output))
        print("  functions whose callers still pass no collection (warning text, count of failing reports):")
        for message, count in failing.most_common(40):
            print(f"    {count:4d}  {message}")
        print("  the call that passed it none (reading function <- its caller, count of tracebacks):")
        for (reader, caller), count in fallback_callers(output).most_common(40):
            print(f"    {count:4d}  {reader} <- {caller}")

        passing = tests_with_callers_passing(copy_root)
        code, output, seconds = run_tests(copy_root, "error", args.pytest_args, passing)
        print(f"\nmigration mode, every caller passing its collection (-W error::..., {len(CALLERS_PASSING)} call(s) "
              f"edited): exit {code}, {summary_line(output)} in {seconds:.0f} s")
        for (reader, caller), count in fallback_callers(output).most_common(40):
            print(f"    {count:4d}  {reader} <- {caller}")
        if code != 0:
            print(output[-6000:])
    return 0


if __name__ == "__main__":
    sys.exit(main())

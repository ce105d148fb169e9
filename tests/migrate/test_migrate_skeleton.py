"""``migrate`` parses a skeleton of each file: the definitions no rewrite touches stood in for by placeholders.

The oracle is the whole file: the skeleton's rewrite must be the whole file's, byte for byte, and a skeleton
put back untouched must be the file again."""

from __future__ import annotations

import ast
import os
import textwrap
import time
from pathlib import Path

import pytest
from fixtures.processes import children_left

cst = pytest.importorskip("libcst")

from fixtures.migrated_packages import write_sources  # noqa: E402

from pgregistry._source.config import PRESETS  # noqa: E402
from pgregistry.migrate import _engine as _migrate  # noqa: E402
from pgregistry.migrate._engine import migrate  # noqa: E402
from pgregistry.migrate._skeleton import build_skeleton, restore_placeholders  # noqa: E402

#: A module with every kind of definition around the reads: decorated, one-line, async, nested classes,
#: members with and without reads, a method that binds ``self.pg_collection`` and callers of threaded functions.
A = '''\
"""Module doc."""
import functools
import operator

from megatron.core import parallel_state as ps


@functools.lru_cache(maxsize=None)
def cached():  # a comment on the def line
    return 1


def one_line(): return 2


async def fetch(x):
    # a comment inside
    return x


def reduce(x):
    group = ps.get_tensor_model_parallel_group()
    return x, group


def calls_reduce(x):
    return reduce(x)


class Model:
    """Class doc."""

    size = 3

    def __init__(self, pg_collection):
        self.pg_collection = pg_collection

    @property
    def untouched(self):
        return operator.add(1, 2)  # operator is read here only

    def reads(self):
        return ps.get_data_parallel_world_size()

    def passes(self, x):
        return reduce(x)

    class Inner:
        def deep(self):
            return 0


class Unrelated:
    def method(self):
        return 4
'''

#: A module without reads that calls a threaded function from a function, a method and one of the others.
B = '''\
from pkg.a import reduce


def caller(x, pg_collection=None):
    return reduce(x)


def bystander():
    return 5


class Holder:
    def __init__(self, pg_collection):
        self.pg_collection = pg_collection

    def step(self, x):
        return reduce(x)

    def other(self):
        return 6
'''


def _run(tmp_path: Path, files: dict[str, bytes]) -> _migrate.Migration:
    return migrate(write_sources(tmp_path, files), PRESETS["megatron"], target="megatron", name="pg_collection")


def _outcome(migration: _migrate.Migration) -> tuple[object, ...]:
    return (
        sorted((c.path, c.after) for c in migration.changes),
        [(path, read.site.line, read.way, read.collection, read.reason) for path, read in migration.reads],
        migration.passed,
        migration.threaded,
        migration.failures,
    )


def _variants() -> dict[str, dict[str, bytes]]:
    tabbed = A.replace("    ", "\t")
    return {
        "spaces": {"pkg/a.py": A.encode(), "pkg/b.py": B.encode()},
        "crlf": {"pkg/a.py": A.replace("\n", "\r\n").encode(), "pkg/b.py": B.replace("\n", "\r\n").encode()},
        "cr-only": {"pkg/a.py": A.replace("\n", "\r").encode(), "pkg/b.py": B.replace("\n", "\r").encode()},
        "mixed": {"pkg/a.py": A.replace("\n\n", "\r\n\r").encode(), "pkg/b.py": B.encode()},
        "tabs": {"pkg/a.py": tabbed.encode(), "pkg/b.py": B.replace("    ", "\t").encode()},
        "latin-1": {"pkg/a.py": ("# -*- coding: latin-1 -*-\n# caf\u00e9\n" + A).encode("latin-1"),
                    "pkg/b.py": B.encode()},
    }


@pytest.mark.parametrize("variant", sorted(_variants()))
def test_the_skeletons_rewrite_is_the_whole_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, variant: str
) -> None:
    files = _variants()[variant]
    made: list[object] = []
    real = _migrate.build_skeleton

    def counted(*args: object) -> object:
        frame = real(*args)  # type: ignore[arg-type]
        made.append(frame)
        return frame

    monkeypatch.setattr(_migrate, "build_skeleton", counted)
    with_skeletons = _outcome(_run(tmp_path / "skeleton", files))
    assert any(frame is not None for frame in made)  # the fixture does exercise placeholders
    monkeypatch.setattr(_migrate, "build_skeleton", lambda *args: None)
    whole = _outcome(_run(tmp_path / "whole", files))
    assert with_skeletons == whole
    changes, _, passed, threaded, failures = whole
    # calls_reduce reads nothing: threaded upward, so its own callers could pass a collection
    assert not failures and passed == 4 and threaded == ["pkg/a.py: reduce", "pkg/a.py: calls_reduce"]
    assert [path for path, _ in changes] == ["_process_group_fallback.py", "pkg/a.py", "pkg/b.py"]  # type: ignore[union-attr]


def _placeholders(data: bytes, needed: object) -> tuple[bytes, dict[str, str]]:
    frame = build_skeleton(data, ast.parse(data), needed)  # type: ignore[arg-type]
    assert frame is not None
    return frame.data, frame.decode_kept("utf-8")


@pytest.mark.parametrize("members", [False, True])
def test_a_skeleton_keeps_every_line_number_parses_and_puts_back_the_file(members: bool) -> None:
    data = A.replace("\n", "\r\n").encode() + b"x = 1"  # no newline at the end
    # members=True: keep the module-level definitions, stand in for every member.
    text, kept = _placeholders(data, lambda start, end, member: members and not member)
    assert text.count(b"\n") == data.count(b"\n")
    assert ast.dump(ast.parse(text).body[2]) == ast.dump(ast.parse(data).body[2])  # not a definition: as it was
    module = cst.parse_module(text)
    assert restore_placeholders(module.code, kept) == data.decode()
    left = {n.name for n in ast.walk(ast.parse(text)) if isinstance(n, (ast.FunctionDef, ast.ClassDef,
                                                                        ast.AsyncFunctionDef))}
    assert left == ({"cached", "one_line", "fetch", "reduce", "calls_reduce", "Model", "Unrelated"} if members
                    else set())
    assert len(kept) == (6 if members else 7)  # the members of Model (Inner.deep goes with Inner) and Unrelated


def test_a_file_that_holds_the_placeholders_prefix_is_parsed_whole() -> None:
    data = textwrap.dedent("""
        _pgregistry_kept_0 = 1
        def f():
            return 1
    """).encode()
    assert build_skeleton(data, ast.parse(data), lambda *_: False) is None


def test_a_placeholder_found_twice_is_not_put_back() -> None:
    data = b"def f():\n    return 1\n"
    text, kept = _placeholders(data, lambda *_: False)
    assert restore_placeholders(text.decode() * 2, kept) is None


#: A module without reads whose functions are threaded upward (only its own facts say so).
D = '''\
from pkg.a import reduce


def relays(x):
    return reduce(x)


def top(x):
    return relays(x)
'''


def _tree(copies: int) -> dict[str, bytes]:
    """``copies`` of the pair above, each in its own package, plus files without reads calling into each, and one
    whose functions are threaded upward."""
    files: dict[str, bytes] = {}
    for index in range(copies):
        files[f"pkg{index}/a.py"] = A.encode()
        files[f"pkg{index}/b.py"] = B.replace("pkg.a", f"pkg{index}.a").encode()
        files[f"pkg{index}/c.py"] = B.replace("pkg.a", f"pkg{(index + 1) % copies}.a").encode()
        files[f"pkg{index}/d.py"] = D.replace("pkg.a", f"pkg{index}.a").encode()
    return files


@pytest.mark.parametrize("failing", ["", "first", "second", "look"])
def test_a_run_split_across_processes_is_the_run_in_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failing: str
) -> None:
    """Forked workers (three, on files the size threshold would keep in one process), calls from one worker's
    files into another's threaded functions; a child that dies in either phase, or once it took files without
    reads to look through, is redone here."""
    files = _tree(6)
    serial = _outcome(_run(tmp_path / "serial", files))
    # 8 calls per package pass their collection (calls_reduce's and d.py's, threaded upward, too), those in c.py
    # into the next package
    assert serial[2] == 48
    monkeypatch.setattr(_migrate, "PARALLEL_MIN_BYTES", 0)
    forked: list[bool] = []
    real_phases = _migrate.two_phases

    def spied(*args: object, fork: bool) -> object:
        forked.append(fork)
        return real_phases(*args, fork=fork)  # type: ignore[arg-type]

    monkeypatch.setattr(_migrate, "two_phases", spied)
    parent = os.getpid()
    if failing:
        real = getattr(_migrate._Worker, failing)

        def dies_in_a_child(self: object, *args: object) -> object:
            if os.getpid() != parent:
                os._exit(3)
            return real(self, *args)

        monkeypatch.setattr(_migrate._Worker, failing, dies_in_a_child)
    sources = write_sources(tmp_path / "split", files)
    split = _outcome(migrate(sources, PRESETS["megatron"], target="megatron", name="pg_collection", jobs=3))
    assert forked == [True]
    assert split == serial
    assert not children_left()  # every child was reaped


def test_the_facts_of_files_a_dead_child_took_are_read_between_the_phases(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A child that dies once it took files without reads to read their facts (here: every one left, while this
    process waits with the one it took) loses nothing: those files' facts are read here between the phases, so
    the functions only they hold are still threaded upward."""
    files = _tree(2)
    serial = _outcome(_run(tmp_path / "serial", files))
    assert {"pkg1/d.py: relays", "pkg1/d.py: top"} <= set(serial[3])  # type: ignore[arg-type]
    monkeypatch.setattr(_migrate, "PARALLEL_MIN_BYTES", 0)
    parent, died = os.getpid(), tmp_path / "died"
    real = _migrate._Worker.read_facts

    def drains_and_dies(self: _migrate._Worker, taken: list[tuple[str, bytes]]) -> object:
        if os.getpid() != parent:
            while self.facts_queue.take() is not None:
                pass
            died.touch()
            os._exit(3)
        deadline = time.monotonic() + 30
        while not died.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        return real(self, taken)

    monkeypatch.setattr(_migrate._Worker, "read_facts", drains_and_dies)
    sources = write_sources(tmp_path / "split", files)
    split = _outcome(migrate(sources, PRESETS["megatron"], target="megatron", name="pg_collection", jobs=2))
    assert died.exists()  # the child took files and died
    assert split == serial
    assert not children_left()

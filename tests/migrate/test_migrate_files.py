"""``pgregistry migrate`` on the files a user owns: every file Python accepts is read as Python reads it (its
coding declaration or BOM, CR-only line endings) in every mode and written back the same way; a bug of the tool
is exit 2 naming the file, never exit 1 (which ``--check`` keeps for "would change"); the work grows linearly
with a file's size (counted in operations, never timed)."""

from __future__ import annotations

import cProfile
import pstats
import re
import subprocess
from pathlib import Path

import pytest
from fixtures.scan_projects import Project

pytest.importorskip("libcst")

from pgregistry._source.config import PRESETS  # noqa: E402
from pgregistry._source.files import SourceFile  # noqa: E402
from pgregistry._source.storage import StorageError  # noqa: E402
from pgregistry.allowlist import _ratchet  # noqa: E402
from pgregistry.cli import main  # noqa: E402
from pgregistry.migrate import _engine, _facts, _plan, _rewrite, _skeleton  # noqa: E402
from pgregistry.migrate._diff import render_unified_diff  # noqa: E402

ARGS = ["migrate", "--preset", "megatron"]
READ = "def f(x):\n    return ps.get_tensor_model_parallel_group()\n"


def _write_bytes(project: Project, path: str, data: bytes) -> Path:
    target = project.root / path
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(data)
    return target


@pytest.mark.parametrize(
    ("header", "encoding"),
    [(b"# -*- coding: latin-1 -*-\n", "latin-1"), (b"\xef\xbb\xbf", "utf-8-sig")],
    ids=["coding-declaration", "bom"],
)
def test_a_file_in_another_encoding_is_diffed_checked_and_written_in_it(
    project: Project, capsysbinary: pytest.CaptureFixture[bytes], header: bytes, encoding: str
) -> None:
    text = f"from megatron.core import parallel_state as ps\n\n# café\n{READ}"
    original = header + text.encode(encoding.removesuffix("-sig"))
    path = _write_bytes(project, "src/pkg/m.py", original)
    assert main(ARGS) == 0  # the default mode, which crashed with UnicodeDecodeError on latin-1
    out = capsysbinary.readouterr().out  # the diff in the file's own bytes, as git diff gives it
    assert " # café\n".encode(encoding.removesuffix("-sig")) in out and b"+def f(x, *, pg_collection=None):\n" in out
    assert b"--- a/src/pkg/m.py\n+++ b/src/pkg/m.py\n@@ -1," in out  # beside the new helper module's diff
    assert main([*ARGS, "--check"]) == 1
    assert main([*ARGS, "--write"]) == 0
    data = path.read_bytes()
    assert data.startswith(header) and "# café\n".encode(encoding.removesuffix("-sig")) in data
    compile(data, str(path), "exec", dont_inherit=True)
    assert "pg_collection" in data.decode(encoding)
    assert main([*ARGS, "--check"]) == 0


def test_a_file_with_cr_only_line_endings_is_migrated_keeping_them(
    project: Project, capsys: pytest.CaptureFixture[str]
) -> None:
    text = f"from megatron.core import parallel_state as ps\n\n\ndef g():\n    return 1\n\n\n{READ}"
    path = _write_bytes(project, "src/pkg/m.py", text.replace("\n", "\r").encode())
    assert main(ARGS) == 0
    assert "+++ b/src/pkg/m.py" in capsys.readouterr().out
    assert main([*ARGS, "--check"]) == 1  # would change: not an IndexError's exit 1
    assert main([*ARGS, "--write"]) == 0
    data = path.read_bytes()
    assert b"\n" not in data and b"\rdef f(x, *, pg_collection=None):\r" in data
    assert b"\rdef g():\r    return 1\r" in data  # a definition stood in for by a placeholder, put back
    compile(data, str(path), "exec", dont_inherit=True)
    assert main([*ARGS, "--check"]) == 0


@pytest.mark.parametrize(
    ("ending", "tail"),
    [
        pytest.param("\r", "", id="cr-only"),
        pytest.param("\r", "\n", id="cr-only-blank-line"),
        pytest.param("\r", "\n\n# the end\n", id="cr-only-comment-and-blank-lines"),
        pytest.param("\n", "# see C:\\dir\\\n", id="comment-ending-in-backslash"),
        pytest.param("\r\n", "# a\\\n\n", id="crlf-backslash-blank"),
        pytest.param("\r", "y = 1", id="cr-only-no-final-newline"),
        pytest.param("\n", "", id="lf"),
    ],
)
def test_the_last_line_ending_is_kept_whatever_the_line_endings(
    project: Project, capsys: pytest.CaptureFixture[str], ending: str, tail: str
) -> None:
    """Every byte the rewrite does not replace is the file's, its last line ending too: libcst reads a file whose
    last line ends in a lone ``\\r``, or in a comment ending with ``\\``, as having no final newline, and its
    render dropped that line's ending. The oracle: the same file with ``\\n`` endings, migrated, its endings made
    the file's; its tail as written."""
    text = f"from megatron.core import parallel_state as ps\n\n\n{READ}{tail}"
    lf = _write_bytes(project, "src/pkg/lf.py", text.encode())
    path = _write_bytes(project, "src/pkg/m.py", text.replace("\n", ending).encode())
    assert main([*ARGS, "--write"]) == 0
    capsys.readouterr()
    assert lf.read_bytes().endswith(tail.encode() or b"\n")  # the oracle keeps its own ending
    assert path.read_bytes() == lf.read_bytes().replace(b"\n", ending.encode())
    assert main([*ARGS, "--check"]) == 0


def test_the_diff_names_any_file_as_git_does_and_git_applies_it(
    project: Project, capsysbinary: pytest.CaptureFixture[bytes]
) -> None:
    """A name holding a newline split the diff's ``---`` line in two (the diff no longer applied), and one that is
    no UTF-8 (a byte read back as a surrogate) was an internal error half-way through the diff. Each name is
    written as ``git diff`` writes it (C-style quoted where it holds a control character, a quote, a backslash or
    a byte past ASCII); the oracle: ``git apply`` of the diff gives the tree ``--write`` gives."""
    names = ["a b.py", "new\nline.py", 'quo"te.py', "back\\slash.py", "tab\t.py", "caf\u00e9.py", "bad\udcff.py"]
    for name in names:
        _write_bytes(project, f"src/pkg/{name}", SOURCE.encode())
    assert main([*ARGS, "--quiet"]) == 0
    diff = capsysbinary.readouterr().out
    assert b'--- "a/src/pkg/new\\nline.py"\n+++ "b/src/pkg/new\\nline.py"\n' in diff
    assert b'--- "a/src/pkg/caf\\303\\251.py"\n' in diff and b"--- a/src/pkg/a b.py\n" in diff
    assert main([*ARGS, "--write", "--quiet"]) == 0
    written = {path: path.read_bytes() for path in (project.root / "src/pkg").iterdir()}
    assert len(written) == len(names) + 2  # and __init__.py, the new helper module
    (project.root / "src/pkg/_process_group_fallback.py").unlink()
    for name in names:
        _write_bytes(project, f"src/pkg/{name}", SOURCE.encode())
    subprocess.run(["git", "init", "-q"], cwd=project.root, check=True, timeout=60)
    subprocess.run(["git", "apply"], cwd=project.root, input=diff, check=True, capture_output=True, timeout=60)
    assert {path: path.read_bytes() for path in (project.root / "src/pkg").iterdir()} == written


def test_an_error_of_the_tool_on_a_file_is_exit_2_naming_it_in_every_mode(
    project: Project, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    project.write("src/pkg/m.py", f"from megatron.core import parallel_state as ps\n\n\n{READ}")

    def broken(*args: object, **kwargs: object) -> None:
        raise IndexError("list index out of range")

    monkeypatch.setattr(_engine, "plan_file", broken)
    for mode in ([], ["--check"], ["--write"]):
        assert main([*ARGS, *mode]) == 2
        err = capsys.readouterr().err
        assert "src/pkg/m.py" in err and "internal error (IndexError: list index out of range)" in err
        assert "Traceback" not in err


def test_an_error_of_the_tool_outside_any_file_is_exit_2_not_1(
    project: Project, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    project.write("src/pkg/m.py", f"from megatron.core import parallel_state as ps\n\n\n{READ}")

    def broken(*args: object, **kwargs: object) -> None:
        raise KeyError("x")

    monkeypatch.setattr(_engine, "migrate", broken)
    assert main([*ARGS, "--check"]) == 2
    assert "internal error (KeyError: 'x'); please report it" in capsys.readouterr().err


def _generated(functions: int) -> bytes:
    """A generated module: ``functions`` functions, every third reading the grid, the next calling it (threaded
    upward) and the third calling the one before (which has no collection to pass): so unchanged lines stay
    between the changed ones, as in a real file (a file every line of which changes is one stretch for the
    diff's ``difflib``)."""
    parts = ["from megatron.core import parallel_state as ps\n\n"]
    for i in range(functions):
        read = "ps.get_tensor_model_parallel_rank()" if i % 3 == 0 else "1"
        called = f"f{max(i - 1, 0)}" if i % 3 != 2 else "int"
        parts.append(f"def f{i}(x):\n    y = {called}(x) if {i} else x\n    return {read} + y\n\n\n")
    return "".join(parts).encode()


class _CountingPattern:
    """A compiled pattern that adds the length of each text it searches to its owner's count."""

    def __init__(self, pattern: re.Pattern[bytes], owner: _CountingRe) -> None:
        self.pattern, self.owner = pattern, owner

    def __getattr__(self, name: str) -> object:
        method = getattr(self.pattern, name)
        if name not in ("search", "match", "fullmatch", "finditer", "findall", "sub", "split"):
            return method

        def counted(text: bytes, *args: object, **kwargs: object) -> object:
            self.owner.scanned += len(text)
            return method(text, *args, **kwargs)

        return counted


class _CountingRe:
    """The :mod:`re` module as the migrate modules see it, counting the bytes every search scans."""

    def __init__(self) -> None:
        self.scanned = 0

    def __getattr__(self, name: str) -> object:
        return getattr(re, name)

    def compile(self, pattern: bytes, flags: int = 0) -> _CountingPattern:
        return _CountingPattern(re.compile(pattern, flags), self)

    def search(self, pattern: bytes, text: bytes, flags: int = 0) -> object:
        return self.compile(pattern, flags).search(text)

    def finditer(self, pattern: bytes, text: bytes, flags: int = 0) -> object:
        return self.compile(pattern, flags).finditer(text)


def _operations(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, functions: int) -> tuple[dict[str, int], int]:
    """Each function's call count and the bytes the regular expressions scanned, migrating and diffing the
    generated module of ``functions`` functions in this process."""
    path = tmp_path / f"m{functions}.py"
    path.write_bytes(_generated(functions))
    counting = _CountingRe()
    for module in (_engine, _facts, _plan, _rewrite, _skeleton):
        monkeypatch.setattr(module, "re", counting)
    profile = cProfile.Profile()
    profile.enable()
    outcome = _engine.migrate([SourceFile("pkg/m.py", path)], PRESETS["megatron"], target="megatron",
                              name="pg_collection", jobs=1)
    (change,) = [c for c in outcome.changes if c.path == "pkg/m.py"]  # beside the new helper module
    diff = render_unified_diff("pkg/m.py", change.before, change.after)
    profile.disable()
    # every third function reads, and the next, calling it, is threaded upward
    assert not outcome.failures and diff.count(b"+def f") == -(-functions // 3) + (functions + 1) // 3
    stats = pstats.Stats(profile).stats  # type: ignore[attr-defined]
    return {pstats.func_std_string(function): row[1] for function, row in stats.items()}, counting.scanned


def test_the_work_grows_linearly_with_the_size_of_a_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Counted, not timed: doubling a file may at most about double how often any function is called (a loop
    over the reads per definition, a diff that rescans the rest of the file per match) and the bytes the
    regular expressions scan (a search over the whole file per function), where 1 MB took minutes."""
    small, small_scanned = _operations(tmp_path, monkeypatch, 150)
    large, large_scanned = _operations(tmp_path, monkeypatch, 300)
    grown = {name: (small.get(name, 0), count) for name, count in large.items()
             if count >= 300 and count > 2.4 * small.get(name, 0)}
    assert not grown, f"called more than linearly more often (150 -> 300 functions): {grown}"
    assert large_scanned <= 2.4 * small_scanned, (small_scanned, large_scanned)


SOURCE = f"from megatron.core import parallel_state as ps\n\n\n{READ}"


@pytest.fixture
def untabled(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Project:
    """A project whose pyproject.toml has no ``[tool.pgregistry.allowlist]`` table, with a read in a file."""
    monkeypatch.chdir(tmp_path)
    project = Project(tmp_path)
    project.write("pyproject.toml", "[project]\nname = 'x'\n")
    project.write("src/pkg/__init__.py", "")
    project.write("src/pkg/m.py", SOURCE)
    return project


def test_write_regenerates_the_allowlist_the_user_named_without_a_pyproject_table(
    untabled: Project, capsys: pytest.CaptureFixture[str]
) -> None:
    named = ["--allowlist", "lists/allow.json"]
    untabled.write("lists/allow.json", "")
    assert main(["allowlist", "update", "--preset", "megatron", *named]) == 0
    assert "src/pkg/m.py" in untabled.read("lists/allow.json")
    assert main([*ARGS, "--write", *named]) == 0
    assert "pg_collection" in untabled.read("src/pkg/m.py")
    assert "src/pkg/m.py" not in untabled.read("lists/allow.json")  # was left stale, silently
    capsys.readouterr()


def test_write_with_an_allowlist_that_does_not_exist_exits_2_and_writes_nothing(
    untabled: Project, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([*ARGS, "--write", "--allowlist", "lists/typo.json"]) == 2
    assert "--allowlist lists/typo.json: no such file" in capsys.readouterr().err
    assert untabled.read("src/pkg/m.py") == SOURCE


def test_write_says_why_a_configured_allowlist_is_not_regenerated(
    project: Project, capsys: pytest.CaptureFixture[str]
) -> None:
    project.write("src/pkg/m.py", SOURCE)
    assert main([*ARGS, "--write"]) == 0
    assert f"no allowlist regenerated: the configured {project.root / 'allowlist.json'} does not exist" in (
        capsys.readouterr().err)


def test_write_whose_allowlist_cannot_be_regenerated_says_the_files_were_written(
    project: Project, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sources were rewritten, then the allowlist's update failed (a full disk): exit 2 with the update's
    line alone, which under ``--quiet`` read as "nothing was written" (what exit 2 means everywhere else)."""
    project.write("src/pkg/m.py", SOURCE)
    assert main(["allowlist", "update", "--preset", "megatron"]) == 0
    before = project.read("allowlist.json")

    def full_disk(path: Path, data: bytes) -> None:
        raise StorageError(f"cannot write {path}: No space left on device; the previous file is unchanged")

    monkeypatch.setattr(_ratchet, "atomic_write", full_disk)
    capsys.readouterr()
    assert main([*ARGS, "--write", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "No space left on device" in err and "pg_collection" in project.read("src/pkg/m.py")
    assert (
        "pgregistry migrate: error: 2 file(s) were rewritten (src/pkg/_process_group_fallback.py, src/pkg/m.py), "
        "but the allowlist was not regenerated (above): fix that, then run `pgregistry allowlist update`"
    ) in err
    assert project.read("allowlist.json") == before


@pytest.mark.parametrize("named", [False, True], ids=["configured", "named"])
def test_write_whose_allowlist_is_a_directory_is_refused_before_anything_is_written(
    project: Project, capsys: pytest.CaptureFixture[str], named: bool
) -> None:
    """It was "the configured allowlist.json does not exist" (``--allowlist``: "no such file; create it"), and,
    configured, the sources were rewritten with the ratchet's list left as it was."""
    project.write("src/pkg/m.py", SOURCE)
    (project.root / "allowlist.json").mkdir()
    assert main([*ARGS, "--write", *(["--allowlist", "allowlist.json"] if named else [])]) == 2
    assert "allowlist.json is a directory, not a regular file" in capsys.readouterr().err
    assert project.read("src/pkg/m.py") == SOURCE


def test_write_whose_allowlist_is_a_link_out_of_the_project_is_refused_before_anything_is_written(
    project: Project, capsys: pytest.CaptureFixture[str], tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The update refuses such an allowlist (it would write over a file of the user's anywhere); ``--write``
    rewrote the sources first, then failed on it."""
    project.write("src/pkg/m.py", SOURCE)
    elsewhere = tmp_path_factory.mktemp("elsewhere") / "notes.txt"
    elsewhere.write_text("not an allowlist\n")
    (project.root / "allowlist.json").symlink_to(elsewhere)
    assert main([*ARGS, "--write"]) == 2
    assert f"is a link to {elsewhere}, outside the project" in capsys.readouterr().err
    assert project.read("src/pkg/m.py") == SOURCE and elsewhere.read_text() == "not an allowlist\n"


class _SlowClock:
    """``time`` as the progress sees it, each reading 4 s after the one before: a long run."""

    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        self.now += 4.0
        return self.now


@pytest.mark.parametrize("long", [False, True], ids=["short-run-quiet", "long-run-says-progress"])
def test_progress_goes_to_stderr_on_a_long_run_only(
    project: Project, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, long: bool
) -> None:
    from pgregistry.migrate import _progress

    for index in range(3):
        project.write(f"src/pkg/m{index}.py", SOURCE)
    if long:
        monkeypatch.setattr(_progress, "time", _SlowClock())
    assert main(ARGS) == 0
    out, err = capsys.readouterr()
    said = [line for line in err.splitlines() if re.match(r"pgregistry migrate: .*: \d+ of \d+ \(\d+ s\)$", line)]
    assert "pgregistry migrate:" not in out  # the diff alone on stdout
    assert bool(said) == long, err
    if long:
        assert any(line.startswith("pgregistry migrate: planning the files with reads: ") for line in said)

"""``pgregistry migrate --write`` leaves nothing half-done: a run killed (a real SIGKILL) at any step leaves every
file old or new and a journal the next run finishes, the tree then all old or all new with no temporary file;
links stay links; a hard-linked file is refused; a file changed on disk while the others are written is never
overwritten and nothing is left written."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from fixtures.fifos import without_blocking_on
from fixtures.scan_projects import Project

pytest.importorskip("libcst")

from pgregistry.cli import main  # noqa: E402
from pgregistry.migrate import _writing  # noqa: E402
from pgregistry.migrate._writing import JOURNAL, Change, WriteError, write_changes  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
ARGS = ["migrate", "--preset", "megatron"]
IMPORT = "from megatron.core import parallel_state as ps\n"
#: A callee and its callers in other files: a caller rewritten without its callee is a TypeError at run time.
FILES = {
    "src/pkg/a.py": f"{IMPORT}\n\ndef reduce(x):\n    return ps.get_tensor_model_parallel_group()\n",
    **{
        f"src/pkg/{name}.py": f"{IMPORT}from .a import reduce\n\n\ndef {name}(x):\n"
                              "    return reduce(x), ps.get_tensor_model_parallel_rank()\n"
        for name in ("b", "c")
    },
}


def _tree(project: Project) -> dict[str, str]:
    return {path: project.read(path) for path in FILES}


def _leftovers(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.name.endswith(".tmp") or p.name == JOURNAL)


KILL = """
import os, signal, sys
calls = {"fsync": 0, "replace": 0, "unlink": 0}
name, at = sys.argv[1], int(sys.argv[2])
real = getattr(os, name)
def killing(*args, **kwargs):
    calls[name] += 1
    if calls[name] == at:
        os.kill(os.getpid(), signal.SIGKILL)
    return real(*args, **kwargs)
setattr(os, name, killing)
from pgregistry.cli import main
sys.exit(main(["migrate", "--preset", "megatron", "--write"]))
"""


@pytest.mark.parametrize(
    ("call", "at"),
    [
        ("fsync", 1),  # writing the journal (state: writing)
        ("fsync", 4),  # writing the temporary files
        ("replace", 2),  # the journal turning to "renaming"
        ("replace", 4),  # one file renamed of three
        ("unlink", 1),  # every file renamed, the journal not yet removed
    ],
)
def test_a_write_killed_at_any_step_leaves_old_or_new_files_and_the_next_run_finishes_it(
    project: Project, capsys: pytest.CaptureFixture[str], call: str, at: int
) -> None:
    for path, text in FILES.items():
        project.write(path, text)
    old = _tree(project)
    killed = subprocess.run([sys.executable, "-c", KILL, call, str(at)], cwd=project.root, capture_output=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=90)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    now = _tree(project)
    assert all(now[path] == old[path] or "pg_collection" in now[path] for path in FILES)
    if (project.root / JOURNAL).exists():
        assert main([*ARGS, "--check"]) == 2  # CI never reads a half-written tree as done or "would change"
        assert JOURNAL in capsys.readouterr().err
    else:  # killed while writing the journal: nothing else was written
        assert now == old
    assert main([*ARGS, "--quiet"]) == 0  # any other mode finishes (or rolls back) the interrupted run first
    finished = capsys.readouterr().err
    assert "an interrupted `pgregistry migrate --write` " in finished
    assert _leftovers(project.root) == []
    now = _tree(project)
    if "rolled back" in finished or "had written nothing" in finished:
        assert now == old
    else:
        assert all(now[path] != old[path] for path in FILES)  # every file new: none left behind
        assert "def reduce(x, *, pg_collection=None):" in now["src/pkg/a.py"]
        assert "reduce(x, pg_collection=pg_collection)" in now["src/pkg/b.py"]
        assert main([*ARGS, "--check"]) == 0
    assert main([*ARGS, "--write"]) == 0
    assert _leftovers(project.root) == []
    assert main([*ARGS, "--check"]) == 0
    capsys.readouterr()


def test_a_file_changed_on_disk_while_the_others_are_written_is_not_overwritten_and_none_is_left_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The check at write time, for every file, not only the first: the third file is edited while the first
    is renamed into place."""
    paths = [tmp_path / f"m{i}.py" for i in range(3)]
    changes = []
    for path in paths:
        path.write_text("x = 1\n")
        changes.append(Change(path.name, path, b"x = 1\n", path.stat().st_mtime_ns, b"x = 2\n"))
    real_replace = os.replace

    def replace_then_edit(source: str, target: str) -> None:
        real_replace(source, target)
        if Path(target) == paths[0]:
            paths[2].write_text("x = 1  # edited meanwhile\n")

    monkeypatch.setattr(_writing.os, "replace", replace_then_edit)
    with pytest.raises(WriteError, match=r"m2.py: changed on disk since it was read.*nothing was written"):
        write_changes(changes, tmp_path)
    assert [p.read_text() for p in paths] == ["x = 1\n", "x = 1\n", "x = 1  # edited meanwhile\n"]
    assert _leftovers(tmp_path) == []


def test_links_stay_links_and_each_file_is_rewritten_once(
    project: Project, capsys: pytest.CaptureFixture[str], tmp_path_factory: pytest.TempPathFactory
) -> None:
    text = FILES["src/pkg/a.py"]
    real = project.write("src/pkg/a.py", text)
    (project.root / "src/pkg/alias.py").symlink_to("a.py")
    (project.root / "src/pkg/sub").mkdir()
    (project.root / "src/pkg/sub/again.py").symlink_to("../a.py")
    outside = tmp_path_factory.mktemp("elsewhere") / "shared.py"
    outside.write_text(text)
    (project.root / "src/pkg/shared.py").symlink_to(outside)
    vendored = project.write("src/vendored/v.py", text)
    (project.root / "src/pkg/v.py").symlink_to("../vendored/v.py")
    assert main([*ARGS, "--write", "--extend-exclude", "vendored"]) == 0
    err = capsys.readouterr().err
    assert f"src/pkg/shared.py: a link to {outside}, outside the project: left untouched" in err
    assert "src/pkg/v.py: a link to src/vendored/v.py, which is excluded: left untouched" in err
    assert vendored.read_text() == text
    assert (project.root / "src/pkg/alias.py").is_symlink() and (project.root / "src/pkg/sub/again.py").is_symlink()
    assert (project.root / "src/pkg/shared.py").is_symlink() and outside.read_text() == text
    written = real.read_text()
    assert written.count("pg_collection=None") == 1 and 'pg_group(pg_collection, "tp")' in written
    assert main([*ARGS, "--check", "--extend-exclude", "vendored"]) == 0


def test_a_file_reached_through_a_linked_directory_is_written_in_the_project_only(
    project: Project, capsys: pytest.CaptureFixture[str], tmp_path_factory: pytest.TempPathFactory
) -> None:
    """A link to a file outside the project is left untouched; a link to a directory outside it, named as a
    path, was walked and its files rewritten there. Each file is taken by where it is: outside, left untouched
    and said so; inside (a link to a directory of the project), rewritten once, under its own path."""
    text = FILES["src/pkg/a.py"]
    outside = tmp_path_factory.mktemp("elsewhere")
    (outside / "o.py").write_text(text)
    (project.root / "src/pkg/ext").symlink_to(outside)
    real = project.write("src/lib/b.py", text)
    (project.root / "src/pkg/lib").symlink_to("../lib")
    assert main([*ARGS, "--write", "src/pkg/ext", "src/pkg/lib"]) == 0
    err = capsys.readouterr().err
    assert f"src/pkg/ext/o.py: through a link, {outside / 'o.py'}, outside the project: left untouched" in err
    assert (outside / "o.py").read_text() == text and sorted(p.name for p in outside.iterdir()) == ["o.py"]
    assert real.read_text().count("pg_collection=None") == 1
    assert main([*ARGS, "--check", "src/pkg/lib"]) == 0


def test_a_hard_linked_file_is_refused_naming_its_links_and_nothing_is_written(
    project: Project, capsys: pytest.CaptureFixture[str]
) -> None:
    for path, text in FILES.items():
        project.write(path, text)
    os.link(project.root / "src/pkg/a.py", project.root / "src/pkg/a_again.py")
    assert main([*ARGS, "--write"]) == 2
    err = capsys.readouterr().err
    assert "src/pkg/a.py: has 2 hard links (others: src/pkg/a_again.py)" in err
    assert _tree(project) == FILES
    assert os.stat(project.root / "src/pkg/a.py").st_nlink == 2


def test_a_file_edited_after_the_kill_stops_the_recovery_naming_it_and_the_journal_stays(
    project: Project, capsys: pytest.CaptureFixture[str]
) -> None:
    for path, text in FILES.items():
        project.write(path, text)
    killed = subprocess.run([sys.executable, "-c", KILL, "replace", "4"], cwd=project.root, capture_output=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=90)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    edited = project.write("src/pkg/c.py", FILES["src/pkg/c.py"] + "# edited after the kill\n")
    assert main([*ARGS, "--write"]) == 2
    err = capsys.readouterr().err
    assert "cannot be finished" in err and str(edited) in err and JOURNAL in err
    assert (project.root / JOURNAL).exists() and project.read("src/pkg/c.py").endswith("# edited after the kill\n")


def test_a_journal_in_a_state_this_tool_never_writes_is_refused_and_nothing_is_renamed(
    project: Project, capsys: pytest.CaptureFixture[str]
) -> None:
    """A journal read as "renaming" whatever its state said would finish a run nobody made: a temporary file
    whose hash it lists replaces the user's file. Only the two states the tool writes are read."""
    import hashlib
    import json

    for path, text in FILES.items():
        project.write(path, text)
    target = project.root / "src/pkg/a.py"
    temporary = project.write("src/pkg/.a.py.new.tmp", "replaced = True\n")
    digest = {name: hashlib.sha256(path.read_bytes()).hexdigest() for name, path in
              (("old", target), ("new", temporary))}
    row = {"target": str(target), "temporary": str(temporary), **digest}
    project.write(JOURNAL, json.dumps({"state": "finishing", "files": [row]}))
    assert main([*ARGS, "--write"]) == 2
    err = capsys.readouterr().err
    assert "cannot be read" in err and "finishing" in err
    assert _tree(project) == FILES and (project.root / JOURNAL).exists() and temporary.exists()


@pytest.mark.parametrize("listed", ["outside", "another file", "target outside"])
def test_a_journal_listing_files_this_tool_never_writes_is_refused_and_nothing_is_removed(
    project: Project, capsys: pytest.CaptureFixture[str], tmp_path_factory: pytest.TempPathFactory, listed: str
) -> None:
    """A journal found at the project root (committed, copied from another tree, hand-made) was trusted: rolling
    back "writing" removed every file it listed as a temporary one, anywhere, in any mode (a diff too). Only the
    rows this tool writes are read: a file of the project, its temporary file beside it under the name it gives
    them; any other journal is refused, naming it and the path, and nothing is removed or renamed."""
    import json

    for path, text in FILES.items():
        project.write(path, text)
    precious = tmp_path_factory.mktemp("outside") / "precious.py"
    precious.write_text(FILES["src/pkg/a.py"])
    target, temporary = project.root / "src/pkg/a.py", project.root / "src/pkg/.a.py.0123abcd.pgregistry-migrate.tmp"
    if listed == "outside":
        temporary = precious
    elif listed == "another file":
        temporary = project.root / "src/pkg/b.py"
    else:
        target, temporary = precious, precious.with_name(".precious.py.0123abcd.pgregistry-migrate.tmp")
        temporary.write_text("replaced = True\n")
    row = {"target": str(target), "temporary": str(temporary), "old": None, "new": "0" * 64}
    for state in ("writing", "renaming"):
        project.write(JOURNAL, json.dumps({"state": state, "files": [row]}))
        assert main(ARGS) == 2
        err = capsys.readouterr().err
        named = row["target" if listed == "target outside" else "temporary"]
        assert "cannot be read" in err and JOURNAL in err and str(named) in err, err
        assert _tree(project) == FILES and precious.read_text() == FILES["src/pkg/a.py"]
        assert (project.root / JOURNAL).exists() and temporary.exists()


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_a_fifo_in_place_of_the_journal_or_of_a_file_to_write_is_named_not_waited_on(
    project: Project, capsys: pytest.CaptureFixture[str]
) -> None:
    """The journal, and each file checked once more before it is written, were read with a plain ``open``: a FIFO
    there (a file swapped for one after it was read) waited for a writer forever. Each is named, exit 2 (a
    ``WriteError``), nothing written."""
    for path, text in FILES.items():
        project.write(path, text)
    journal = project.root / JOURNAL
    os.mkfifo(journal)
    assert without_blocking_on(journal, lambda: main(ARGS)) == 2
    assert "cannot be read" in capsys.readouterr().err and _tree(project) == FILES
    journal.unlink()
    target = project.root / "src/pkg/a.py"
    change = Change("src/pkg/a.py", target, target.read_bytes(), target.stat().st_mtime_ns, b"new = 1\n")
    target.unlink()
    os.mkfifo(target)
    with pytest.raises(WriteError, match="src/pkg/a.py: cannot read it again: not a regular file"):
        without_blocking_on(target, lambda: write_changes([change], project.root))
    assert target.is_fifo() and _leftovers(project.root) == []

"""``pgregistry migrate`` on disk: --diff/--write/--check exit codes, the allowlist regenerated, and every bad input
named with exit 2 and nothing written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from fixtures.fifos import without_blocking_on
from fixtures.scan_projects import Project

pytest.importorskip("libcst")

from pgregistry._source.files import SourceFile  # noqa: E402
from pgregistry.cli import main  # noqa: E402
from pgregistry.migrate._helper_file import helper_text  # noqa: E402
from pgregistry.migrate._megatron_release import megatron_source  # noqa: E402
from pgregistry.migrate._writing import Change, WriteError, write_changes  # noqa: E402

SOURCE = """\
from megatron.core import parallel_state as ps


def f(x):
    return ps.get_tensor_model_parallel_group()
"""
ARGS = ["migrate", "--preset", "megatron"]


def test_diff_by_default_writes_nothing(project: Project, capsys: pytest.CaptureFixture[str]) -> None:
    project.write("src/pkg/m.py", SOURCE)
    assert main(ARGS) == 0
    out, err = capsys.readouterr()
    assert "--- a/src/pkg/m.py\n+++ b/src/pkg/m.py\n" in out
    assert "+def f(x, *, pg_collection=None):" in out
    # the fallback helper the rewritten read calls: a new file of the top package, shown in the diff
    assert "--- /dev/null\n+++ b/src/pkg/_process_group_fallback.py\n" in out
    assert "+from pkg._process_group_fallback import pg_group\n" in out
    assert "direct" in err and "2 files would change" in err
    assert project.read("src/pkg/m.py") == SOURCE
    assert not (project.root / "src/pkg/_process_group_fallback.py").exists()


def test_check_exits_1_then_write_then_check_exits_0_and_a_second_write_changes_nothing(
    project: Project, capsys: pytest.CaptureFixture[str]
) -> None:
    project.write("src/pkg/m.py", SOURCE)
    project.write("allowlist.json", "")
    assert main(["allowlist", "update", "--preset", "megatron"]) == 0
    before = json.loads(project.read("allowlist.json"))
    assert "src/pkg/m.py" in json.dumps(before)
    assert main([*ARGS, "--check"]) == 1
    assert main([*ARGS, "--write"]) == 0
    written = project.read("src/pkg/m.py")
    assert 'return pg_group(pg_collection, "tp")' in written and "pgregistry" not in written
    helper = project.root / "src/pkg/_process_group_fallback.py"
    assert helper.read_bytes() == helper_text(megatron_source(project.root).accessors)
    assert helper.stat().st_mode & 0o777 == 0o666 & ~_umask()  # not mkstemp's 0600
    assert "src/pkg/m.py" not in project.read("allowlist.json")  # the ratchet shrank in the same run
    assert "_process_group_fallback" not in project.read("allowlist.json")  # it holds no counted read
    assert main([*ARGS, "--check"]) == 0
    stamp = helper.stat().st_mtime_ns
    assert main([*ARGS, "--write"]) == 0
    assert project.read("src/pkg/m.py") == written and helper.stat().st_mtime_ns == stamp
    assert list(helper.parent.glob("*.tmp")) == []
    capsys.readouterr()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_a_helper_module_the_tool_did_not_write_is_refused_and_nothing_is_written(
    project: Project, capsys: pytest.CaptureFixture[str]
) -> None:
    project.write("src/pkg/m.py", SOURCE)
    project.write("src/pkg/_process_group_fallback.py", "MINE = 1\n")
    assert main([*ARGS, "--write"]) == 2
    err = capsys.readouterr().err
    assert "src/pkg/_process_group_fallback.py:1:1: the fallback helper module pkg._process_group_fallback is a " \
           "file pgregistry migrate did not write; name another module with --helper-module" in err
    assert project.read("src/pkg/m.py") == SOURCE
    assert project.read("src/pkg/_process_group_fallback.py") == "MINE = 1\n"


@pytest.mark.parametrize("where", ["option", "pyproject"])
def test_the_helper_module_is_the_one_the_user_names(
    project: Project, capsys: pytest.CaptureFixture[str], where: str
) -> None:
    project.write("src/pkg/m.py", SOURCE)
    options = ["--helper-module", "pkg.groups_fallback"] if where == "option" else []
    if where == "pyproject":
        project.write("pyproject.toml", project.read("pyproject.toml") +
                      '\n[tool.pgregistry.migrate]\nhelper-module = "pkg.groups_fallback"\n')
    assert main([*ARGS, "--write", *options]) == 0
    assert "from pkg.groups_fallback import pg_group\n" in project.read("src/pkg/m.py")
    assert b"Written by `pgregistry migrate`" in (project.root / "src/pkg/groups_fallback.py").read_bytes()
    capsys.readouterr()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--write", "--check"], "not allowed with argument"),
        (["--target", "jax"], "invalid choice: 'jax'"),
        (["--isolated", "--config", "pyproject.toml"], "--isolated and --config contradict each other"),
        (["--collection-name", "pg-collection"], "is not a Python identifier"),
        (["--helper-module", "pkg.2nd"], "--helper-module 'pkg.2nd' is not a dotted module name"),
        (["/"], "outside the project root"),
    ],
)
def test_bad_options_exit_2_naming_the_problem(
    project: Project, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    project.write("src/pkg/m.py", SOURCE)
    with pytest.raises(SystemExit) if "--write" in args or "--target" in args else _no_exit() as raised:
        code = main([*ARGS, *args])
    if raised is not None:
        code = raised.value.code  # type: ignore[attr-defined]
    assert code == 2
    assert message in capsys.readouterr().err
    assert project.read("src/pkg/m.py") == SOURCE


class _no_exit:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> bool:
        return False


@pytest.mark.parametrize(
    ("args", "named"), [(["--write", "--allowlist", ""], "argument --allowlist"), ([""], "argument PATH")]
)
def test_an_empty_path_is_refused_naming_the_option(
    project: Project, capsys: pytest.CaptureFixture[str], args: list[str], named: str
) -> None:
    # An empty path was Path('.'), the current directory: `migrate "$UNSET"` migrated the whole directory, and
    # `--allowlist "$UNSET"` was refused as `--allowlist .: no such file`, a name the user never gave. Both are now
    # refused as the ratchet refuses an empty path.
    project.write("src/pkg/m.py", SOURCE)
    before = sorted(project.root.rglob("*"))
    with pytest.raises(SystemExit) as raised:
        main([*ARGS, *args])
    assert raised.value.code == 2
    assert f"pgregistry migrate: error: {named}: is empty" in capsys.readouterr().err
    assert sorted(project.root.rglob("*")) == before  # nothing written
    assert project.read("src/pkg/m.py") == SOURCE


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("def broken(:\n", "syntax error"),
        ("type Alias = int\n", "needs Python >= 3.12"),
    ],
)
def test_a_file_that_does_not_parse_is_named_and_nothing_is_written(
    project: Project, capsys: pytest.CaptureFixture[str], text: str, message: str
) -> None:
    if "type Alias" in text and sys.version_info >= (3, 12):
        pytest.skip("this Python parses type aliases")
    project.write("src/pkg/m.py", SOURCE)
    project.write("src/pkg/z.py", text)
    assert main([*ARGS, "--write"]) == 2
    err = capsys.readouterr().err
    assert "src/pkg/z.py:1:" in err and message in err and "nothing was written" in err
    assert project.read("src/pkg/m.py") == SOURCE


def test_a_read_only_file_is_named_and_nothing_is_written(
    project: Project, capsys: pytest.CaptureFixture[str]
) -> None:
    project.write("src/pkg/a.py", SOURCE)
    locked = project.write("src/pkg/b.py", SOURCE)
    locked.chmod(0o444)
    assert main([*ARGS, "--write"]) == 2
    assert "src/pkg/b.py: read-only" in capsys.readouterr().err
    assert project.read("src/pkg/a.py") == SOURCE  # checked before anything was written


def test_a_file_changed_on_disk_since_it_was_read_is_not_overwritten(tmp_path: Path) -> None:
    path = tmp_path / "m.py"
    path.write_text(SOURCE)
    stat = path.stat()
    change = Change("m.py", path, SOURCE.encode(), stat.st_mtime_ns, b"new\n")
    path.write_text(SOURCE + "# edited meanwhile\n")
    with pytest.raises(WriteError, match="m.py: changed on disk since it was read"):
        write_changes([change], tmp_path)
    assert path.read_text() == SOURCE + "# edited meanwhile\n"
    assert SourceFile("m.py", path).absolute == path


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_a_py_that_is_no_regular_file_is_named_as_left_untouched(
    project: Project, capsys: pytest.CaptureFixture[str]
) -> None:
    """A FIFO or a dangling link named ``*.py`` in the tree was skipped without a word (``allowlist check`` names
    each): a run that looked at nothing there said "0 files would change". Each is named with what it is."""
    project.write("src/pkg/m.py", SOURCE)
    os.mkfifo(project.root / "src/pkg/pipe.py")
    (project.root / "src/pkg/gone.py").symlink_to("nowhere.py")
    for mode in ([], ["--check"], ["--write"]):
        assert main([*ARGS, *mode]) in (0, 1)
        err = capsys.readouterr().err
        assert "src/pkg/pipe.py: a FIFO, not a regular file: left untouched" in err, err
        assert "src/pkg/gone.py: a link to nothing, not a regular file: left untouched" in err
    assert "pg_collection" in project.read("src/pkg/m.py")


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_a_fifo_that_replaces_a_file_after_discovery_does_not_block(tmp_path: Path) -> None:
    """The ratchet's scan reads a file non-blocking (a FIFO is refused, not waited on); migrate read it again
    with a plain ``open``, which waits for a writer forever."""
    from pgregistry._source.config import PRESETS
    from pgregistry.migrate._engine import migrate

    os.mkfifo(tmp_path / "pipe.py")
    outcome = without_blocking_on(
        tmp_path / "pipe.py",
        lambda: migrate([SourceFile("pipe.py", tmp_path / "pipe.py")], PRESETS["megatron"], target="megatron",
                        name="pg_collection"),
    )
    (failure,) = outcome.failures
    assert failure.path == "pipe.py" and failure.failure is not None
    assert "not a regular file" in failure.failure.message


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
@pytest.mark.parametrize(
    "name", ["setup.cfg", "tox.ini", "megatron/core/parallel_state.py", "megatron/core/process_groups_config.py"]
)
def test_a_fifo_where_a_setting_is_read_is_passed_over_not_waited_on(
    project: Project, capsys: pytest.CaptureFixture[str], name: str
) -> None:
    """Besides the sources, a run reads the project's line length (``setup.cfg``, ``tox.ini``, ``.flake8``) and its
    Megatron-Core release (``megatron/core/...``): a FIFO at one of those names blocked the run forever. It is
    passed over as a file that is not there."""
    project.write("src/pkg/m.py", SOURCE)
    fifo = project.root / name
    fifo.parent.mkdir(parents=True, exist_ok=True)
    if name.endswith("process_groups_config.py"):  # read beside the project's parallel_state.py only
        project.write("megatron/core/parallel_state.py", "def get_data_parallel_group(with_gtp_remat=False): ...\n")
    os.mkfifo(fifo)
    assert without_blocking_on(fifo, lambda: main([*ARGS, "--quiet", "src"])) == 0
    assert "+def f(x, *, pg_collection=None):" in capsys.readouterr().out


def test_a_file_deleted_since_it_was_read_is_named_not_an_internal_error(tmp_path: Path) -> None:
    """A file removed between the scan and the write was ``internal error (FileNotFoundError ...); please report
    it``: the check's ``stat`` came before the check that reads it again. Nothing is written either way."""
    kept, gone = tmp_path / "a.py", tmp_path / "m.py"
    for path in (kept, gone):
        path.write_text(SOURCE)
    changes = [Change(p.name, p, SOURCE.encode(), p.stat().st_mtime_ns, b"new = 1\n") for p in (kept, gone)]
    gone.unlink()
    with pytest.raises(WriteError, match="^m.py: cannot read it again: No such file or directory"):
        write_changes(changes, tmp_path)
    assert kept.read_text() == SOURCE and sorted(p.name for p in tmp_path.iterdir()) == ["a.py"]


def test_without_libcst_the_error_names_the_extra(
    project: Project, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "libcst", None)  # import libcst raises ImportError
    assert main(ARGS) == 2
    assert "pip install 'pgregistry[migrate]'" in capsys.readouterr().err


def test_the_package_and_the_command_table_import_no_libcst() -> None:
    code = (
        "import sys, pgregistry, pgregistry.doors; from pgregistry.cli import _build_parser; _build_parser(); "
        "assert 'libcst' not in sys.modules and 'torch' not in sys.modules, sorted(sys.modules)"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_the_migrated_tree_imports_in_the_order_it_did_through_a_cycle_with_parallel_state(
    project: Project, capsys: pytest.CaptureFixture[str]
) -> None:
    """Megatron-Core's own cycle: parallel_state imports utils, which imports parallel_state (and, rewritten, the
    helper). The helper imports parallel_state where the files imported it before, after defining its functions."""
    project.write("megatron/core/__init__.py", "import megatron.core.user\n")
    project.write("megatron/core/parallel_state.py", """\
        from .utils import divide


        def get_tensor_model_parallel_group():
            return "the global tp group"
        """)
    project.write("megatron/core/utils.py", """\
        from megatron.core import parallel_state


        def divide(a, b):
            return a // b


        def tp(pg_collection=None):
            return parallel_state.get_tensor_model_parallel_group()


        def where():  # parallel_state stays imported here
            return parallel_state.__name__
        """)
    project.write("megatron/core/user.py", """\
        from megatron.core.parallel_state import get_tensor_model_parallel_group
        from megatron.core.utils import divide


        def f(x, pg_collection=None):
            return divide(x, 2), get_tensor_model_parallel_group()
        """)
    assert main([*ARGS, "--write", "megatron"]) == 0
    assert "from megatron.core._process_group_fallback import pg_group\n" in project.read("megatron/core/user.py")
    code = ("import warnings; warnings.simplefilter('ignore'); import megatron.core.user as user, "
            "megatron.core.utils as utils; print(user.f(4), utils.tp())")
    done = subprocess.run([sys.executable, "-c", code], cwd=project.root, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(project.root)})
    assert done.returncode == 0, done.stderr
    assert done.stdout == "(2, 'the global tp group') the global tp group\n"
    capsys.readouterr()


def test_an_unknown_migrate_setting_is_named_and_nothing_is_written(
    project: Project, capsys: pytest.CaptureFixture[str]
) -> None:
    project.write("src/pkg/m.py", SOURCE)
    project.write("pyproject.toml", project.read("pyproject.toml") + '\n[tool.pgregistry.migrate]\nhelper = "x"\n')
    assert main([*ARGS, "--write"]) == 2
    assert "[tool.pgregistry.migrate] has no setting 'helper' (known: helper-module)" in capsys.readouterr().err
    assert project.read("src/pkg/m.py") == SOURCE

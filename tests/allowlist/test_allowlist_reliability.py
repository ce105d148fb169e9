"""The allowlist file is never lost or corrupted, and no input hangs or silently stops the scan.

Each test reproduces a fault found by trying the command as a hostile user would: a crash or a full disk
during ``update``, two updates at once, a future-version allowlist, a FIFO named ``*.py``, a file written
for a newer Python. Faults of the operating system are produced for real where a test can (a kill -9, a
directory that cannot hold the file, a real second process) and by failing ``os.fsync`` where it cannot (a
full disk)."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from fixtures.fifos import without_blocking_on
from fixtures.scan_projects import Project

from pgregistry._source.scanner import _NEWER_SYNTAX
from pgregistry.allowlist import _ratchet as ratchet
from pgregistry.allowlist import main as allowlist_main

REPO = Path(__file__).resolve().parents[2]

READ_A = """
import megatron.core.parallel_state as ps

def a():
    return ps.get_tensor_model_parallel_group()
"""
READ_B = READ_A.replace("def a", "def b").replace("tensor_model", "data")


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = allowlist_main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture
def listed(project: Project, capsys: pytest.CaptureFixture[str]) -> Project:
    project.write("src/pkg/a.py", READ_A)
    assert run(capsys, "update", "--no-cache")[0] == 0
    project.write("src/pkg/b.py", READ_B)  # a new read: the next update must rewrite the file
    return project


def _leftovers(project: Project) -> list[str]:
    return sorted(p.name for p in project.root.iterdir() if p.name.startswith(".allowlist.json"))


def test_a_full_disk_exits_2_with_one_line_and_keeps_the_old_file(
    listed: Project, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    before = (listed.root / "allowlist.json").read_bytes()

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    code, _, err = run(capsys, "update", "--no-cache")
    assert code == 2
    assert err.count("\n") == 1 and "No space left on device" in err and "allowlist.json" in err
    assert (listed.root / "allowlist.json").read_bytes() == before
    assert _leftovers(listed) == []


def test_an_unwritable_location_exits_2_with_one_line(project: Project, capsys: pytest.CaptureFixture[str]) -> None:
    project.write("src/pkg/a.py", READ_A)
    project.write("blocker", "a file where the allowlist's directory should be\n")
    code, _, err = run(capsys, "update", "--no-cache", "--allowlist", "blocker/allowlist.json")
    assert code == 2
    assert err.count("\n") == 1 and "blocker/allowlist.json" in err
    assert err.startswith(("pgregistry allowlist: error: cannot write", "pgregistry allowlist: error: cannot lock"))


KILL_DURING_WRITE = """
import os, signal, sys
os.fsync = lambda fd: os.kill(os.getpid(), signal.SIGKILL)  # the process dies with the new bytes half-flushed
from pgregistry.allowlist import main
main(["update", "--no-cache"])
"""


def test_kill_9_during_update_leaves_the_old_file(listed: Project) -> None:
    before = (listed.root / "allowlist.json").read_bytes()
    environment = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-c", KILL_DURING_WRITE], cwd=listed.root, env=environment, capture_output=True, timeout=60
    )
    assert done.returncode == -signal.SIGKILL, done.stderr
    assert (listed.root / "allowlist.json").read_bytes() == before


def _holds_open(pid: int, directory: Path) -> bool:
    """Whether process ``pid`` has ``directory`` open (the allowlist's lock is a lock on its directory)."""
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
        return any(os.path.realpath(f"/proc/{pid}/fd/{fd}") == str(directory.resolve()) for fd in fds)
    except OSError:  # the process ended meanwhile
        return False


def _eventually(condition: Callable[[], bool], seconds: float = 60.0) -> bool:
    give_up = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > give_up:
            return False
        time.sleep(0.02)
    return True


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc to see the other update wait")
def test_concurrent_partial_updates_lose_no_entry(
    project: Project, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A second real process runs ``update src/pkg/b.py`` while this one is between reading the allowlist and
    writing it (the window where, unlocked, both read the same old list and the last write wins)."""
    project.write("src/pkg/a.py", READ_A)
    project.write("src/pkg/b.py", "")
    assert run(capsys, "update", "--no-cache")[0] == 0
    project.write("src/pkg/a.py", READ_A)
    project.write("src/pkg/b.py", READ_B)
    environment = {**os.environ, "PYTHONPATH": str(REPO)}
    merged = ratchet.Allowlist.merge_scanned
    other: list[subprocess.Popen[bytes]] = []

    def racing_merge(self: ratchet.Allowlist, *args: object, **kwargs: object) -> ratchet.Allowlist:
        command = [sys.executable, "-m", "pgregistry.allowlist", "update", "--no-cache", "src/pkg/b.py"]
        other.append(subprocess.Popen(command, cwd=project.root, env=environment, stderr=subprocess.PIPE))
        # Unlocked, the other update completes now; locked, it waits for this one, holding the directory it locks
        # open. Waited for as such, not for a fixed time: on a loaded machine the other interpreter can take
        # seconds to start, and a fixed wait would let an unlocked update pass untested.
        assert _eventually(lambda: other[0].poll() is not None or _holds_open(other[0].pid, project.root))
        return merged(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(ratchet.Allowlist, "merge_scanned", racing_merge)
    assert run(capsys, "update", "--no-cache", "src/pkg/a.py")[0] == 0
    _, err = other[0].communicate(timeout=60)
    assert other[0].returncode == 0, err
    allowed = json.loads(project.read("allowlist.json"))["allowed"]
    assert set(allowed) == {"src/pkg/a.py", "src/pkg/b.py"}


def test_a_write_by_another_process_after_reading_is_refused(listed: Project, monkeypatch: pytest.MonkeyPatch) -> None:
    """The second line of defence (for writers that take no lock): re-read before the rename."""
    path = listed.root / "allowlist.json"
    read = path.read_bytes()
    path.write_text(path.read_text().replace('"total": 1', '"total": 1 '))
    with pytest.raises(OSError, match="changed by another process"):
        ratchet.Allowlist({}).write(path, read)


def test_a_future_version_allowlist_is_never_rewritten(listed: Project, capsys: pytest.CaptureFixture[str]) -> None:
    future = json.dumps({"version": 2, "allowed": {}, "total": 0, "owners": {"src/pkg/a.py": "team-a"}}) + "\n"
    listed.write("allowlist.json", future)
    code, _, err = run(capsys, "update", "--no-cache")
    assert code == 2 and "version 2" in err and "newer pgregistry" in err
    assert listed.read("allowlist.json") == future


def test_a_partial_update_of_an_unreadable_allowlist_says_what_works(
    listed: Project, capsys: pytest.CaptureFixture[str]
) -> None:
    listed.write("allowlist.json", '{"allowed": {"x.py": ["12:accessor:mpu.get_data_parallel_group"]}}\n')
    code, _, err = run(capsys, "update", "--no-cache", "src/pkg/b.py")
    assert code == 2 and "with no PATH" in err


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_a_fifo_named_py_is_skipped_with_a_warning_not_read(listed: Project) -> None:
    os.mkfifo(listed.root / "src" / "pkg" / "pipe.py")
    environment = {**os.environ, "PYTHONPATH": str(REPO)}
    command = [sys.executable, "-m", "pgregistry.allowlist", "update", "--no-cache"]
    done = subprocess.run(command, cwd=listed.root, env=environment, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "src/pkg/pipe.py: warning: skipped: not a regular file" in done.stderr


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_a_fifo_that_replaces_a_file_after_discovery_does_not_block(tmp_path: Path) -> None:
    from pgregistry._source.config import ScanConfig
    from pgregistry._source.engine import scan_files
    from pgregistry._source.files import SourceFile

    os.mkfifo(tmp_path / "pipe.py")
    outcome: list[object] = []
    worker = threading.Thread(
        target=lambda: outcome.append(scan_files([SourceFile("pipe.py", tmp_path / "pipe.py")], ScanConfig())),
        daemon=True,
    )
    worker.start()
    worker.join(timeout=20)
    if worker.is_alive():  # unblock the reader so the test process can exit
        os.close(os.open(tmp_path / "pipe.py", os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail("scanning a FIFO blocked")
    (result,) = outcome[0].results  # type: ignore[attr-defined]
    assert result.failure is not None and "not a regular file" in result.failure.message


def _newer_than_running() -> tuple[str, str] | None:
    """A line of syntax this interpreter cannot parse, and the version it needs."""
    samples = {
        (3, 12): "type Alias = list[int]\n",
        (3, 14): "try:\n    pass\nexcept ValueError, TypeError:\n    pass\n",
    }
    for version, source in samples.items():
        if version > sys.version_info[:2]:
            assert any(v == version for v, _, _ in _NEWER_SYNTAX)
            return source, f"{version[0]}.{version[1]}"
    return None


NEWER = _newer_than_running()


@pytest.mark.skipif(NEWER is None, reason="no syntax sample newer than this Python")
def test_newer_syntax_names_the_python_it_needs_and_can_be_skipped(
    listed: Project, capsys: pytest.CaptureFixture[str]
) -> None:
    assert NEWER is not None
    source, version = NEWER
    assert run(capsys, "update", "--no-cache")[0] == 0
    before = listed.read("allowlist.json")
    listed.write("src/pkg/b.py", READ_B + textwrap.dedent(source))
    code, _, err = run(capsys, "check", "--no-cache")
    assert code == 2 and f"needs Python >= {version}" in err and "--skip-newer-syntax" in err
    code, out, err = run(capsys, "check", "--no-cache", "--skip-newer-syntax")
    assert code == 0, out + err
    assert f"src/pkg/b.py: warning: skipped: needs Python >= {version}" in err
    # Skipped, the file's entries are kept by a full update, not dropped as stale.
    assert run(capsys, "update", "--no-cache", "--skip-newer-syntax")[0] == 0
    assert listed.read("allowlist.json") == before
    # A genuinely broken file is never skippable.
    listed.write("src/pkg/c.py", "def broken(:\n")
    assert run(capsys, "check", "--no-cache", "--skip-newer-syntax")[0] == 2


def test_a_symlinked_root_keeps_project_keys_and_excludes(
    project: Project, tmp_path_factory: pytest.TempPathFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    """``roots = ["src"]`` where ``src`` links elsewhere: keys were ``../...`` and path excludes stopped applying."""
    elsewhere = tmp_path_factory.mktemp("elsewhere")
    (elsewhere / "pkg").mkdir()
    (elsewhere / "pkg" / "a.py").write_text(textwrap.dedent(READ_A))
    (elsewhere / "vendored").mkdir()
    (elsewhere / "vendored" / "v.py").write_text(textwrap.dedent(READ_B))
    for child in (project.root / "src").iterdir():
        for leaf in child.iterdir():
            leaf.unlink()
        child.rmdir()
    (project.root / "src").rmdir()
    (project.root / "src").symlink_to(elsewhere, target_is_directory=True)
    project.write(
        "pyproject.toml",
        '[tool.pgregistry.allowlist]\nroots = ["src"]\nallowlist = "allowlist.json"\n'
        'extend-exclude = ["src/vendored"]\n',
    )
    assert run(capsys, "update", "--no-cache")[0] == 0
    assert set(json.loads(project.read("allowlist.json"))["allowed"]) == {"src/pkg/a.py"}
    assert run(capsys, "check", "--no-cache", "src/pkg")[0] == 0


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="PEP 701 f-strings parse on this Python")
@pytest.mark.parametrize(
    "source",
    [
        # NeMo RL tests/unit/test_version_check.py: a backslash inside an f-string expression.
        "message = f\"prefixes:\\n{'\\n'.join(lines)}\"\n",
        'message = f"{", ".join(lines)}"\n',  # the f-string's own quote reused inside it
    ],
)
def test_pep_701_f_strings_name_python_3_12_and_a_broken_f_string_does_not(source: str) -> None:
    from pgregistry._source.config import ScanConfig
    from pgregistry._source.scanner import scan_source

    failure = scan_source(source.encode(), "m.py", ScanConfig()).failure
    assert failure is not None and failure.needs == "3.12"
    broken = scan_source(b'message = f"{}"\n', "m.py", ScanConfig()).failure
    assert broken is not None and broken.needs == ""


@pytest.fixture
def umask_027() -> Iterator[None]:
    """A umask no default shares (``0o027``: a new file is ``0o640``), restored afterwards."""
    previous = os.umask(0o027)
    try:
        yield
    finally:
        os.umask(previous)


def test_a_new_allowlist_gets_the_mode_of_any_new_file(
    project: Project, capsys: pytest.CaptureFixture[str], umask_027: None
) -> None:
    """Reported (issue 41): ``update`` made a new allowlist ``0600`` (``mkstemp``'s mode), unreadable to the group
    that reads the repository; it gets what the umask gives any new file, as a file the test writes does."""
    project.write("src/pkg/a.py", READ_A)
    assert run(capsys, "update", "--no-cache")[0] == 0
    other = project.write("src/pkg/other.py", "")
    assert (project.root / "allowlist.json").stat().st_mode & 0o7777 == other.stat().st_mode & 0o7777 == 0o640


def test_a_rewritten_allowlist_keeps_its_mode(
    listed: Project, capsys: pytest.CaptureFixture[str], umask_027: None
) -> None:
    path = listed.root / "allowlist.json"
    path.chmod(0o604)
    before = path.read_text()
    assert run(capsys, "update", "--no-cache")[0] == 0
    assert path.read_text() != before  # rewritten (b.py's read is new)
    assert path.stat().st_mode & 0o7777 == 0o604


def test_an_allowlist_that_is_a_link_stays_a_link_and_its_file_is_updated(
    listed: Project, capsys: pytest.CaptureFixture[str]
) -> None:
    """An allowlist kept elsewhere (``allowlist.json -> shared/allowlist.json``) was replaced by a regular file
    holding the new list: the link was gone and the file it named kept the old list. The link stays, and the
    file it names holds the new list, with no temporary file left in either directory."""
    shared = listed.root / "shared"
    shared.mkdir()
    (listed.root / "allowlist.json").rename(shared / "allowlist.json")
    (listed.root / "allowlist.json").symlink_to("shared/allowlist.json")
    assert run(capsys, "update", "--no-cache")[0] == 0
    assert (listed.root / "allowlist.json").is_symlink()
    assert "src/pkg/b.py" in (shared / "allowlist.json").read_text()  # b.py's read is new
    assert _leftovers(listed) == [] and sorted(p.name for p in shared.iterdir()) == ["allowlist.json"]
    assert run(capsys, "check", "--no-cache")[0] == 0



def test_an_allowlist_that_is_a_link_out_of_the_project_is_refused_and_nothing_is_written(
    listed: Project, capsys: pytest.CaptureFixture[str], tmp_path_factory: pytest.TempPathFactory
) -> None:
    """An update writes the project's files only: through a repository's link it would write over a file of the
    user's anywhere (a full update replaces one that is no allowlist). Refused, naming the link and its file."""
    elsewhere = tmp_path_factory.mktemp("elsewhere") / "notes.txt"
    elsewhere.write_text("not an allowlist\n")
    (listed.root / "allowlist.json").unlink()
    (listed.root / "allowlist.json").symlink_to(elsewhere)
    code, _, err = run(capsys, "update", "--no-cache")
    assert code == 2 and f"is a link to {elsewhere}, outside the project" in err
    assert elsewhere.read_text() == "not an allowlist\n" and (listed.root / "allowlist.json").is_symlink()

def test_a_path_listed_twice_is_refused_naming_it_and_no_entry_is_dropped(
    listed: Project, capsys: pytest.CaptureFixture[str]
) -> None:
    """A file's entries twice in the list (a merge that kept both sides) were read as the last block alone: with
    the last block's total the check passed and a partial update rewrote the list without the first block's
    entries, silently; with both blocks' total it was refused as a total that does not add up, naming no path."""
    path = listed.root / "allowlist.json"
    key = "a|get_data_parallel_group|call"
    twice = path.read_text().replace(
        '"src/pkg/a.py": {', f'"src/pkg/a.py": {{\n      "{key}": 1\n    }},\n    "src/pkg/a.py": {{'
    )
    for total in ('"total": 1', '"total": 2'):
        path.write_text(twice.replace('"total": 1', total))
        before = path.read_bytes()
        for action in (["check"], ["update", "src/pkg/b.py"]):
            code, _, err = run(capsys, *action, "--no-cache")
            assert code == 2 and "'src/pkg/a.py'" in err and "twice" in err and "allowlist.json" in err, err
            assert path.read_bytes() == before
    path.write_text(twice.replace("{", '{"version": 1, ', 1))  # a field twice is refused alike
    assert run(capsys, "check", "--no-cache")[0] == 2


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_a_fifo_in_place_of_the_scan_cache_is_passed_over_not_waited_on(
    listed: Project, capsys: pytest.CaptureFixture[str]
) -> None:
    """The cache is read before the scan: a FIFO at its file's name blocked every run with the cache on. It is
    passed over as a cache that cannot be read (the scan parses every file)."""
    from pgregistry._source.cache import ScanCache
    from pgregistry._source.config import ScanConfig

    cache = listed.root / ".pgregistry_cache"
    fifo = ScanCache(cache, ScanConfig()).file
    cache.mkdir(exist_ok=True)
    os.mkfifo(fifo)
    assert without_blocking_on(fifo, lambda: allowlist_main(["update"])) == 0
    assert "src/pkg/b.py" in listed.read("allowlist.json")


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_a_fifo_in_place_of_the_allowlist_or_megatrons_list_is_named_not_waited_on(
    project: Project, capsys: pytest.CaptureFixture[str]
) -> None:
    """``check``, ``update``, ``stats`` and ``import --from`` read their list with a plain ``open``, which waits on a
    FIFO for a writer forever. Each is exit 2 naming it, nothing written."""
    project.write("src/pkg/a.py", READ_A)
    os.mkfifo(project.root / "allowlist.json")
    os.mkfifo(project.root / "megatron.json")
    for action in (["check"], ["update"], ["stats"], ["import", "--from", "megatron.json"]):
        fifo = project.root / ("megatron.json" if "import" in action else "allowlist.json")
        code, _, err = without_blocking_on(fifo, lambda action=action: run(capsys, *action, "--no-cache"))
        assert code == 2 and fifo.name in err and "not a regular file" in err, (action, err)
    assert (project.root / "allowlist.json").is_fifo()


def test_a_directory_that_cannot_be_listed_is_named_not_skipped(
    listed: Project, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``os.walk`` passes over a directory it cannot list (no read permission), silently: ``check`` passed
    without scanning it, a full ``update`` dropped its files' entries, ``migrate`` left its reads. Exit 2 naming
    it. (The permission error is raised by a double of ``os.scandir``: these tests run as root, whom no mode
    stops.)"""
    listed.write("src/pkg/sub/c.py", READ_A.replace("def a", "def c"))
    assert run(capsys, "update", "--no-cache")[0] == 0
    before = listed.read("allowlist.json")
    real_scandir = os.scandir

    def unlistable(path: object = ".") -> object:
        if str(path).endswith("sub"):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        return real_scandir(path)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "scandir", unlistable)
    for action in ("check", "update"):
        code, _, err = run(capsys, action, "--no-cache")
        assert code == 2 and f"{listed.root / 'src/pkg/sub'}: cannot list it: Permission denied" in err, err
    assert listed.read("allowlist.json") == before
    from pgregistry.cli import main

    assert main(["migrate", "--check"]) == 2
    assert "src/pkg/sub: cannot list it: Permission denied" in capsys.readouterr().err


def test_a_read_only_allowlist_is_refused_and_left_as_it_is(
    listed: Project, capsys: pytest.CaptureFixture[str]
) -> None:
    """A rename into its directory replaced a read-only allowlist (``chmod a-w``: kept as it is on purpose),
    even as root, where ``migrate --write`` refuses a read-only source file. Refused alike, before anything is
    written."""
    from pgregistry.cli import main

    path = listed.root / "allowlist.json"
    before, source = path.read_bytes(), listed.read("src/pkg/b.py")
    assert main(["migrate", "--check"]) == 1  # --write has files to rewrite
    path.chmod(0o444)
    code, _, err = run(capsys, "update", "--no-cache")
    assert code == 2 and "allowlist.json: read-only; make it writable to update it" in err, err
    assert main(["migrate", "--write"]) == 2
    assert "read-only" in capsys.readouterr().err and listed.read("src/pkg/b.py") == source
    assert path.read_bytes() == before and path.stat().st_mode & 0o777 == 0o444


def test_json_pythons_reader_cannot_hold_is_named_exit_2_and_a_cache_of_it_passed_over(
    listed: Project, capsys: pytest.CaptureFixture[str]
) -> None:
    """Arrays nested past Python's recursion limit, or an integer of more than 4,300 digits, escaped ``json.loads``
    as a ``RecursionError`` or ``ValueError`` traceback: exit 1, which the ratchet keeps for "the check failed".
    A scan cache of such JSON (said to be passed over when it cannot be read) stopped every run alike."""
    from pgregistry._source.cache import ScanCache
    from pgregistry._source.config import ScanConfig

    path = listed.root / "allowlist.json"
    good = path.read_text()
    nested = "[" * 100_000 + "]" * 100_000
    for text, why in ((nested, "nested too deeply to read"), (good.replace('"total": 1', '"total": 1' + "0" * 5000),
                                                               "Exceeds the limit (4300 digits)")):
        path.write_text(text)
        for action in (["check"], ["stats"], ["update", "src/pkg/b.py"]):  # a full update replaces it, saying so
            code, _, err = run(capsys, *action, "--no-cache")
            assert code == 2, (action, code, err)
            assert err.startswith("pgregistry allowlist: error: allowlist.json: malformed allowlist JSON:"), err
            assert why in err and "regenerate the file" in err and "Traceback" not in err, (action, err)
            assert path.read_text() == text
    (listed.root / "megatron.json").write_text(nested)
    code, _, err = run(capsys, "import", "--from", "megatron.json", "--no-cache")
    assert code == 2 and "megatron.json: malformed JSON: nested too deeply to read" in err, err
    path.write_text(good)
    cache = ScanCache(listed.root / ".pgregistry_cache", ScanConfig()).file
    cache.parent.mkdir(exist_ok=True)
    cache.write_text(nested)
    assert run(capsys, "update")[0] == 0  # every file parsed, as without a cache
    assert "src/pkg/b.py" in listed.read("allowlist.json")


def test_a_path_written_otherwise_than_the_scan_writes_it_is_refused_naming_the_spelling(
    listed: Project, capsys: pytest.CaptureFixture[str]
) -> None:
    """``./src/pkg/a.py`` (an entry merged by hand) named no scanned file: ``check src`` left it unjudged and called
    the read it allows new (exit 1), a check of the whole tree passed calling it moved, and ``update src/pkg/b.py``
    kept it. Each spelling is refused, exit 2, naming the one to write; nothing is written."""
    path = listed.root / "allowlist.json"
    good = path.read_text()
    spellings = {
        "./src/pkg/a.py": "write 'src/pkg/a.py'",
        "src//pkg/a.py": "write 'src/pkg/a.py'",
        "src/pkg/../pkg/a.py": "write 'src/pkg/a.py'",
        "src/pkg/a.py/": "write 'src/pkg/a.py'",
        "../src/pkg/a.py": "lies outside the project",
    }
    for spelling, why in spellings.items():
        path.write_text(good.replace('"src/pkg/a.py"', json.dumps(spelling)))
        before = path.read_bytes()
        for action in (["check", "src"], ["check"], ["update", "src/pkg/b.py"]):
            code, _, err = run(capsys, *action, "--no-cache")
            assert code == 2 and f"allowlist.json: {spelling!r}" in err and why in err, (spelling, action, err)
            assert path.read_bytes() == before

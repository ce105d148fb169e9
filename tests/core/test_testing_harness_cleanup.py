"""run_world leaves nothing behind: processes a rank spawned end with the world, and when the process running the
world is killed outright, its ranks, what they spawned and the store directory go too.

Each case runs a world in a subprocess whose stdout the test reads to the end, as a pipeline would: a process
left holding that stdout open makes the read time out (it hung a CI pipeline for 10 minutes before ranks got
their own process groups).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

_SPAWN_SLEEPER = """
    import os, subprocess, sys, time
    from pathlib import Path
    import torch.distributed as dist
    from pgregistry.testing import run_world

    def spawn_sleeper(pid_dir, then_wait):
        sleeper = subprocess.Popen(["sleep", "300"])  # inherits this process's stdout, like a server or a tail
        Path(pid_dir, f"rank-{dist.get_rank()}").write_text(f"{os.getpid()} {sleeper.pid}")
        if then_wait:
            time.sleep(300)
        return sleeper.pid

    run_world(2, spawn_sleeper, sys.argv[1], sys.argv[2] == "wait", timeout=300)
    print("world done", flush=True)
"""


def _alive(pid: int) -> bool:
    """Running or stopped, not a zombie (a zombie holds no file open)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def _pids(pid_dir: Path) -> list[int]:
    return [int(pid) for file in pid_dir.iterdir() for pid in file.read_text().split()]


def _eventually(condition: Callable[[], bool], seconds: float = 15.0) -> bool:
    give_up = time.monotonic() + seconds
    while time.monotonic() < give_up:
        if condition():
            return True
        time.sleep(0.1)
    return False


@pytest.fixture
def world_script(tmp_path: Path) -> Iterator[tuple[Path, Path, Path]]:
    """(script, pid directory, TMPDIR of the script); kills whatever a failing run left behind."""
    script, pid_dir, temp = tmp_path / "world.py", tmp_path / "pids", tmp_path / "tmp"
    script.write_text(textwrap.dedent(_SPAWN_SLEEPER))
    pid_dir.mkdir()
    temp.mkdir()
    yield script, pid_dir, temp
    for pid in _pids(pid_dir):
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)


def _start(script: Path, pid_dir: Path, temp: Path, mode: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(script), str(pid_dir), mode],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "TMPDIR": str(temp)},
    )


def test_processes_a_rank_spawned_end_with_the_world(world_script: tuple[Path, Path, Path]) -> None:
    script, pid_dir, temp = world_script
    world = _start(script, pid_dir, temp, "return")
    try:
        out, err = world.communicate(timeout=60)  # EOF only once nothing holds the script's stdout open
    finally:
        world.kill()
    assert world.returncode == 0, err
    assert out == "world done\n"
    assert len(_pids(pid_dir)) == 4
    assert _eventually(lambda: not any(_alive(pid) for pid in _pids(pid_dir)))
    assert list(temp.iterdir()) == []


def test_killing_the_parent_ends_ranks_what_they_spawned_and_the_store(world_script: tuple[Path, Path, Path]) -> None:
    script, pid_dir, temp = world_script
    world = _start(script, pid_dir, temp, "wait")
    try:
        assert _eventually(lambda: len(list(pid_dir.iterdir())) == 2, 45.0)
        assert [path.name for path in temp.iterdir() if path.name.startswith("pgregistry-world-")] != []
        world.kill()  # SIGKILL: the parent's clean-up never runs
        out, _ = world.communicate(timeout=30)
    finally:
        world.kill()
    assert out == ""
    assert _eventually(lambda: not any(_alive(pid) for pid in _pids(pid_dir)))
    assert _eventually(lambda: list(temp.iterdir()) == [])

"""``check --base REV`` keeps the ratchet tight without failing commits that only remove reads.

Each key may read at most ``min(listed, read at REV + granted by this change's allowlist diff)``: a commit that
only removes reads passes with "can shrink" notices, a later one cannot re-add a read into the slack the stale
entry left (REV's code already read less), a real new read still fails, and moves are still paired. Built on
small git repositories made in each test; the reference counts are written out by hand."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from fixtures.scan_projects import THREE, Project, git

from pgregistry.allowlist import main as allowlist_main
from pgregistry.allowlist._baseline import base_limits
from pgregistry.allowlist._ratchet import Allowlist

KEY = "step|get_data_parallel_group|call"

TWO = THREE.replace("    d = ps.get_data_parallel_group()\n", "    d = None\n")


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = allowlist_main([*argv, "--no-cache"])
    return code, capsys.readouterr().out



def commit(project: Project, message: str) -> None:
    git(project, "add", "-A")
    git(project, "commit", "-q", "-m", message)


def listed(project: Project) -> dict[str, int]:
    allowed: dict[str, dict[str, int]] = json.loads(project.read("allowlist.json"))["allowed"]
    return allowed["src/pkg/a.py"]


@pytest.fixture
def repository(project: Project, capsys: pytest.CaptureFixture[str]) -> Project:
    """A repository whose allowlist lists 3 reads of ``get_data_parallel_group`` in ``step`` and 3 in the code."""
    git(project, "init", "-q", "-b", "main")
    project.write("src/pkg/a.py", THREE)
    assert run(capsys, "update", "--allowlist", "allowlist.json")[0] == 0
    assert listed(project)[KEY] == 3
    commit(project, "base")
    return project


def check(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    return run(capsys, "check", "--allowlist", "allowlist.json", *argv)


def test_a_removal_only_change_passes_with_a_can_shrink_notice(
    repository: Project, capsys: pytest.CaptureFixture[str]
) -> None:
    repository.write("src/pkg/a.py", TWO)
    code, out = check(capsys)
    assert code == 1 and "stale allowlist entry" in out  # without a base, slack is a failure
    code, out = check(capsys, "--base", "HEAD")
    assert code == 0, out
    assert f"src/pkg/a.py:5:9: notice: allowlist entry '{KEY}' can shrink" in out
    assert "found 2, allowed 3" in out and "1 entry can shrink" in out.splitlines()[-1]
    code, out = check(capsys, "--base", "HEAD", "--format", "github")
    assert code == 0 and "::error" not in out
    assert out.startswith("::notice file=src/pkg/a.py,line=5,col=9,title=Allowlist entry can shrink::")
    code, out = check(capsys, "--base", "HEAD", "--format", "json")
    payload = json.loads(out)
    assert code == 0 and payload["ok"] and not payload["stale_fails"] and not payload["new"]
    assert [(item["key"], item["found"], item["allowed"]) for item in payload["stale"]] == [(KEY, 2, 3)]


def test_re_adding_a_read_into_a_stale_entrys_slack_fails(
    repository: Project, capsys: pytest.CaptureFixture[str]
) -> None:
    repository.write("src/pkg/a.py", TWO)
    commit(repository, "remove a read, list not shrunk")  # passed CI under --base, with a notice
    repository.write("src/pkg/a.py", THREE.replace("    d = ps", "    z = 1\n    d = ps"))
    assert check(capsys)[0] == 0  # without a base the old allowance lets it through
    code, out = check(capsys, "--base", "HEAD")
    assert code == 1, out
    flagged = [line for line in out.splitlines() if line.startswith("src/pkg/a.py:")]
    assert len(flagged) == 1 and flagged[0].startswith("src/pkg/a.py:9:9: new read")
    assert "found 3, allowed 2" in out and "the allowlist lists 3, but the base revision reads 2" in out
    # `update` here changes nothing (the list already says 3), so the grant cannot hide in an unchanged list.
    run(capsys, "update", "--allowlist", "allowlist.json")
    assert check(capsys, "--base", "HEAD")[0] == 1


def test_the_documented_way_to_keep_a_re_added_read(repository: Project, capsys: pytest.CaptureFixture[str]) -> None:
    repository.write("src/pkg/a.py", TWO)
    commit(repository, "remove a read, list not shrunk")
    assert run(capsys, "update", "--allowlist", "allowlist.json")[0] == 0
    commit(repository, "shrink the list on the base branch")
    repository.write("src/pkg/a.py", THREE)
    assert check(capsys, "--base", "HEAD")[0] == 1
    assert run(capsys, "update", "--allowlist", "allowlist.json")[0] == 0  # the diff shows 2 -> 3
    assert listed(repository)[KEY] == 3
    assert check(capsys, "--base", "HEAD")[0] == 0


def test_a_real_new_read_fails_and_a_reviewed_update_grants_it(
    repository: Project, capsys: pytest.CaptureFixture[str]
) -> None:
    repository.write("src/pkg/a.py", THREE.replace("    d = ps", "    e = ps.get_data_parallel_group()\n    d = ps"))
    code, out = check(capsys, "--base", "HEAD")
    assert code == 1 and "found 4, allowed 3" in out and "the allowlist lists" not in out
    assert run(capsys, "update", "--allowlist", "allowlist.json")[0] == 0
    assert listed(repository)[KEY] == 4
    assert check(capsys, "--base", "HEAD")[0] == 0


def test_a_new_read_beside_a_removed_one_still_fails(repository: Project, capsys: pytest.CaptureFixture[str]) -> None:
    other = TWO.replace("get_tensor_model_parallel_rank", "get_pipeline_model_parallel_rank")
    repository.write("src/pkg/a.py", other)
    code, out = check(capsys, "--base", "HEAD")
    assert code == 1
    assert "new read of global process-group state: call of get_pipeline_model_parallel_rank" in out
    assert "notice: allowlist entry 'step|get_data_parallel_group|call' can shrink" in out


def test_moves_are_still_paired_and_cannot_smuggle_a_read_into_slack(
    repository: Project, capsys: pytest.CaptureFixture[str]
) -> None:
    repository.write("src/pkg/a.py", TWO)
    commit(repository, "remove a read, list not shrunk")
    git(repository, "mv", "src/pkg/a.py", "src/pkg/b.py")
    repository.write("src/pkg/b.py", TWO.replace("def step", "def train_step") + "\n# more\n" * 3)
    code, out = check(capsys, "--base", "HEAD")
    assert code == 0, out
    assert "src/pkg/a.py -> src/pkg/b.py: moved 2 reads" in out and "can shrink" in out
    # The same rename carrying the third read back: the base read 2, so one read is new.
    repository.write("src/pkg/b.py", THREE.replace("def step", "def train_step") + "\n# more\n" * 3)
    code, out = check(capsys, "--base", "HEAD")
    assert code == 1 and "1 new read" in out.splitlines()[-1], out


def test_a_move_merged_without_update_still_passes_later_and_stays_tight(
    repository: Project, capsys: pytest.CaptureFixture[str]
) -> None:
    """Found replaying Megatron-LM with a list that is only updated when the check fails: after a move merged
    without `update`, the base reads under keys the list lacks; they keep the allowance their old keys lost."""
    repository.write("src/pkg/a.py", THREE.replace("def step", "def train_step"))
    assert check(capsys, "--base", "HEAD")[0] == 0
    commit(repository, "rename step, list not rewritten")
    repository.write("src/pkg/c.py", "x = 1\n")
    code, out = check(capsys, "--base", "HEAD")
    assert code == 0, out
    assert "notice: allowlist entry 'step|get_data_parallel_group|call' can shrink" in out
    added = THREE.replace("    d = ps", "    e = ps.get_data_parallel_group()\n    d = ps")
    repository.write("src/pkg/a.py", added.replace("def step", "def train_step"))
    code, out = check(capsys, "--base", "HEAD")
    assert code == 1 and "found 4, allowed 3" in out, out


def test_an_unreadable_allowlist_at_the_base_is_an_error(
    repository: Project, capsys: pytest.CaptureFixture[str]
) -> None:
    good = repository.read("allowlist.json")
    repository.write("allowlist.json", good.replace('"total": 4', '"total": 5'))
    commit(repository, "hand-edited list")
    repository.write("allowlist.json", good)
    code = allowlist_main(["check", "--allowlist", "allowlist.json", "--no-cache", "--base", "HEAD"])
    err = capsys.readouterr().err
    assert code == 2 and "allowlist.json at HEAD: 'total' is 5" in err


def test_base_limits_by_hand() -> None:
    listed_now = Allowlist({"new.py": {"f|x|call": 3, "g|x|call": 2}, "c.py": {"h|x|call": 1}})
    at_base = Allowlist({"old.py": {"f|x|call": 3, "g|x|call": 1}, "c.py": {"h|x|call": 1}})
    read_at_base = {"old.py": {"f|x|call": 2, "g|x|call": 1}}
    limits = base_limits(listed_now, at_base, read_at_base, lambda path: {"new.py": "old.py"}.get(path, path))
    # f: read 2 at the base, nothing granted -> 2; g: read 1, granted 2 - 1 = 1 -> 2; h: read 0 at the base -> none.
    assert limits.entries == {"new.py": {"f|x|call": 2, "g|x|call": 2}}


def test_base_limits_share_lost_allowance_with_keys_moved_at_the_base() -> None:
    listed_now = Allowlist({"a.py": {"f|x|call": 3, "g|y|call": 1}})
    read_at_base = {"a.py": {"f2|x|call": 2, "h|x|call": 4, "g|y|call": 1}}
    limits = base_limits(listed_now, listed_now, read_at_base, lambda path: path, ["a.py"])
    # f lost its 3 (read 0 at the base); f2 and h, unlisted, share those 3 in sorted order: f2 2, h 1.
    assert limits.entries == {"a.py": {"g|y|call": 1, "f2|x|call": 2, "h|x|call": 1}}


@pytest.mark.parametrize("argv", [["check", "--allowlist", "allowlist.json", "--base"], ["stats", "--since"]])
def test_a_revision_that_does_not_exist_is_named(
    repository: Project, capsys: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    # It used to say "git rev-parse --verify failed: 1", naming neither the revision nor what was wrong with it.
    code = allowlist_main([*argv, "no-such-rev", "--no-cache"])
    captured = capsys.readouterr()
    assert (code, captured.out) == (2, "")
    assert captured.err == (
        "pgregistry allowlist: error: unknown revision 'no-such-rev': no commit of that name in the git repository "
        f"at {repository.root}\n"
    )


def _allowlist_process(root: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pgregistry", "allowlist", *argv, "--no-cache"],
        cwd=root, capture_output=True, text=True, timeout=60,
    )


def test_an_empty_base_is_refused_not_read_as_no_base(repository: Project) -> None:
    # `--base "$BASE"` with the CI variable unset passed as a check without a base: the ratchet's base rule was
    # silently off. It is now a usage error saying what to do.
    repository.write("src/pkg/a.py", TWO)
    commit(repository, "remove a read, list not shrunk")
    assert _allowlist_process(repository.root, "check", "--base", "HEAD").returncode == 0
    for fmt in ("text", "github"):
        done = _allowlist_process(repository.root, "check", "--base", "", "--format", fmt)
        assert done.returncode == 2, done.stdout + done.stderr
        assert done.stderr == (
            'pgregistry allowlist: error: --base is empty (an unset variable, as in --base "$VAR"?): set it to a '
            "git revision, or leave the option out to check without a base\n"
        )
    assert done.stdout.startswith("::error title=pgregistry allowlist::--base is empty")


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["stats", "--since", ""], "pgregistry allowlist: error: --since is empty"),
        (["check", "--exclude", ""], "pgregistry allowlist: error: --exclude is empty"),
        (["check", "--extend-exclude", " "], "pgregistry allowlist: error: --extend-exclude is empty"),
        (["update", "--module", "megatron.core.parallel_state", "--module", ""], "error: --module is empty"),
        (["check", "--allowlist", ""], "pgregistry allowlist check: error: argument --allowlist: is empty"),
        (["check", "--config", ""], "pgregistry allowlist check: error: argument --config: is empty"),
        (["update", "--cache-dir", ""], "pgregistry allowlist update: error: argument --cache-dir: is empty"),
        (["import", "--from", ""], "pgregistry allowlist import: error: argument --from: is empty"),
        (["check", ""], "pgregistry allowlist check: error: argument PATH: is empty"),
    ],
)
def test_every_empty_revision_path_or_pattern_is_refused_naming_the_option(
    repository: Project, argv: list[str], named: str
) -> None:
    # An empty path was Path('.'), the current directory (`--cache-dir ''` wrote the cache into it, `check ''`
    # judged the whole tree as a partial check); an empty pattern or module name matched nothing, silently.
    before = sorted(repository.root.rglob("*"))
    done = _allowlist_process(repository.root, *argv)
    assert done.returncode == 2, done.stdout + done.stderr
    assert named in done.stderr, done.stderr
    assert sorted(repository.root.rglob("*")) == before  # nothing written

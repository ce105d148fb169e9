"""Output fit for a pull request and a burn-down: line order, one fix per key with the accessor's own
replacement, capped GitHub annotations, refactors reported as moved, the added site of a key flagged (from
git), ``stats`` on a subset, and ``stats --since`` against an earlier revision of a real git repository."""

from __future__ import annotations

import pytest
from fixtures.scan_projects import THREE, Project, git

from pgregistry.allowlist import main as allowlist_main
from pgregistry.allowlist._report import GITHUB_ANNOTATION_CAP


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = allowlist_main([*argv, "--no-cache"])
    captured = capsys.readouterr()
    return code, captured.out, captured.err





def test_sites_in_line_order_and_one_fix_per_key(project: Project, capsys: pytest.CaptureFixture[str]) -> None:
    project.write("src/pkg/a.py", THREE)
    project.write("allowlist.json", '{"allowed": {}, "total": 0, "version": 1}\n')
    code, out, _ = run(capsys, "check")
    assert code == 1
    lines = [int(line.split(":")[1]) for line in out.splitlines() if line.startswith("src/pkg/a.py:")]
    assert lines == [5, 6, 7, 8]
    fixes = [line for line in out.splitlines() if line.startswith("    fix for ")]
    assert fixes == [
        "    fix for step|get_data_parallel_group|call: use `pg_collection.dp` from the ProcessGroupCollection the "
        "caller passes in instead of `ps.get_data_parallel_group`; if the read must stay for now, run "
        "`pgregistry allowlist update` and commit the allowlist",
        "    fix for step|get_tensor_model_parallel_rank|call: use `group_rank(pg_collection.tp)` from the "
        "ProcessGroupCollection the caller passes in instead of `ps.get_tensor_model_parallel_rank`; if the read "
        "must stay for now, run `pgregistry allowlist update` and commit the allowlist",
    ]


def test_github_annotations_are_grouped_per_key_capped_and_summarised(
    project: Project, capsys: pytest.CaptureFixture[str]
) -> None:
    functions = "".join(
        f"def f{i}():\n    ps.get_data_parallel_rank()\n    ps.get_data_parallel_rank()\n" for i in range(15)
    )
    project.write("src/pkg/a.py", "import megatron.core.parallel_state as ps\n" + functions)
    project.write("allowlist.json", '{"allowed": {}, "total": 0, "version": 1}\n')
    code, out, _ = run(capsys, "check", "--format", "github")
    lines = out.splitlines()
    assert code == 1
    annotations = [line for line in lines if line.startswith("::error file=")]
    assert len(annotations) == GITHUB_ANNOTATION_CAP
    assert all("(also line" in line for line in annotations)
    (summary,) = [line for line in lines if line.startswith("::error title=pgregistry allowlist::")]
    assert "5 more allowlist finding(s) not annotated" in summary
    assert sum(line.startswith("src/pkg/a.py:") for line in lines) == 30  # every site in the log
    assert lines[-1].startswith("allowlist check failed: 30 new reads")


def test_a_renamed_class_passes_and_is_listed_as_moved(project: Project, capsys: pytest.CaptureFixture[str]) -> None:
    project.write(
        "src/pkg/a.py",
        "import megatron.core.parallel_state as ps\nclass A:\n    def f(self):\n"
        "        return ps.get_data_parallel_group()\n",
    )
    assert run(capsys, "update")[0] == 0
    project.write("src/pkg/a.py", project.read("src/pkg/a.py").replace("class A", "class B"))
    code, out, _ = run(capsys, "check")
    assert code == 0, out
    assert "src/pkg/a.py: moved 1 read: 'A.f|get_data_parallel_group|call' -> 'B.f|get_data_parallel_group|call'" in out
    assert "1 read moved (not a failure; run `pgregistry allowlist update` to rewrite their keys)" in out
    assert run(capsys, "update")[0] == 0
    assert "moved" not in run(capsys, "check")[1]


def test_stats_on_a_path_reports_that_paths_allowance(project: Project, capsys: pytest.CaptureFixture[str]) -> None:
    project.write("src/pkg/a.py", THREE)
    project.write("src/pkg/b.py", THREE)
    assert run(capsys, "update")[0] == 0
    code, out, _ = run(capsys, "stats", "src/pkg/a.py")
    assert code == 0
    assert out.splitlines()[0] == "4 reads of global process-group state in 1 file; the allowlist allows 4 of them here"


@pytest.fixture
def repository(project: Project, capsys: pytest.CaptureFixture[str]) -> Project:
    git(project, "init", "-q", "-b", "main")
    project.write("src/pkg/a.py", THREE)
    project.write(
        "src/pkg/old_utils.py",
        "import megatron.core.parallel_state as ps\n\ndef util():\n    return ps.get_context_parallel_group()\n",
    )
    assert run(capsys, "update")[0] == 0
    git(project, "add", "-A")
    git(project, "commit", "-q", "-m", "base")
    return project


def move_the_data_parallel_read(repository: Project, path: str, content: str) -> None:
    """Take the data-parallel read out of ``a.py`` (written as :data:`THREE`) and write ``path`` with ``content``,
    which reads it instead."""
    repository.write("src/pkg/a.py", THREE.replace("    d = ps.get_data_parallel_group()\n", "    d = None\n"))
    repository.write(path, content)


def test_base_flags_only_the_added_site_of_a_key(repository: Project, capsys: pytest.CaptureFixture[str]) -> None:
    repository.write("src/pkg/a.py", THREE.replace("    c = ", "    e = ps.get_data_parallel_group()\n    c = "))
    code, out, _ = run(capsys, "check")
    assert code == 1 and sum(line.startswith("src/pkg/a.py:") for line in out.splitlines()) == 4
    code, out, _ = run(capsys, "check", "--base", "HEAD")
    flagged = [line for line in out.splitlines() if line.startswith("src/pkg/a.py:")]
    assert code == 1 and len(flagged) == 1 and flagged[0].startswith("src/pkg/a.py:7:")


def test_base_pairs_reads_across_a_git_rename(repository: Project, capsys: pytest.CaptureFixture[str]) -> None:
    git(repository, "mv", "src/pkg/old_utils.py", "src/pkg/common_utils.py")
    moved = repository.read("src/pkg/common_utils.py").replace("def util", "def util_v2") + "\n# more\n" * 3
    repository.write("src/pkg/common_utils.py", moved)
    assert run(capsys, "check")[0] == 1  # the scope changed too: only git can tell it is the same file
    code, out, _ = run(capsys, "check", "--base", "HEAD")
    assert code == 0, out
    assert "src/pkg/old_utils.py -> src/pkg/common_utils.py: moved 1 read" in out


def test_stats_since_a_revision_shows_the_burn_down(repository: Project, capsys: pytest.CaptureFixture[str]) -> None:
    move_the_data_parallel_read(
        repository,
        "src/pkg/b.py",
        "from megatron.core import parallel_state\n\ndef g(x=None):\n"
        "    if x is None:\n        x = parallel_state.get_data_parallel_group()\n",
    )
    code, out, _ = run(capsys, "stats", "--since", "HEAD")
    assert code == 0
    rows = {line.split()[0]: line.split()[1:4] for line in out.splitlines() if line[:1].isalpha()}
    assert rows["direct"] == ["5", "4", "-1"] and rows["fallback"] == ["0", "1", "+1"]
    assert rows["total"] == ["5", "5", "+0"]
    assert run(capsys, "stats", "--since", "no-such-rev")[0] == 2


def test_base_pairs_reads_split_out_into_a_new_file(repository: Project, capsys: pytest.CaptureFixture[str]) -> None:
    """Megatron-LM: MoE logging moved out of moe_utils.py (which stays) into a new moe_logging.py."""
    move_the_data_parallel_read(
        repository,
        "src/pkg/logging.py",
        "import megatron.core.parallel_state as ps\n\nclass Tracker:\n    def sync(self):\n"
        "        return ps.get_data_parallel_group()\n",
    )
    git(repository, "add", "-A")
    assert run(capsys, "check")[0] == 1
    code, out, _ = run(capsys, "check", "--base", "HEAD")
    assert code == 0, out
    assert "src/pkg/a.py -> src/pkg/logging.py: moved 1 read" in out
    # A read added to a new file beyond what moved there still fails.
    repository.write("src/pkg/logging.py", repository.read("src/pkg/logging.py") + "\nps.get_data_parallel_group()\n")
    assert run(capsys, "check", "--base", "HEAD")[0] == 1

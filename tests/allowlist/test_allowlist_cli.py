"""``pgregistry allowlist check|update|stats``: exit codes, output formats, settings, idempotent updates, and
a command path that never imports torch."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from fixtures.scan_projects import Project

from pgregistry._source.config import ScanConfig, Settings, read_toml
from pgregistry._source.options import add_settings_options, settings_arguments
from pgregistry.allowlist import main as allowlist_main
from pgregistry.allowlist._cli import add_actions
from pgregistry.cli import main

REPO = Path(__file__).resolve().parents[2]

READS = """
import megatron.core.parallel_state as ps

class Model:
    def forward(self):
        return ps.get_tensor_model_parallel_group()
"""


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["allowlist", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture
def listed(project: Project, capsys: pytest.CaptureFixture[str]) -> Project:
    """A project whose allowlist matches its code."""
    project.write("src/pkg/model.py", READS)
    assert run(capsys, "update")[0] == 0
    return project


def test_update_then_check_passes(listed: Project, capsys: pytest.CaptureFixture[str]) -> None:
    payload = json.loads(listed.read("allowlist.json"))
    assert payload["allowed"] == {"src/pkg/model.py": {"Model.forward|get_tensor_model_parallel_group|call": 1}}
    code, out, _ = run(capsys, "check")
    assert code == 0
    assert "allowlist check passed: 1 allowed read" in out


def test_update_is_idempotent(listed: Project, capsys: pytest.CaptureFixture[str]) -> None:
    before = (listed.root / "allowlist.json").read_bytes()
    code, out, _ = run(capsys, "update")
    assert code == 0 and "allowlist unchanged" in out
    assert (listed.root / "allowlist.json").read_bytes() == before
    assert allowlist_main(["update", "--no-cache", "--jobs", "1"]) == 0
    assert (listed.root / "allowlist.json").read_bytes() == before


def test_check_fails_on_a_new_read_with_file_line_and_fix(listed: Project, capsys: pytest.CaptureFixture[str]) -> None:
    listed.write("src/pkg/new.py", "\n\ndef f():\n    return mpu.get_data_parallel_rank()\n")
    code, out, _ = run(capsys, "check")
    assert code == 1
    assert (
        "src/pkg/new.py:4:12: new read of global process-group state: call of get_data_parallel_rank "
        "(`mpu.get_data_parallel_rank`) in f; found 1, allowed 0 in this scope"
    ) in out
    assert "fix for f|get_data_parallel_rank|call: use `group_rank(pg_collection.dp)`" in out
    assert "`pgregistry allowlist update`" in out
    assert "allowlist check failed: 1 new read of global process-group state, 0 stale entries" in out


def test_check_fails_on_a_stale_entry(listed: Project, capsys: pytest.CaptureFixture[str]) -> None:
    listed.write(
        "src/pkg/model.py", "class Model:\n    def forward(self, pg_collection):\n        return pg_collection.tp\n"
    )
    code, out, _ = run(capsys, "check")
    assert code == 1
    assert "src/pkg/model.py: stale allowlist entry 'Model.forward|get_tensor_model_parallel_group|call'" in out
    assert "run `pgregistry allowlist update` to shrink the allowlist" in out
    assert run(capsys, "update")[0] == 0
    assert json.loads(listed.read("allowlist.json"))["total"] == 0
    assert run(capsys, "check")[0] == 0


def test_shifted_and_moved_code_still_passes(listed: Project, capsys: pytest.CaptureFixture[str]) -> None:
    listed.write("src/pkg/model.py", "import os\n\n\n" + READS.replace("return ps", "x = 1\n        return ps"))
    assert run(capsys, "check")[0] == 0


def test_json_format(listed: Project, capsys: pytest.CaptureFixture[str]) -> None:
    listed.write("src/pkg/new.py", "ps.get_data_parallel_rank()\n")
    code, out, _ = run(capsys, "check", "--format", "json")
    payload = json.loads(out)
    assert code == 1 and payload["ok"] is False and payload["stale"] == []
    (new,) = payload["new"]
    assert (new["path"], new["scope"], new["accessor"], new["form"]) == (
        "src/pkg/new.py",
        "<module>",
        "get_data_parallel_rank",
        "call",
    )
    assert new["sites"] == [
        {"line": 1, "col": 1, "expr": "ps.get_data_parallel_rank", "family": "parallel_state", "guarded": False}
    ]
    code, out, _ = run(capsys, "stats", "--format", "json")
    stats = json.loads(out)
    assert code == 0 and stats["total"] == 2 and stats["allowed_total"] == 1
    assert stats["by_file"] == {"src/pkg/model.py": 1, "src/pkg/new.py": 1}


def test_github_format(listed: Project, capsys: pytest.CaptureFixture[str]) -> None:
    listed.write("src/pkg/new.py", "x = 1\nps.get_data_parallel_rank()\n")
    listed.write("src/pkg/model.py", "")
    code, out, _ = run(capsys, "check", "--format", "github")
    lines = out.splitlines()
    assert code == 1
    assert lines[0].startswith("::error file=src/pkg/model.py,title=Stale allowlist entry::") or lines[0].startswith(
        "::error file=src/pkg/new.py,line=2,col=1,title=New global process-group read::"
    )
    assert sum(line.startswith("::error file=") for line in lines) == 2
    assert all("\n" not in line for line in lines)


def test_stats_text(listed: Project, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "stats")
    assert code == 0
    assert out.startswith("1 read of global process-group state in 1 file; the allowlist allows 1")
    for section in ("by accessor:", "by file:", "by scope:"):
        assert section in out
    assert "1  src/pkg/model.py  Model.forward" in out


def test_paths_limit_what_is_judged_and_updated(listed: Project, capsys: pytest.CaptureFixture[str]) -> None:
    listed.write("src/other/new.py", "ps.get_data_parallel_rank()\n")
    assert run(capsys, "check")[0] == 1
    assert run(capsys, "check", "src/pkg")[0] == 0  # the new read is outside the given path
    assert run(capsys, "update", "src/other")[0] == 0
    payload = json.loads(listed.read("allowlist.json"))
    assert set(payload["allowed"]) == {"src/pkg/model.py", "src/other/new.py"}
    assert run(capsys, "check")[0] == 0


@pytest.mark.parametrize("fmt", ["text", "json", "github"])
def test_a_syntax_error_exits_2_naming_file_and_line(
    listed: Project, capsys: pytest.CaptureFixture[str], fmt: str
) -> None:
    listed.write("src/pkg/broken.py", "x = 1\ndef f(:\n")
    before = listed.read("allowlist.json")
    for action in ("check", "update", "stats"):
        code, out, err = run(capsys, action, "--format", fmt)
        assert code == 2
        text = out + err
        if fmt == "json":
            assert json.loads(out)["errors"][0]["path"] == "src/pkg/broken.py"
        elif fmt == "github":
            assert "::error file=src/pkg/broken.py,line=2," in out
        else:
            assert "src/pkg/broken.py:2:7: error: syntax error: invalid syntax" in err
            assert "1 file could not be parsed" in text
    assert listed.read("allowlist.json") == before  # update wrote nothing


def test_a_non_utf8_file_exits_2(listed: Project, capsys: pytest.CaptureFixture[str]) -> None:
    (listed.root / "src/pkg/latin.py").write_bytes(b"x = 1\ny = 'caf\xe9'\n")
    code, _, err = run(capsys, "check")
    assert code == 2
    assert "src/pkg/latin.py:2:9: error: not valid utf-8" in err


@pytest.mark.parametrize(
    "content, message",
    [
        ("{", "malformed allowlist JSON"),
        ('{"version": 0, "allowed": {}, "total": 0}', "unsupported allowlist version 0"),
        ('{"_comment": "", "allowed": {"a.py": ["1:get_x_group:x"]}, "total": 1}', "has no 'version'"),
    ],
)
def test_a_bad_allowlist_exits_2(
    listed: Project, capsys: pytest.CaptureFixture[str], content: str, message: str
) -> None:
    listed.write("allowlist.json", content)
    for action in ("check", "stats"):
        code, _, err = run(capsys, action)
        assert code == 2 and "allowlist.json" in err and message in err
    # A partial update needs the rest of the list, so it refuses too; a full update regenerates it.
    assert run(capsys, "update", "src/pkg")[0] == 2
    code, _, err = run(capsys, "update")
    assert code == 0 and "replacing unreadable allowlist" in err
    assert run(capsys, "check")[0] == 0


def test_a_missing_allowlist_exits_2(project: Project, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "check")
    assert code == 2 and "no such allowlist; create it with `pgregistry allowlist update`" in err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["check", "no/such/dir"], "no such file or directory"),
        (["check", "--config", "missing.toml"], "missing.toml: no such file"),
        (["check", "--module", "not valid"], "is not a dotted module name"),
    ],
)
def test_usage_errors_exit_2(
    project: Project, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    code, _, err = run(capsys, *argv)
    assert code == 2 and message in err


@pytest.mark.parametrize("argv", [["frobnicate"], ["check", "--jobs", "0"], ["check", "--format", "xml"], []])
def test_argparse_errors_exit_2(project: Project, argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["allowlist", *argv])
    assert exit_info.value.code == 2


def test_pyproject_settings(project: Project, capsys: pytest.CaptureFixture[str]) -> None:
    project.write(
        "pyproject.toml",
        """
        [tool.pgregistry.allowlist]
        roots = ["lib"]
        exclude = ["legacy"]
        modules = ["dist_state"]
        aliases = []
        allowlist = "ci/reads.json"
        cache-dir = ".cache/pgr"
        """,
    )
    project.write("lib/a.py", "from x import dist_state as d\nd.get_tensor_model_parallel_group()\nps.get_rank_x()\n")
    project.write("lib/legacy/b.py", "from x import dist_state as d\nd.get_tensor_model_parallel_group()\n")
    project.write("src/ignored.py", "from x import dist_state as d\nd.get_tensor_model_parallel_group()\n")
    assert run(capsys, "update")[0] == 0
    payload = json.loads(project.read("ci/reads.json"))
    assert payload["allowed"] == {"lib/a.py": {"<module>|get_tensor_model_parallel_group|call": 1}}
    assert list((project.root / ".cache/pgr").glob("allowlist-scan-*.json"))
    # Command-line options override the file: other modules, other excludes, another allowlist.
    code, out, _ = run(capsys, "stats", "--module", "parallel_state", "--exclude", "nothing", "--format", "json")
    assert code == 0 and json.loads(out)["total"] == 0
    code, out, _ = run(capsys, "stats", "--exclude", "nothing", "--format", "json")
    assert json.loads(out)["by_file"] == {"lib/a.py": 1, "lib/legacy/b.py": 1}
    assert run(capsys, "update", "--allowlist", "other.json")[0] == 0
    assert (project.root / "other.json").exists()


def test_settings_are_found_from_a_subdirectory(listed: Project, capsys: pytest.CaptureFixture[str]) -> None:
    os.chdir(listed.root / "src" / "pkg")
    code, out, _ = run(capsys, "check")
    assert code == 0 and "(allowlist.json)" in out


def test_a_typo_in_pyproject_exits_2(project: Project, capsys: pytest.CaptureFixture[str]) -> None:
    project.write("pyproject.toml", '[tool.pgregistry.allowlist]\nroot = ["src"]\n')
    code, _, err = run(capsys, "check")
    assert code == 2 and "unknown key(s) in [tool.pgregistry.allowlist]: root" in err
    project.write("pyproject.toml", "[tool.pgregistry.allowlist]\nroots = 'src'\n")
    code, _, err = run(capsys, "check")
    assert code == 2 and "roots must be a list of non-empty strings" in err


def test_a_settings_file_that_is_no_utf_8_is_named_exit_2(project: Project, capsys: pytest.CaptureFixture[str]) -> None:
    """A ``pyproject.toml`` saved in latin-1 made ``allowlist check`` die with a traceback (exit 1: "the check
    failed"), and ``migrate`` print the decoder's message alone, naming no file; a ``ruff.toml`` alike."""
    pyproject = project.root / "pyproject.toml"
    pyproject.write_bytes(b"# caf\xe9\n" + pyproject.read_bytes())
    code, _, err = run(capsys, "check")
    assert code == 2 and f"{pyproject} is not valid TOML: not UTF-8" in err and "Traceback" not in err
    assert main(["migrate"]) == 2
    assert f"{pyproject} is not valid TOML: not UTF-8" in capsys.readouterr().err
    pyproject.write_bytes(pyproject.read_bytes()[len(b"# caf\xe9\n"):])
    (project.root / "ruff.toml").write_bytes(b"line-length = 100 # \xff\n")
    assert main(["migrate"]) == 2
    assert f"{project.root / 'ruff.toml'} is not valid TOML: not UTF-8" in capsys.readouterr().err


def test_isolated_ignores_pyproject(listed: Project, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "check", "--isolated")
    assert code == 2 and "process_group_usage_allowlist.json: no such allowlist" in err


TORCH_FREE = """
import runpy
import sys
args = ["stats", "--isolated", "--no-cache", {path!r}]
from pgregistry.cli import main
assert main(["allowlist", *args]) == 0
sys.argv = ["python -m pgregistry.allowlist", *args]
try:
    runpy.run_module("pgregistry.allowlist", run_name="__main__")
except SystemExit as exit:
    assert exit.code == 0, exit.code
loaded = sorted(name for name in sys.modules if name == "torch" or name.startswith("torch."))
assert not loaded, f"the allowlist command imported {{loaded[:5]}}"
"""


def test_the_allowlist_command_never_imports_torch(tmp_path: Path) -> None:
    (tmp_path / "m.py").write_text("ps.get_data_parallel_rank()\n")
    script = TORCH_FREE.format(path=str(tmp_path / "m.py"))
    environment = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, env=environment, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("1 read of global process-group state") == 2


def _action_parsers() -> dict[str, argparse.ArgumentParser]:
    parser = argparse.ArgumentParser()
    add_actions(parser)
    (actions,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(actions.choices)


def test_each_action_help_describes_only_that_action() -> None:
    for name, parser in _action_parsers().items():
        description = parser.description or ""
        assert description.endswith(".") and description.count(". ") == 0, (name, description)
        assert "ratchet it against a committed allowlist" not in description, name


def test_the_docs_usage_lines_offer_what_help_offers() -> None:
    """docs/allowlist.md's usage block names each action's own options; the shared ones are in its "More
    options" paragraph. Together they are exactly what ``ACTION --help`` offers."""
    text = (REPO / "docs" / "allowlist.md").read_text()
    usage = text.split("```\n", 2)[1]
    more = text.split("More options:", 1)[1].split("\n\n", 1)[0]
    shared = set(re.findall(r"`(--[a-z-]+)", more))
    for name, parser in _action_parsers().items():
        (line,) = (line for line in usage.splitlines() if line.split()[2] == name)
        offered = {s for a in parser._actions for s in a.option_strings if s.startswith("--")} - {"--help"}
        assert set(re.findall(r"--[a-z-]+", line)) == offered - shared, name


def test_the_docs_allowlist_file_is_this_repositorys_committed_one() -> None:
    """docs/allowlist.md shows this repository's allowlist as it is committed (its comment shortened)."""
    text = (REPO / "docs" / "allowlist.md").read_text()
    shown = json.loads(text.split("## The allowlist file", 1)[1].split("```json\n", 1)[1].split("```", 1)[0])
    committed = json.loads((REPO / "allowlist" / "process_group_usage_allowlist.json").read_text())
    assert {**shown, "_comment": None} == {**committed, "_comment": None}


def test_the_settings_options_handed_to_another_command_parse_back_to_the_same_settings() -> None:
    """``migrate --write`` hands its settings options to ``allowlist update``: every option, repeated ones and
    values that start with a dash included, arrives as it was given."""
    parser = argparse.ArgumentParser()
    add_settings_options(parser)
    given = parser.parse_args([
        "--config", "sub/pyproject.toml", "--isolated", "--exclude", "a/*", "--exclude=-odd/*",
        "--extend-exclude", "b/*", "--extend-exclude=-c", "--module", "mpu", "--module", "ps", "--preset", "megatron",
    ])
    assert parser.parse_args(settings_arguments(given)) == given
    nothing = parser.parse_args([])
    assert settings_arguments(nothing) == [] and parser.parse_args(settings_arguments(nothing)) == nothing


def test_a_cache_dir_that_is_a_file_is_refused_naming_it(listed: Project, capsys: pytest.CaptureFixture[str]) -> None:
    # `--cache-dir FILE` (an existing regular file) ran without a cache, silently: every run parsed every file again.
    listed.write("cache.txt", "not a directory\n")
    for action in ("check", "update", "stats"):
        code, _, err = run(capsys, action, "--cache-dir", "cache.txt")
        assert code == 2, (action, err)
        assert "--cache-dir cache.txt is a regular file, not a directory" in err
    assert listed.read("cache.txt") == "not a directory\n"


@pytest.mark.parametrize(
    "config, kind", [("/dev/null", "is a character device, not a regular file"), ("src", "is a directory, not a")]
)
def test_a_config_that_is_no_regular_file_is_named_as_what_it_is(
    project: Project, capsys: pytest.CaptureFixture[str], config: str, kind: str
) -> None:
    # `--config /dev/null` and `--config DIR` were reported as "no such file", a path that plainly exists.
    code, _, err = run(capsys, "check", "--config", config)
    assert code == 2 and f"--config {config} {kind}" in err
    assert "no such file" not in err


def _documented_settings(text: str, folder: Path) -> dict[str, object]:
    """The ``[tool.pgregistry.allowlist]`` table of docs/allowlist.md's "Configuration", read as TOML (its
    ``accessors`` line, which elides with ``...``, left out)."""
    block = text.split("## Configuration", 1)[1].split("```toml\n", 1)[1].split("```", 1)[0]
    (folder / "pyproject.toml").write_text("\n".join(line for line in block.splitlines() if "..." not in line))
    return dict(read_toml(folder / "pyproject.toml")["tool"]["pgregistry"]["allowlist"])


def test_the_docs_settings_are_the_known_keys_and_their_defaults_are_the_code_s(tmp_path: Path) -> None:
    """docs/allowlist.md's settings table names every key the table takes (and no other), and the keys it
    shows at their default value (those without an example's ``# default`` comment) hold the code's."""
    text = (REPO / "docs" / "allowlist.md").read_text()
    documented = _documented_settings(text, tmp_path)
    scan_keys = {field.name.replace("_", "-"): field.name for field in dataclasses.fields(ScanConfig)}
    known = set(scan_keys) | {"roots", "exclude", "extend-exclude", "preset", "allowlist", "cache-dir"}
    assert set(documented) | {"accessors"} == known
    defaults = Settings(root=REPO)
    assert documented["exclude"] == list(defaults.exclude) and documented["cache-dir"] == str(defaults.cache_dir)
    for key in set(scan_keys) - {"accessors"}:
        assert documented[key] == list(getattr(ScanConfig(), scan_keys[key])), key
    assert f'# default ["{defaults.roots[0]}"]' in text and f'# default "{defaults.allowlist}"' in text

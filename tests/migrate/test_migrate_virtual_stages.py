"""``pgregistry migrate`` on ``is_pipeline_first/last_stage(ignore_virtual=False, vp_stage=...)`` (issue 40,
Megatron-LM's #3962): rewritten to ``pg_read(c, "pp", "first_stage", ignore_virtual=False, vp_stage=...)`` only
with --target megatron on a release whose accessors are the form its fallback helper reproduces; left, with the
reason, otherwise. The rewrite's behaviour in a real world (the five modes) is the differential harness's
(tests/migrate/differential/virtual_stages.toml); here, the text, the reasons, the release check and the helper's
virtual part without a world, against the accessors themselves."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

pytest.importorskip("libcst")

from fixtures.migrated_packages import write_sources  # noqa: E402

from pgregistry._source.config import PRESETS  # noqa: E402
from pgregistry._source.fields import VIRTUAL_STAGE_REASON  # noqa: E402
from pgregistry.migrate._engine import Helper, migrate  # noqa: E402
from pgregistry.migrate._megatron_release import megatron_source  # noqa: E402
from pgregistry.migrate._virtual_stages import has_virtual_stage_form  # noqa: E402

SOURCE = """\
from megatron.core import parallel_state as ps


def layers(n, vp_stage, flag):
    if ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage):
        n -= 1
    if ps.is_pipeline_last_stage(ignore_virtual=False):
        n -= 1
    if ps.is_pipeline_last_stage(ignore_virtual=flag, vp_stage=vp_stage):
        n -= 1
    return n
"""

REWRITTEN = """\
from megatron.core import parallel_state as ps  # noqa: F401
from _process_group_fallback import pg_read


def layers(n, vp_stage, flag, *, pg_collection=None):
    if pg_read(pg_collection, "pp", "first_stage", ignore_virtual=False, vp_stage=vp_stage):
        n -= 1
    if pg_read(pg_collection, "pp", "last_stage", ignore_virtual=False):
        n -= 1
    if pg_read(pg_collection, "pp", "last_stage", ignore_virtual=flag, vp_stage=vp_stage):
        n -= 1
    return n
"""

#: Megatron-LM's accessors of 2025-04-29 (39fd897529) to 2025-05-20: ``vp_stage=`` only checked against the global
#: virtual pipeline rank, which decides.
RANK_FORM = '''
def is_pipeline_first_stage(ignore_virtual=True, vp_stage=None):
    """Return True if in the first pipeline model-parallel stage, False otherwise."""
    if not ignore_virtual:
        if (
            get_virtual_pipeline_model_parallel_world_size() is not None
            and get_virtual_pipeline_model_parallel_rank() != 0
        ):
            return False
        if vp_stage is not None:
            assert get_virtual_pipeline_model_parallel_rank() == vp_stage
    return get_pipeline_model_parallel_rank() == 0


def is_pipeline_last_stage(ignore_virtual=True, vp_stage=None):
    """Return True if in the last pipeline-model-parallel stage, False otherwise."""
    if not ignore_virtual:
        virtual_pipeline_model_parallel_world_size = get_virtual_pipeline_model_parallel_world_size()
        if (
            virtual_pipeline_model_parallel_world_size is not None
            and get_virtual_pipeline_model_parallel_rank()
            != (virtual_pipeline_model_parallel_world_size - 1)
        ):
            return False
    return get_pipeline_model_parallel_rank() == (get_pipeline_model_parallel_world_size() - 1)
'''


def _migrated(tmp_path: Path, *, target: str = "megatron", helper: Helper | None = None) -> tuple[str, list[str]]:
    sources = write_sources(tmp_path, {"m.py": SOURCE})
    migration = migrate(sources, PRESETS["megatron"], target=target, name="pg_collection", helper=helper or Helper())
    assert not migration.failures, migration.failures
    texts = {change.path: change.after.decode() for change in migration.changes}
    return texts.get("m.py", SOURCE), sorted(read.reason for _, read in migration.reads if read.way == "left")


def test_the_stage_of_the_collections_pp_with_the_virtual_keywords_passed_on(tmp_path: Path) -> None:
    text, left = _migrated(tmp_path)
    assert text == REWRITTEN
    assert left == []


@pytest.mark.parametrize(
    ("target", "helper"),
    [("pgregistry", Helper()), ("megatron", Helper(virtual_stages=False))],
    ids=["pgregistry-target", "release-of-another-form"],
)
def test_left_with_the_reason_where_no_helper_reproduces_the_virtual_part(
    tmp_path: Path, target: str, helper: Helper
) -> None:
    text, left = _migrated(tmp_path, target=target, helper=helper)
    assert "is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)" in text
    assert "is_pipeline_last_stage(ignore_virtual=False)" in text
    assert left == sorted([VIRTUAL_STAGE_REASON] * 2 + ["ignore_virtual= is not a literal True or False"])


def test_the_release_form_is_checked_on_the_trees_parallel_state(tmp_path: Path) -> None:
    installed = pytest.importorskip("megatron.core.parallel_state")
    text = Path(installed.__file__).read_bytes()
    assert has_virtual_stage_form(text)
    assert has_virtual_stage_form(text.replace(b"in the first pipeline", b"on the first pipeline"))  # docstring
    assert not has_virtual_stage_form(RANK_FORM.encode())
    assert not has_virtual_stage_form(b"def get_tensor_model_parallel_rank():\n    return 0\n")
    assert not has_virtual_stage_form(b"def (")
    core = tmp_path / "megatron" / "core"
    core.mkdir(parents=True)
    (core / "parallel_state.py").write_text(RANK_FORM)
    assert not megatron_source(tmp_path, search=[]).virtual_stages
    (core / "parallel_state.py").write_bytes(text)
    assert megatron_source(tmp_path, search=[]).virtual_stages


def test_given_a_collection_the_virtual_part_is_the_accessors(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.distributed not initialised: a collection whose ``pp`` is ``None`` (one stage) against the accessor
    itself wherever the accessor does not reach the pipeline group (it would raise there): the same False, the same
    assertion; True where the accessor would ask the group, as the one-stage ``pp`` answers."""
    ps = pytest.importorskip("megatron.core.parallel_state")
    from megatron.core.process_groups_config import ProcessGroupCollection

    from pgregistry.migrate._fallback_helper import pg_read

    collection = ProcessGroupCollection(pp=None)
    accessors = {"first_stage": ps.is_pipeline_first_stage, "last_stage": ps.is_pipeline_last_stage}
    monkeypatch.setattr(ps, "_VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE", 3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the virtual pipeline size is no group: no fallback warning
        for kind, accessor in accessors.items():
            target = 0 if kind == "first_stage" else 2
            for stage in (0, 1, 2):
                got = pg_read(collection, "pp", kind, ignore_virtual=False, vp_stage=stage)
                if stage == target:
                    assert got is True
                else:
                    assert got is accessor(ignore_virtual=False, vp_stage=stage) is False
            with pytest.raises(AssertionError) as original:
                accessor(ignore_virtual=False, vp_stage=None)
            with pytest.raises(AssertionError) as rewritten:
                pg_read(collection, "pp", kind, ignore_virtual=False, vp_stage=None)
            # (pytest rewrites pgregistry's asserts, as a plugin's, adding its explanation below the message)
            assert str(rewritten.value).splitlines()[0] == str(original.value)
    monkeypatch.setattr(ps, "_VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE", None)
    assert pg_read(collection, "pp", "last_stage", ignore_virtual=False, vp_stage=None) is True


def test_the_tool_reads_the_form_of_the_trees_own_release(tmp_path: Path) -> None:
    """The command on a tree holding a ``megatron/core/parallel_state.py`` of another form leaves the read."""
    core = tmp_path / "megatron" / "core"
    core.mkdir(parents=True)
    for folder in (tmp_path / "megatron", core):
        (folder / "__init__.py").write_text("")
    (core / "parallel_state.py").write_text(RANK_FORM)
    (core / "user.py").write_text(SOURCE)
    done = subprocess.run(
        [sys.executable, "-m", "pgregistry", "migrate", "--isolated", "--preset", "megatron", "megatron/core/user.py"],
        cwd=tmp_path, capture_output=True, text=True, timeout=60,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
    )
    assert done.returncode in (0, 1), done.stderr
    assert VIRTUAL_STAGE_REASON in done.stdout + done.stderr

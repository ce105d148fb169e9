"""The field table follows the code's Megatron-Core: before GTP remat a data-parallel read is the plain group.

Megatron-LM's hand migrations that predate GTP remat (#5259, #5250, #5328) wrote ``pg_collection.dp_cp`` for
``get_data_parallel_group(with_context_parallel=True)``; on 0.19 the same call returns ``dp_cp_gtp_remat``."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from fixtures.scan_projects import Project

from pgregistry._source.fields import FieldChoice, collection_field
from pgregistry.migrate._megatron_release import megatron_source

#: The accessor's signature before and since GTP remat (Megatron-Core's parallel_state.py).
BEFORE = "def get_data_parallel_group(with_context_parallel=False, partial_data_parallel=False):\n    ...\n"
SINCE = ("def get_data_parallel_group(\n    with_context_parallel=False, partial_data_parallel=False, "
         "with_gtp_remat=True\n):\n    ...\n")


@pytest.mark.parametrize(("accessor", "keywords", "since", "before"), [
    ("get_data_parallel_group", {"with_context_parallel": True}, "dp_cp_gtp_remat", "dp_cp"),
    ("get_data_parallel_world_size", {}, "dp_gtp_remat", "dp"),  # a pseudo field since (see the helper)
    ("get_data_parallel_rank", {"with_context_parallel": True}, "dp_cp_gtp_remat", "dp_cp"),
    ("get_expert_data_parallel_group", {}, "expt_dp_gtp_remat", "expt_dp"),
    ("get_data_parallel_group", {"with_context_parallel": True, "with_gtp_remat": False}, "dp_cp", None),
    ("get_tensor_model_parallel_group", {}, "tp", "tp"),
])
def test_a_data_parallel_read_is_the_field_of_the_codes_release(
    accessor: str, keywords: dict[str, object], since: str | None, before: str | None
) -> None:
    for gtp_remat, want in ((True, since), (False, before)):
        choice = collection_field(accessor, keywords, gtp_remat=gtp_remat)
        assert choice.field == (want or ""), (gtp_remat, choice)
        assert bool(choice.reason) == (want is None)
    assert collection_field(accessor, keywords) == collection_field(accessor, keywords, gtp_remat=True)


def test_with_gtp_remat_in_code_whose_release_has_none_is_left_with_its_reason() -> None:
    choice = collection_field("get_data_parallel_group", {"with_gtp_remat": True}, gtp_remat=False)
    assert choice == FieldChoice(reason="with_gtp_remat= in code whose Megatron-Core has no GTP remat")


def test_the_projects_parallel_state_first_then_the_installed_one_then_0_19(tmp_path: Path) -> None:
    project, installed = tmp_path / "project", tmp_path / "site-packages"
    (installed / "megatron" / "core").mkdir(parents=True)
    (installed / "megatron" / "core" / "parallel_state.py").write_text(SINCE)
    assert megatron_source(project, [str(tmp_path / "nowhere")]).gtp_remat is True  # nothing found: 0.19's
    assert "assumed" in megatron_source(project, [str(tmp_path / "nowhere")]).where
    found = megatron_source(project, [str(tmp_path / "nowhere"), str(installed)])
    assert found.gtp_remat is True and found.where.startswith("the installed ")
    (project / "megatron" / "core").mkdir(parents=True)
    (project / "megatron" / "core" / "parallel_state.py").write_text(BEFORE)
    own = megatron_source(project, [str(installed)])
    assert own.gtp_remat is False and own.where.startswith("the project's ")
    assert "without GTP remat" in own.describe()


@pytest.mark.parametrize(("state", "field"), [(BEFORE, "dp_cp"), (SINCE, "dp_cp_gtp_remat")])
def test_migrate_rewrites_with_the_table_of_the_projects_megatron_core(
    project: Project, capsys: pytest.CaptureFixture[str], state: str, field: str
) -> None:
    pytest.importorskip("libcst")
    from pgregistry.cli import main

    project.write("megatron/core/parallel_state.py", state)
    project.write("src/pkg/m.py", """\
        from megatron.core import parallel_state as ps


        def f(pg_collection):
            return ps.get_data_parallel_group(with_context_parallel=True)
        """)
    assert main(["migrate", "--write", "--preset", "megatron", "src"]) == 0
    assert f'return pg_group(pg_collection, "{field}")\n' in project.read("src/pkg/m.py")
    # the helper falls back through the accessor as that release spells it
    assert f'("{field}", "group"): ("get_data_parallel_group", {{"with_context_parallel": True}}),' in project.read(
        "src/pkg/_process_group_fallback.py")
    out, _ = capsys.readouterr()
    assert f"project's {project.root / 'megatron' / 'core' / 'parallel_state.py'}" in out


#: A release's ``use_mpu_process_groups`` (its table of getters, as Megatron-Core's process_groups_config.py has it).
SHIMS = '''\
from functools import partial

from megatron.core import parallel_state


class ProcessGroupCollection:
    @classmethod
    def use_mpu_process_groups(cls, required_pgs=None):
        pg_to_func = {
            'tp': partial(parallel_state.get_tensor_model_parallel_group, check_initialized=False),
            'dp_cp_ag': lambda: None,
            'dp_cp': partial(parallel_state.get_data_parallel_group, with_context_parallel=True),
        }
        return cls(**{pg: pg_to_func[pg]() for pg in required_pgs})
'''


def test_a_shims_getters_are_read_from_the_release_beside_its_parallel_state(tmp_path: Path) -> None:
    from pgregistry.migrate._megatron_release import shim_getters

    assert shim_getters(SHIMS.encode()) == {
        "tp": ("get_tensor_model_parallel_group", {"check_initialized": False}),
        "dp_cp": ("get_data_parallel_group", {"with_context_parallel": True}),
    }
    (tmp_path / "megatron" / "core").mkdir(parents=True)
    (tmp_path / "megatron" / "core" / "parallel_state.py").write_text(BEFORE)
    assert megatron_source(tmp_path, []).shims is None  # no process_groups_config.py beside it
    (tmp_path / "megatron" / "core" / "process_groups_config.py").write_text(SHIMS)
    assert megatron_source(tmp_path, []).shims == shim_getters(SHIMS.encode())


@pytest.mark.parametrize("with_shims", [True, False])
def test_migrate_dissolves_a_shim_as_the_projects_release_reads_its_fields(
    project: Project, capsys: pytest.CaptureFixture[str], with_shims: bool
) -> None:
    pytest.importorskip("libcst")
    from pgregistry.cli import main

    # Before GTP remat, dp_cp is get_data_parallel_group(with_context_parallel=True): this release's shim reads it
    # with exactly that getter, checked (read inline: where the shim read it); tp unchecked.
    project.write("megatron/core/parallel_state.py", BEFORE)
    if with_shims:
        project.write("megatron/core/process_groups_config.py", SHIMS)
    source = """\
        from megatron.core.process_groups_config import ProcessGroupCollection


        def f():
            return ProcessGroupCollection.use_mpu_process_groups(required_pgs=["dp_cp"]).dp_cp


        def g():
            return ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"]).tp
        """
    project.write("src/pkg/m.py", source)
    assert main(["migrate", "--write", "--preset", "megatron", "src"]) == 0
    text = project.read("src/pkg/m.py")
    if with_shims:
        assert 'return pg_group(pg_collection, "dp_cp")\n' in text
        assert 'return pg_group(pg_collection, "tp", check_initialized=False)\n' in text
    else:  # which getters this release's shim calls is not known: the shims stay, saying so
        assert text == textwrap.dedent(source)
        assert "2 shim: which getter use_mpu_process_groups calls for each field is not known (no " \
               "megatron/core/process_groups_config.py found)" in capsys.readouterr().out

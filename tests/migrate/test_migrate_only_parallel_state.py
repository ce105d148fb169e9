"""``pgregistry migrate`` rewrites a read only when what it is called on is ``parallel_state`` itself.

The ratchet counts every call of an accessor on a configured module name (``mpu``, ``parallel_state``), as
Megatron-LM's checker does, also on a user's ``mpu`` object; ``migrate`` resolves the name with libcst's scopes and
rewrites only the reads bound to an import of a configured module (or, as the scanner resolves them, to nothing
in the file: a configured alias). The others stay, each with the reason. The assertions are on which reads were
rewritten and why the others were not, not on the replacement text."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

pytest.importorskip("libcst")

from fixtures.migrated_packages import write_sources  # noqa: E402

from pgregistry._source.config import PRESETS, ScanConfig  # noqa: E402
from pgregistry.migrate._engine import Migration, migrate  # noqa: E402


def run(tmp_path: Path, files: dict[str, str], config: ScanConfig = PRESETS["megatron"]) -> Migration:
    sources = write_sources(tmp_path, {path: textwrap.dedent(text) for path, text in files.items()})
    migration = migrate(sources, config, target="megatron", name="pg_collection")
    assert not migration.failures, migration.failures
    return migration


def ways(migration: Migration) -> dict[tuple[int, str], str]:
    """(line, read as spelled) -> the way it went, or ``left: <reason>``."""
    return {
        (read.site.line, read.site.expr): read.way if read.way != "left" else f"left: {read.reason}"
        for _, read in migration.reads
    }


#: DeepSpeed's shape (``inference/engine.py``, ``utils/groups.py``): the user hands in an ``mpu`` object.
DEEPSPEED = """\
from deepspeed.utils import groups

mpu = None


class Engine:
    def __init__(self, mpu=None):
        self.mpu = mpu
        if self.mpu:
            self.mpu.get_data_parallel_group()

    def ranks(self):
        return self.mpu.get_tensor_model_parallel_rank(), groups.mpu.get_tensor_model_parallel_world_size()


def sizes(mpu):
    return mpu.get_tensor_model_parallel_world_size()


def later(mpu=None):
    def inner():
        return mpu.get_tensor_model_parallel_rank()
    return inner


def _get_data_parallel_group():
    return mpu.get_data_parallel_group()
"""


def test_reads_on_a_user_supplied_mpu_are_counted_and_never_rewritten(tmp_path: Path) -> None:
    migration = run(tmp_path, {"deepspeed/engine.py": DEEPSPEED}, ScanConfig())
    assert migration.changes == []  # the tool writes nothing there
    assert ways(migration) == {
        (10, "self.mpu.get_data_parallel_group"):
            "left: `self.mpu` is an attribute of `self`, a parameter of Engine.__init__, not parallel_state",
        (13, "self.mpu.get_tensor_model_parallel_rank"):
            "left: `self.mpu` is an attribute of `self`, a parameter of Engine.ranks, not parallel_state",
        (13, "groups.mpu.get_tensor_model_parallel_world_size"):
            "left: `groups.mpu` is an attribute of `groups`, imported from deepspeed.utils.groups, not "
            "parallel_state",
        (17, "mpu.get_tensor_model_parallel_world_size"): "left: `mpu` is a parameter of sizes, not parallel_state",
        (22, "mpu.get_tensor_model_parallel_rank"): "left: `mpu` is a parameter of later, not parallel_state",
        (27, "mpu.get_data_parallel_group"):
            "left: `mpu` is a name the module assigns, not an import of parallel_state",
    }


def test_every_import_of_parallel_state_is_rewritten(tmp_path: Path) -> None:
    source = """\
    import megatron.core.parallel_state
    import megatron.core.parallel_state as ps_module
    from megatron.core import mpu
    from megatron.core import parallel_state as state
    from megatron.core.parallel_state import get_tensor_model_parallel_group as tp_group


    def f():
        return (
            megatron.core.parallel_state.get_tensor_model_parallel_group(),
            ps_module.get_pipeline_model_parallel_group(),
            mpu.get_context_parallel_group(),
            state.get_tensor_model_parallel_rank(),
            tp_group(),
        )


    def g():
        from megatron.core import parallel_state

        return parallel_state.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size()
    """
    migration = run(tmp_path, {"m.py": source})
    assert {key: way for key, way in ways(migration).items() if way.startswith("left")} == {}
    assert sorted(migration.threaded) == ["m.py: f", "m.py: g"]


def test_a_local_or_a_parameter_that_shadows_the_import_is_not_parallel_state(tmp_path: Path) -> None:
    source = """\
    from megatron.core import parallel_state


    def f(parallel_state):
        return parallel_state.get_tensor_model_parallel_group()


    def g(ps):
        return ps.get_tensor_model_parallel_group()


    def h():
        parallel_state = make_a_fake()
        return parallel_state.get_tensor_model_parallel_group()


    def real():
        return parallel_state.get_tensor_model_parallel_group()
    """
    assert ways(run(tmp_path, {"m.py": source})) == {
        (5, "parallel_state.get_tensor_model_parallel_group"):
            "left: `parallel_state` is a parameter of f, not parallel_state",
        (9, "ps.get_tensor_model_parallel_group"): "left: `ps` is a parameter of g, not parallel_state",
        (14, "parallel_state.get_tensor_model_parallel_group"):
            "left: `parallel_state` is a name h assigns, not an import of parallel_state",
        (18, "parallel_state.get_tensor_model_parallel_group"): "threaded",
    }


def test_a_configured_module_is_parallel_state_and_another_module_of_that_name_is_not(tmp_path: Path) -> None:
    # ``--module mylib.state``: the project's own module. ``other.state`` ends with ``state`` too, as a global of
    # another module, not the module ``mylib.state``.
    source = """\
    from mylib import state
    from other import holder


    def f():
        return state.get_tensor_model_parallel_group(), holder.state.get_pipeline_model_parallel_group()
    """
    config = ScanConfig(modules=("state",))
    assert ways(run(tmp_path, {"m.py": source}, config)) == {
        (6, "state.get_tensor_model_parallel_group"): "threaded",
        (6, "holder.state.get_pipeline_model_parallel_group"):
            "left: `holder.state` is an attribute of `holder`, imported from other.holder, not parallel_state",
    }


def test_names_a_lambda_a_comprehension_or_a_match_binds_are_not_parallel_state(tmp_path: Path) -> None:
    """libcst's scopes name no function for a lambda's or a comprehension's own scope (the report said "a parameter
    of None", "the module assigns"), and record no binding of a ``match`` capture (``case ps:`` was rewritten into a
    read of the grid: the hostile probe of the rewrite)."""
    source = """\
    from megatron.core import parallel_state as ps


    def f(obj, objs):
        by_lambda = (lambda ps: ps.get_tensor_model_parallel_rank())(obj)
        return by_lambda, [ps.get_tensor_model_parallel_world_size() for ps in objs]


    def g(obj):
        match obj:
            case [*ps]:
                return ps
            case ps:
                return ps.get_tensor_model_parallel_rank()


    def real():
        return ps.get_tensor_model_parallel_rank()
    """
    assert ways(run(tmp_path, {"m.py": source})) == {
        (5, "ps.get_tensor_model_parallel_rank"): "left: `ps` is a parameter of a lambda in f, not parallel_state",
        (6, "ps.get_tensor_model_parallel_world_size"):
            "left: `ps` is a name a comprehension in f assigns, not an import of parallel_state",
        (14, "ps.get_tensor_model_parallel_rank"):
            "left: `ps` is a name a match statement in g captures, not an import of parallel_state",
        (18, "ps.get_tensor_model_parallel_rank"): "threaded",
    }


def test_under_the_default_names_another_module_named_parallel_state_is_not_megatron_cores(tmp_path: Path) -> None:
    """The default names match any module called ``parallel_state`` or ``mpu``; the fallback helper reads Megatron-
    Core's. vLLM's, Apex's, old Megatron-LM's ``megatron.mpu`` and a tree's own copy have globals of their own."""
    source = """\
    from apex.transformer import parallel_state as apex_ps
    from megatron.core import parallel_state
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank


    def f():
        return (
            apex_ps.get_tensor_model_parallel_rank(),
            get_tensor_model_parallel_rank(),
            parallel_state.get_tensor_model_parallel_rank(),
        )
    """
    assert ways(run(tmp_path, {"m.py": source}, ScanConfig())) == {
        (8, "apex_ps.get_tensor_model_parallel_rank"):
            "left: `apex_ps` is imported from apex.transformer.parallel_state, not Megatron-Core's parallel_state, "
            "which the fallback helper would read instead",
        (9, "get_tensor_model_parallel_rank"):
            "left: `get_tensor_model_parallel_rank` is imported from vllm.distributed.parallel_state, not "
            "Megatron-Core's parallel_state, which the fallback helper would read instead",
        (10, "parallel_state.get_tensor_model_parallel_rank"): "threaded",
    }


def test_a_modules_own_definition_of_an_accessors_name_is_not_parallel_states(tmp_path: Path) -> None:
    """A fork's module that star-imports parallel_state and defines its own ``get_tensor_model_parallel_rank``: a
    ``def`` bound the name where the text check looked for assignments only, and the skeleton stood a placeholder in
    for the definition, so libcst's scopes found none; the read became the grid's."""
    source = """\
    from megatron.core.parallel_state import *  # noqa: F403


    if True:
        class get_pipeline_model_parallel_rank:  # noqa: N801
            pass


    def get_tensor_model_parallel_rank():
        return 99


    def f():
        rank = get_tensor_model_parallel_rank()
        return rank, get_tensor_model_parallel_world_size(), get_pipeline_model_parallel_rank()
    """
    assert ways(run(tmp_path, {"m.py": source})) == {
        (14, "get_tensor_model_parallel_rank"):
            "left: `get_tensor_model_parallel_rank` is a name the module assigns, not an import of parallel_state",
        (15, "get_tensor_model_parallel_world_size"): "threaded",
        (15, "get_pipeline_model_parallel_rank"):
            "left: `get_pipeline_model_parallel_rank` is a name the module assigns, not an import of parallel_state",
    }

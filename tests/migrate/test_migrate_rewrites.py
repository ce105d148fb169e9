"""``pgregistry migrate``: each form of read rewritten (or left, with its reason), on small sources.

The expected sources are written out whole: a rewrite is judged by the code it produces, never by the counts it
reports. Megatron-Core is not imported: the rewritten code is only compiled here (a real world runs it in
test_migrate_world.py)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

pytest.importorskip("libcst")

from fixtures.migrated_packages import write_sources  # noqa: E402

from pgregistry._source.config import PRESETS  # noqa: E402
from pgregistry.migrate._engine import Migration, migrate  # noqa: E402

HEAD = "from megatron.core import parallel_state as ps\n"
#: ``HEAD`` once the rewrite reads nothing through it: it stays, since without Megatron-Core it is where the module
#: fails to import (the helper's own import of parallel_state is guarded), marked for linters.
HEAD_KEPT = "from megatron.core import parallel_state as ps  # noqa: F401\n"


def helper(*names: str) -> str:
    """The import of the fallback helper the run writes (at the root of a tree of plain modules)."""
    return f"from _process_group_fallback import {', '.join(names)}\n"


def run(tmp_path: Path, files: dict[str, str], target: str = "megatron", name: str = "pg_collection") -> Migration:
    sources = write_sources(tmp_path, {path: textwrap.dedent(text) for path, text in files.items()})
    return migrate(sources, PRESETS["megatron"], target=target, name=name)


def after(tmp_path: Path, source: str, **options: str) -> str:
    """The rewritten text of one file ``m.py`` (the original when nothing changes)."""
    migration = run(tmp_path, {"m.py": source}, **options)
    assert not migration.failures, migration.failures
    changed = {change.path: change.after.decode() for change in migration.changes}
    return changed.get("m.py", textwrap.dedent(source))


def reasons(tmp_path: Path, source: str) -> list[str]:
    migration = run(tmp_path, {"m.py": source})
    return [read.reason for _, read in migration.reads if read.way == "left"]


def test_a_required_parameter_is_read_directly(tmp_path: Path) -> None:
    source = HEAD + """
def f(x, pg_collection):
    return ps.get_tensor_model_parallel_group(), ps.get_context_parallel_world_size()
"""
    assert after(tmp_path, source) == HEAD_KEPT + helper("pg_group", "pg_size") + """
def f(x, pg_collection):
    return pg_group(pg_collection, "tp"), pg_size(pg_collection, "cp")
"""


def test_an_optional_parameter_is_read_in_place(tmp_path: Path) -> None:
    source = HEAD + '''
def f(x, pg_collection=None):
    """Doc."""
    # the reduction
    return ps.get_data_parallel_group(with_context_parallel=True, with_gtp_remat=False)
'''
    assert after(tmp_path, source) == HEAD_KEPT + helper("pg_group") + '''
def f(x, pg_collection=None):
    """Doc."""
    # the reduction
    return pg_group(pg_collection, "dp_cp")
'''


def test_each_read_falls_back_where_it_was_so_an_early_return_never_warns(tmp_path: Path) -> None:
    # Megatron-Core's param_is_not_tensor_parallel_duplicate: a caller that gives tp_group returns before the
    # global read; a fallback above it would warn (an error under -W error) though that caller passed its group.
    source = HEAD + '''
def is_not_duplicate(param, tp_group=None):
    """Doc."""
    if getattr(param, "tensor_model_parallel", False):
        return True
    if tp_group is not None:
        return tp_group.rank() == 0
    # Fallback to legacy global state.
    return ps.get_tensor_model_parallel_rank() == 0 and ps.get_context_parallel_world_size() == 1
'''
    assert after(tmp_path, source) == HEAD_KEPT + helper("pg_rank", "pg_size") + '''
def is_not_duplicate(param, tp_group=None, *, pg_collection=None):
    """Doc."""
    if getattr(param, "tensor_model_parallel", False):
        return True
    if tp_group is not None:
        return tp_group.rank() == 0
    # Fallback to legacy global state.
    return pg_rank(pg_collection, "tp") == 0 and pg_size(pg_collection, "cp") == 1
'''


def test_the_amax_group_is_chosen_by_its_flag_and_the_tensor_and_data_group_without_cp_stays(
    tmp_path: Path,
) -> None:
    source = HEAD + """
def amax(config, pg_collection):
    return ps.get_amax_reduction_group(with_context_parallel=True, tp_only_amax_red=config.tp_only_amax_red)


def tp_dp(pg_collection):
    return ps.get_tensor_and_data_parallel_group()
"""
    assert after(tmp_path, source) == HEAD + helper("pg_group") + """
def amax(config, pg_collection):
    return (
        pg_group(pg_collection, "tp_cp")
        if config.tp_only_amax_red
        else pg_group(pg_collection, "tp_dp_cp")
    )


def tp_dp(pg_collection):
    return ps.get_tensor_and_data_parallel_group()
"""
    assert reasons(tmp_path, source) == ["no collection field holds the tensor and data parallel group"]


def test_a_local_above_the_read_is_used_and_one_below_is_a_reason(tmp_path: Path) -> None:
    source = HEAD + """
def f(build):
    pg_collection = build()
    return ps.get_pipeline_model_parallel_rank()

def g(build):
    rank = ps.get_pipeline_model_parallel_rank()
    pg_collection = build()
    return rank, pg_collection
"""
    text = after(tmp_path, source)
    assert '    return pg_rank(pg_collection, "pp")\n' in text
    assert "rank = ps.get_pipeline_model_parallel_rank()" in text
    assert reasons(tmp_path, source) == ["read above the assignment of the local pg_collection"]


def test_an_attribute_of_self_is_used_in_methods_and_after_its_assignment_in_init(tmp_path: Path) -> None:
    source = HEAD + """
class Layer:
    def __init__(self, collection):
        self.pg_collection = collection
        self.tp = ps.get_tensor_model_parallel_world_size()

    def forward(self, x):
        if ps.is_pipeline_first_stage():
            return x
        return ps.get_expert_model_parallel_group()
"""
    assert after(tmp_path, source) == HEAD_KEPT + helper("pg_group", "pg_read", "pg_size") + """
class Layer:
    def __init__(self, collection):
        self.pg_collection = collection
        self.tp = pg_size(self.pg_collection, "tp")

    def forward(self, x):
        if pg_read(self.pg_collection, "pp", "first_stage"):
            return x
        return pg_group(self.pg_collection, "ep")
"""


def test_no_collection_threads_a_keyword_only_parameter_and_callers_pass_theirs(tmp_path: Path) -> None:
    library = HEAD + """
def shard(x, *args, **kwargs):
    return ps.get_tensor_model_parallel_rank()

def size(x):
    return ps.get_tensor_model_parallel_world_size()
"""
    user = """
from lib import shard
import lib

def step(x, pg_collection):
    return shard(x, 1), lib.size(x)

def bare(x):
    return shard(x)

def wrapped(x, **kwargs):
    return shard(x, **kwargs)
"""
    migration = run(tmp_path, {"lib.py": library, "user.py": user})
    texts = {change.path: change.after.decode() for change in migration.changes}
    assert texts["lib.py"] == HEAD_KEPT + helper("pg_rank", "pg_size") + """
def shard(x, *args, pg_collection=None, **kwargs):
    return pg_rank(pg_collection, "tp")

def size(x, *, pg_collection=None):
    return pg_size(pg_collection, "tp")
"""
    # bare reads nothing but calls shard: threaded upward (wrapped passes **kwargs, which may hold one)
    assert texts["user.py"] == textwrap.dedent(user).replace(
        "return shard(x, 1), lib.size(x)", "return shard(x, 1, pg_collection=pg_collection), "
        "lib.size(x, pg_collection=pg_collection)"
    ).replace("def bare(x):\n    return shard(x)", "def bare(x, *, pg_collection=None):\n"
              "    return shard(x, pg_collection=pg_collection)")
    assert migration.passed == 3


def test_a_call_through_a_package_that_re_exports_the_function_passes_the_collection(tmp_path: Path) -> None:
    """Megatron-LM's ``from .utils import logical_and_across_model_parallel_group`` (defined in
    ``utils/common_utils.py``, re-exported by ``utils/__init__.py``): the call through the package is the call."""
    common = HEAD + """
def all_true(flag, group=None):
    if group is None:
        group = ps.get_model_parallel_group()
    return flag, group
"""
    user = """
from .utils import all_true
from pkg import utils
import pkg as top

def step(flag, pg_collection):
    return all_true(flag), utils.all_true(flag), top.all_true(flag)
"""
    migration = run(tmp_path, {
        "pkg/__init__.py": "from .utils import all_true  # a chain: the package re-exports its subpackage's\n",
        "pkg/utils/__init__.py": "from .common import all_true\n",
        "pkg/utils/common.py": common,
        "pkg/user.py": user,
    })
    texts = {change.path: change.after.decode() for change in migration.changes}
    assert texts["pkg/user.py"] == textwrap.dedent(user).replace(
        "return all_true(flag), utils.all_true(flag), top.all_true(flag)",
        "return (\n        all_true(flag, pg_collection=pg_collection),\n"
        "        utils.all_true(flag, pg_collection=pg_collection),\n"
        "        top.all_true(flag, pg_collection=pg_collection),\n    )")  # over 100 columns: split as black
    assert migration.passed == 3


def test_a_keyword_added_to_a_call_over_several_lines_goes_on_its_own_line(tmp_path: Path) -> None:
    source = HEAD + """
def inner(x):
    return x, ps.get_context_parallel_group()

def outer(x, pg_collection):
    y = inner(
        x
    )  # the closing parenthesis stays on its line
    return inner(x,
                 )
"""
    assert after(tmp_path, source).endswith("""
def outer(x, pg_collection):
    y = inner(
        x,
        pg_collection=pg_collection
    )  # the closing parenthesis stays on its line
    return inner(x,
                 pg_collection=pg_collection,
                 )
""")


def test_threading_is_transitive_a_threaded_caller_passes_its_collection_on(tmp_path: Path) -> None:
    source = HEAD + """
def inner():
    return ps.get_context_parallel_group()

def outer():
    return inner(), ps.get_context_parallel_rank()
"""
    text = after(tmp_path, source)
    assert "def outer(*, pg_collection=None):" in text
    assert 'return inner(pg_collection=pg_collection), pg_rank(pg_collection, "cp")' in text


def test_nested_functions_read_the_enclosing_collection_inline(tmp_path: Path) -> None:
    source = HEAD + """
def outer(pg_collection=None):
    def inner():
        return ps.get_tensor_model_parallel_group()
    return inner

def alone():
    def inner():
        return ps.get_tensor_model_parallel_group()
    return inner
"""
    text = after(tmp_path, source)
    assert '        return pg_group(pg_collection, "tp")\n    return inner' in text  # the enclosing one's
    # alone's inner has none: alone is given one, and inner reads it as a closure (nobody could pass inner one)
    assert run(tmp_path, {"m.py": source}).threaded == ["m.py: alone"]


def test_decorators_async_and_methods(tmp_path: Path) -> None:
    source = HEAD + """
import functools

class C:
    @staticmethod
    def s():
        return ps.get_pipeline_model_parallel_group()

    @property
    def p(self):
        return ps.get_pipeline_model_parallel_group()

    def __len__(self):
        return ps.get_pipeline_model_parallel_world_size()

@functools.lru_cache
def cached():
    return ps.get_pipeline_model_parallel_group()

@some.decorator(1)
async def run():
    return ps.get_pipeline_model_parallel_group()
"""
    text = after(tmp_path, source)
    assert "    def s(*, pg_collection=None):" in text
    assert "async def run(*, pg_collection=None):" in text
    assert sorted(reasons(tmp_path, source)) == [
        "decorated with @functools.lru_cache, which a new parameter would break",
        "decorated with @property, which a new parameter would break",
        "special method __len__: Python calls it with its own arguments",
    ]


def test_a_pg_collection_of_another_meaning_is_not_reused(tmp_path: Path) -> None:
    source = HEAD + """
def f(pg_collection: str):
    return pg_collection, ps.get_data_parallel_group(with_gtp_remat=False)
"""
    assert after(tmp_path, source) == HEAD_KEPT + helper("pg_group") + """
def f(pg_collection: str, *, process_group_collection=None):
    return pg_collection, pg_group(process_group_collection, "dp")
"""


def test_comments_and_formatting_are_kept(tmp_path: Path) -> None:
    source = HEAD + """
def f(
    x,  # the input
    y,
):
    # the tensor-parallel group
    group = ps.get_tensor_model_parallel_group()   # keep me
    return (x,
            y,   group)
"""
    assert after(tmp_path, source) == HEAD_KEPT + helper("pg_group") + """
def f(
    x,  # the input
    y,
    *,
    pg_collection=None,
):
    # the tensor-parallel group
    group = pg_group(pg_collection, "tp")   # keep me
    return (x,
            y,   group)
"""


def test_existing_fallbacks_go_through_the_warning_lazily(tmp_path: Path) -> None:
    source = """
from megatron.core import parallel_state
from megatron.core.utils import get_tensor_model_parallel_group_if_none

def f(x, tp_group=None, cp_group=None):
    tp_group = get_tensor_model_parallel_group_if_none(tp_group)
    if cp_group is None:
        cp_group = parallel_state.get_context_parallel_group()
    return x

class L:
    def __init__(self, tp_group=None, pg_collection=None):
        self.tp_group = get_tensor_model_parallel_group_if_none(tp_group, is_expert=self.is_expert)
"""
    text = after(tmp_path, source)
    assert "def f(x, tp_group=None, cp_group=None, *, pg_collection=None):" in text
    # a fallback helper's read falls back to the helper (it answers None where nothing is initialised)
    assert '    tp_group = tp_group if tp_group is not None else pg_read(pg_collection, "tp", "group_if_none")\n' \
        in text
    assert '        cp_group = pg_group(pg_collection, "cp")\n' in text
    # an attribute flag is read once, after the group, whether or not the group is None: both go through a lambda
    # (black's split)
    assert (
        '        self.tp_group = (\n            lambda tp_group, is_expert: (\n                tp_group\n'
        '                if tp_group is not None\n                else (\n'
        '                    pg_read(pg_collection, "expt_tp", "group_if_none")\n                    if is_expert\n'
        '                    else pg_read(pg_collection, "tp", "group_if_none")\n                )\n'
        '            )\n        )(tp_group, self.is_expert)\n' in text
    )
    # the imports the reads needed go but the first, where the module fails without Megatron-Core (kept, marked for
    # linters: the second would fail there too, so it goes); the helper's comes after it
    assert text.startswith(
        "\nfrom megatron.core import parallel_state  # noqa: F401\n"
        "from _process_group_fallback import pg_group, pg_read\n\ndef f(")


def test_an_import_the_rewrite_leaves_unused_goes_and_the_helpers_comes_among_its_peers(tmp_path: Path) -> None:
    """No noqa marker: a name the rewrite leaves unused goes (the helper imports parallel_state itself when a
    read falls back); the helper's import goes with the file's imports of its package, before relative ones."""
    user = """
    from megatron.core.parallel_state import get_tensor_model_parallel_group
    from megatron.core import mpu
    from .utils import divide, get_tensor_model_parallel_group_if_none

    def f(x, pg_collection, tp_group=None):
        tp_group = get_tensor_model_parallel_group_if_none(tp_group)
        return divide(x, 2), get_tensor_model_parallel_group(), mpu.get_context_parallel_group(), tp_group
    """
    again = """
    from megatron.core import parallel_state  # noqa: E402
    from megatron.core.parallel_state import get_context_parallel_group

    def g(pg_collection):
        return get_context_parallel_group(), parallel_state.get_tensor_model_parallel_group()
    """
    migration = run(tmp_path, {
        "megatron/core/__init__.py": "from megatron.core import parallel_state as mpu\n",
        "megatron/core/parallel_state.py": "def get_tensor_model_parallel_group(): ...\n",
        "megatron/core/utils.py": "def divide(a, b): ...\n",
        "megatron/core/user.py": user,
        "megatron/core/again.py": again,
    })
    texts = {change.path: change.after.decode() for change in migration.changes}
    assert texts["megatron/core/user.py"] == """
from megatron.core._process_group_fallback import pg_group, pg_read
from .utils import divide

def f(x, pg_collection, tp_group=None):
    tp_group = tp_group if tp_group is not None else pg_read(pg_collection, "tp", "group_if_none")
    return divide(x, 2), pg_group(pg_collection, "tp"), pg_group(pg_collection, "cp"), tp_group
"""
    assert texts["megatron/core/again.py"] == """
from megatron.core._process_group_fallback import pg_group

def g(pg_collection):
    return pg_group(pg_collection, "cp"), pg_group(pg_collection, "tp")
"""
    assert "megatron/core/_process_group_fallback.py" in texts  # in the top package: megatron/core


def test_a_dotted_import_and_an_aliased_one_the_rewrite_leaves_unused_go(tmp_path: Path) -> None:
    """``import a.b.c`` binds ``a`` and ``from m import x as y`` binds ``y``: the names read, so the ones that go
    (an unread alias of the same statement stays, and so does an aliased dotted import nothing read)."""
    source = """
import megatron.core.parallel_state
import megatron.core.tensor_parallel as tp_layers
from megatron.core import parallel_state as ps, utils as u


def f(x, pg_collection):
    return megatron.core.parallel_state.get_tensor_model_parallel_group(), ps.get_context_parallel_group()
"""
    assert after(tmp_path, source) == """
import megatron.core.tensor_parallel as tp_layers
from megatron.core import utils as u
from _process_group_fallback import pg_group


def f(x, pg_collection):
    return pg_group(pg_collection, "tp"), pg_group(pg_collection, "cp")
"""


@pytest.mark.parametrize("spelling", ["get_tensor_model_parallel_group_if_none",
                                      "\uff47et_tensor_model_parallel_group_if_none"])
def test_an_import_the_rewrite_stops_reading_stays_while_another_function_reads_it(
    tmp_path: Path, spelling: str
) -> None:
    """The other read is in a function the rewrite does not touch (and does not parse): found by its text, or,
    spelled with a letter Python normalises (a fullwidth g), by its ast."""
    user = f"""
    from .utils import get_tensor_model_parallel_group_if_none

    def f(pg_collection, tp_group=None):
        return get_tensor_model_parallel_group_if_none(tp_group)

    def g():
        return {spelling}
    """
    migration = run(tmp_path, {"megatron/core/utils.py": "def divide(a, b): ...\n", "megatron/core/user.py": user})
    texts = {change.path: change.after.decode() for change in migration.changes}
    assert texts["megatron/core/user.py"] == textwrap.dedent(user).replace(
        "return get_tensor_model_parallel_group_if_none(tp_group)",
        'return tp_group if tp_group is not None else pg_read(pg_collection, "tp", "group_if_none")').replace(
        "\nfrom .utils", "\nfrom _process_group_fallback import pg_read\nfrom .utils")


def test_what_cannot_be_rewritten_stays_with_its_reason(tmp_path: Path) -> None:
    source = HEAD + """
from megatron.core.process_groups_config import ProcessGroupCollection

GROUP = ps.get_tensor_model_parallel_group()

class C:
    size = ps.get_tensor_model_parallel_world_size()

def f(name, vp_stage):
    a = getattr(ps, "get_data_parallel_rank")()
    b = ps.is_pipeline_last_stage(False, vp_stage)
    c = ps.get_data_parallel_group()
    d = ps.get_data_parallel_group(flag)
    e = ps._TENSOR_MODEL_PARALLEL_GROUP
    g = ProcessGroupCollection.use_mpu_process_groups()
    return a, b, c, d, e, g
"""
    assert sorted(reasons(tmp_path, source)) == sorted([
        "module level: runs at import, before any collection exists",
        "class body: runs when the class is defined, before any collection exists",
        "dynamic getattr: the accessor is looked up by name at run time",
        "positional or star arguments: which group they pick is not known",
        "positional or star arguments: which group they pick is not known",
        "a module global or a reference to the accessor, not a call of it",
        "shim: builds every field from the globals (remove it once every caller passes a collection)",
    ])


def test_the_pgregistry_target_reads_through_pgregistry_doors(tmp_path: Path) -> None:
    source = HEAD + """
def f(pg_collection):
    return ps.get_tensor_model_parallel_rank(), ps.is_pipeline_last_stage()

def g():
    return ps.get_data_parallel_world_size(with_gtp_remat=False)
"""
    assert after(tmp_path, source, target="pgregistry") == HEAD_KEPT + """\
from pgregistry.doors import pg_rank, pg_read, pg_size

def f(pg_collection):
    return pg_rank(pg_collection, "tp"), pg_read(pg_collection, "pp", "last_stage")

def g(*, pg_collection=None):
    return pg_size(pg_collection, "dp")
"""


def test_a_configured_collection_name(tmp_path: Path) -> None:
    source = HEAD + """
def f(pgs):
    return ps.get_tensor_model_parallel_group()
"""
    assert 'return pg_group(pgs, "tp")' in after(tmp_path, source, name="pgs")


def test_a_file_that_imports_the_helper_already_imports_what_it_needs_in_that_one_statement(tmp_path: Path) -> None:
    source = """\
import os

# the process groups
from _process_group_fallback import pg_rank
from megatron.core import parallel_state as ps


def f(pg_collection):
    return pg_rank(pg_collection, "tp"), ps.get_tensor_model_parallel_group(), os.sep
"""
    assert after(tmp_path, source) == source.replace(
        "from _process_group_fallback import pg_rank\nfrom megatron.core import parallel_state as ps\n",
        "from _process_group_fallback import pg_group, pg_rank\n" + HEAD_KEPT).replace(
        "ps.get_tensor_model_parallel_group()", 'pg_group(pg_collection, "tp")')


def test_the_rewrite_is_idempotent(tmp_path: Path) -> None:
    source = HEAD + """
from megatron.core.utils import get_tensor_model_parallel_group_if_none

def f(tp_group=None):
    tp_group = get_tensor_model_parallel_group_if_none(tp_group)
    return ps.get_tensor_model_parallel_rank(), ps.is_pipeline_first_stage(), tp_group
"""
    once = after(tmp_path, source)
    assert once != textwrap.dedent(source)
    second = run(tmp_path, {"m.py": once})
    assert second.changes == [] and second.failures == []


def test_a_read_after_non_ascii_text_on_its_line_is_located(tmp_path: Path) -> None:
    """Reads are located by the scanner's own (ast) positions, whose columns count bytes, not characters."""
    source = HEAD + """
def f(pg_collection):
    return "né", ps.get_tensor_model_parallel_group()
"""
    assert after(tmp_path, source) == HEAD_KEPT + helper("pg_group") + """
def f(pg_collection):
    return "né", pg_group(pg_collection, "tp")
"""


def test_a_function_that_builds_the_collection_from_the_globals_reads_one_shim_of_its_class(tmp_path: Path) -> None:
    # As Megatron-Core's _build_default_pg_collection / get_default_pg_collection: each field the table names is
    # read from one use_mpu_process_groups (the same group); a group no field holds stays, with its reason.
    source = HEAD + """
from megatron.core.process_groups_config import ProcessGroupCollection

def default_collection():
    pg_collection = ProcessGroupCollection()
    pg_collection.tp = ps.get_tensor_model_parallel_group()
    pg_collection.dp_cp = ps.get_data_parallel_group(with_context_parallel=True, partial_data_parallel=False)
    pg_collection.dp = ps.get_data_parallel_group(with_context_parallel=False)
    pg_collection.expt_dp = ps.get_expert_data_parallel_group(with_gtp_remat=False)
    return pg_collection
"""
    rewritten = HEAD + """
from megatron.core.process_groups_config import ProcessGroupCollection

def default_collection():
    pg_collection = ProcessGroupCollection()
    mpu_groups = ProcessGroupCollection.use_mpu_process_groups(
        required_pgs=["tp", "dp_cp_gtp_remat", "expt_dp"]
    )
    pg_collection.tp = mpu_groups.tp
    pg_collection.dp_cp = mpu_groups.dp_cp_gtp_remat
    pg_collection.dp = ps.get_data_parallel_group(with_context_parallel=False)
    pg_collection.expt_dp = mpu_groups.expt_dp
    return pg_collection
"""
    assert after(tmp_path, source) == rewritten
    assert after(tmp_path, rewritten) == rewritten  # idempotent
    # the data-parallel group with GTP remat (no CP) is a pseudo field: no collection holds it to fill from
    assert reasons(tmp_path, source) == [
        "builds the collection: assigns fields of pg_collection (a shim written by hand)"
    ]


def test_a_builders_shim_takes_a_numbered_name_when_mpu_groups_is_taken(tmp_path: Path) -> None:
    source = HEAD + """
from megatron.core.process_groups_config import ProcessGroupCollection

def default_collection(mpu_groups):
    pg_collection = ProcessGroupCollection()
    pg_collection.tp = ps.get_tensor_model_parallel_group()
    return pg_collection, mpu_groups
"""
    text = after(tmp_path, source)
    assert '    mpu_groups_2 = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"])\n' in text  # fits
    assert "    pg_collection.tp = mpu_groups_2.tp\n" in text


def test_a_function_that_adds_a_field_to_the_collection_it_was_given_still_reads_through_it(tmp_path: Path) -> None:
    # As Megatron-LM's get_model before its hand migration #5250: the collection it resolves gets one more field;
    # its other reads go through the collection, the read assigned into the field stays.
    source = HEAD + """
def get_model(pg_collection=None):
    if pg_collection is None:
        pg_collection = ProcessGroupCollection.use_mpu_process_groups()
    pg_collection.dp_cp_ag = ps.get_data_parallel_group(with_context_parallel=True, with_gtp_remat=False)
    return ps.get_pipeline_model_parallel_rank()
"""
    assert after(tmp_path, source) == HEAD + helper("pg_rank") + """
def get_model(pg_collection=None):
    if pg_collection is None:
        pg_collection = ProcessGroupCollection.use_mpu_process_groups()
    pg_collection.dp_cp_ag = ps.get_data_parallel_group(with_context_parallel=True, with_gtp_remat=False)
    return pg_rank(pg_collection, "pp")
"""
    assert reasons(tmp_path, source) == [
        "shim: builds every field from the globals (remove it once every caller passes a collection)",
        "builds the collection: assigns fields of pg_collection (a shim written by hand)",
    ]


def test_a_new_parameter_keeps_the_closing_parenthesis_on_its_own_line(tmp_path: Path) -> None:
    source = HEAD + """
def f(
    x: int, y: bool = False
) -> int:
    return ps.get_tensor_model_parallel_world_size()
"""
    text = after(tmp_path, source)
    assert "def f(\n    x: int, y: bool = False, *, pg_collection=None\n) -> int:\n" in text, text


def test_a_file_whose_reads_all_stay_gets_the_same_reasons_unparsed(tmp_path: Path) -> None:
    """Such a file is not parsed with libcst (a shim, a module-level read): its reasons are still given."""
    source = HEAD + """
from megatron.core.process_groups_config import ProcessGroupCollection

GROUP = ps.get_tensor_model_parallel_group()
DEFAULT = ProcessGroupCollection.use_mpu_process_groups()
"""
    assert after(tmp_path, source) == textwrap.dedent(source)
    assert reasons(tmp_path, source) == [
        "module level: runs at import, before any collection exists",
        "shim: builds a collection from the globals (remove it once every caller passes one)",
    ]


def test_a_read_inside_an_f_string_gets_the_quotes_the_f_string_allows(tmp_path: Path) -> None:
    # Megatron-LM's training/initialize.py prints f"{mpu.get_tensor_model_parallel_world_size()}": before Python
    # 3.12 an f-string's expression may not hold its own quote, so pg_size(c, "tp") there does not compile.
    source = HEAD + '''
def f(pg_collection):
    print(f"size {ps.get_tensor_model_parallel_world_size()}")
    print(f'next {ps.get_pipeline_model_parallel_next_rank()}')
    return f"""{ps.get_context_parallel_rank()}"""
'''
    assert after(tmp_path, source) == HEAD_KEPT + helper("pg_rank", "pg_read", "pg_size") + '''
def f(pg_collection):
    print(f"size {pg_size(pg_collection, 'tp')}")
    print(f'next {pg_read(pg_collection, "pp", "next_rank")}')
    return f"""{pg_rank(pg_collection, 'cp')}"""
'''


def test_the_comments_above_a_local_import_the_rewrite_removes_stay(tmp_path: Path) -> None:
    # Megatron-Bridge's gpt_builder.modelopt_transformer_layer_spec: the comments above its local import of
    # parallel_state say what the code below does; the import goes (the import of megatron.core after it fails first
    # without Megatron-Core), the comments stay.
    source = '''import os

def spec(config, pg_collection):
    """Doc."""
    # When context parallel > 1, only causal masks
    from megatron.core import parallel_state
    from megatron.core.models.gpt import get_spec

    return get_spec(config.mask if config.mask is not None else parallel_state.get_context_parallel_world_size() == 1)
'''
    assert after(tmp_path, source) == "import os\n" + helper("pg_size") + '''
def spec(config, pg_collection):
    """Doc."""
    # When context parallel > 1, only causal masks
    from megatron.core.models.gpt import get_spec

    return get_spec(config.mask if config.mask is not None else pg_size(pg_collection, "cp") == 1)
'''


def test_a_method_called_on_a_read_s_group_stays(tmp_path: Path) -> None:
    # Megatron-LM's get_megatron_optimizer (before #3349): the read is the inner call, which starts where the
    # outer .rank() / .size() call does; taking the outer one dropped the method and read the outer call's keywords.
    source = HEAD + '''
def f(pg_collection):
    rank = ps.get_model_parallel_group().rank()
    return ps.get_data_parallel_group(with_context_parallel=True).size() > rank
'''
    assert after(tmp_path, source) == HEAD_KEPT + helper("pg_group") + '''
def f(pg_collection):
    rank = pg_group(pg_collection, "mp").rank()
    return pg_group(pg_collection, "dp_cp_gtp_remat").size() > rank
'''


def test_an_if_or_while_line_the_rewrite_made_too_long_is_split_as_black_splits_it(tmp_path: Path) -> None:
    # Megatron-Bridge's DiTSelfAttention: `if self.layernorm_across_heads and pg_size(<a learned chain>, "tp") > 1:`
    # passed the tree's line length; black puts such a condition in parentheses, split at its delimiters.
    source = HEAD + '''
def f(heads, threshold, process_groups_of_the_whole_model):
    if heads and ps.get_tensor_model_parallel_world_size() > 1 and threshold > 10000000000000000000:
        return 1
    elif threshold and ps.get_context_parallel_world_size() > threshold * 2 + 1000000000000000000:
        return 2
    while ps.get_pipeline_model_parallel_world_size() > heads + 100000000000000000000000000000000000:
        return 3
    if ps.get_tensor_model_parallel_rank():
        return 4
'''
    rewritten = after(tmp_path, source, name="process_groups_of_the_whole_model")
    assert rewritten == HEAD_KEPT + helper("pg_rank", "pg_size") + '''
def f(heads, threshold, process_groups_of_the_whole_model):
    if (
        heads
        and pg_size(process_groups_of_the_whole_model, "tp") > 1
        and threshold > 10000000000000000000
    ):
        return 1
    elif (
        threshold
        and pg_size(process_groups_of_the_whole_model, "cp") > threshold * 2 + 1000000000000000000
    ):
        return 2
    while (
        pg_size(process_groups_of_the_whole_model, "pp")
        > heads + 100000000000000000000000000000000000
    ):
        return 3
    if pg_rank(process_groups_of_the_whole_model, "tp"):
        return 4
'''


def test_an_arithmetic_value_the_rewrite_made_too_long_goes_in_parentheses(tmp_path: Path) -> None:
    # Megatron-Bridge's diffusion steps: `sharding_factor = pg_size(<a learned chain>, "cp") * 2` passed the line
    # length and was left, since the splitter knew no shape for one arithmetic operation.
    source = HEAD + '''
def f(process_groups_of_the_whole_model):
    sharding_factor_of_the_packed_sequence = ps.get_context_parallel_world_size() * 2 + 10000000
    return sharding_factor_of_the_packed_sequence
'''
    assert after(tmp_path, source, name="process_groups_of_the_whole_model") == HEAD_KEPT + helper("pg_size") + '''
def f(process_groups_of_the_whole_model):
    sharding_factor_of_the_packed_sequence = (
        pg_size(process_groups_of_the_whole_model, "cp") * 2 + 10000000
    )
    return sharding_factor_of_the_packed_sequence
'''


def test_an_assert_the_rewrite_made_too_long_is_split_as_black_splits_it(tmp_path: Path) -> None:
    # Megatron-Bridge's llama4 attention: `assert original_seq_len % (pg_size(<a learned chain>, "cp") * 2) == 0`.
    source = HEAD + '''
def f(original_length_of_the_batch, process_groups_of_the_whole_model):
    assert original_length_of_the_batch % (ps.get_context_parallel_world_size() * 2) == 0 + 10000
'''
    assert after(tmp_path, source, name="process_groups_of_the_whole_model") == HEAD_KEPT + helper("pg_size") + '''
def f(original_length_of_the_batch, process_groups_of_the_whole_model):
    assert (
        original_length_of_the_batch % (pg_size(process_groups_of_the_whole_model, "cp") * 2)
        == 0 + 10000
    )
'''


SHIM = "from megatron.core.process_groups_config import ProcessGroupCollection\n"
#: ``SHIM`` once no shim is left: it stays, where the module fails without Megatron-Core (see ``HEAD_KEPT``).
SHIM_KEPT = "from megatron.core.process_groups_config import ProcessGroupCollection  # noqa: F401\n"


def test_a_shim_read_only_for_its_fields_becomes_the_reads_of_those_fields(tmp_path: Path) -> None:
    # The three shapes Megatron-LM's #6234 removed by hand: read inline (VocabParallelEmbedding), a local read for
    # one of two fields (ColumnParallelLinear), a local named like the collection read for both
    # (_allreduce_replicated_grads_over_gtp_remat_group). Each read falls back as use_mpu_process_groups reads the
    # field (check_initialized=False: None where parallel_state is not initialised, where the getter raises).
    source = SHIM + '''
class Linear:
    def __init__(self, is_expert):
        self.is_expert = is_expert

        # the weight-sharding group
        _pg = ProcessGroupCollection.use_mpu_process_groups(
            required_pgs=["gtp_remat", "expt_gtp_remat"]
        )
        group = _pg.expt_gtp_remat if self.is_expert else _pg.gtp_remat
        self.group = group


def embedding():
    group = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["gtp_remat"]).gtp_remat
    return group


def allreduce(model):
    """Doc."""
    pg_collection = ProcessGroupCollection.use_mpu_process_groups(
        required_pgs=["gtp_remat", "expt_gtp_remat"]
    )
    dense = pg_collection.gtp_remat
    return dense, pg_collection.expt_gtp_remat
'''
    assert after(tmp_path, source) == SHIM_KEPT + helper("pg_group") + '''
class Linear:
    def __init__(self, is_expert, *, pg_collection=None):
        self.is_expert = is_expert

        # the weight-sharding group
        group = (
            pg_group(pg_collection, "expt_gtp_remat", check_initialized=False)
            if self.is_expert
            else pg_group(pg_collection, "gtp_remat", check_initialized=False)
        )
        self.group = group


def embedding(*, pg_collection=None):
    group = pg_group(pg_collection, "gtp_remat", check_initialized=False)
    return group


def allreduce(model, *, pg_collection=None):
    """Doc."""
    dense = pg_group(pg_collection, "gtp_remat", check_initialized=False)
    return dense, pg_group(pg_collection, "expt_gtp_remat", check_initialized=False)
'''


def test_a_shim_named_like_the_collection_leaves_no_local_that_hides_the_collection(tmp_path: Path) -> None:
    # The local pg_collection is gone: the read after it is the threaded collection's, not the shim's (which holds
    # no tp), and the collection in scope (self.pg_collection) is the one the shim's reads read.
    source = SHIM + HEAD + '''
def allreduce(model):
    pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["gtp_remat"])
    group = pg_collection.gtp_remat
    return group, ps.get_tensor_model_parallel_rank()


class Layer:
    def __init__(self, pg_collection):
        self.pg_collection = pg_collection

    def forward(self):
        _pg = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["expt_gtp_remat"])
        return _pg.expt_gtp_remat
'''
    assert after(tmp_path, source) == SHIM_KEPT + helper("pg_group", "pg_rank") + '''
def allreduce(model, *, pg_collection=None):
    group = pg_group(pg_collection, "gtp_remat", check_initialized=False)
    return group, pg_rank(pg_collection, "tp")


class Layer:
    def __init__(self, pg_collection):
        self.pg_collection = pg_collection

    def forward(self):
        return pg_group(self.pg_collection, "expt_gtp_remat", check_initialized=False)
'''


@pytest.mark.parametrize(("body", "reason"), [
    ("_pg = ProcessGroupCollection.use_mpu_process_groups(required_pgs=['gtp_remat'])\n    return _pg",
     "shim: its collection is used otherwise than read for the fields it lists (_pg is passed on, returned, "
     "stored or bound again)"),
    ("_pg = ProcessGroupCollection.use_mpu_process_groups(required_pgs=['gtp_remat'])\n    g(_pg.gtp_remat, _pg)",
     "shim: its collection is used otherwise than read for the fields it lists (_pg is passed on, returned, "
     "stored or bound again)"),
    ("self.pgs = ProcessGroupCollection.use_mpu_process_groups(required_pgs=['gtp_remat'])",
     "shim: its collection is used otherwise than read for the fields it lists"),
    ("g(ProcessGroupCollection.use_mpu_process_groups(required_pgs=['gtp_remat']))",
     "shim: its collection is used otherwise than read for the fields it lists"),
    ("_pg = ProcessGroupCollection.use_mpu_process_groups(required_pgs=['gtp_remat'])\n    return _pg.tp",
     "shim: reads 'tp', a field it does not list"),
    ("return ProcessGroupCollection.use_mpu_process_groups(required_pgs=['gtp_remat']).tp",
     "shim: reads 'tp', a field it does not list"),
    ("_pg = ProcessGroupCollection.use_mpu_process_groups(required_pgs=['gtp_remat'])\n    _pg.gtp_remat = None",
     "shim: a field of _pg is assigned or deleted"),
    ("_pg = ProcessGroupCollection.use_mpu_process_groups(required_pgs=['gtp_remat'])\n"
     "    return lambda: _pg.gtp_remat",
     "shim: _pg is read in a nested function, lambda or class"),
    ("_pg = ProcessGroupCollection.use_mpu_process_groups(required_pgs=['gtp_remat'])\n"
     "    _pg = ProcessGroupCollection.use_mpu_process_groups(required_pgs=['gtp_remat'])\n    return _pg.gtp_remat",
     "shim: its collection is used otherwise than read for the fields it lists (_pg is passed on, returned, "
     "stored or bound again)"),
    ("if pg_collection is None:\n        pg_collection = ProcessGroupCollection.use_mpu_process_groups()\n"
     "    return pg_collection.tp",
     "shim: builds every field from the globals (remove it once every caller passes a collection)"),
    ("if pg_collection is None:\n"
     "        pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=['tp'])\n"
     "    return pg_collection.tp",
     "shim: rebinds the parameter pg_collection (the default of callers that pass none)"),
    ("if flag:\n        _pg = ProcessGroupCollection.use_mpu_process_groups(required_pgs=['tp'])\n"
     "        return _pg.tp",
     "shim: assigned to _pg inside a block, not at the function's top level"),
    # dp's getter asserts where parallel_state is not initialised: the shim raised where it stood, a moved read
    # would raise only where it is read (or never, in a branch not taken).
    ("_pg = ProcessGroupCollection.use_mpu_process_groups(required_pgs=['dp', 'tp'])\n    return _pg.tp",
     "shim: use_mpu_process_groups reads 'dp' checked where it is built (it raises there when parallel_state is "
     "not initialised): its reads may not move"),
    ("return ProcessGroupCollection.use_mpu_process_groups(required_pgs=FIELDS).tp",
     "shim: the fields it lists are not a literal list"),
    ("return ProcessGroupCollection.use_mpu_process_groups(required_pgs=['nonsense']).nonsense",
     "shim: this Megatron-Core's use_mpu_process_groups builds no field 'nonsense'"),
], ids=["returned", "passed-on", "stored-on-self", "passed-inline", "unlisted-field", "unlisted-field-inline",
        "field-assigned", "read-in-lambda", "bound-twice", "default-builder", "rebinds-the-parameter", "in-a-block",
        "checked-field-moved", "not-a-literal-list", "no-such-field"])
def test_a_shim_whose_collection_escapes_stays_with_its_reason(tmp_path: Path, body: str, reason: str) -> None:
    source = SHIM + f"""
def f(self, flag, pg_collection=None):
    {body}
"""
    assert after(tmp_path, source) == source
    assert set(reasons(tmp_path, source)) == {reason}  # each shim of it (two that bind one local: both)


def test_a_checked_field_read_inline_is_read_where_the_shim_read_it(tmp_path: Path) -> None:
    # Read inline, the read is where the shim was: dp's checked getter raises where it raised (the fallback calls
    # it as use_mpu_process_groups does, with_gtp_remat=False, no check_initialized).
    source = SHIM + """
def f():
    return ProcessGroupCollection.use_mpu_process_groups(required_pgs=["dp"]).dp
"""
    assert after(tmp_path, source) == SHIM_KEPT + helper("pg_group") + """
def f(*, pg_collection=None):
    return pg_group(pg_collection, "dp")
"""


def test_a_shim_stays_where_the_release_does_not_say_what_it_calls(tmp_path: Path) -> None:
    from pgregistry.migrate._engine import Helper

    files = write_sources(tmp_path, {"m.py": SHIM + """
def f():
    return ProcessGroupCollection.use_mpu_process_groups(required_pgs=["gtp_remat"]).gtp_remat
"""})
    unknown = migrate(files, PRESETS["megatron"], target="megatron", name="pg_collection", helper=Helper(shims=None))
    assert not unknown.changes
    assert [read.reason for _, read in unknown.reads] == [
        "shim: which getter use_mpu_process_groups calls for each field is not known (no "
        "megatron/core/process_groups_config.py found)"]
    older = migrate(files, PRESETS["megatron"], target="megatron", name="pg_collection", helper=Helper(shims={}))
    assert [read.reason for _, read in older.reads] == [
        "shim: this Megatron-Core's use_mpu_process_groups builds no field 'gtp_remat'"]
    # A release whose shim reads the field checked: the fallback calls the getter as that shim does.
    checked = migrate(files, PRESETS["megatron"], target="megatron", name="pg_collection",
                      helper=Helper(shims={"gtp_remat": ("get_gtp_weight_remat_group", {})}))
    assert [change.after.decode() for change in checked.changes if change.path == "m.py"] == [
        SHIM_KEPT + helper("pg_group") + """
def f(*, pg_collection=None):
    return pg_group(pg_collection, "gtp_remat")
"""]


def test_a_shim_that_stays_for_its_function_is_still_the_collection_of_its_other_reads(tmp_path: Path) -> None:
    # No caller can pass an autograd Function's forward a collection, so its shim stays; the local it binds is then
    # the collection in scope for the read below it, as before the shim rule.
    source = SHIM + HEAD + '''
import torch


class F(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"])
        return pg_collection.tp, ps.get_tensor_model_parallel_rank()
'''
    assert after(tmp_path, source) == SHIM + '''
import torch
''' + helper("pg_rank") + '''

class F(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"])
        return pg_collection.tp, pg_rank(pg_collection, "tp")
'''
    assert reasons(tmp_path, source) == [
        "forward of an autograd Function: torch calls it through .apply(...), which takes no keyword"]


def test_a_keyword_expression_a_target_would_not_evaluate_leaves_the_read(tmp_path: Path) -> None:
    """``check_initialized=self.checked``: ``--target pgregistry`` passes no such keyword, so the property the call
    read would go unread; the read stays, in both targets (a plain name is read the same unread: rewritten)."""
    source = """
from megatron.core import parallel_state

def f(checked, pg_collection=None):
    return parallel_state.get_tensor_model_parallel_group(check_initialized=checked)

class L:
    def g(self, pg_collection=None):
        return parallel_state.get_tensor_model_parallel_group(check_initialized=self.checked)
"""
    why = "check_initialized= is an expression the rewrite would not evaluate where the call did"
    assert [reason for reason in reasons(tmp_path, source) if why in reason] != []
    for target in ("megatron", "pgregistry"):
        text = after(tmp_path / target, source, target=target)
        assert "parallel_state.get_tensor_model_parallel_group(check_initialized=self.checked)" in text
        assert "    return pg_group(pg_collection, \"tp\"" in text

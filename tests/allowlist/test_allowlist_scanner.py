"""The scanner: every import and reference form found, look-alikes rightly not found, edit-proof keys, and
sources that cannot be parsed reported with their line."""

from __future__ import annotations

import pytest
from fixtures.scan_projects import keys, scan
from hypothesis import given, settings
from hypothesis import strategies as st

from pgregistry._source import scanner
from pgregistry._source.config import ConfigError, ScanConfig

TP = "get_tensor_model_parallel_group"

FOUND = {
    "import a.b.parallel_state, fully dotted": (
        "import megatron.core.parallel_state\nmegatron.core.parallel_state.get_tensor_model_parallel_group()\n",
        f"<module>|{TP}|call",
    ),
    "dotted, no import at all": (
        "megatron.core.parallel_state.get_tensor_model_parallel_group()\n",
        f"<module>|{TP}|call",
    ),
    "import ... as ps": (
        "import megatron.core.parallel_state as ps\nps.get_tensor_model_parallel_group()\n",
        f"<module>|{TP}|call",
    ),
    "import ... as an unusual alias": (
        "import megatron.core.parallel_state as pstate\npstate.get_tensor_model_parallel_group()\n",
        f"<module>|{TP}|call",
    ),
    "from a.b import parallel_state as mpu": (
        "from megatron.core import parallel_state as mpu\nmpu.get_tensor_model_parallel_group()\n",
        f"<module>|{TP}|call",
    ),
    "from a.b import parallel_state as anything": (
        "from megatron.core import parallel_state as st\nst.get_tensor_model_parallel_group()\n",
        f"<module>|{TP}|call",
    ),
    "from a.b import parallel_state": (
        "from megatron.core import parallel_state\nparallel_state.get_tensor_model_parallel_group()\n",
        f"<module>|{TP}|call",
    ),
    "accessor imported by name": (
        "from megatron.core.parallel_state import get_tensor_model_parallel_group\n"
        "get_tensor_model_parallel_group()\n",
        f"<module>|{TP}|call",
    ),
    "accessor imported under another name": (
        "from megatron.core.parallel_state import get_tensor_model_parallel_group as tp_group\ntp_group()\n",
        f"<module>|{TP}|call",
    ),
    "star import": (
        "from megatron.core.parallel_state import *\nget_tensor_model_parallel_group()\n",
        f"<module>|{TP}|call",
    ),
    "relative: from . import parallel_state": (
        "from . import parallel_state as ps2\nps2.get_tensor_model_parallel_group()\n",
        f"<module>|{TP}|call",
    ),
    "relative: from ..parallel_state import name": (
        "from ..parallel_state import get_tensor_model_parallel_group as g\ng()\n",
        f"<module>|{TP}|call",
    ),
    "bare name parallel_state (Megatron-LM checker rule)": (
        "parallel_state.get_tensor_model_parallel_group()\n",
        f"<module>|{TP}|call",
    ),
    "bare name mpu (Megatron-LM checker rule)": ("mpu.get_tensor_model_parallel_group()\n", f"<module>|{TP}|call"),
    "bare name ps (Megatron-LM checker rule)": ("ps.get_tensor_model_parallel_group()\n", f"<module>|{TP}|call"),
    "old megatron: from megatron import mpu": (
        "from megatron import mpu\nmpu.get_tensor_model_parallel_group()\n",
        f"<module>|{TP}|call",
    ),
    "partial(ps.get_x)": (
        "import functools\nimport megatron.core.parallel_state as ps\n"
        "functools.partial(ps.get_tensor_model_parallel_group)\n",
        f"<module>|{TP}|reference",
    ),
    "fn = ps.get_x": ("fn = ps.get_tensor_model_parallel_group\n", f"<module>|{TP}|reference"),
    "reference to an accessor imported by name": (
        "from megatron.core.parallel_state import get_tensor_model_parallel_group as g\nhooks = [g]\n",
        f"<module>|{TP}|reference",
    ),
    "attribute of an accessor": (
        "name = ps.get_tensor_model_parallel_group.__name__\n",
        f"<module>|{TP}|reference",
    ),
    "getattr with a literal": ('getattr(ps, "get_tensor_model_parallel_group")\n', f"<module>|{TP}|getattr"),
    "getattr called": ('getattr(ps, "get_tensor_model_parallel_group")()\n', f"<module>|{TP}|getattr"),
    "getattr with a default": (
        'getattr(ps, "get_tensor_model_parallel_group", None)\n',
        f"<module>|{TP}|getattr",
    ),
    "getattr on an imported module": (
        'from megatron.core import parallel_state as q\ngetattr(q, "get_tensor_model_parallel_group")()\n',
        f"<module>|{TP}|getattr",
    ),
    "call split over lines": (
        "x = (\n    ps\n    .get_tensor_model_parallel_group(\n    )\n)\n",
        f"<module>|{TP}|call",
    ),
    "module global": (
        "group = ps._TENSOR_MODEL_PARALLEL_GROUP\n",
        "<module>|_TENSOR_MODEL_PARALLEL_GROUP|reference",
    ),
    "gloo getter": ("ps.get_data_parallel_group_gloo()\n", "<module>|get_data_parallel_group_gloo|call"),
    "world size": (
        "ps.get_tensor_model_parallel_world_size()\n",
        "<module>|get_tensor_model_parallel_world_size|call",
    ),
    "src rank": ("ps.get_data_parallel_src_rank()\n", "<module>|get_data_parallel_src_rank|call"),
    "groups": (
        "ps.get_hierarchical_context_parallel_groups()\n",
        "<module>|get_hierarchical_context_parallel_groups|call",
    ),
    "shim on the class": (
        'ProcessGroupCollection.use_mpu_process_groups(required=["tp"])\n',
        "<module>|use_mpu_process_groups|call",
    ),
    "shim on anything": ("pgc = self.use_mpu_process_groups()\n", "<module>|use_mpu_process_groups|call"),
    "shim imported under another name": (
        "from megatron.core.process_groups_config import use_mpu_process_groups as shim\nshim()\n",
        "<module>|use_mpu_process_groups|call",
    ),
    "shim referenced": (
        "make = ProcessGroupCollection.use_mpu_process_groups\n",
        "<module>|use_mpu_process_groups|reference",
    ),
    "global grid: from pgregistry.global_grid import global_collection": (
        "from pgregistry.global_grid import global_collection\nglobal_collection()\n",
        "<module>|global_collection|call",
    ),
    "global grid: module imported from the package": (
        "from pgregistry import global_grid\nglobal_grid.global_collection()\n",
        "<module>|global_collection|call",
    ),
    "global grid: import ... as": (
        "import pgregistry.global_grid as reg\nreg.global_collection()\n",
        "<module>|global_collection|call",
    ),
    "global grid: fully dotted": (
        "import pgregistry\npgregistry.global_grid.global_collection()\n",
        "<module>|global_collection|call",
    ),
    "global grid: a name of the package root": (
        "import pgregistry\npgregistry.global_collection()\n",
        "<module>|global_collection|call",
    ),
    "global grid: get_global_*": (
        "from pgregistry.global_grid import get_global_grid\nget_global_grid()\n",
        "<module>|get_global_grid|call",
    ),
}


@pytest.mark.parametrize("source, key", FOUND.values(), ids=FOUND.keys())
def test_each_form_is_found(source: str, key: str) -> None:
    assert keys(source, path="megatron/core/transformer/layer.py") == [key]


def test_relative_import_resolves_against_the_files_package() -> None:
    source = (
        "from .global_grid import global_collection\nfrom . import global_grid\n"
        "global_collection()\nglobal_grid.global_collection()\n"
    )
    assert keys(source, path="pgregistry/fallback.py") == ["<module>|global_collection|call"] * 2
    # The same relative import in another package names another module.
    assert keys(source, path="otherpkg/fallback.py") == []


NOT_FOUND = {
    "a getter on another object": "config.get_tensor_model_parallel_group()\nself.pg_collection.tp\n",
    "a getter on a model": "model.get_data_parallel_group()\n",
    "initialize_*": "ps.initialize_model_parallel(2)\n",
    "destroy_*": "ps.destroy_model_parallel()\n",
    "is_*": "ps.is_initialized()\nps.model_parallel_is_initialized()\n",
    "virtual pipeline rank": "ps.get_virtual_pipeline_model_parallel_rank()\n",
    "virtual pipeline size": "ps.get_virtual_pipeline_model_parallel_world_size()\n",
    "memory buffer": "ps.get_global_memory_buffer()\n",
    "nccl options": "ps.get_nccl_options('tp', {})\n",
    "all ranks": "ps.get_all_ranks()\n",
    "alias bound to another module": "import psutil as ps\nps.get_tensor_model_parallel_group()\n",
    "mpu bound to another module": "import os as mpu\nmpu.get_tensor_model_parallel_group()\n",
    "same name from another module": (
        "from mylib.groups import get_tensor_model_parallel_group\nget_tensor_model_parallel_group()\n"
    ),
    "a local function of the same name": (
        "def get_tensor_model_parallel_group():\n    return None\nget_tensor_model_parallel_group()\n"
    ),
    "strings and comments": (
        "# ps.get_tensor_model_parallel_group()\n"
        "doc = 'mpu.get_data_parallel_group()'\n"
        "patch('megatron.core.parallel_state.get_tensor_model_parallel_group')\n"
    ),
    "a write to a module global": "ps._TENSOR_MODEL_PARALLEL_GROUP = None\n",
    "a monkeypatched accessor": "ps.get_tensor_model_parallel_group = lambda: None\n",
    "getattr with a computed name": "getattr(ps, name)\n",
    "the global grid set up": (
        "from pgregistry.global_grid import initialize_global_grid\nfrom pgregistry.registry import build\n"
        "initialize_global_grid(layout)\nbuild(layout)\n"
    ),
    "the module itself passed around": "import megatron.core.parallel_state as ps\nuse(ps)\n",
    "a lower-case private global": "ps._tensor_model_parallel_group\n",
}


@pytest.mark.parametrize("source", NOT_FOUND.values(), ids=NOT_FOUND.keys())
def test_look_alikes_are_not_found(source: str) -> None:
    assert keys(source) == []


def test_scopes_are_qualified_and_follow_python_evaluation() -> None:
    source = """
    import functools
    X = ps.get_tensor_model_parallel_rank()

    class Outer:
        size = ps.get_tensor_model_parallel_world_size()

        class Inner:
            def method(self):
                return ps.get_tensor_model_parallel_group()

        @functools.cache
        @decorate(ps.get_data_parallel_rank())
        def forward(self, group=ps.get_data_parallel_group()):
            def helper():
                return [ps.get_context_parallel_group() for _ in range(2)]
            return lambda: ps.get_pipeline_model_parallel_group()

    async def run():
        await ps.get_expert_model_parallel_group()
    """
    assert keys(source) == [
        "<module>|get_tensor_model_parallel_rank|call",
        "Outer.Inner.method|get_tensor_model_parallel_group|call",
        "Outer.forward.helper|get_context_parallel_group|call",
        "Outer.forward|get_pipeline_model_parallel_group|call",
        "Outer|get_data_parallel_group|call",  # a default is evaluated where the function is defined
        "Outer|get_data_parallel_rank|call",  # so is a decorator
        "Outer|get_tensor_model_parallel_world_size|call",
        "run|get_expert_model_parallel_group|call",
    ]


def test_site_carries_line_column_and_spelling() -> None:
    result = scan("import x\n\nclass A:\n    def f(self):\n        return  mpu.get_data_parallel_rank()\n")
    (site,) = result.sites
    assert (site.line, site.col, site.expr, site.family) == (
        5,
        17,
        "mpu.get_data_parallel_rank",
        "parallel_state",
    )
    assert site.key == "A.f|get_data_parallel_rank|call"


def test_edits_that_keep_the_scope_keep_the_keys() -> None:
    before = """
    class Model:
        def forward(self, x):
            group = ps.get_tensor_model_parallel_group()
            return x
    """
    after = """
    '''A new module docstring.'''
    import os  # and a new import


    class Model:
        def other(self):
            return 1

        def forward(self, x):
            x = x + 1
            # the read moved down, below new code
            y = x * 2
            group = ps.get_tensor_model_parallel_group()
            return y
    """
    assert keys(before) == keys(after) == ["Model.forward|get_tensor_model_parallel_group|call"]
    lines = [site.line for site in scan(before).sites], [site.line for site in scan(after).sites]
    assert lines == ([4], [14])


def test_repeated_reads_in_a_scope_share_a_key() -> None:
    source = "def f():\n    ps.get_data_parallel_rank()\n    ps.get_data_parallel_rank()\n"
    assert keys(source) == ["f|get_data_parallel_rank|call"] * 2


def test_configured_module_names_and_patterns() -> None:
    config = ScanConfig(modules=("dist_state",), aliases=(), accessors=("tp_*",), ignore_accessors=())
    source = (
        "from lib import dist_state as d\nd.tp_group()\nd.get_tensor_model_parallel_group()\nps.tp_group()\n"
    )
    assert keys(source, config=config) == ["<module>|tp_group|call"]
    assert keys("import lib.dist_state\nlib.dist_state.tp_rank\n", config=config) == [
        "<module>|tp_rank|reference"
    ]


def test_an_alias_for_part_of_a_dotted_module_name_resolves() -> None:
    config = ScanConfig(registry_modules=("pgregistry.global_grid",))
    source = "import pgregistry as pg\n\ndef f():\n    return pg.global_grid.global_collection()\n"
    assert keys(source, config=config) == ["f|global_collection|call"]
    assert keys("import os as pg\npg.global_grid.global_collection()\n", config=config) == []


def test_bad_configuration_names_the_setting() -> None:
    with pytest.raises(ConfigError, match="modules: 'not a module' is not a dotted module name"):
        ScanConfig(modules=("not a module",))
    with pytest.raises(ConfigError, match="aliases"):
        ScanConfig(aliases=("a.b",))


FAILURES = {
    "syntax error": (b"def f(:\n    pass\n", 1, "syntax error: invalid syntax"),
    "unclosed bracket": (b"x = 1\ny = (1,\n", 2, "syntax error: '(' was never closed"),
    "invalid utf-8 in code": (b"a = 1\nb = 2\n\xff = 3\n", 3, "not valid utf-8"),
    "invalid utf-8 in a comment (ast.parse accepts it)": (b"a = 1\nb = 2  # caf\xe9\n", 2, "not valid utf-8"),
    "invalid utf-8 in a docstring": (b'"""doc\n\xe9\n"""\n', 2, "not valid utf-8"),
    "null byte": (b"a = 1\nb = 2\x00\n", 2, "syntax error"),
    "unknown encoding": (b"# coding: klingon\nx = 1\n", 1, "unknown encoding"),
}


@pytest.mark.parametrize("data, line, message", FAILURES.values(), ids=FAILURES.keys())
def test_unparseable_source_is_a_failure_with_its_line(data: bytes, line: int, message: str) -> None:
    result = scanner.scan_source(data, "pkg/bad.py", ScanConfig())
    assert result.failure is not None and result.sites == ()
    assert result.failure.line == line
    assert message in result.failure.message


def test_declared_encodings_and_line_endings() -> None:
    latin = "# -*- coding: latin-1 -*-\nname = 'café'\nps.get_data_parallel_rank()\n".encode("latin-1")
    assert [s.line for s in scanner.scan_source(latin, "m.py", ScanConfig()).sites] == [3]
    crlf = b"x = 1\r\ny = 2\r\nps.get_data_parallel_rank()\r\n"
    old_mac = b"x = 1\ry = 2\rps.get_data_parallel_rank()\r"
    for data in (crlf, old_mac):
        assert [s.line for s in scanner.scan_source(data, "m.py", ScanConfig()).sites] == [3]


def test_invalid_escape_warnings_do_not_escape_the_scanner(recwarn: pytest.WarningsRecorder) -> None:
    assert keys("import re\npattern = re.compile('\\d+')\nps.get_data_parallel_rank()\n") == [
        "<module>|get_data_parallel_rank|call"
    ]
    assert not recwarn.list


def test_deep_nesting() -> None:
    deep = "x = " + " + ".join(["ps.get_data_parallel_rank()"] * 900) + "\n"
    assert len(keys(deep)) == 900  # the walk is iterative
    too_deep = "x = " + " + ".join(["a"] * 5000) + "\n"  # CPython's compiler refuses this too
    failure = scan(too_deep).failure
    assert failure is not None and "nested too deeply" in failure.message


def test_result_rows_round_trip() -> None:
    result = scan("def f():\n    ps.get_data_parallel_rank()\n")
    assert scanner.decode_result(result.path, scanner.encode_result(result)) == result
    with pytest.raises(ValueError, match="malformed"):
        scanner.decode_result("m.py", [[["1", 1, "s", "a", "call", "e", "f"]], None])


# Property: the pruned walk (only lines that mention a trigger word) finds exactly what a full walk finds.
SNIPPETS = (
    "value = ps.get_data_parallel_rank()",
    "hook = functools.partial(pstate.get_tensor_model_parallel_group)",
    "size = tpws()",
    "g = getattr(mpu, 'get_pipeline_model_parallel_group')()",
    "cfg = config.get_tensor_model_parallel_group()",
    "pgc = ProcessGroupCollection.use_mpu_process_groups()",
    "grid = global_grid.global_collection(None)",
    "other = obj.method(1, key=[i for i in range(3)])",
    "deep = ((((megatron.core.parallel_state\n    .get_context_parallel_group()))))",
    "text = 'ps.get_data_parallel_rank()'  # mpu.get_x_group()",
)
IMPORTS = (
    "import functools",
    "import megatron.core.parallel_state as pstate",
    "from megatron.core.parallel_state import get_tensor_model_parallel_world_size as tpws",
    "from pgregistry import global_grid",
)


def _program(plan: list[tuple[int, int, int]]) -> str:
    lines = [*IMPORTS]
    for depth, snippet, filler in plan:
        header = ["class C:", "    def m(self):", "        if True:"][:depth]
        lines += header + ["    " * depth + "pass"] * filler
        lines += ["    " * depth + part for part in SNIPPETS[snippet].split("\n")]
    return "\n".join(lines) + "\n"


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 3), st.integers(0, len(SNIPPETS) - 1), st.integers(0, 3)), max_size=12)
)
def test_pruned_walk_equals_full_walk(plan: list[tuple[int, int, int]]) -> None:
    source = _program(plan).encode()
    pruned = scanner.scan_source(source, "pkg/m.py", ScanConfig())
    every_line = list(range(1, source.count(b"\n") + 2))
    original = scanner._lines_matching
    scanner._lines_matching = lambda pattern, text: every_line  # type: ignore[assignment]
    try:
        full = scanner.scan_source(source, "pkg/m.py", ScanConfig())
    finally:
        scanner._lines_matching = original
    assert pruned == full
    assert pruned.failure is None

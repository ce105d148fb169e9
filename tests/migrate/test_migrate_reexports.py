"""A threaded function re-exported by a package under another name (``from .common import f as g``): the calls
of ``g``, through the package, are calls of ``f`` and pass the collection (issue 41, item 9: a planted bug that
dropped the alias went unnoticed)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

pytest.importorskip("libcst")

from fixtures.migrated_packages import write_sources  # noqa: E402

from pgregistry._source.config import PRESETS  # noqa: E402
from pgregistry.migrate._engine import migrate  # noqa: E402

COMMON = """\
from megatron.core import parallel_state as ps


def all_true(flag):
    return flag, ps.get_model_parallel_group()
"""
USER = """\
from .utils import agree
from pkg import utils


def step(flag, pg_collection):
    return agree(flag), utils.agree(flag)
"""


def test_a_call_of_a_function_re_exported_under_another_name_passes_the_collection(tmp_path: Path) -> None:
    files = {
        "pkg/__init__.py": "",
        "pkg/utils/__init__.py": "from .common import all_true as agree\n",
        "pkg/utils/common.py": COMMON,
        "pkg/user.py": USER,
    }
    migration = migrate(write_sources(tmp_path, files), PRESETS["megatron"], target="megatron", name="pg_collection")
    texts = {change.path: change.after.decode() for change in migration.changes}
    assert "def all_true(flag, *, pg_collection=None):" in texts["pkg/utils/common.py"]
    assert texts["pkg/user.py"] == textwrap.dedent(USER).replace(
        "return agree(flag), utils.agree(flag)",
        "return agree(flag, pg_collection=pg_collection), utils.agree(flag, pg_collection=pg_collection)")
    assert migration.passed == 2

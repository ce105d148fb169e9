"""Modules built from a spec's field pass the collection in scope where every class the tree puts in that field is
one the tool threads (issue 40): Megatron-Core's ``Attention.__init__`` builds ``submodules.linear_proj(...)``, a
class a layer spec chose (``RowParallelLinear``, through a backend's method or a ``ModuleSpec``), whose
``__init__`` reads ``gtp_remat``. Where the tree may put anything else in the field, the call is left and the
report says why.

The rewritten package is imported and run: the collection given at the top reaches the read with every fallback
warning an error; without one the read falls back as before, with the warning naming the class's ``__init__``.
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
from fixtures.migrated_packages import TensorParallelOnly, importable_rewrite, write_sources

from pgregistry._source.config import PRESETS
from pgregistry.migrate._engine import Migration, migrate
from pgregistry.migrate._report import render_report

pytest.importorskip("libcst")
pytest.importorskip("megatron.core")

#: Linear layers: one that reads (as ``RowParallelLinear``), a subclass inheriting its ``__init__``, one that
#: takes the keyword already with a meaning of its own, and one that reads nothing and takes no keyword.
LAYERS = '''\
from megatron.core import parallel_state


class Row:
    def __init__(self, size, *, tp_group=None):
        self.rank = parallel_state.get_tensor_model_parallel_rank()
        self.size = size


class FusedRow(Row):
    pass


class Owned:
    def __init__(self, size, *, tp_group=None, pg_collection=None):
        self.rank = pg_collection.tp.rank()


class Plain:
    def __init__(self, size, *, tp_group=None):
        self.size = size
'''

#: Submodules dataclasses, their modules (as ``Attention``: a collection in scope), and the specs filling them:
#: directly, through a backend's method, a local, ``not_none`` and a ``ModuleSpec``.
MODELS = '''\
from dataclasses import dataclass

from megatron.core import parallel_state
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.typed_torch import not_none

from pkg.layers import FusedRow, Owned, Plain, Row


class Backend:
    def row(self):
        return FusedRow


@dataclass
class ProjSubmodules:
    proj: type = Row


@dataclass
class OwnedSubmodules:
    proj: type


@dataclass
class MixedSubmodules:
    proj: type
    norm: type = None


@dataclass
class BaseSubmodules:
    proj: type


class WiderSubmodules(BaseSubmodules):
    """An instance may be given where BaseSubmodules is annotated: its field's values count too."""


class Attention:
    def __init__(self, submodules: ProjSubmodules, pg_collection=None):
        self.pg_collection = pg_collection
        self.proj = submodules.proj(4, tp_group=None)
        self.built = build_module(submodules.proj, 5)


class Owning:
    def __init__(self, submodules: OwnedSubmodules, pg_collection=None):
        self.pg_collection = pg_collection
        self.proj = submodules.proj(4)


class Mixing:
    def __init__(self, submodules: MixedSubmodules, pg_collection=None):
        self.pg_collection = pg_collection
        self.proj = submodules.proj(4)


class Based:
    def __init__(self, submodules: BaseSubmodules, pg_collection=None):
        self.pg_collection = pg_collection
        self.proj = submodules.proj(4)


def world():
    """A read: the file is planned with the ones that read (its classes without reads stood in for at first)."""
    return parallel_state.get_data_parallel_world_size()


def specs(flag):
    chosen = Backend().row() if flag else Row
    return [
        ProjSubmodules(),
        ProjSubmodules(proj=chosen),
        ProjSubmodules(proj=not_none(FusedRow) if flag else Row),
        ProjSubmodules(proj=ModuleSpec(module=Row, params={})),
        OwnedSubmodules(proj=Owned),
        OwnedSubmodules(proj=Row),
        MixedSubmodules(proj=Row),
        MixedSubmodules(proj=Plain),
        BaseSubmodules(proj=Row),
        WiderSubmodules(proj=Plain),
    ]
'''


@pytest.fixture
def migrated(tmp_path: Path) -> Iterator[tuple[Migration, dict[str, str]]]:
    """The migration and its rewritten texts, written and importable (``pkg``)."""
    files = {"pkg/__init__.py": "", "pkg/layers.py": LAYERS, "pkg/models.py": MODELS}
    migration = migrate(write_sources(tmp_path, files), PRESETS["megatron"], target="megatron", name="pg_collection")
    with importable_rewrite(tmp_path, migration) as texts:
        yield migration, texts


def test_a_field_holding_only_threaded_classes_is_passed_the_collection(
    migrated: tuple[Migration, dict[str, str]],
) -> None:
    models = migrated[1]["pkg/models.py"]
    # the dataclass default, a backend's method, a local, not_none, a ModuleSpec: Row, or FusedRow inheriting it
    assert "        self.proj = submodules.proj(4, tp_group=None, pg_collection=pg_collection)" in models
    assert "        self.built = build_module(submodules.proj, 5, pg_collection=pg_collection)" in models


def test_a_field_that_may_hold_another_class_is_left_and_reported(
    migrated: tuple[Migration, dict[str, str]],
) -> None:
    migration, texts = migrated
    models = texts["pkg/models.py"]
    # Owned takes the keyword already, with a meaning of its own; Plain does not take it (in a subclass of the
    # annotated submodules class, for Based)
    assert models.count("        self.proj = submodules.proj(4)\n") == 3
    left = {(call.line, call.reason) for call in migration.spec_calls_left}
    assert {line for line, _ in left} == {models.splitlines().index(f"class {name}:") + 4
                                           for name in ("Owning", "Mixing", "Based")}
    reasons = " | ".join(reason for _, reason in left)
    assert "pkg.layers.Owned takes pg_collection already" in reasons
    assert "pkg.layers.Plain has no parameter pg_collection" in reasons
    report = render_report(migration.reads, len(migration.threaded), migration.passed, 2, "changed",
                           migration.spec_calls_left)
    assert "pkg/models.py:" in report and "submodules.proj (spec field)" in report


def test_the_collection_given_reaches_the_class_a_spec_names(migrated: tuple[Migration, dict[str, str]]) -> None:
    models = importlib.import_module("pkg.models")
    for spec in models.specs(True)[:4] + models.specs(False)[:4]:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a fallback anywhere would raise
            attention = models.Attention(spec, pg_collection=TensorParallelOnly(3))
        assert (attention.proj.rank, attention.built.rank, attention.built.size) == (3, 3, 5)


def test_without_a_collection_the_read_falls_back_as_before(migrated: tuple[Migration, dict[str, str]]) -> None:
    models = importlib.import_module("pkg.models")
    from megatron.core import parallel_state

    def outcome(build: object) -> object:
        try:
            return build()  # type: ignore[operator]
        except Exception as error:  # what the original raises without torch.distributed, if it raises
            return type(error)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = outcome(lambda: models.Attention(models.specs(True)[1]).proj.rank)
    assert got == outcome(parallel_state.get_tensor_model_parallel_rank)
    assert any("pkg.layers.Row.__init__" in str(w.message) for w in caught), [str(w.message) for w in caught]

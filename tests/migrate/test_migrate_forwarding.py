"""A class whose ``__init__`` only forwards to a threaded base's through ``super().__init__(...)`` takes the
collection and passes it on, and a call of a local assigned classes passes the collection in scope where every
class the local may hold takes it (issue 40): Megatron-Core's ``GPTModel.__init__`` builds its output layer as
``output_layer_cls(...)``, the local holding ``TELMHeadColumnParallelLinear`` (whose ``__init__`` reads nothing
and calls ``super().__init__``: ``TEColumnParallelLinear``'s, which reads) or ``ColumnParallelLinear``.

The rewritten package is imported and run: the collection given at the top reaches the read with every fallback
warning an error; without one the read falls back as before, with the warning naming the base's ``__init__``.
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

pytest.importorskip("libcst")
pytest.importorskip("megatron.core")

#: A column layer that reads (as ``TEColumnParallelLinear``), a head forwarding to it (as
#: ``TELMHeadColumnParallelLinear``), a subclass inheriting the head's ``__init__``, and the classes the rule
#: must leave: one forwarding ``**kwargs``, one naming the collection, a decorated one, one calling its base's
#: ``__init__`` from a nested function, and one taking no keyword at all.
LAYERS = '''\
from megatron.core import parallel_state


def keep(cls):
    return cls


class Column:
    def __init__(self, size, *, config=None, tp_group=None):
        self.rank = parallel_state.get_tensor_model_parallel_rank()
        self.size = size


class Head(Column):
    def __init__(self, size, *, config=None, tp_group=None):
        if size < 0:
            raise ValueError(size)
        super().__init__(size, config=config, tp_group=tp_group)
        self.head = True


class WideHead(Head):
    pass


class Forwards(Column):
    def __init__(self, size, **rest):
        super().__init__(size, **rest)


class Named(Column):
    def __init__(self, size, pg_collection=None):
        super().__init__(size)


@keep
class Kept(Column):
    def __init__(self, size):
        super().__init__(size)


class Later(Column):
    def __init__(self, size):
        def build():
            super(Later, self).__init__(size)

        build()


class Plain:
    def __init__(self, size, *, tp_group=None):
        self.size = size
'''

#: A model holding its collection (as ``GPTModel``) that builds a layer through locals: one holding only
#: classes that take the keyword, one that may hold ``Plain``, one bound by a loop too, and the left classes.
MODELS = '''\
from pkg import layers
from pkg.layers import Forwards, Head, Kept, Later, Named, Plain, WideHead


class Model:
    def __init__(self, flag, pg_collection=None):
        self.pg_collection = pg_collection
        output_layer_cls = (
            Head
            if flag
            else layers.Column
        )
        self.output = output_layer_cls(3, tp_group=None)
        wide_cls = WideHead
        self.wide = wide_cls(5)

    def left(self, flag):
        mixed_cls = Head if flag else Plain
        self.mixed = mixed_cls(4)
        looped_cls = Head
        for looped_cls in (Head, Plain):
            pass
        self.looped = looped_cls(6)

    def others(self):
        return Forwards(1), Named(2), Kept(3), Later(4)
'''


@pytest.fixture
def migrated(tmp_path: Path) -> Iterator[tuple[Migration, dict[str, str]]]:
    """The migration and its rewritten texts, written and importable (``pkg``)."""
    files = {"pkg/__init__.py": "", "pkg/layers.py": LAYERS, "pkg/models.py": MODELS}
    migration = migrate(write_sources(tmp_path, files), PRESETS["megatron"], target="megatron", name="pg_collection")
    with importable_rewrite(tmp_path, migration) as texts:
        yield migration, texts


def test_an_init_forwarding_to_a_threaded_base_takes_the_collection_and_passes_it_on(
    migrated: tuple[Migration, dict[str, str]],
) -> None:
    layers = migrated[1]["pkg/layers.py"]
    signature = "    def __init__(self, size, *, config=None, tp_group=None, pg_collection=None):"
    assert f"class Head(Column):\n{signature}" in layers
    assert "        super().__init__(size, config=config, tp_group=tp_group, pg_collection=pg_collection)" in layers


def test_inits_the_forwarding_rule_leaves_alone(migrated: tuple[Migration, dict[str, str]]) -> None:
    layers = migrated[1]["pkg/layers.py"]
    # **kwargs passed on, the collection named, a decorated class, a nested function's super().__init__
    assert "    def __init__(self, size, **rest):\n        super().__init__(size, **rest)\n" in layers
    assert "    def __init__(self, size, pg_collection=None):\n        super().__init__(size)\n" in layers
    assert "class Kept(Column):\n    def __init__(self, size):\n        super().__init__(size)\n" in layers
    assert "            super(Later, self).__init__(size)\n" in layers
    assert "        return Forwards(1), Named(2), Kept(3), Later(4)\n" in migrated[1]["pkg/models.py"]


def test_a_local_holding_only_classes_taking_the_keyword_is_passed_the_collection(
    migrated: tuple[Migration, dict[str, str]],
) -> None:
    models = migrated[1]["pkg/models.py"]
    assert "        self.output = output_layer_cls(3, tp_group=None, pg_collection=pg_collection)" in models
    # a subclass inheriting a forwarding __init__ unchanged
    assert "        self.wide = wide_cls(5, pg_collection=pg_collection)" in models


def test_a_local_that_may_hold_another_class_is_left_and_reported(
    migrated: tuple[Migration, dict[str, str]],
) -> None:
    migration, texts = migrated
    models = texts["pkg/models.py"]
    assert "        self.mixed = mixed_cls(4)\n" in models
    assert "        self.looped = looped_cls(6)\n" in models  # bound by a loop too: not a local the rule reads
    left = [call for call in migration.spec_calls_left if call.local]
    assert [(call.field, call.line) for call in left] == [
        ("mixed_cls", models.splitlines().index("        self.mixed = mixed_cls(4)") + 1)
    ]
    assert "pkg.layers.Plain has no parameter pg_collection" in left[0].reason


def test_the_collection_given_reaches_the_base_read(migrated: tuple[Migration, dict[str, str]]) -> None:
    models = importlib.import_module("pkg.models")
    for flag in (True, False):
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a fallback anywhere on the way would raise
            model = models.Model(flag, pg_collection=TensorParallelOnly(3))
        assert (model.output.rank, model.output.size, getattr(model.output, "head", False)) == (3, 3, flag)
        assert (model.wide.rank, model.wide.head) == (3, True)


def test_without_a_collection_the_read_falls_back_as_before(migrated: tuple[Migration, dict[str, str]]) -> None:
    layers = importlib.import_module("pkg.layers")
    from megatron.core import parallel_state

    def outcome(build: object) -> object:
        try:
            return build()  # type: ignore[operator]
        except Exception as error:  # what the original raises without torch.distributed, if it raises
            return type(error)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = outcome(lambda: layers.Head(2).rank)
    assert got == outcome(parallel_state.get_tensor_model_parallel_rank)
    assert any("pkg.layers.Column.__init__" in str(w.message) for w in caught), [str(w.message) for w in caught]
    assert outcome(lambda: layers.Head(-1)) is ValueError

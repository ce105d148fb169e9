"""Instantiating a class whose ``__init__`` was threaded (or a subclass inheriting it unchanged) passes the
collection in scope (issue 40): Megatron-Core's ``LanguageModelEmbedding.__init__`` builds
``tensor_parallel.VocabParallelEmbedding(...)``, whose ``__init__`` reads the grid, and ``GPTModel.__init__``
(holding ``self.pg_collection``) builds ``LanguageModelEmbedding(...)``.

The rewritten package is imported and run: the collection given at the top is seen to reach the read with every
fallback warning an error; the calls the rule must leave alone are checked in the text.
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
from fixtures.migrated_packages import TensorParallelOnly, importable_rewrite, write_sources

from pgregistry._source.config import PRESETS
from pgregistry.migrate._engine import migrate

pytest.importorskip("libcst")
pytest.importorskip("megatron.core")

#: The class that reads (as ``VocabParallelEmbedding``), subclasses that do not thread their own ``__init__``,
#: a class whose ``__new__`` takes the same arguments, and a decorated one (the decorator may stand for anything).
LAYERS = '''\
from megatron.core import parallel_state


def keep(cls):
    return cls


class Embedding:
    def __init__(self, size):
        self.rank = parallel_state.get_tensor_model_parallel_rank()
        self.size = size


class Inherits(Embedding):
    pass


class Mixin:
    pass


class Mixed(Mixin, Embedding):
    pass


class Own(Embedding):
    def __init__(self, size):
        super().__init__(size)


class Cached:
    def __new__(cls, size):
        return super().__new__(cls)

    def __init__(self, size):
        self.rank = parallel_state.get_tensor_model_parallel_rank()


@keep
class Decorated:
    def __init__(self):
        self.rank = parallel_state.get_tensor_model_parallel_rank()


def local():
    return Embedding(1), parallel_state.get_data_parallel_rank()
'''

#: The package re-exports the class, as ``megatron.core.tensor_parallel`` does.
PACKAGE = "from pkg.layers import Embedding\n"

#: A threaded ``__init__`` building the class through the package (as ``LanguageModelEmbedding``), a model holding
#: a collection building that (as ``GPTModel``), and the calls that must stay as they are.
MODELS = '''\
import pkg
from megatron.core import parallel_state
from pkg import layers
from pkg.layers import Cached, Decorated, Inherits, Mixed, Own


class Outer:
    def __init__(self, size):
        self.tp = parallel_state.get_tensor_model_parallel_world_size()
        self.embedding = pkg.Embedding(size)


class Deeper(layers.Inherits):
    """Inherits the threaded __init__ through a subclass that does."""


class Model:
    def __init__(self, collection):
        self.pg_collection = collection
        self.outer = Outer(3)
        self.deeper = Deeper(6)

    def others(self, options):
        return (Inherits(1), Own(2), Mixed(2), Decorated(), Cached(3), layers.Embedding(4, **options),
                layers.Embedding(5, pg_collection=None))
'''


@pytest.fixture
def rewritten(tmp_path: Path) -> Iterator[dict[str, str]]:
    """The migrated package's texts, written and importable (``pkg``), removed from ``sys.modules`` after."""
    files = {"pkg/__init__.py": PACKAGE, "pkg/layers.py": LAYERS, "pkg/models.py": MODELS}
    migration = migrate(write_sources(tmp_path, files), PRESETS["megatron"], target="megatron", name="pg_collection")
    with importable_rewrite(tmp_path, migration) as texts:
        yield texts


def test_instantiations_of_a_threaded_class_pass_the_collection_in_scope(rewritten: dict[str, str]) -> None:
    models = rewritten["pkg/models.py"].splitlines()
    assert "        self.embedding = pkg.Embedding(size, pg_collection=pg_collection)" in models
    assert "        self.outer = Outer(3, pg_collection=self.pg_collection)" in models
    # a subclass inheriting the threaded __init__ unchanged, through another module and another subclass
    assert "        self.deeper = Deeper(6, pg_collection=self.pg_collection)" in models
    # in its own module, by its plain name, from a function threaded because it reads
    assert "    return Embedding(1, pg_collection=pg_collection), pg_rank(" in rewritten["pkg/layers.py"]


def test_calls_the_rule_leaves_alone(rewritten: dict[str, str]) -> None:
    models = rewritten["pkg/models.py"]
    # one whose first base is another class (its __init__ runs first), a decorated class, one with a __new__,
    # **kwargs, the keyword given (a subclass forwarding through super().__init__: test_migrate_forwarding.py)
    passed = "pg_collection=self.pg_collection"
    assert f"Inherits(1, {passed}), Own(2, {passed}), Mixed(2)," in models
    assert "Mixed(2), Decorated(), Cached(3), layers.Embedding(4, **options)," in models
    assert "layers.Embedding(5, pg_collection=None)" in models


def test_the_collection_given_at_the_top_reaches_the_class_read(rewritten: dict[str, str]) -> None:
    models = importlib.import_module("pkg.models")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a fallback anywhere on the way would raise
        model = models.Model(TensorParallelOnly(3))
    assert (model.outer.tp, model.outer.embedding.rank, model.outer.embedding.size) == (4, 3, 3)
    assert (model.deeper.rank, model.deeper.size) == (3, 6)


def test_without_a_collection_the_class_read_falls_back_as_before(rewritten: dict[str, str]) -> None:
    models = importlib.import_module("pkg.models")
    from megatron.core import parallel_state

    def outcome(build: object) -> object:
        try:
            return build()  # type: ignore[operator]
        except Exception as error:  # what the original raises without torch.distributed, if it raises
            return type(error)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = outcome(lambda: (lambda outer: (outer.tp, outer.embedding.rank))(models.Outer(2)))
        alone = outcome(lambda: importlib.import_module("pkg.layers").Embedding(2).rank)
    size, rank = parallel_state.get_tensor_model_parallel_world_size, parallel_state.get_tensor_model_parallel_rank
    assert got == outcome(lambda: (size(), rank()))
    assert alone == outcome(rank)
    warned = [str(w.message) for w in caught]
    assert any("pkg.models.Outer.__init__" in message for message in warned), warned
    assert any("pkg.layers.Embedding.__init__" in message for message in warned), warned

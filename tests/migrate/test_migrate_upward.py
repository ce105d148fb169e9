"""Threading upward (issue 40): a function that reads nothing but calls a threaded one gets the collection too, so
the callers above it can pass one; a method only where every method of its name in the tree gets it.

The trees are small packages; the rewritten one is imported and run, so a collection passed at the top is seen
to reach the read (the suite makes every fallback warning an error), and a polymorphic call to be accepted by
each override.
"""

from __future__ import annotations

import importlib
import textwrap
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
from fixtures.migrated_packages import importable_rewrite, write_sources

from pgregistry._source.config import PRESETS
from pgregistry.migrate import _engine as _migrate
from pgregistry.migrate._engine import migrate

pytest.importorskip("libcst")
pytest.importorskip("megatron.core")

#: The read, in a module-level function (as Megatron-Core's ``param_is_not_gtp_duplicate``).
LAYERS = '''\
from megatron.core import parallel_state


def not_duplicate(param):
    return parallel_state.get_tensor_model_parallel_rank() == 0 or param
'''

#: Megatron-Core's optimizer chain, read-less above the read; ``step`` has a scheduler's twin that reads nothing,
#: and ``Holder`` already holds a collection. The reads in the file keep it planned in the first phase, where the
#: methods above the read are placeholders of its skeleton.
OPTIMIZER = '''\
from megatron.core import parallel_state

from pkg import layers


def world():
    return parallel_state.get_data_parallel_world_size()


class Base:
    def __init__(self, params):
        self.params = params

    def _filter(self, params):
        return [p for p in params if layers.not_duplicate(p)]

    def grads(self):
        return self._filter(self.params)

    def norm(self):
        return len(self.grads())

    def step(self):
        return self.norm()


class Chained(Base):
    def __init__(self, children):
        self.chained = children

    def norm(self):
        return self.chained[0].norm()


class Scheduler:
    def step(self):
        return 1


class Holder:
    def __init__(self, pg_collection):
        self.pg_collection = pg_collection

    def filtered(self, params):
        return [p for p in params if layers.not_duplicate(p)]

    def norm(self):
        return len(self.filtered([0, 7])) + sum(1 for p in (0, 7) if layers.not_duplicate(p))
'''


def _migrated(root: Path, files: dict[str, str], jobs: int = 1) -> _migrate.Migration:
    return migrate(write_sources(root, files), PRESETS["megatron"], target="megatron", name="pg_collection", jobs=jobs)


def _files() -> dict[str, str]:
    return {"pkg/__init__.py": "", "pkg/layers.py": LAYERS, "pkg/optimizer.py": OPTIMIZER}


@pytest.fixture
def rewritten(tmp_path: Path) -> Iterator[dict[str, str]]:
    """The migrated package's texts, written and importable (``pkg``), removed from ``sys.modules`` after."""
    with importable_rewrite(tmp_path, _migrated(tmp_path, _files())) as texts:
        yield texts


def test_read_less_callers_are_threaded_up_to_the_top(rewritten: dict[str, str]) -> None:
    optimizer = rewritten["pkg/optimizer.py"]
    for line in ("    def _filter(self, params, *, pg_collection=None):",
                 "        return [p for p in params if layers.not_duplicate(p, pg_collection=pg_collection)]",
                 "    def grads(self, *, pg_collection=None):",
                 "        return self._filter(self.params, pg_collection=pg_collection)",
                 "    def norm(self, *, pg_collection=None):",
                 "        return len(self.grads(pg_collection=pg_collection))",
                 # an override on another object: every norm of the tree takes the keyword
                 "        return self.chained[0].norm(pg_collection=pg_collection)"):
        assert line in optimizer.splitlines(), line
    # step has a twin (the scheduler's) that calls nothing threaded: no step gets it, so no call passes one
    assert "    def step(self):\n        return self.norm()\n" in optimizer
    # a class holding a collection passes its own, and needs no parameter, but where another method of the name
    # needs it (norm), it takes it too, so that the polymorphic call is accepted
    assert "    def filtered(self, params):" in optimizer
    assert optimizer.count("layers.not_duplicate(p, pg_collection=self.pg_collection)") == 2
    assert optimizer.count("    def norm(self, *, pg_collection=None):") == 3


def test_a_collection_passed_at_the_top_reaches_the_read(rewritten: dict[str, str]) -> None:
    optimizer = importlib.import_module("pkg.optimizer")

    class Group:
        def __init__(self, rank: int) -> None:
            self._rank = rank

        def rank(self) -> int:
            return self._rank

        def size(self) -> int:
            return 2

    class Collection:
        def __init__(self, rank: int) -> None:
            self.tp = Group(rank)

    chained = optimizer.Chained([optimizer.Base([0, 0, 5])])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a fallback anywhere on the way would raise
        assert chained.norm(pg_collection=Collection(0)) == 3  # TP rank 0: every parameter counted
        assert chained.norm(pg_collection=Collection(1)) == 1  # rank 1: only the non-duplicate one
        assert optimizer.Holder(Collection(1)).filtered([0, 7]) == [7]
        # its own collection, not the None it was given
        assert optimizer.Holder(Collection(1)).norm() == 2 == optimizer.Holder(Collection(1)).norm(pg_collection=None)


def test_without_a_collection_the_read_falls_back_as_before(rewritten: dict[str, str]) -> None:
    optimizer = importlib.import_module("pkg.optimizer")
    chained = optimizer.Chained([optimizer.Base([0, 5])])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            got: object = chained.norm()
        except Exception as error:  # what the original raises without torch.distributed, if it raises
            got = type(error)
    from megatron.core import parallel_state

    try:
        want: object = 1 + int(parallel_state.get_tensor_model_parallel_rank() == 0)
    except Exception as error:
        want = type(error)
    assert got == want
    assert any("pkg.layers.not_duplicate" in str(w.message) for w in caught), [str(w.message) for w in caught]


def test_the_upward_closure_does_not_depend_on_skeletons_or_the_split(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    files = {**_files(), **{f"pkg/copy{i}.py": OPTIMIZER.replace("class ", f"class C{i}") for i in range(4)}}
    serial = _migrated(tmp_path / "serial", files)
    upward = [entry for entry in serial.threaded if entry.endswith(("grads", "_filter"))]
    assert len(upward) == 10, serial.threaded  # Base's two, and each copy's
    monkeypatch.setattr(_migrate, "PARALLEL_MIN_BYTES", 0)
    split = _migrated(tmp_path / "split", files, jobs=3)
    monkeypatch.setattr(_migrate, "build_skeleton", lambda *args: None)
    whole = _migrated(tmp_path / "whole", files)
    for other in (split, whole):
        assert [(c.path, c.after) for c in other.changes] == [(c.path, c.after) for c in serial.changes]
        assert other.threaded == serial.threaded and other.passed == serial.passed


def test_a_function_passed_as_a_value_is_not_threaded_upward(tmp_path: Path) -> None:
    caller = textwrap.dedent('''\
        from pkg import layers


        def keep(p):
            return layers.not_duplicate(p)


        def kept(params):
            return list(filter(keep, params))
    ''')
    migration = _migrated(tmp_path, {"pkg/__init__.py": "", "pkg/layers.py": LAYERS, "pkg/caller.py": caller})
    assert migration.threaded == ["pkg/layers.py: not_duplicate"]
    assert not any(change.path == "pkg/caller.py" for change in migration.changes)

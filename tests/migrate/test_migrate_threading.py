"""Where ``pgregistry migrate`` takes a read's collection from: one in scope, else a parameter threaded into a
function whose callers the tree holds, else nowhere (the read stays, with the reason).

Never threaded: an autograd Function's ``forward`` / ``backward`` (``.apply`` passes no keyword), a hook (torch
calls it), a framework callback (a method a base class outside the tree declares, never called by name in the
tree), a function only passed as a value. A nested function reads its enclosing function's collection. A
collection the code already holds (``self._pg_collection``, ``config._pg_collection`` where the tree assigns
it) is used. The assertions are on which functions were given the parameter and why reads stayed (the plan),
and on what the rewritten code does, run in a 2-rank gloo world against Megatron-Core's ``parallel_state`` with
a collection of a second grid: never on the replacement text."""

from __future__ import annotations

import textwrap
import types
import warnings
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("libcst")

from pgregistry._source.config import PRESETS  # noqa: E402
from pgregistry._source.files import SourceFile  # noqa: E402
from pgregistry.migrate._engine import Migration, migrate  # noqa: E402
from pgregistry.testing import run_world  # noqa: E402

SOURCE = textwrap.dedent('''\
    import functools

    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.process_groups_config import ProcessGroupCollection


    class Scale(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.size = ps.get_tensor_model_parallel_world_size()
            return x * (ctx.size + 1)

        @staticmethod
        def backward(ctx, grad):
            return grad * (ps.get_tensor_model_parallel_world_size() + 2)


    class Shift(Scale):
        @staticmethod
        def forward(ctx, x):
            return x + ps.get_tensor_model_parallel_rank()


    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.seen = None
            self.register_forward_hook(self._after)

        def _after(self, module, args, output):
            self.seen = ps.get_tensor_model_parallel_rank()

        def extra_repr(self):
            return f"tp={ps.get_tensor_model_parallel_world_size()}"

        def forward(self, x):
            return x


    def before(module, args):
        module.before = ps.get_tensor_model_parallel_world_size()


    def warm(module):
        before(module, ())
        module.register_forward_pre_hook(before)


    def run(block, x, loss):  # forward and backward called by name: only the autograd rule keeps Scale's
        loss.backward()
        return block.forward(x)


    def world_size():
        return ps.get_tensor_model_parallel_world_size()


    SIZE = functools.partial(world_size)


    def make_reader():
        def read():
            return ps.get_tensor_model_parallel_group()

        return read


    class Model:
        def __init__(self, pg_collection=None):
            self._pg_collection = pg_collection

        def tp(self):
            return ps.get_tensor_model_parallel_group()


    def setup(config, groups):
        config._pg_collection = groups


    def step(config):
        return ps.get_pipeline_model_parallel_group()


    def given(model_pg_collection=None):
        return ps.get_tensor_model_parallel_group()


    def built():
        groups = ProcessGroupCollection.use_mpu_process_groups()
        return groups, ps.get_pipeline_model_parallel_group()


    def listed(pg_collections):
        return pg_collections, ps.get_pipeline_model_parallel_group()
    ''')


@pytest.fixture(scope="module")
def migration(tmp_path_factory: pytest.TempPathFactory) -> Migration:
    root = tmp_path_factory.mktemp("tree")
    (root / "m.py").write_text(SOURCE)
    done = migrate([SourceFile("m.py", root / "m.py")], PRESETS["megatron"], target="megatron", name="pg_collection")
    assert not done.failures, done.failures
    return done


def _left(migration: Migration) -> dict[str, list[str]]:
    """Scope of each read left -> its reasons."""
    found: dict[str, list[str]] = {}
    for _, read in migration.reads:
        if read.way == "left":
            found.setdefault(read.site.scope, []).append(read.reason)
    return found


def test_only_plain_functions_whose_callers_the_tree_holds_are_given_the_parameter(migration: Migration) -> None:
    assert sorted(migration.threaded) == ["m.py: listed", "m.py: make_reader"]


def test_an_autograd_functions_forward_and_backward_keep_their_reads(migration: Migration) -> None:
    reason = "an autograd Function: torch calls it through .apply(...), which takes no keyword"
    left = _left(migration)
    assert left["Scale.forward"] == [f"forward of {reason}"]
    assert left["Scale.backward"] == [f"backward of {reason}"]
    assert left["Shift.forward"] == [f"forward of {reason}"]  # a class of the tree deriving from one


def test_hooks_callbacks_and_functions_passed_as_values_keep_their_reads(migration: Migration) -> None:
    left = _left(migration)
    assert left["Block._after"] == ["a hook (passed to a register_*hook): torch calls _after with its own arguments"]
    assert left["before"] == ["a hook (passed to a register_*hook): torch calls before with its own arguments"]
    assert left["Block.extra_repr"] == [
        "a callback: Block derives from torch.nn.Module, outside the tree, and the tree never calls extra_repr by "
        "name"
    ]
    assert left["world_size"] == [
        "passed as a value (world_size is referenced, never called, in the tree): no caller can pass it one"
    ]


def test_a_collection_the_code_holds_is_used(migration: Migration) -> None:
    ways = {read.site.scope: (read.way, read.collection) for _, read in migration.reads}
    assert ways["Model.tp"] == ("in-scope", "self._pg_collection")
    assert ways["step"] == ("in-scope", 'getattr(config, "_pg_collection", None)')  # setup assigns it
    assert ways["make_reader.read"] == ("threaded", "pg_collection")  # the enclosing function's, as a closure
    assert ways["given"] == ("in-scope", "model_pg_collection")  # a parameter named as one
    assert ways["built"] == ("in-scope", "groups")  # a local assigned one
    assert ways["listed"] == ("threaded", "pg_collection")  # a list of collections is not one


def _ranks(group: Any) -> list[int]:
    import torch.distributed as dist

    return dist.get_process_group_ranks(group)


def _load(text: str, name: str = "m") -> types.ModuleType:
    module = types.ModuleType(name)
    exec(compile(text, f"{name}.py", "exec"), module.__dict__)
    return module


def _uses(module: types.ModuleType) -> dict[str, Any]:
    """What the functions that keep their reads do, called as torch and the code call them."""
    import torch

    x = torch.ones(2, requires_grad=True)
    scaled = module.Scale.apply(x)
    scaled.sum().backward()
    block = module.Block()
    module.warm(block)
    block(torch.ones(1))
    return {
        "apply": (scaled.tolist(), module.Shift.apply(torch.ones(2)).tolist(), x.grad.tolist()),
        "hooks": (block.seen, block.before, repr(block)),
        "value": module.SIZE(),
    }


def _rank(original: str, rewritten: str, helper: str) -> dict[str, Any]:
    import sys

    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection

    from pgregistry.fallback import ProcessGroupFallbackWarning

    parallel_state.initialize_model_parallel(create_gloo_process_groups=False)  # TP 1, PP 1: DP 2
    try:
        both = dist.new_group([0, 1])  # a second grid: TP and PP over both ranks
        collection = ProcessGroupCollection(tp=both, pp=both)
        sys.modules["_process_group_fallback"] = _load(helper, "_process_group_fallback")  # as the run wrote it
        old, new = _load(original), _load(rewritten)
        out: dict[str, Any] = {"rank": dist.get_rank(), "second grid": _ranks(both)}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            warnings.simplefilter("error", ProcessGroupFallbackWarning)  # a read left never falls back
            out["old uses"], out["new uses"] = _uses(old), _uses(new)
            out["reader"] = _ranks(new.make_reader(pg_collection=collection)())
            out["model"] = _ranks(new.Model(pg_collection=collection).tp())
            out["step"] = _ranks(new.step(types.SimpleNamespace(_pg_collection=collection)))
            out["given"] = _ranks(new.given(model_pg_collection=collection))
            out["built"] = _ranks(new.built()[1]), _ranks(old.built()[1])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("ignore")
            warnings.simplefilter("always", ProcessGroupFallbackWarning)
            out["old reader"], out["new reader"] = _ranks(old.make_reader()()), _ranks(new.make_reader()())
            out["old step"] = _ranks(old.step(types.SimpleNamespace()))
            out["new step"] = _ranks(new.step(types.SimpleNamespace()))  # a config without a collection
            out["old given"], out["new given"] = _ranks(old.given()), _ranks(new.given())
            out["warned"] = sorted(
                {str(w.message).split(" ", 1)[0] for w in caught if issubclass(w.category, ProcessGroupFallbackWarning)}
            )
        return out
    finally:
        parallel_state.destroy_model_parallel()


def test_the_rewritten_code_runs_as_torch_and_its_callers_call_it(migration: Migration) -> None:
    pytest.importorskip("megatron.core.parallel_state")
    texts = {change.path: change.after.decode() for change in migration.changes}
    for out in run_world(2, _rank, SOURCE, texts["m.py"], texts["_process_group_fallback.py"], timeout=60):
        assert out["new uses"] == out["old uses"]
        assert out["old uses"]["apply"][0] == [2.0, 2.0]  # TP 1: the values a swap of groups would change
        assert out["second grid"] == [0, 1]
        # The collection passed (of the second grid) is what is read, in the closure and where the code holds one.
        assert out["reader"] == out["model"] == out["step"] == out["given"] == [0, 1]
        assert out["built"][0] == out["built"][1] == [out["rank"]]
        # None passed: exactly the global group, with the warning naming the function that read.
        assert out["new reader"] == out["old reader"] == [out["rank"]]
        assert out["new step"] == out["old step"] == out["new given"] == out["old given"] == [out["rank"]]
        assert out["warned"] == ["m.given", "m.make_reader.read", "m.step"]


def test_a_subclass_of_an_autograd_function_of_another_file_keeps_its_reads(tmp_path: Path) -> None:
    # Its base's bases are in another file: a static forward(ctx, ...) is an autograd Function's by its shape.
    (tmp_path / "base.py").write_text("import torch\n\n\nclass Base(torch.autograd.Function):\n    pass\n")
    (tmp_path / "sub.py").write_text(textwrap.dedent('''\
        from megatron.core import parallel_state as ps

        from base import Base


        class Sub(Base):
            @staticmethod
            def forward(ctx, x):
                return x + ps.get_tensor_model_parallel_rank()


        def run(function, x):
            return function.forward(None, x)
        '''))
    files = [SourceFile(name, tmp_path / name) for name in ("base.py", "sub.py")]
    done = migrate(files, PRESETS["megatron"], target="megatron", name="pg_collection")
    assert done.threaded == []
    assert _left(done) == {
        "Sub.forward": ["forward of an autograd Function: torch calls it through .apply(...), which takes no keyword"]
    }


def test_an_attribute_another_file_assigns_is_in_scope_only_where_a_class_declares_it(tmp_path: Path) -> None:
    files = {
        "provider.py": "class Provider:\n    _pg_collection: 'ProcessGroupCollection | None' = None\n",
        "setup.py": textwrap.dedent('''\
            def setup(config, ctx, groups):
                """
                Args:
                    pg_collection: a docstring's line, no field
                """
                config._pg_collection = groups
                ctx.pg_collection = groups


            class Wrapper:
                def attach(self, groups):
                    self.config._pg_collection = groups
            '''),
        "use.py": textwrap.dedent('''\
            from megatron.core import parallel_state as ps


            def step(config):
                return ps.get_pipeline_model_parallel_group()


            def apply_like(ctx):
                return ps.get_tensor_model_parallel_group()


            class Model(Wrapper):
                def tp(self):
                    return ps.get_tensor_model_parallel_group()


            class Unrelated:
                def tp(self):
                    return ps.get_tensor_model_parallel_group()
            '''),
    }
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    done = migrate([SourceFile(name, tmp_path / name) for name in files], PRESETS["megatron"], target="megatron",
                   name="pg_collection")
    ways = {read.site.scope: (read.way, read.collection) for _, read in done.reads}
    assert ways == {
        "step": ("in-scope", 'getattr(config, "_pg_collection", None)'),  # Provider declares the field
        "apply_like": ("threaded", "pg_collection"),  # setup's ctx says nothing of this ctx
        "Model.tp": ("in-scope", 'getattr(getattr(self, "config", None), "_pg_collection", None)'),  # a Wrapper
        "Unrelated.tp": ("threaded", "pg_collection"),  # nothing ties its self.config to Wrapper's
    }
    # Each step may be missing on another object: the expression gives None (then the fallback), never raises.
    assert eval(ways["Model.tp"][1], {"self": object()}) is None
    config = types.SimpleNamespace(_pg_collection="held")
    assert eval(ways["Model.tp"][1], {"self": types.SimpleNamespace(config=config)}) == "held"


def test_an_autograd_ctx_holds_only_what_its_own_file_stores_on_it(tmp_path: Path) -> None:
    # Megatron-Core: dsa.py stores ctx.pg_collection and inference/config.py declares a pg_collection field;
    # cross_entropy.py's forward gets a fresh ctx from torch, which holds neither.
    files = {
        "config.py": "class Config:\n    pg_collection: 'ProcessGroupCollection | None' = None\n",
        "dsa.py": textwrap.dedent('''\
            import torch
            from megatron.core import parallel_state as ps


            class Indexer(torch.autograd.Function):
                @staticmethod
                def forward(ctx, x, pg_collection):
                    ctx.pg_collection = pg_collection
                    return x

                @staticmethod
                def backward(ctx, grad):
                    return grad, ps.get_tensor_model_parallel_group()
            '''),
        "cross_entropy.py": textwrap.dedent('''\
            import torch
            from megatron.core import parallel_state as ps


            class CrossEntropy(torch.autograd.Function):
                @staticmethod
                def forward(ctx, x, tp_group=None):
                    if tp_group is None:
                        tp_group = ps.get_tensor_model_parallel_group()
                    return x
            '''),
    }
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    done = migrate([SourceFile(name, tmp_path / name) for name in files], PRESETS["megatron"], target="megatron",
                   name="pg_collection")
    ways = {read.site.scope: (read.way, read.collection) for _, read in done.reads}
    assert ways == {
        "Indexer.backward": ("in-scope", 'getattr(ctx, "pg_collection", None)'),  # its forward stored it
        "CrossEntropy.forward": ("left", ""),
    }


def test_a_parameter_named_like_a_collection_but_annotated_as_another_class_is_not_one(tmp_path: Path) -> None:
    # Megatron-Core's get_forward_backward_func(schedule_pg_collection: MultiModuleProcessGroupCollection).
    (tmp_path / "m.py").write_text(textwrap.dedent('''\
        from megatron.core import parallel_state as ps


        def schedule(schedule_pg_collection: "MultiModuleProcessGroupCollection | None" = None):
            return ps.get_pipeline_model_parallel_world_size()


        def given(model_pg_collection: "ProcessGroupCollection | None" = None):
            return ps.get_pipeline_model_parallel_world_size()
        '''))
    done = migrate([SourceFile("m.py", tmp_path / "m.py")], PRESETS["megatron"], target="megatron",
                   name="pg_collection")
    ways = {read.site.scope: (read.way, read.collection) for _, read in done.reads}
    assert ways == {"schedule": ("threaded", "pg_collection"), "given": ("in-scope", "model_pg_collection")}


def test_a_chain_of_self_is_in_scope_only_in_the_classes_the_tree_ties_it_to(tmp_path: Path) -> None:
    # Megatron-Bridge 0.6.2: two diffusion data modules assign self.dataset.pg_collection; methods of unrelated
    # classes (whose self.dataset, if any, is something else) were given that chain, read with getattr.
    files = {
        "data.py": textwrap.dedent('''\
            class DataModule:
                pg_collection: 'ProcessGroupCollection | None' = None


            class Provider:
                def build(self, context):
                    self.dataset.pg_collection = context.pg_collection
            '''),
        "use.py": textwrap.dedent('''\
            from megatron.core import parallel_state as ps


            class Trainer:
                def tp(self):
                    return ps.get_tensor_model_parallel_group()


            class SubProvider(Provider):
                def tp(self):
                    return ps.get_tensor_model_parallel_group()


            class Holder:
                def __init__(self):
                    self.dataset = DataModule()

                def tp(self):
                    return ps.get_tensor_model_parallel_group()
            '''),
    }
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    done = migrate([SourceFile(name, tmp_path / name) for name in files], PRESETS["megatron"], target="megatron",
                   name="pg_collection")
    ways = {read.site.scope: (read.way, read.collection) for _, read in done.reads}
    chain = 'getattr(getattr(self, "dataset", None), "pg_collection", None)'
    assert ways == {
        "Trainer.tp": ("threaded", "pg_collection"),  # nothing ties Trainer's self.dataset to a collection
        "SubProvider.tp": ("in-scope", chain),  # Provider, its base, assigns the chain
        "Holder.tp": ("in-scope", chain),  # its self.dataset is a DataModule, which declares pg_collection
    }

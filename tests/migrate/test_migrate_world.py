"""A function ``pgregistry migrate`` rewrote, run in a real gloo world on Megatron-Core's own ``parallel_state``: it
reads exactly the groups, ranks and sizes the original read, through the fallback helper the run wrote (with the
warning) when no collection is passed or the one passed lacks the field, and without one when Megatron-Core's
collection is passed.

The oracle is the original source, run in the same world: nothing the tool computes is compared with itself."""

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
from pgregistry.migrate._engine import migrate  # noqa: E402
from pgregistry.testing import run_world  # noqa: E402

SOURCE = textwrap.dedent("""\
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.utils import get_tensor_model_parallel_group_if_none


    def groups():
        return (
            ps.get_tensor_model_parallel_group(),
            ps.get_pipeline_model_parallel_group(),
            ps.get_data_parallel_group(with_context_parallel=True),
            ps.get_data_parallel_group(with_gtp_remat=False),
            ps.get_model_parallel_group(),
        )


    def numbers():
        return (
            ps.get_tensor_model_parallel_rank(),
            ps.get_tensor_model_parallel_world_size(),
            ps.get_data_parallel_rank(with_context_parallel=True),
            ps.is_pipeline_first_stage(),
            ps.is_pipeline_last_stage(),
            ps.get_pipeline_model_parallel_next_rank(),
            ps.get_pipeline_model_parallel_prev_rank(),
            ps.get_tensor_model_parallel_src_rank(),
            ps.get_model_parallel_src_rank(),
        )


    def fallback(tp_group=None):
        return get_tensor_model_parallel_group_if_none(tp_group)


    def build():
        pg_collection = ProcessGroupCollection()
        pg_collection.tp = ps.get_tensor_model_parallel_group()
        pg_collection.pp = ps.get_pipeline_model_parallel_group()
        pg_collection.dp_cp = ps.get_data_parallel_group(with_context_parallel=True, partial_data_parallel=False)
        pg_collection.tp_dp_cp = ps.get_tensor_and_data_parallel_group(with_context_parallel=True)
        return pg_collection


    def amax(config):
        return ps.get_amax_reduction_group(with_context_parallel=True, tp_only_amax_red=config.tp_only)
    """)


def _load(text: str, name: str = "m") -> types.ModuleType:
    module = types.ModuleType(name)
    exec(compile(text, f"{name}.py", "exec"), module.__dict__)
    return module


def _plain(value: Any) -> Any:
    import torch.distributed as dist

    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if isinstance(value, dist.ProcessGroup):
        return ("group", tuple(dist.get_process_group_ranks(value)))
    return value


def _rank(original: str, rewritten: str, helper: str) -> dict[str, Any]:
    import sys

    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection

    from pgregistry.fallback import ProcessGroupFallbackWarning

    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=2, pipeline_model_parallel_size=2, create_gloo_process_groups=False
    )
    try:
        sys.modules["_process_group_fallback"] = _load(helper, "_process_group_fallback")  # as the run wrote it
        old, new = _load(original), _load(rewritten)
        out: dict[str, Any] = {}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("ignore")  # Megatron-Core's own deprecation notices
            warnings.simplefilter("always", ProcessGroupFallbackWarning)
            for name in ("groups", "numbers", "fallback"):
                out[f"old {name}"] = _plain(getattr(old, name)())
                out[f"new {name}"] = _plain(getattr(new, name)())
            out["warned"] = sorted(
                {str(w.message).split(" ", 1)[0] for w in caught if issubclass(w.category, ProcessGroupFallbackWarning)}
            )
        collection = ProcessGroupCollection.use_mpu_process_groups()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            warnings.simplefilter("error", ProcessGroupFallbackWarning)  # passing one never falls back
            out["passed groups"] = _plain(new.groups(pg_collection=collection))
            out["passed numbers"] = _plain(new.numbers(pg_collection=collection))
            out["given group"] = _plain(new.fallback(parallel_state.get_pipeline_model_parallel_group()))
        partial = ProcessGroupCollection.use_mpu_process_groups(["pp"])  # fields it lacks: the global ones
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("ignore")
            warnings.simplefilter("always", ProcessGroupFallbackWarning)
            out["partial numbers"] = _plain(new.numbers(pg_collection=partial))
            out["partial warned"] = sorted({str(w.message).split("process group ")[1].split(" ")[0] for w in caught
                                            if issubclass(w.category, ProcessGroupFallbackWarning)})
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            warnings.simplefilter("error", ProcessGroupFallbackWarning)
            try:
                new.groups()
                out["error mode"] = "no error"
            except ProcessGroupFallbackWarning as error:
                out["error mode"] = str(error).split(" ", 1)[0]
        out["expected given"] = _plain(parallel_state.get_pipeline_model_parallel_group())
        out["world"] = dist.get_world_size()
        # The amax group needs data parallelism to tell its two choices apart: TP 2 x DP 2.
        parallel_state.destroy_model_parallel()
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=2, create_gloo_process_groups=False)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for tp_only in (True, False):
                config = types.SimpleNamespace(tp_only=tp_only)
                out[f"old amax {tp_only}"] = _plain(old.amax(config))
                out[f"new amax {tp_only}"] = _plain(new.amax(config))
            for name, module in (("old", old), ("new", new)):
                built = module.build()
                out[f"{name} build"] = _plain((built.tp, built.pp, built.dp_cp, built.tp_dp_cp))
        return out
    finally:
        parallel_state.destroy_model_parallel()


def test_a_rewritten_function_reads_the_groups_it_read_before_with_the_warning(tmp_path: Path) -> None:
    pytest.importorskip("megatron.core.parallel_state")
    path = tmp_path / "m.py"
    path.write_text(SOURCE)
    migration = migrate([SourceFile("m.py", path)], PRESETS["megatron"], target="megatron", name="pg_collection")
    assert [read.reason for _, read in migration.reads if read.way == "left"] == []
    texts = {change.path: change.after.decode() for change in migration.changes}
    rewritten = texts["m.py"]
    assert " ps." not in rewritten and "get_tensor_model_parallel_group_if_none" not in rewritten
    assert "pgregistry" not in rewritten
    results = run_world(4, _rank, SOURCE, rewritten, texts["_process_group_fallback.py"], timeout=60)
    for rank, out in enumerate(results):
        assert out["world"] == 4
        for name in ("groups", "numbers", "fallback"):
            assert out[f"new {name}"] == out[f"old {name}"], (rank, name)
        assert out["passed groups"] == out["old groups"]
        assert out["passed numbers"] == out["old numbers"]
        assert out["partial numbers"] == out["old numbers"]
        assert out["partial warned"] == ["'dp_cp_gtp_remat'", "'mp'", "'tp'"]  # not pp: it has it
        assert out["given group"] == out["expected given"]
        assert out["warned"] == ["m.fallback", "m.groups", "m.numbers"]
        assert out["error mode"] == "m.groups"
        for tp_only in (True, False):
            assert out[f"new amax {tp_only}"] == out[f"old amax {tp_only}"], (rank, tp_only)
        assert out["old amax True"] != out["old amax False"]  # the two choices differ, so a swap is seen
        assert out["new build"] == out["old build"], rank

"""The fallback helper ``pgregistry migrate`` writes into a migrated tree (pgregistry/migrate/_fallback_helper.py),
run against Megatron-Core 0.19.2's real ``parallel_state``: the collection's field when it holds it, else exactly
what the accessor returns or raises, with the warning naming the function that read.

Oracles: the accessors themselves, named here by hand (never through the helper's table), and the ranks of groups
this test builds itself."""

from __future__ import annotations

import re
import sys
import types
import warnings
from collections.abc import Callable
from typing import Any

import pytest

from pgregistry._source.fields import FieldChoice, collection_field, fallback_table
from pgregistry.migrate import _fallback_helper as helper
from pgregistry.migrate._helper_file import helper_text, table_text
from pgregistry.testing import run_world

ps = pytest.importorskip("megatron.core.parallel_state")
from megatron.core.utils import get_tensor_model_parallel_group_if_none  # noqa: E402

#: (field, kind) -> the accessor call a rewritten read of it replaced: the oracle.
READS: dict[tuple[str, str], Callable[[], Any]] = {
    ("tp", "group"): lambda: ps.get_tensor_model_parallel_group(),
    ("tp", "rank"): lambda: ps.get_tensor_model_parallel_rank(),
    ("tp", "size"): lambda: ps.get_tensor_model_parallel_world_size(),
    ("tp", "src_rank"): lambda: ps.get_tensor_model_parallel_src_rank(),
    ("pp", "group"): lambda: ps.get_pipeline_model_parallel_group(),
    ("pp", "rank"): lambda: ps.get_pipeline_model_parallel_rank(),
    ("pp", "next_rank"): lambda: ps.get_pipeline_model_parallel_next_rank(),
    ("pp", "prev_rank"): lambda: ps.get_pipeline_model_parallel_prev_rank(),
    ("pp", "first_rank"): lambda: ps.get_pipeline_model_parallel_first_rank(),
    ("pp", "last_rank"): lambda: ps.get_pipeline_model_parallel_last_rank(),
    ("pp", "first_stage"): lambda: ps.is_pipeline_first_stage(),
    ("pp", "last_stage"): lambda: ps.is_pipeline_last_stage(),
    ("cp", "size"): lambda: ps.get_context_parallel_world_size(),
    ("cp", "rank"): lambda: ps.get_context_parallel_rank(),
    ("cp", "global_ranks"): lambda: ps.get_context_parallel_global_ranks(),
    ("ep", "size"): lambda: ps.get_expert_model_parallel_world_size(),
    ("mp", "src_rank"): lambda: ps.get_model_parallel_src_rank(),
    ("dp", "rank"): lambda: ps.get_data_parallel_rank(with_gtp_remat=False),
    ("dp_cp_gtp_remat", "group"): lambda: ps.get_data_parallel_group(with_context_parallel=True),
    ("dp_gtp_remat", "group"): lambda: ps.get_data_parallel_group(),
    ("dp_gtp_remat", "rank"): lambda: ps.get_data_parallel_rank(),
    ("dp_gtp_remat", "size"): lambda: ps.get_data_parallel_world_size(),
    # a read of Megatron-Core's fallback helper falls back to it (None without torch.distributed)
    ("tp", "group_if_none"): lambda: get_tensor_model_parallel_group_if_none(None),
    ("expt_tp", "group_if_none"): lambda: get_tensor_model_parallel_group_if_none(None, is_expert=True),
}

#: Groups Megatron-Core makes only on some ranks or settings: on a grid of two pipeline stages and one optimizer
#: instance, without hierarchical CP, the accessors raise on the ranks (or settings) without one.
MADE_SOMEWHERE: dict[tuple[str, str], Callable[[], Any]] = {
    ("embd", "group"): lambda: ps.get_embedding_group(),
    ("pos_embd", "group"): lambda: ps.get_position_embedding_group(),
    ("inter_dist_opt", "group"): lambda: ps.get_inter_distributed_optimizer_instance_group(),
    ("hcp", "group"): lambda: ps.get_hierarchical_context_parallel_groups(),
}


def _plain(value: Any) -> Any:
    import torch.distributed as dist

    if isinstance(value, dist.ProcessGroup):
        return ("group", tuple(dist.get_process_group_ranks(value)))
    return value


def _outcome(read: Callable[[], Any]) -> Any:
    """What ``read()`` returns, or the type and message of what it raises."""
    try:
        return _plain(read())
    except Exception as error:  # noqa: BLE001 - the exception is the outcome compared
        return ("raised", type(error).__name__, str(error))


def _reader_of(field: str, kind: str, collection: Any) -> Any:
    """A read in a function of its own (the warning names it)."""
    return helper.pg_read(collection, field, kind)


def _warned(caught: list[warnings.WarningMessage]) -> list[str]:
    """``'field' owner`` of each fallback warning."""
    from pgregistry.fallback import ProcessGroupFallbackWarning

    found = (re.match(r"(\S+) was not given process group ('\w+')", str(w.message)) for w in caught
             if issubclass(w.category, ProcessGroupFallbackWarning))
    return sorted({f"{match.group(2)} {match.group(1)}" for match in found if match is not None})


def _rank() -> dict[str, Any]:
    import torch.distributed as dist
    from megatron.core.process_groups_config import ProcessGroupCollection

    from pgregistry.fallback import ProcessGroupFallbackWarning

    out: dict[str, Any] = {"rank": dist.get_rank()}
    ps.initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
                                 create_gloo_process_groups=False)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Megatron-Core's own deprecation notices
            out["oracle"] = {key: _outcome(read) for key, read in READS.items()}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("ignore")
            warnings.simplefilter("always", ProcessGroupFallbackWarning)
            out["none"] = {key: _outcome(lambda key=key: _reader_of(*key, None)) for key in READS}
            out["none warned"] = _warned(caught)
        full = ProcessGroupCollection.use_mpu_process_groups()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            warnings.simplefilter("error", ProcessGroupFallbackWarning)  # a full collection never falls back
            out["full"] = {key: _outcome(lambda key=key: _reader_of(*key, full)) for key in READS}
        partial = ProcessGroupCollection.use_mpu_process_groups(["pp"])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("ignore")
            warnings.simplefilter("always", ProcessGroupFallbackWarning)
            out["partial tp"] = [_outcome(lambda k=k: _reader_of("tp", k, partial)) for k in ("group", "rank")]
            out["partial pp"] = _outcome(lambda: _reader_of("pp", "rank", partial))
            out["partial warned"] = _warned(caught)
        # A second grid: TP across the pipeline ({0, 2}, {1, 3}) and PP within it ({0, 1}, {2, 3}), the
        # transpose of the global one; built by this test, so its ranks are known without the helper.
        second_tp = [dist.new_group([0, 2]), dist.new_group([1, 3])][dist.get_rank() % 2]
        second_pp = [dist.new_group([0, 1]), dist.new_group([2, 3])][dist.get_rank() // 2]
        remat = [dist.new_group([0, 1]), dist.new_group([2, 3])][dist.get_rank() // 2]
        second = ProcessGroupCollection(tp=second_tp, pp=second_pp, cp=None, dp=second_pp, gtp_remat=remat)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("ignore")
            warnings.simplefilter("always", ProcessGroupFallbackWarning)
            out["second"] = {key: _outcome(lambda key=key: _reader_of(*key, second)) for key in (
                ("tp", "group"), ("tp", "rank"), ("pp", "next_rank"), ("pp", "last_rank"), ("pp", "last_stage"),
                ("cp", "group"), ("cp", "rank"), ("cp", "size"), ("cp", "global_ranks"), ("dp_gtp_remat", "rank"))}
            out["second warned"] = _warned(caught)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("ignore")
            warnings.simplefilter("always", ProcessGroupFallbackWarning)
            out["made somewhere"] = {key: _outcome(lambda key=key: _reader_of(*key, full)) for key in MADE_SOMEWHERE}
            out["made somewhere warned"] = _warned(caught)
        out["made somewhere oracle"] = {key: _outcome(read) for key, read in MADE_SOMEWHERE.items()}
        one_rank_remat = ProcessGroupCollection(dp=second_pp, gtp_remat=None)
        with warnings.catch_warnings():
            warnings.simplefilter("error", ProcessGroupFallbackWarning)
            out["remat off"] = _outcome(lambda: _reader_of("dp_gtp_remat", "group", one_rank_remat))
        return out
    finally:
        ps.destroy_model_parallel()


def test_the_helper_reads_the_collections_field_else_exactly_what_the_accessor_returns() -> None:
    for out in run_world(4, _rank, timeout=60):
        rank = out["rank"]
        oracle = out["oracle"]
        assert out["none"] == oracle, rank
        assert out["full"] == oracle, rank
        # every field read once, named with the function that read
        fields = sorted({field for field, _ in READS})
        assert out["none warned"] == sorted(f"'{f}' {__name__}._reader_of" for f in fields)
        assert out["partial tp"] == [oracle[("tp", "group")], oracle[("tp", "rank")]]
        assert out["partial pp"] == oracle[("pp", "rank")]
        assert out["partial warned"] == [f"'tp' {__name__}._reader_of"]
        second_tp = [(0, 2), (1, 3)][rank % 2]
        second_pp = [(0, 1), (2, 3)][rank // 2]
        second = out["second"]
        assert second[("tp", "group")] == ("group", second_tp) != oracle[("tp", "group")]
        assert second[("tp", "rank")] == rank // 2
        assert second[("pp", "next_rank")] == second_pp[(rank % 2 + 1) % 2]
        assert second[("pp", "last_rank")] == second_pp[1]
        assert second[("pp", "last_stage")] == (rank % 2 == 1)
        # a field set to None is an axis that is off: this rank alone
        assert [second[("cp", k)] for k in ("group", "rank", "size", "global_ranks")] == [None, 0, 1, [rank]]
        # GTP remat over two ranks: dp is not the group spanning it, so the global one is read, with the warning
        assert second[("dp_gtp_remat", "rank")] == oracle[("dp_gtp_remat", "rank")]
        assert out["second warned"] == [f"'dp_gtp_remat' {__name__}._reader_of"]
        # GTP remat off: the collection's dp is that group
        assert out["remat off"] == ("group", second_pp)
        # Megatron-Core's collection holds None for a group it did not make here (use_mpu_process_groups reads
        # them with check_initialized=False): not an axis that is off, but the accessor's AssertionError, with the
        # warning; the made ones answer from the collection
        made = out["made somewhere oracle"]
        assert out["made somewhere"] == made, rank
        raised = sorted(f"'{field}'" for (field, _), outcome in made.items() if outcome[0] == "raised")
        assert raised == (["'hcp'", "'inter_dist_opt'"] if rank < 2 else ["'hcp'", "'inter_dist_opt'", "'pos_embd'"])
        assert out["made somewhere warned"] == [f"{field} {__name__}._reader_of" for field in raised], rank


def test_without_torch_distributed_the_accessors_own_values_and_exceptions_are_kept() -> None:
    import torch.distributed as dist

    assert not dist.is_initialized()  # the test process never joins a world (run_world forks)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        oracle = {key: _outcome(read) for key, read in READS.items()}
        helped = {key: _outcome(lambda key=key: _reader_of(*key, None)) for key in READS}
    assert helped == oracle
    assert oracle[("cp", "size")] == 0 and oracle[("ep", "size")] == 0 and oracle[("dp_gtp_remat", "rank")] == 0
    assert oracle[("tp", "group")][:2] == ("raised", "AssertionError")
    assert oracle[("tp", "group_if_none")] is None


def test_without_torch_distributed_a_dissolved_shims_reads_are_the_shims_fields() -> None:
    """Each field a ``use_mpu_process_groups`` shim may be dissolved into (:mod:`pgregistry.migrate._shims`), read
    through the helper with the keywords the rule gives it, is what Megatron-Core's own shim holds for it where
    parallel_state is not initialised (the oracle: the shim itself). The field's plain accessor asserts there."""
    import libcst as cst
    from megatron.core.process_groups_config import ProcessGroupCollection

    from pgregistry.migrate._megatron_release import find_installed_shim_getters
    from pgregistry.migrate._shims import Dissolved, dissolve_shim

    getters = find_installed_shim_getters()
    assert getters is not None
    dissolved: dict[str, dict[str, object]] = {}
    for name in getters:
        statement = cst.parse_statement(f"g = ProcessGroupCollection.use_mpu_process_groups(required_pgs=['{name}'])"
                                        f".{name}\n")
        call = statement.body[0].value.value  # type: ignore[attr-defined]
        found = dissolve_shim(call, [statement], 0, [], getters, gtp_remat=True)
        if isinstance(found, Dissolved):
            dissolved[name] = found.reads[0][2]
    assert {"gtp_remat", "expt_gtp_remat", "tp", "dp", "dp_cp"} <= set(dissolved)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        oracle = {name: _outcome(lambda name=name: getattr(
            ProcessGroupCollection.use_mpu_process_groups(required_pgs=[name]), name)) for name in dissolved}
        helped = {name: _outcome(lambda name=name: helper.pg_group(None, name, **dissolved[name]))
                  for name in dissolved}
        plain = _outcome(lambda: helper.pg_group(None, "gtp_remat"))
    assert helped == oracle
    assert oracle["gtp_remat"] is None and plain[:2] == ("raised", "AssertionError")


def _load_without_pgregistry(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """The helper as the tool writes it, loaded where ``pgregistry`` cannot be imported."""
    monkeypatch.setitem(sys.modules, "pgregistry.fallback", None)  # ``from pgregistry.fallback import`` fails
    module = types.ModuleType("tree._process_group_fallback")
    exec(compile(helper_text(), "_process_group_fallback.py", "exec"), module.__dict__)
    return module


def test_without_pgregistry_the_warning_is_the_modules_own_once_per_function_and_field(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from pgregistry.fallback import ProcessGroupFallbackWarning

    local = _load_without_pgregistry(monkeypatch)

    assert local.parallel_state is ps  # the copy in a tree imports it when it is imported
    assert local.ProcessGroupFallbackWarning is not ProcessGroupFallbackWarning
    assert not issubclass(local.ProcessGroupFallbackWarning, ProcessGroupFallbackWarning)

    def reads() -> tuple[int, int, int]:
        first = local.pg_size(None, "cp")
        second = local.pg_size(None, "cp")
        return first, second, local.pg_rank(None, "cp")

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        assert reads() == (0, 0, 0)  # torch.distributed is not initialised: Megatron-Core's 0
        assert reads() == (0, 0, 0)
    messages = [str(w.message) for w in caught if w.category is local.ProcessGroupFallbackWarning]
    owner = f"{__name__}.{reads.__qualname__.replace('.<locals>', '')}"
    assert messages == [f"{owner} was not given process group 'cp' and falls back to Megatron-Core's global "
                        "parallel_state; pass a ProcessGroupCollection that sets it"]
    for _ in range(2):  # under an error filter: every time
        with warnings.catch_warnings():
            warnings.simplefilter("error", local.ProcessGroupFallbackWarning)
            with pytest.raises(local.ProcessGroupFallbackWarning, match=re.escape(owner)):
                reads()


def test_with_pgregistry_the_warning_is_pgregistrys() -> None:
    from pgregistry.fallback import ProcessGroupFallbackWarning

    with warnings.catch_warnings():
        warnings.simplefilter("error", ProcessGroupFallbackWarning)
        with pytest.raises(ProcessGroupFallbackWarning, match=f"^{__name__}._reader_of was not given process group"):
            _reader_of("cp", "size", None)


def test_the_helpers_table_is_the_field_tables_inverse_over_the_releases_accessors() -> None:
    """Each entry reads what the field table calls its field and kind, through an accessor Megatron-Core 0.19.2
    defines; the table written into the template is the one the tool writes for that release."""
    accessors = [name for name in dir(ps) if name.startswith(("get_", "is_pipeline_"))]
    table = fallback_table(accessors, gtp_remat=True)
    assert helper.FALLBACKS == table
    for accessor, _ in table.values():
        assert callable(getattr(ps, accessor)), accessor
    # the composite accessor is never a fallback: tp_dp_cp is read through its own
    assert table[("tp_dp_cp", "group")] == ("get_tensor_and_data_parallel_group", {"with_context_parallel": True})
    assert collection_field("get_data_parallel_rank", {}) == FieldChoice("dp_gtp_remat", "rank")
    assert table_text(table) in helper_text(accessors).decode()
    assert max(map(len, helper_text(accessors).decode().splitlines())) <= 100  # Megatron-Core's line length
    # before GTP remat: the plain data-parallel group is dp_cp, read without with_gtp_remat
    before = fallback_table(accessors, gtp_remat=False)
    assert before[("dp_cp", "group")] == ("get_data_parallel_group", {"with_context_parallel": True})
    assert ("dp_gtp_remat", "rank") not in before

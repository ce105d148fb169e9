"""The ``megatron`` preset: every read Megatron-LM and its users make, and none of another project's.

Each source is a small reproduction of what the real trees hold (Megatron-LM ``megatron/``, Megatron-Bridge,
NeMo RL), scanned at the path it has there, so relative imports resolve as they do in the real package."""

from __future__ import annotations

import pytest
from fixtures.scan_projects import Project, keys, scan

from pgregistry._source.config import PRESETS, ScanConfig
from pgregistry.allowlist import main as allowlist_main

MEGATRON = PRESETS["megatron"]

VLLM = """
from vllm.distributed.parallel_state import get_pp_group

def sample(self):
    return get_pp_group().is_last_rank
"""


def test_another_projects_parallel_state_is_not_reported() -> None:
    """NeMo RL imports vLLM's ``parallel_state``; the default rule (any module named parallel_state) reports it."""
    assert keys(VLLM, "nemo_rl/models/generation/vllm/worker.py", ScanConfig()) == ["sample|get_pp_group|call"]
    assert keys(VLLM, "nemo_rl/models/generation/vllm/worker.py", MEGATRON) == []


READS_THE_DEFAULT_RULE_MISSES = """
from megatron.core import mpu, parallel_state
from megatron.core.parallel_state import get_context_parallel_global_ranks

def step(model):
    if mpu.is_pipeline_first_stage(ignore_virtual=True):
        pass
    if parallel_state.is_pipeline_last_stage():
        pass
    ranks = get_context_parallel_global_ranks()
    return parallel_state.is_rank_in_embedding_group(), parallel_state.get_all_ranks(), ranks

def groups():
    return parallel_state._DATA_PARALLEL_GROUP_WITH_CP, parallel_state._EXPERT_DATA_PARALLEL_GROUP_WITH_GTP_REMAT
"""


def test_the_preset_reports_what_the_default_rule_misses() -> None:
    path = "megatron/training/utils/common_utils.py"
    assert keys(READS_THE_DEFAULT_RULE_MISSES, path, ScanConfig()) == []
    assert keys(READS_THE_DEFAULT_RULE_MISSES, path, MEGATRON) == sorted(
        [
            "groups|_DATA_PARALLEL_GROUP_WITH_CP|reference",
            "groups|_EXPERT_DATA_PARALLEL_GROUP_WITH_GTP_REMAT|reference",
            "step|get_all_ranks|call",
            "step|get_context_parallel_global_ranks|call",
            "step|is_pipeline_first_stage|call",
            "step|is_pipeline_last_stage|call",
            "step|is_rank_in_embedding_group|call",
        ]
    )


HELPER_USE = """
from ..utils import get_tensor_model_parallel_group_if_none

def all_reduce(input_, group=None):
    group = get_tensor_model_parallel_group_if_none(group)
    return group
"""
HELPER_DEFINITION = """
from megatron.core import parallel_state

def get_tensor_model_parallel_group_if_none(tp_group, is_expert=False):
    if tp_group is None:
        tp_group = parallel_state.get_tensor_model_parallel_group()
    return tp_group

def local_user(tp_group):
    return get_tensor_model_parallel_group_if_none(tp_group)
"""


def test_fallback_helpers_are_counted_where_they_are_called() -> None:
    """``get_tensor_model_parallel_group_if_none(x)`` reads the global group when x is None: a site at every
    call, through a relative import and inside the helper's own module."""
    (site,) = scan(HELPER_USE, "megatron/core/tensor_parallel/mappings.py", MEGATRON).sites
    assert (site.key, site.family) == ("all_reduce|get_tensor_model_parallel_group_if_none|call", "fallback-helper")
    found = {s.key: s for s in scan(HELPER_DEFINITION, "megatron/core/utils.py", MEGATRON).sites}
    assert set(found) == {
        "get_tensor_model_parallel_group_if_none|get_tensor_model_parallel_group|call",
        "local_user|get_tensor_model_parallel_group_if_none|call",
    }
    assert found["get_tensor_model_parallel_group_if_none|get_tensor_model_parallel_group|call"].guarded


GUARDS = """
from megatron.core import parallel_state as ps

def f(tp_group=None, dp_group=None, cp_group=None):
    if tp_group is None:
        tp_group = ps.get_tensor_model_parallel_group()
    if dp_group is not None:
        pass
    else:
        dp_group = ps.get_data_parallel_group()
    cp_group = cp_group or ps.get_context_parallel_group()
    pp = ps.get_pipeline_model_parallel_group() if cp_group is None else cp_group
    if not torch.distributed.is_initialized():
        return ps.get_model_parallel_group()
    if not self.ep_group:
        self.ep_group = ps.get_expert_tensor_parallel_group()
    return ps.get_expert_model_parallel_group()
"""


def test_each_site_is_tagged_fallback_or_unconditional() -> None:
    guarded = {s.accessor: s.guarded for s in scan(GUARDS, "megatron/core/x.py", MEGATRON).sites}
    assert guarded == {
        "get_tensor_model_parallel_group": True,
        "get_data_parallel_group": True,
        "get_context_parallel_group": True,
        "get_pipeline_model_parallel_group": True,
        "get_model_parallel_group": False,
        "get_expert_tensor_parallel_group": True,
        "get_expert_model_parallel_group": False,
    }


IMPLEMENTATION = """
_TENSOR_MODEL_PARALLEL_GROUP = None

def get_tensor_model_parallel_group():
    return _TENSOR_MODEL_PARALLEL_GROUP
"""


@pytest.mark.parametrize("path", ["megatron/core/parallel_state.py", "megatron/core/process_groups_config.py"])
def test_the_implementation_and_the_shim_are_exempt(path: str) -> None:
    source = IMPLEMENTATION + "\nfrom megatron.core import parallel_state\nparallel_state.get_data_parallel_group()\n"
    assert keys(source, path, MEGATRON) == []
    assert keys(source, "megatron/core/other.py", MEGATRON) != []


def test_preset_from_pyproject_and_command_line(project: Project, capsys: pytest.CaptureFixture[str]) -> None:
    project.write("src/pkg/worker.py", VLLM)
    assert allowlist_main(["stats", "--no-cache"]) == 0
    assert "1 read of" in capsys.readouterr().out
    assert allowlist_main(["stats", "--no-cache", "--preset", "megatron"]) == 0
    assert "0 reads of" in capsys.readouterr().out
    project.write("pyproject.toml", '[tool.pgregistry.allowlist]\nroots = ["src"]\npreset = "megatron"\n')
    assert allowlist_main(["stats", "--no-cache"]) == 0
    assert "0 reads of" in capsys.readouterr().out
    project.write("pyproject.toml", '[tool.pgregistry.allowlist]\npreset = "megatorn"\n')
    assert allowlist_main(["stats", "--no-cache"]) == 2
    assert "unknown preset 'megatorn' (known: megatron)" in capsys.readouterr().err

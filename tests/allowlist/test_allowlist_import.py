"""Importing Megatron-LM's line-keyed allowlist (tools/process_group_usage_allowlist.json of PR 6258)."""

from __future__ import annotations

import json

import pytest
from fixtures.scan_projects import Project

from pgregistry.allowlist import main as allowlist_main

MAPPINGS = """
from megatron.core import parallel_state
from ..utils import get_tensor_model_parallel_group_if_none

def reduce(x, group=None):
    group = get_tensor_model_parallel_group_if_none(group)
    world = parallel_state.get_tensor_model_parallel_world_size()
    return parallel_state.get_data_parallel_group(), world
"""

# What Megatron-LM's checker writes for MAPPINGS at megatron/core/tensor_parallel/mappings.py.
MEGATRON_LIST = {
    "_comment": "Grandfathered reads of global process-group state in megatron/core.",
    "allowed": {
        "megatron/core/tensor_parallel/mappings.py": [
            "7:accessor:parallel_state.get_tensor_model_parallel_world_size",
            "8:accessor:parallel_state.get_data_parallel_group",
        ]
    },
    "total": 2,
}


@pytest.fixture
def megatron(project: Project) -> Project:
    project.write(
        "pyproject.toml",
        '[tool.pgregistry.allowlist]\nroots = ["megatron"]\npreset = "megatron"\nallowlist = "allowlist.json"\n',
    )
    project.write("megatron/core/tensor_parallel/mappings.py", MAPPINGS)
    return project


def test_import_maps_lines_to_keys_and_counts_what_its_rule_misses(
    megatron: Project, capsys: pytest.CaptureFixture[str]
) -> None:
    megatron.write("tools/process_group_usage_allowlist.json", json.dumps(MEGATRON_LIST))
    code = allowlist_main(["import", "--no-cache", "--from", "tools/process_group_usage_allowlist.json"])
    err = capsys.readouterr().err
    assert code == 0, err
    assert (
        "imported 2 entries" in err
        and "1 reads its rule does not list: get_tensor_model_parallel_group_if_none 1" in err
    )
    allowed = json.loads(megatron.read("allowlist.json"))["allowed"]
    assert allowed == {
        "megatron/core/tensor_parallel/mappings.py": {
            "reduce|get_data_parallel_group|call": 1,
            "reduce|get_tensor_model_parallel_group_if_none|call": 1,
            "reduce|get_tensor_model_parallel_world_size|call": 1,
        }
    }
    # The keys survive what breaks the line-keyed list: lines inserted above the reads.
    megatron.write("megatron/core/tensor_parallel/mappings.py", "import os\n\n" + MAPPINGS)
    assert allowlist_main(["check", "--no-cache"]) == 0


def test_an_out_of_date_list_is_refused_and_nothing_written(
    megatron: Project, capsys: pytest.CaptureFixture[str]
) -> None:
    stale = dict(MEGATRON_LIST, allowed={"megatron/core/tensor_parallel/mappings.py": ["9:accessor:mpu.get_x_group"]})
    megatron.write("list.json", json.dumps(stale))
    assert allowlist_main(["import", "--no-cache", "--from", "list.json"]) == 2
    assert "mappings.py:9 get_x_group" in capsys.readouterr().err
    assert not (megatron.root / "allowlist.json").exists()
    megatron.write("list.json", '{"version": 1, "allowed": {}, "total": 0}')
    assert allowlist_main(["import", "--no-cache", "--from", "list.json"]) == 2
    assert "not Megatron-LM's allowlist format" in capsys.readouterr().err
    megatron.write("list.json", '{"allowed": {')  # cut short: the file, line and column named
    assert allowlist_main(["import", "--no-cache", "--from", "list.json"]) == 2
    assert "list.json:1:14: malformed JSON: Expecting property name" in capsys.readouterr().err

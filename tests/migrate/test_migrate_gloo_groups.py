"""``pgregistry migrate`` leaves reads of gloo groups (``get_data_parallel_group_gloo``), with a reason that says
why: no collection holds one. Megatron-LM's #3349 and #3962 removed such reads from ``get_megatron_optimizer`` by
moving them into a helper that still reads them from ``parallel_state`` (0.19.2's
``ProcessGroupCollection.setup_process_groups_for_optimizer``), and refuses them given a collection; the claim is
checked here against the installed Megatron-Core itself, so a release that adds a gloo field fails this test."""

from __future__ import annotations

import dataclasses
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("libcst")

from fixtures.migrated_packages import write_sources  # noqa: E402

from pgregistry._source.config import PRESETS  # noqa: E402
from pgregistry._source.fields import GLOO_REASON  # noqa: E402
from pgregistry.collection import FIELD_NAMES  # noqa: E402
from pgregistry.migrate._engine import migrate  # noqa: E402

SOURCE = """\
from megatron.core import parallel_state as mpu


def optimizer_groups(use_gloo_process_groups):
    if use_gloo_process_groups:
        return mpu.get_data_parallel_group_gloo(with_context_parallel=True, partial_data_parallel=True), (
            mpu.get_expert_data_parallel_group_gloo(partial_expert_data_parallel=True)
        )
    return mpu.get_tensor_model_parallel_group(), None
"""


def test_a_gloo_groups_read_stays_with_the_reason(tmp_path: Path) -> None:
    sources = write_sources(tmp_path, {"m.py": textwrap.dedent(SOURCE)})
    migration = migrate(sources, PRESETS["megatron"], target="megatron", name="pg_collection")
    assert not migration.failures, migration.failures
    left = {read.site.accessor: read.reason for _, read in migration.reads if read.way == "left"}
    assert left == {
        "get_data_parallel_group_gloo": GLOO_REASON,
        "get_expert_data_parallel_group_gloo": GLOO_REASON,
    }
    text = {change.path: change.after.decode() for change in migration.changes}["m.py"]
    assert 'pg_group(pg_collection, "tp")' in text  # the read beside them is rewritten


def test_no_collection_holds_a_gloo_group_and_megatron_refuses_them_with_one() -> None:
    config = pytest.importorskip("megatron.core.process_groups_config")
    collection_type = config.ProcessGroupCollection
    assert not [f.name for f in dataclasses.fields(collection_type) if "gloo" in f.name]
    assert not [name for name in FIELD_NAMES if "gloo" in name]  # nor pgregistry's
    given = collection_type(dp=None, dp_cp=None, expt_dp=None, mp=None, tp_ep_pp=None)
    with pytest.raises(ValueError, match="Gloo process groups are not supported when pg_collection is provided"):
        collection_type.setup_process_groups_for_optimizer(given, [object()], use_gloo_process_groups=True)

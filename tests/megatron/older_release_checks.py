"""Run by test_megatron_older_release.py in a subprocess whose path puts an older Megatron-Core first (one without the
GTP fields); prints a JSON report. Not a test module itself: the older release cannot share a process with the one
the other tests import."""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch.distributed as dist  # noqa: E402
from megatron_support import describe_groups, error_of, megatron_fields, megatron_initialize  # noqa: E402

from pgregistry import registry  # noqa: E402
from pgregistry.interop.megatron import from_megatron, megatron_config_kwargs, to_megatron  # noqa: E402
from pgregistry.layout import ParallelLayout  # noqa: E402
from pgregistry.testing import run_world  # noqa: E402

SIZES = {"tp": 2, "ep": 2, "expt_tp": 1}
GTP_FIELDS = ("gtp_remat", "expt_gtp_remat", "tp_ep_pp_with_egtp_remat", "dp_cp_gtp_remat", "expt_dp_gtp_remat")


def _on_rank() -> dict[str, Any]:
    names = megatron_fields()
    layout = ParallelLayout(num_ranks=dist.get_world_size(), **SIZES)
    with megatron_initialize(SIZES) as mc:
        theirs = describe_groups(mc, names)
        adopted = from_megatron(mc)
        out: dict[str, Any] = {"unset_gtp_fields": [f for f in GTP_FIELDS if not adopted.is_set(f)]}
    registry.destroy()
    pg = registry.build(layout)
    ours = describe_groups(to_megatron(pg), names)  # off axes as the build's one-rank group, as Megatron-Core has
    out["parity_wrong"] = [n for n, r in ours.items() if r != theirs[n]]
    out["to_megatron_fields"] = sorted(vars(to_megatron(pg)))
    gtp = registry.build(ParallelLayout(num_ranks=dist.get_world_size(), tp=2, gtp_remat=2))
    out["gtp_refused"] = error_of(lambda: to_megatron(gtp))
    out["gtp_config_refused"] = error_of(lambda: megatron_config_kwargs(ParallelLayout(num_ranks=4, gtp_remat=2)))
    registry.destroy()
    return out


if __name__ == "__main__":
    warnings.simplefilter("ignore")
    import megatron.core

    report = {"version": megatron.core.__version__, "fields": list(megatron_fields()), "ranks": run_world(4, _on_rank)}
    print(json.dumps(report))

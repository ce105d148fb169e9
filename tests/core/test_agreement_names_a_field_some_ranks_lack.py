"""``pgregistry._runtime.agreement.check_agreement`` names a field that some ranks did not give at all, on every rank
alike.

Reported (issue 41): ``MultiModuleOptimizer.step(max_norm=None)`` on one rank left ``max_norm`` out of that rank's
fields; its message had an empty detail ("ranks disagree on ...: ; this rank is rank 0") and the others said
``<missing>``. The helper now reads every rank's fields, so every caller names such a field and who gave what.
"""

from __future__ import annotations

import torch.distributed as dist

from pgregistry._runtime.agreement import check_agreement
from pgregistry.testing import run_world


def _message() -> str:
    rank = dist.get_rank()
    fields = {"norm_type": "2.0"} if rank == 0 else {"norm_type": "2.0", "max_norm": "1.0"}
    try:
        check_agreement("a call", fields)
    except ValueError as exc:
        return str(exc).replace(f"this rank is rank {rank}", "this rank is rank R")
    return "no error"


def test_a_field_given_on_some_ranks_only_is_named_with_each_ranks_value_on_every_rank() -> None:
    expected = (
        "ranks disagree on a call: 'max_norm' differs (ranks [0] asked for nothing (not given); "
        "ranks [1, 2] asked for 1.0); this rank is rank R. Every rank must make "
        "the same call with the same arguments."
    )
    assert run_world(3, _message, timeout=30) == [expected] * 3

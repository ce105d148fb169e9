"""The docstring examples that need the installed torchtitan run and print what they show.

Each runs on every rank of a 2-rank gloo world, as its docstring says (``mark_torchtitan_experts``'
needs none: it runs there with the others), with torchtitan's device type put back after each
object's examples (``from_parallel_dims``' sets it to ``"cpu"``, as a reader on a machine without
GPUs does).
"""

from __future__ import annotations

from fixtures.docstring_examples import run_examples_of
from titan_support import require_torchtitan

from pgregistry.testing import run_world

require_torchtitan()

EXAMPLES = [
    "pgregistry.interop.torchtitan.communicator_ranks",
    "pgregistry.interop.torchtitan.from_parallel_dims",
    "pgregistry.interop.torchtitan.mark_torchtitan_experts",
    "pgregistry.interop.torchtitan.to_parallel_dims",
]


def _examples_with_torchtitans_device_kept(names: list[str]) -> tuple[dict[str, int], int, str]:
    import torchtitan.distributed.parallel_dims as titan

    device_type = titan.device_type

    def put_back() -> None:
        titan.device_type = device_type

    return run_examples_of(names, clean_up=put_back)


def test_the_torchtitan_examples_print_what_they_show_on_every_rank() -> None:
    outcomes = run_world(2, _examples_with_torchtitans_device_kept, EXAMPLES, timeout=60)
    for rank, (counts, failures, report) in enumerate(outcomes):
        assert all(counts.values()), f"rank {rank}: no docstring example: {counts}"
        assert failures == 0, f"rank {rank}:\n{report}"

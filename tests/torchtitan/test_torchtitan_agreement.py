"""torchtitan bridge options that must match across ranks, and a bridge given something else than it takes.

In a real 2-rank gloo world (TP 2): ``to_parallel_dims`` with an ``spmd_backend`` or ``device_type`` that differs
across ranks is refused on every rank, naming the option and which ranks asked for what, before any group or mesh
is made (it used to be accepted: the ranks then built different meshes); so is a span's collection on one rank only
(that rank used to raise alone). ``from_parallel_dims`` of something that is
not a ``ParallelDims`` is a ``TypeError`` naming the type and what to pass, on every rank that was given it (the
others name it in their ``ValueError``), and outside a world too.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch.distributed as dist
from titan_support import require_torchtitan, use_cpu

require_torchtitan()

from torchtitan.distributed.parallel_dims import ParallelDims  # noqa: E402

from pgregistry import registry  # noqa: E402
from pgregistry.interop.torchtitan import from_parallel_dims, to_parallel_dims  # noqa: E402
from pgregistry.layout import ParallelLayout  # noqa: E402
from pgregistry.testing import run_world  # noqa: E402

WORLD = 2


def _error_of(call: Any) -> str:
    try:
        call()
    except (ValueError, TypeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def _on_rank() -> dict[str, str]:
    use_cpu()
    rank = dist.get_rank()
    pg = registry.build(ParallelLayout(num_ranks=WORLD, tp=WORLD))
    spmd = ("spmd_types", "full_dtensor")[rank]
    out = {
        "spmd_backend": _error_of(lambda: to_parallel_dims(pg, spmd_backend=spmd, device_type="cpu")),
        "device_type": _error_of(lambda: to_parallel_dims(pg, device_type=("cpu", "meta")[rank])),
        "not parallel dims": _error_of(lambda: from_parallel_dims("x")),
        "one rank's not parallel dims": _error_of(
            lambda: from_parallel_dims("x" if rank == 0 else ParallelDims(
                dp_replicate=1, dp_shard=1, cp=1, tp=WORLD, pp=1, ep=1, world_size=WORLD,
            ))
        ),
    }
    half = registry.build(ParallelLayout(num_ranks=1), name="half")  # rank 0's span
    out["one rank's span"] = _error_of(lambda: to_parallel_dims(half if rank == 0 else pg, device_type="cpu"))
    out["gpu"] = _error_of(lambda: to_parallel_dims(pg, device_type="gpu"))  # a mesh of "gpu" was made before
    out["still agrees"] = _error_of(lambda: to_parallel_dims(pg, device_type="cpu"))
    registry.destroy()
    return out


@pytest.fixture(scope="module")
def results() -> list[dict[str, str]]:
    return run_world(WORLD, _on_rank, timeout=60)


@pytest.mark.parametrize(("option", "values"), [("spmd_backend", ("spmd_types", "full_dtensor")),
                                                ("device_type", ("cpu", "meta"))])
def test_options_that_differ_across_ranks_are_refused_on_every_rank(
    results: list[dict[str, str]], option: str, values: tuple[str, str]
) -> None:
    for rank, out in enumerate(results):
        message = out[option]
        assert message.startswith("ValueError: ranks disagree on to_parallel_dims:"), (rank, message)
        assert f"{option!r} differs (ranks [0] asked for {values[0]!r}; ranks [1] asked for {values[1]!r})" in (
            message
        ), (rank, message)
        assert out["still agrees"] == "no error", rank


def test_from_parallel_dims_of_something_else_is_a_type_error() -> None:
    with pytest.raises(TypeError, match=r"expects torchtitan's ParallelDims .* got builtins\.str; .*pgregistry\.build"):
        from_parallel_dims("x")  # no world: nothing collective has begun


def test_from_parallel_dims_of_something_else_raises_on_every_rank(results: list[dict[str, str]]) -> None:
    for out in results:
        assert out["not parallel dims"].startswith(
            "TypeError: from_parallel_dims expects torchtitan's ParallelDims"
        ), out["not parallel dims"]
        assert "got builtins.str" in out["not parallel dims"]
    # Rank 0 passes a string, rank 1 a ParallelDims without meshes: rank 0 raises its TypeError, rank 1 a ValueError
    # naming both ranks' faults and then the degrees the ranks disagree on.
    mixed = [out["one rank's not parallel dims"] for out in results]
    assert mixed[0].startswith("TypeError: from_parallel_dims expects torchtitan's ParallelDims"), mixed[0]
    assert mixed[1].startswith("ValueError: from_parallel_dims: ranks [0, 1] found"), mixed[1]
    assert "rank 0: from_parallel_dims expects torchtitan's ParallelDims" in mixed[1], mixed[1]
    assert "got builtins.str" in mixed[1] and "rank 1: the ParallelDims has no meshes yet" in mixed[1], mixed[1]
    assert (
        "the ranks also disagree: 'degrees' differs (ranks [0] asked for not a ParallelDims (builtins.str); "
        "ranks [1] asked for _Sizes("
    ) in mixed[1], mixed[1]


def test_a_span_on_one_rank_is_refused_on_every_rank(results: list[dict[str, str]]) -> None:
    for rank, out in enumerate(results):
        message = out["one rank's span"]
        assert message == results[0]["one rank's span"], (rank, message)
        assert message.startswith("ValueError: to_parallel_dims: ranks [0] found"), (rank, message)
        assert "the ranks also disagree: 'layout' differs" in message, (rank, message)


def test_a_device_type_that_is_no_torch_device_type_is_refused_on_every_rank(results: list[dict[str, str]]) -> None:
    for rank, out in enumerate(results):
        assert out["gpu"].startswith("ValueError: to_parallel_dims: ranks [0, 1] found"), (rank, out["gpu"])
        assert "device_type 'gpu' is no torch device type: give one such as 'cuda' or 'cpu'" in out["gpu"], rank


def test_mark_torchtitan_experts_given_a_parameter_says_to_mark_it_with_mark_expert() -> None:
    import torch

    from pgregistry.interop.torchtitan import mark_torchtitan_experts

    with pytest.raises(TypeError, match=r"takes the model \(an nn.Module\), but was given a Parameter; .*mark_expert"):
        mark_torchtitan_experts(torch.nn.Parameter(torch.zeros(2)))  # type: ignore[arg-type]

"""torchtitan 0.3.0's own ``clip_grad_norm_(..., ep_enabled=True)`` (``_clip_grad_norm_with_ep``) against the float64
norm of the full grads, next to ``pgregistry.grad_norm``, on a 4-rank gloo world with DTensor parameters laid out
as torchtitan lays them out (dense: FSDP over ``fsdp``; routed experts: ``efsdp`` x ``ep``).

torchtitan decides whether a parameter is an expert by whether its mesh has a dim named "ep", and then trusts
the DTensor placements. Where both are right (the layout torchtitan's parallelize builds, with or without PP) its
norm is the oracle's. Where they are not declared right:

* a per-expert factor whose grad says ``Replicate`` over "ep" (the xorl report's shape: each EP rank holds
  different experts): torchtitan counts each EP rank's own copy as the whole, so every EP rank gets a different,
  low norm, and clips with it (the dense parameter's shards by different scales). pgregistry refuses the
  parameter, naming it;
* experts on a mesh whose EP dim has another name, or on a mesh without EP (FSDP over ``efsdp`` only): torchtitan
  puts them with the dense parameters and raises from DTensor (two meshes in one norm); pgregistry matches the
  mesh dims to the collection's groups by ranks, not names, and gives the oracle's norm.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from fixtures.errors import value_error_of
from titan_support import require_torchtitan, use_cpu

require_torchtitan()

from torch import nn  # noqa: E402
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor  # noqa: E402
from torchtitan.distributed.utils import clip_grad_norm_ as titan_clip_grad_norm_  # noqa: E402

from pgregistry import registry  # noqa: E402
from pgregistry.grad_stats import grad_norm  # noqa: E402
from pgregistry.layout import ParallelLayout  # noqa: E402
from pgregistry.mesh import to_device_mesh  # noqa: E402
from pgregistry.params import mark_expert  # noqa: E402
from pgregistry.testing import run_world  # noqa: E402

WORLD, EXPERTS = 4, 4
MIXED_MESHES = "RuntimeError: All operands in aten.stack.default must have the same mesh"


def _full(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


def _param(full: torch.Tensor, grad: torch.Tensor, mesh: Any, placements: list[Any]) -> nn.Parameter:
    param = nn.Parameter(distribute_tensor(full, mesh, placements))
    param.grad = distribute_tensor(grad, mesh, placements)
    return param


def _titan(params: dict[str, nn.Parameter], **options: Any) -> float | str:
    """torchtitan's norm (clipping to infinity scales every grad by 1), or the error it raises."""
    try:
        return float(titan_clip_grad_norm_(list(params.values()), math.inf, ep_enabled=True, **options))
    except (RuntimeError, AssertionError) as exc:
        return f"{type(exc).__name__}: {str(exc).splitlines()[0]}"


def _no_pp() -> dict[str, Any]:
    layout = ParallelLayout(num_ranks=WORLD, ep=2, expt_tp=1)  # dp 4, expert dp 2
    pg = registry.build(layout)
    ep_rank = pg.get("ep").rank()
    dense_mesh = to_device_mesh(pg, ("dp_cp",), dim_names=("fsdp",))
    dense = _param(_full(0, 8, 4), _full(1, 8, 4), dense_mesh, [Shard(0)])
    grads = _full(3, EXPERTS, 6)
    oracle = float(torch.cat([_full(1, 8, 4).reshape(-1), grads.reshape(-1)]).norm())
    out: dict[str, Any] = {"oracle": oracle, "ep_rank": ep_rank}
    for case, ep_name in (("declared", "ep"), ("renamed", "expert")):
        mesh = to_device_mesh(pg, ("expt_dp", "ep"), dim_names=("efsdp", ep_name))
        expert = mark_expert(_param(_full(2, EXPERTS, 6), grads, mesh, [Shard(0), Shard(0)]))
        params = {"dense": dense, "experts": expert}
        out[case] = {"titan": _titan(params), "pgregistry": float(grad_norm(params, pg))}
    # FSDP over expert data parallelism only: this EP rank's experts, the mesh spans no EP rank.
    mine = slice(ep_rank * EXPERTS // 2, (ep_rank + 1) * EXPERTS // 2)
    efsdp = to_device_mesh(pg, ("expt_dp",), dim_names=("efsdp",))
    expert = mark_expert(_param(_full(2, EXPERTS, 6)[mine], grads[mine], efsdp, [Shard(0)]))
    params = {"dense": dense, "experts": expert}
    out["no ep dim"] = {"titan": _titan(params), "pgregistry": float(grad_norm(params, pg))}
    # The xorl shape: each EP rank's own factors, declared Replicate over "ep" (a plan that left them out).
    mesh = to_device_mesh(pg, ("expt_dp", "ep"), dim_names=("efsdp", "ep"))
    factor = nn.Parameter(DTensor.from_local(_full(2, EXPERTS, 6)[mine], mesh, [Replicate(), Replicate()]))
    factor.grad = DTensor.from_local(grads[mine], mesh, [Replicate(), Replicate()])
    mark_expert(factor)
    params = {"dense": dense, "lora": factor}
    out["replicated over ep"] = {"titan": _titan(params), "pgregistry": value_error_of(lambda: grad_norm(params, pg))}
    # ... and torchtitan clips with that norm: the scale it gives this rank's shard of the dense grad.
    before = dense.grad.to_local().clone()
    titan_clip_grad_norm_(list(params.values()), 1.0, ep_enabled=True)
    out["replicated over ep"]["dense scale"] = float((dense.grad.to_local() / before).mean())
    return out


def _pp() -> dict[str, Any]:
    """PP 2 x EP 2: each stage its own dense rows and experts; torchtitan reduces over the ``pp`` mesh it is given."""
    layout = ParallelLayout(num_ranks=WORLD, pp=2, ep=2, expt_tp=1)  # dp 2, expert dp 1
    pg = registry.build(layout, name="pp")
    stage = layout.coords(dist.get_rank())["pp"]
    dense_mesh = to_device_mesh(pg, ("dp_cp",), dim_names=("fsdp",))
    sparse_mesh = to_device_mesh(pg, ("expt_dp", "ep"), dim_names=("efsdp", "ep"))
    params = {
        "dense": _param(_full(10 + stage, 8, 4), _full(20 + stage, 8, 4), dense_mesh, [Shard(0)]),
        "experts": mark_expert(
            _param(_full(30 + stage, EXPERTS, 6), _full(40 + stage, EXPERTS, 6), sparse_mesh, [Shard(0), Shard(0)])
        ),
    }
    every_grad = [_full(seed + s, *shape).reshape(-1) for s in (0, 1) for seed, shape in ((20, (8, 4)), (40, (4, 6)))]
    return {
        "oracle": float(torch.cat(every_grad).norm()),
        "titan": _titan(params, pp_mesh=to_device_mesh(pg, ("pp",))),
        "pgregistry": float(grad_norm(params, pg)),
    }


def _checks() -> dict[str, Any]:
    use_cpu()
    return {"no pp": _no_pp(), "pp": _pp()}


def test_torchtitan_clip_against_the_oracle() -> None:
    results = run_world(WORLD, _checks, timeout=60)
    for out in results:
        no_pp, pp = out["no pp"], out["pp"]
        oracle = no_pp["oracle"]
        # Declared as torchtitan's parallelize lays them out, with and without PP: torchtitan and pgregistry agree
        # with the oracle (pgregistry sums squares in float32).
        assert math.isclose(no_pp["declared"]["titan"], oracle, rel_tol=1e-12)
        assert math.isclose(pp["titan"], pp["oracle"], rel_tol=1e-12)
        for got, want in ((no_pp["declared"]["pgregistry"], oracle), (pp["pgregistry"], pp["oracle"])):
            assert math.isclose(got, want, rel_tol=2e-6)
        # Experts on a mesh whose EP dim is named otherwise, or with no EP dim: torchtitan raises, pgregistry exact.
        for case in ("renamed", "no ep dim"):
            assert no_pp[case]["titan"].startswith(MIXED_MESHES), no_pp[case]["titan"]
            assert math.isclose(no_pp[case]["pgregistry"], oracle, rel_tol=2e-6)
        # Per-expert factors declared Replicate over "ep": pgregistry refuses, naming them.
        refused = no_pp["replicated over ep"]["pgregistry"]
        assert "lora: marked distinct per EP rank, but its grad is Replicate()" in refused, refused
    # ... and torchtitan counts each EP rank's own factors as all of them: low, and different on each EP rank.
    titan = {out["no pp"]["ep_rank"]: out["no pp"]["replicated over ep"]["titan"] for out in results}
    oracle = results[0]["no pp"]["oracle"]
    assert sorted(titan) == [0, 1] and titan[0] != titan[1]
    assert all(norm < oracle * 0.95 for norm in titan.values()), (titan, oracle)
    # The dense parameter's shards are clipped by different scales on the two EP ranks, neither the oracle's.
    for out in results:
        case = out["no pp"]["replicated over ep"]
        assert math.isclose(case["dense scale"], 1.0 / (titan[out["no pp"]["ep_rank"]] + 1e-6), rel_tol=1e-9)

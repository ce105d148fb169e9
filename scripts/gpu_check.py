"""Check pgregistry's optimizers on a real backend: NCCL on GPUs (default when CUDA is present) or gloo on CPU.

Run under torchrun (``scripts/gpu_check.sh`` does, on 2 GPUs with ``NCCL_NVLS_ENABLE=0``)::

    torchrun --standalone --nproc-per-node 2 scripts/gpu_check.py [--backend nccl|gloo]

Every rank checks, and rank 0 prints one PASS/FAIL line per check (failing ranks named); every rank exits 1 when
any check failed anywhere:

* expert grads filtered with the expert TP group, Megatron-LM PR 6470 (TP = EP = W, expert TP 1; one replicated
  dense and one distinct expert bf16 scalar per rank): through ``build_optimizer``, the mixed-precision and the
  sharded optimizer report norm ``sqrt(1 + W)`` and zero count ``1 + W``; and with the bug reproduced (main copies
  without ``allreduce=False``) ``sqrt(2)`` and ``2``, so the check can fail;
* a layout matrix (every layout of the list that fits W): the toy model of :mod:`pgregistry.testing._toy_models`, raw
  per-rank grads synchronised by the optimizer (all-reduce, or reduce-scatter for the sharded one), then the
  2-norm, inf-norm and zero count against the unsharded float64 oracle (also both at once, one read of the
  buffer on CUDA with triton, and, unsharded, through the list path ``grad_norm``/``count_zeros``, whose
  contiguous grads the one-read kernel reads), one SGD step (lr 1, parameters from 0)
  whose result must be minus the oracle's grads (all-gather included), and the invariance oracle (all grads 1:
  norm ``sqrt(numel)``; all 0: zero count ``numel``);
* the public grad statistics over a model on the device, through the kept classification: ``grad_norm_and_zeros``
  (one read of plain grads) and ``clip_grad_norm_`` (scaled by the clip kernel, and left bit for bit when nothing
  is to be scaled) against the float64 oracle, FSDP2's DTensor grads (``fully_shard`` over the collection's
  ``dp_cp``) against torch's own DTensor norm, the same grad objects re-pointed at new storage read and clipped
  there (the kept reads check their addresses), and on CUDA the clip kernel's rounding: bit for bit torch's
  ``_foreach_mul_`` for float32, bf16 and fp16 over a table of tensors, views off the 16-byte grid included, by a
  given coefficient and by the one the kernel makes from the norm (torch's ``clip_coefficient`` of it); norms whose
  squares leave float32's range (float32 and bf16 grads of 1e20, 1e-25: the one-read kernel's float64 lanes) or
  float64's (float64 grads of 1e160: by range) exact through ``grad_norm``, ``clip_grad_norm_`` and, on CUDA, an
  optimizer's flat buffer, and the clips scaled by them; on CUDA, the 1- and 2-norm's ``grad_norm``,
  ``clip_grad_norm_`` and an optimizer's ``clip_grad_norm`` under ``torch.cuda.set_sync_debug_mode("error")``: no
  device sync;
* the RNG tracker on the device's generators (TP = W): identical data-parallel draws on every rank, distinct
  model-parallel draws, and a fork that restores the outer stream;
* on CUDA, the one-kernel optimizer step (:mod:`pgregistry.optim._fused_step`) compiled here: each rule it runs,
  over several programs, is the float64 rule to rounding at every step and its bf16 copy is torch's rounding bit
  for bit (the oracle and the run are tests/fixtures/optim_reference.py's, which the CPU tests run through triton's
  interpreter); the mixed-precision optimizer (a bf16 model, and bf16 / float32 / fp16 parameters mixed) and the
  sharded one step through it with every model parameter its main param rounded, agree with torch's fused AdamW
  to one bf16 step, and their state moves both ways between the kernel and torch's fused step; their
  ``clip_grad_norm`` (through the clip kernel) returns the oracle's norm, scales to torch's bits and changes
  nothing above the norm.

Initialisation, the gathered table and the tear-down order are :func:`pgregistry.cli._torchrun_checks.run_checks`'s.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path
from typing import Any
from unittest import mock

REPO = Path(__file__).resolve().parent.parent
for root in (REPO, REPO / "tests"):  # tests/ for fixtures: the float64 oracles of the fused step and the toy model
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from fixtures.finish_cases import FINISH_ROWS, bits, finished_side_by_side  # noqa: E402
from fixtures.optim_reference import (  # noqa: E402
    CASES,
    ROUNDING,
    SENTINEL,
    flat_steps,
    model_params,
    rule_steps,
    values,
    worst_units,
)
from fixtures.unsharded_oracle import oracle_norm, oracle_numel, oracle_zeros  # noqa: E402

import pgregistry.optim._mixed_precision  # noqa: E402
import pgregistry.optim._sharded  # noqa: E402
from pgregistry import registry  # noqa: E402
from pgregistry.cli._options import positive_seconds  # noqa: E402
from pgregistry.cli._torchrun_checks import Check, run_checks  # noqa: E402
from pgregistry.collection import FIELD_NAMES, ProcessGroupCollection  # noqa: E402
from pgregistry.grad_stats import (  # noqa: E402
    _reductions,  # noqa: E402
    clip_grad_norm_,
    count_zeros,
    grad_norm,
    grad_norm_and_zeros,
)
from pgregistry.grad_stats._fused import can_run_fused_stats, clip_over_, launch_of, scale_  # noqa: E402
from pgregistry.grad_stats._reductions import Wanted, clip_coefficient  # noqa: E402
from pgregistry.layout import ParallelLayout  # noqa: E402
from pgregistry.optim import (  # noqa: E402
    ElementwiseRule,
    FlatStep,
    MixedPrecisionOptimizer,
    ShardedOptimizer,
    build_optimizer,
    inner_factory,
    setup_process_groups_for_optimizer,
)
from pgregistry.optim._base import FlatOptimizer  # noqa: E402
from pgregistry.optim._fused_step import BLOCK, ITERS, can_run_fused_step  # noqa: E402
from pgregistry.params import copy_param_roles  # noqa: E402
from pgregistry.rng import get_rng_tracker, model_parallel_manual_seed  # noqa: E402
from pgregistry.testing._toy_models import (  # noqa: E402
    EXPERTS,
    dense_and_expert,
    full_grads,
    local_model,
    set_main_grads,
)

REL = 1e-6


def layouts_for(world: int) -> dict[str, dict[str, int]]:
    """The layout matrix: every entry whose sizes fit ``world`` ranks and the toy model's expert count."""
    candidates: dict[str, dict[str, int]] = {
        f"DP{world}": {},
        f"TP{world}": {"tp": world},
        f"EP{world}-ETP1": {"ep": world, "expt_tp": 1},
        f"TP{world}-EP{world}-ETP{world}": {"tp": world, "ep": world},
        "TP2-EP2-ETP1": {"tp": 2, "ep": 2, "expt_tp": 1},
        "TP2-PP2-EP2-ETP1": {"tp": 2, "pp": 2, "ep": 2, "expt_tp": 1},
        "TP2-CP2-EP4-ETP1": {"tp": 2, "cp": 2, "ep": 4, "expt_tp": 1},
        "GTP2-EP2-EGTP2": {"gtp_remat": 2, "ep": 2, "expt_gtp_remat": 2},
    }
    out = {}
    for name, sizes in candidates.items():
        try:
            layout = ParallelLayout(num_ranks=world, **sizes)
        except ValueError:
            continue
        if EXPERTS % layout.ep == 0 and name not in out:
            out[name] = sizes
    return out


def close(value: float, want: float) -> bool:
    return math.isclose(value, want, rel_tol=REL, abs_tol=REL)


def relatively_close(value: float, want: float) -> bool:
    """Within :data:`REL` of ``want``, however small (a norm of 1e-24 is not 0)."""
    return math.isclose(value, want, rel_tol=REL)


# ------------------------------------------------------------------------------- expert grads with expert TP


def _roles_without_allreduce(src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    """The buggy optimizer copy: every role but ``allreduce=False``."""
    copy_param_roles(src, dst)
    if hasattr(dst, "allreduce"):
        del dst.allreduce
    return dst


def _expert_tp_stats(pg: Any, sharded: bool, device: torch.device) -> tuple[float, int]:
    model = dense_and_expert(device=device)
    opt = build_optimizer(model, pg, optimizer="sgd", lr=0.0, sharded=sharded)
    (model.dense.float().sum() + model.experts.weight.float().sum()).backward()  # every grad 1, into the buffer
    opt.sync_grads()
    norm = float(opt.get_grad_norm())
    opt.zero_grad()
    return norm, int(opt.count_zeros())


def expert_grads_with_expert_tp(world: int, device: torch.device) -> list[Check]:
    pg = registry.build(ParallelLayout(num_ranks=world, tp=world, ep=world, expt_tp=1), name="gpu-check-expert-tp")
    want_norm, want_zeros = math.sqrt(1 + world), 1 + world
    checks = []
    for sharded in (False, True):
        kind = "sharded" if sharded else "mixed-precision"
        norm, zeros = _expert_tp_stats(pg, sharded, device)
        checks.append((f"TP = EP = {world}, expert TP 1, {kind}: norm sqrt(1+{world}), zero count {want_zeros}",
                       close(norm, want_norm) and zeros == want_zeros, f"norm {norm:.7f}, zeros {zeros}"))
    real = (pgregistry.optim._mixed_precision.copy_param_roles, pgregistry.optim._sharded.copy_param_roles)
    pgregistry.optim._mixed_precision.copy_param_roles = _roles_without_allreduce  # type: ignore[attr-defined]
    pgregistry.optim._sharded.copy_param_roles = _roles_without_allreduce  # type: ignore[attr-defined]
    try:
        for sharded in (False, True):
            kind = "sharded" if sharded else "mixed-precision"
            norm, zeros = _expert_tp_stats(pg, sharded, device)
            checks.append((f"counterfactual, {kind}: copies without allreduce=False give sqrt(2) and 2",
                           close(norm, math.sqrt(2)) and zeros == 2, f"norm {norm:.7f}, zeros {zeros}"))
    finally:
        pgregistry.optim._mixed_precision.copy_param_roles, pgregistry.optim._sharded.copy_param_roles = real
    return checks


# --------------------------------------------------------------------------------------------- layout matrix


def layout_checks(name: str, sizes: dict[str, int], world: int, device: torch.device) -> list[Check]:
    layout = ParallelLayout(num_ranks=world, **sizes)
    pg = registry.build(layout, name=f"gpu-check-{name}")
    rank = dist.get_rank()
    grads = full_grads("random")
    numel = oracle_numel()
    checks = []
    for sharded in (False, True):
        where = f"{name}, {'sharded' if sharded else 'unsharded'}"
        model, shards = local_model(layout, rank, full_grads("zeros"), device=device)
        opt = build_optimizer(model, pg, optimizer="sgd", lr=1.0, sharded=sharded, mixed_precision=False)
        set_main_grads(model, shards, grads, layout)
        opt.sync_grads()
        stats = (float(opt.get_grad_norm()), float(opt.get_grad_norm(math.inf)), int(opt.count_zeros()))
        want = (oracle_norm(grads, 2.0), oracle_norm(grads, math.inf), oracle_zeros(grads))
        checks.append((f"{where}: 2-norm, inf-norm, zero count = float64 oracle",
                       close(stats[0], want[0]) and close(stats[1], want[1]) and stats[2] == want[2],
                       f"{stats} vs {want}"))
        norm, zero_count = opt.get_grad_norm_and_zeros()  # one read of each span on CUDA with triton
        both = (float(norm), int(zero_count))
        checks.append((f"{where}: norm and zero count in one read = float64 oracle",
                       close(both[0], want[0]) and both[1] == want[2], f"{both} vs {(want[0], want[2])}"))
        if not sharded:  # the list path over the grads as separate tensors (a sharded buffer is stale off-shard)
            listed = (float(grad_norm(model, pg)), count_zeros(model, pg))
            checks.append((f"{where}: list path (grad_norm, count_zeros) = float64 oracle",
                           close(listed[0], want[0]) and listed[1] == want[2], f"{listed} vs {(want[0], want[2])}"))
            if device.type == "cuda":  # one list, half its grads on the host: grouped per device, one result
                mixed = _half_on_host(model)
                listed = (float(grad_norm(mixed, pg)), count_zeros(mixed, pg))
                checks.append((f"{where}: list path over CUDA and CPU grads = float64 oracle",
                               close(listed[0], want[0]) and listed[1] == want[2],
                               f"{listed} vs {(want[0], want[2])}"))
        opt.step()
        params = dict(model.named_parameters())
        worst = max(
            float((params[s.local_name].detach().double().cpu() + s.take(grads[s.full_name])).abs().max())
            for s in shards
        )
        checks.append((f"{where}: one SGD step gives minus the oracle's grads", worst < 1e-6, f"max error {worst:.2e}"))
        opt.zero_grad()
        set_main_grads(model, shards, full_grads("ones"), layout)
        opt.sync_grads()
        ones = float(opt.get_grad_norm())
        opt.zero_grad()
        opt.sync_grads()
        zeros = int(opt.count_zeros())
        checks.append((f"{where}: invariance, norm sqrt({numel}) and zero count {numel}",
                       close(ones, math.sqrt(numel)) and zeros == numel, f"norm {ones:.7f}, zeros {zeros}"))
    return checks


def _half_on_host(model: torch.nn.Module) -> list[torch.Tensor]:
    """The model's parameters, every other one replaced by a host copy (roles and grad copied): a list whose grads
    live on two devices."""
    params: list[torch.Tensor] = []
    for index, param in enumerate(model.parameters()):
        if index % 2 and param.grad is not None:
            host = copy_param_roles(param, torch.nn.Parameter(param.detach().cpu()))
            host.grad = param.grad.detach().cpu()
            param = host
        params.append(param)
    return params


# -------------------------------------------------------------------------------- the public grad statistics


def stats_api_checks(world: int, device: torch.device) -> list[Check]:
    """The functional API over a model on ``device``: one read for both statistics, clipping, FSDP2 grads."""
    layout = ParallelLayout(num_ranks=world, **layouts_for(world)[next(iter(layouts_for(world)))])
    pg = registry.build(layout, name="gpu-check-api")
    grads = full_grads("random")
    want_norm, want_zeros = oracle_norm(grads, 2.0), oracle_zeros(grads)
    model, shards = local_model(layout, dist.get_rank(), grads, device=device)
    checks = []
    for call in range(2):  # the second call reads through the kept classification
        norm, zeros = (float(x) for x in grad_norm_and_zeros(model, pg))
        checks.append((f"grad_norm_and_zeros over the model, call {call + 1}: = float64 oracle",
                       close(norm, want_norm) and int(zeros) == want_zeros, f"{norm}, {int(zeros)}"))
    with_grads = [p for p in model.parameters() if p.grad is not None]
    before = [p.grad.clone() for p in with_grads]  # type: ignore[union-attr]
    returned = float(clip_grad_norm_(model, 2 * want_norm, pg))
    same = all(torch.equal(a, p.grad) for a, p in zip(before, with_grads, strict=True))  # type: ignore[arg-type]
    checks.append(("clip_grad_norm_ above the norm: returns it, leaves every grad bit for bit",
                   close(returned, want_norm) and same, f"{returned}"))
    max_norm = want_norm / 3
    returned = float(clip_grad_norm_(model, max_norm, pg))
    coeff = max_norm / (want_norm + 1e-6)
    params = dict(model.named_parameters())
    worst = max(
        float((params[s.local_name].grad.double().cpu() - s.take(grads[s.full_name]) * coeff).abs().max())
        for s in shards
    )
    checks.append(("clip_grad_norm_ below the norm: grads = oracle's clipped grads",
                   close(returned, want_norm) and worst < 1e-6, f"max error {worst:.2e}"))
    return (
        checks + kept_grads_checks(device) + fsdp_checks(world, device) + scale_kernel_checks(device)
        + exact_norm_checks(device) + finish_kernel_checks(model, pg, device)
    )


def finish_kernel_checks(model: torch.nn.Module, pg: Any, device: torch.device) -> list[Check]:
    """The finishing kernel compiled here: each case of ``tests/fixtures/finish_cases.py`` gives the bits of the
    reductions' torch operations; and the model's statistics and clip over this world (the verdict's flags riding in
    a reduction group's row where a group spans the ranks) give the same bits, and clip the grads to the same bits,
    whether the kernel or torch's operations finish them."""
    if device.type != "cuda" or not can_run_fused_stats(device):
        return []
    cases = finished_side_by_side(device)
    differ = [name for name, (kernel, torch_path) in cases.items() if kernel != torch_path]
    checks = [("finishing kernel: every reduced-rows case = the reductions' torch operations, bit for bit",
               not differ and len(cases) == len(FINISH_ROWS) + 1, f"differ: {differ}")]
    launched = []
    real = _reductions.finish_rows

    def counting(*args: Any, **kwargs: Any) -> Any:
        launched.append(kwargs["norm"])
        return real(*args, **kwargs)

    with_grads = [p for p in model.parameters() if p.grad is not None]
    saved = [p.grad.clone() for p in with_grads]  # type: ignore[union-attr]
    results = {}
    for by_kernel in (True, False):
        for param, grad in zip(with_grads, saved, strict=True):
            param.grad.copy_(grad)  # type: ignore[union-attr]
        with (
            mock.patch.object(_reductions, "can_run_fused_stats", lambda _, on=by_kernel: on),
            mock.patch.object(_reductions, "finish_rows", counting),
        ):
            norm, zeros = grad_norm_and_zeros(model, pg)
            clipped = clip_grad_norm_(model, float(norm) / 3, pg)
            results[by_kernel] = [bits(norm), bits(zeros), bits(grad_norm(model, pg)), bits(clipped),
                                  [p.grad.clone() for p in with_grads]]  # type: ignore[union-attr]
    for param, grad in zip(with_grads, saved, strict=True):
        param.grad.copy_(grad)  # type: ignore[union-attr]
    same = results[True][:4] == results[False][:4] and all(
        torch.equal(a, b) for a, b in zip(results[True][4], results[False][4], strict=True)
    )
    checks.append(("finishing kernel over the model: norm + zeros, norm, clip and clipped grads = torch's "
                   "operations' bits; three kernel launches", same and launched == [True, True, True],
                   f"launches {launched}, kernel {results[True][:4]}, torch {results[False][:4]}"))
    return checks


def kept_grads_checks(device: torch.device) -> list[Check]:
    """A call whose grads are the very objects its reads were planned for skips their types and sizes, never their
    addresses: the same grad objects re-pointed at new storage (``grad.data = ...``, the old storage still alive)
    are read and clipped where they are now, and the old storage is left as it was."""
    model = torch.nn.Sequential(*(torch.nn.Linear(33, 17) for _ in range(4))).to(device)
    gen = torch.Generator(device=device).manual_seed(11)
    for param in model.parameters():
        param.grad = torch.randn(param.shape, generator=gen, device=device)
    clip_grad_norm_(model, 1e30, ALL_OFF)
    clip_grad_norm_(model, 1e30, ALL_OFF)  # kept: the grads' objects noted
    grads = [param.grad for param in model.parameters()]
    old = [grad.data for grad in grads]  # type: ignore[union-attr]
    kept_old = [tensor.clone() for tensor in old]
    for grad in grads:
        grad.data = 3 * torch.randn(grad.shape, generator=gen, device=device)  # type: ignore[union-attr]
    want = math.sqrt(sum(float(grad.double().square().sum()) for grad in grads))  # type: ignore[union-attr]
    returned = float(clip_grad_norm_(model, want / 2, ALL_OFF))
    after = math.sqrt(sum(float(grad.double().square().sum()) for grad in grads))  # type: ignore[union-attr]
    untouched = all(torch.equal(a, b) for a, b in zip(old, kept_old, strict=True))
    return [("clip_grad_norm_ of the same grad objects re-pointed at new storage: reads and scales the new storage",
             close(returned, want) and close(after, want / 2) and untouched,
             f"returned {returned} (want {want}), after {after}, old storage untouched {untouched}")]


def exact_norm_checks(device: torch.device) -> list[Check]:
    """Grads whose ``sum |g|^2`` leaves float32's range in float32 squares: 1e20 (float32, bf16) overflows, 1e-25
    underflows; and float64 grads of 1e160, whose squares overflow float64. The one-read kernel squares in float64
    lanes, torch's norms take ``dtype=torch.float64``, float64 squares go by range: the one reduction gives the
    float64 oracle's norm, with no host read, through the plan's read (``grad_norm``, ``clip_grad_norm_``, scaled by
    the clip kernel) and, on CUDA, an optimizer's flat buffer (its one-read span kernel, then the clip kernel); each
    clip scales by ``max_norm / (norm + 1e-6)``. Before: inf (the clip skipped) or 0."""
    checks = []
    beyond = (
        (torch.float32, 1e20, 1.0), (torch.bfloat16, 1e20, 1.0), (torch.float32, 1e-25, 5e-7),
        (torch.float64, 1e160, 1.0),
    )
    for dtype, scale, max_norm in beyond:
        model = torch.nn.Sequential(*(torch.nn.Linear(65, 33) for _ in range(3))).to(device, dtype)
        gen = torch.Generator(device=device).manual_seed(5)
        for param in model.parameters():
            draw = torch.randn(param.shape, generator=gen, device=device, dtype=torch.float64)
            param.grad = (scale * draw).to(dtype)
        before = [param.grad.double() / scale for param in model.parameters()]  # type: ignore[union-attr]
        want = float(torch.cat([grad.flatten() for grad in before]).norm()) * scale
        coefficient = min(1.0, max_norm / (want + 1e-6))
        norm = float(grad_norm(model, ALL_OFF))
        returned = float(clip_grad_norm_(model, max_norm, ALL_OFF))
        worst = max(  # relative to the largest clipped grad; bf16 rounds each product to 8 bits
            float((param.grad.double() / scale - grad * coefficient).abs().max())  # type: ignore[union-attr]
            / float((grad * coefficient).abs().max())
            for param, grad in zip(model.parameters(), before, strict=True)
        )
        tolerance = 2.0**-8 if dtype == torch.bfloat16 else 1e-6
        checks.append((f"exact norm, {dtype} grads of {scale:g}: grad_norm and clip_grad_norm_ = float64 oracle, "
                       "grads scaled by max_norm / (norm + 1e-6)",
                       relatively_close(norm, want) and relatively_close(returned, want) and worst <= tolerance,
                       f"norm {norm:.7g}, clip {returned:.7g} vs {want:.7g}; worst scaled grad {worst:.1e}"))
    if device.type != "cuda" or not can_run_fused_stats(device) or not can_run_fused_step(device):
        return checks
    opt = _optimizer(MixedPrecisionOptimizer, [torch.bfloat16, torch.float32], device, kernel=True)
    for index, param in enumerate(opt.params):
        grad = values(max(param.numel(), 8), seed=index, device=device)[: param.numel()]
        param.main_grad.copy_(1e20 * grad.view(param.shape))
    start = [grad.double() / 1e20 for grad in opt.grads_to_clip()]
    oracle = float(torch.cat([grad.flatten() for grad in start]).norm()) * 1e20
    norm = float(opt.get_grad_norm())
    one_norm = float(opt.get_grad_norm(1.0))  # torch's multi-tensor norm over the span, cast as it reads
    one_oracle = float(torch.cat([grad.flatten() for grad in start]).abs().sum()) * 1e20
    checks.append(("exact norm, MixedPrecisionOptimizer's flat buffer of grads of 1e20, p=1 (_foreach_norm in "
                   "float64): the oracle's norm", relatively_close(one_norm, one_oracle),
                   f"norm {one_norm:.7g} vs {one_oracle:.7g}"))
    returned = float(opt.clip_grad_norm(1.0))
    after = float(torch.cat([grad.double().flatten() for grad in opt.grads_to_clip()]).norm())
    checks.append(("exact norm, MixedPrecisionOptimizer's flat buffer of grads of 1e20 (span kernel, clip kernel): "
                   "the oracle's norm, clipped to 1",
                   relatively_close(norm, oracle) and relatively_close(returned, oracle)
                   and math.isclose(after, 1.0, rel_tol=1e-5),
                   f"norm {norm:.7g}, clip {returned:.7g} vs {oracle:.7g}; after {after:.7g}"))
    return checks + no_sync_checks(device, opt)


def no_sync_checks(device: torch.device, opt: Any) -> list[Check]:
    """The 1- and 2-norm wait on nothing (as torch's ``clip_grad_norm_``, which a training loop relies on): after a
    first call (plans, launch tables, the kernel's probe), ``grad_norm``, ``clip_grad_norm_`` and the optimizer's
    ``clip_grad_norm`` run under ``torch.cuda.set_sync_debug_mode("error")``, which raises on any synchronising
    operation."""
    checks = []
    model = torch.nn.Sequential(*(torch.nn.Linear(65, 33) for _ in range(3))).to(device)
    for param in model.parameters():
        param.grad = torch.randn_like(param)
    calls = {
        "grad_norm p=2": lambda: grad_norm(model, ALL_OFF),
        "grad_norm p=1": lambda: grad_norm(model, ALL_OFF, norm_type=1.0),
        "clip_grad_norm_ p=2": lambda: clip_grad_norm_(model, 1.0, ALL_OFF),
        "optimizer clip_grad_norm p=2": lambda: opt.clip_grad_norm(1.0),
    }
    for name, call in calls.items():
        call()  # the first call may plan and probe
        torch.cuda.synchronize(device)
        torch.cuda.set_sync_debug_mode("error")
        try:
            call()
            error = ""
        except RuntimeError as raised:
            error = str(raised).splitlines()[0]
        finally:
            torch.cuda.set_sync_debug_mode(0)
        checks.append((f"no device sync: {name}", not error, error or "none"))
    return checks


def fsdp_checks(world: int, device: torch.device) -> list[Check]:
    """FSDP2 (``fully_shard`` over ``dp_cp``): grad_norm of its DTensor grads = torch's DTensor norm."""
    from torch.distributed.fsdp import fully_shard

    from pgregistry.mesh import to_device_mesh

    pg = registry.build(ParallelLayout(num_ranks=world), name="gpu-check-fsdp")
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(64, 64) for _ in range(8))).to(device)
    fully_shard(model, mesh=to_device_mesh(pg, ("dp_cp",), device_type=device.type))
    model(torch.randn(4, 64, device=device)).square().sum().backward()
    grads = [p.grad for p in model.parameters()]
    theirs = float(torch.nn.utils.get_total_norm(grads, foreach=True).full_tensor())  # type: ignore[union-attr]
    ours = [float(grad_norm(model, pg)) for _ in range(2)]
    return [("FSDP2 DTensor grads: grad_norm (twice, kept) = torch's get_total_norm().full_tensor()",
             all(close(value, theirs) for value in ours), f"{ours} vs {theirs}")]


def scale_kernel_checks(device: torch.device) -> list[Check]:
    if device.type != "cuda" or not can_run_fused_stats(device):
        return []
    checks = []
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        gen = torch.Generator(device=device).manual_seed(7)
        whole = torch.randn(3 * BLOCK * ITERS + 997, generator=gen, device=device).to(dtype)
        tensors = [whole[:5000], whole[5001:40000], whole[40003:]]  # the last two off the 16-byte grid
        want = [t.clone() for t in tensors]
        torch._foreach_mul_(want, torch.tensor(0.37, device=device))
        scale_(tensors, torch.tensor(0.37, dtype=torch.float64, device=device))
        exact = all(torch.equal(a, b) for a, b in zip(tensors, want, strict=True))
        kept = [t.clone() for t in tensors]
        scale_(tensors, torch.tensor(1.0, dtype=torch.float64, device=device))
        unchanged = all(torch.equal(a, b) for a, b in zip(tensors, kept, strict=True))
        checks.append((f"clip kernel, {dtype}: torch's _foreach_mul_ bit for bit; a coefficient of 1 changes nothing",
                       exact and unchanged, f"scaled {'exact' if exact else 'DIFFER'}, one {unchanged}"))
        from_norm = []
        for max_norm, norm in ((1.0, 2.7), (0.123456789, 3.3), (1.0, 1.0), (0.5, math.inf)):
            norm64 = torch.tensor(norm, dtype=torch.float64, device=device)
            ours, theirs = [t.clone() for t in kept], [t.clone() for t in kept]
            clip_over_(ours, launch_of(ours), max_norm, norm64)
            torch._foreach_mul_(theirs, clip_coefficient(max_norm, norm64))
            from_norm.append(all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True)))
        checks.append((f"clip kernel from the norm, {dtype}: torch's coefficient and _foreach_mul_ bit for bit",
                       all(from_norm), f"cases exact: {from_norm}"))
    return checks


# -------------------------------------------------------------------------------- one-kernel optimizer step

FUSED_NUMEL = 3 * BLOCK * ITERS + 3000
"""Elements of the rule checks: three programs and a partial fourth (a multiple of 4, as a flat buffer is)."""
FUSED_STEPS = 4
ALL_OFF = ProcessGroupCollection(**dict.fromkeys(FIELD_NAMES))
ADAMW = {"lr": 1e-2, "betas": (0.9, 0.95), "weight_decay": 0.1}


def fused_step_checks(device: torch.device) -> list[Check]:
    if device.type != "cuda":
        return []
    available = can_run_fused_step(device)
    checks = [("one-kernel step: compiled on this GPU, probe exact", available, "else torch's step runs")]
    if not available:
        return checks
    for name in CASES:
        result = rule_steps(name, FUSED_NUMEL, FUSED_STEPS, torch.bfloat16, device)
        records = result["records"]
        units = worst_units(*CASES[name], records)
        copies = all(
            torch.equal(r["buffer"][4:-20], r["after"]["param"][8:-16].to(torch.bfloat16))
            and bool((r["buffer"][:4] == SENTINEL).all() and (r["buffer"][-20:] == SENTINEL).all())
            for r in records
        )
        ran = all(r["ran"] for r in records) and result["unfused"] == 0
        checks.append((f"one-kernel step, {name}: float64 rule to rounding, bf16 copy bit-exact",
                       ran and units <= 1.0 and copies,
                       f"worst {units:.2f} x {ROUNDING:.1e} of the scale; copies {'exact' if copies else 'DIFFER'}"))
    return checks + fused_optimizer_checks(device) + optimizer_clip_checks(device)


def optimizer_clip_checks(device: torch.device) -> list[Check]:
    """The optimizers' ``clip_grad_norm`` on CUDA (the scale kernel making the coefficient from the norm): the norm
    the float64 oracle's, the grads torch's ``_foreach_mul_`` by ``clip_coefficient`` of that norm bit for bit, and a
    max_norm above the norm leaves every bit."""
    if not can_run_fused_stats(device):
        return []
    checks = []
    kinds = ((MixedPrecisionOptimizer, [torch.bfloat16, torch.float32]), (ShardedOptimizer, [torch.bfloat16]))
    for kind, dtypes in kinds:
        opt = _optimizer(kind, dtypes, device, kernel=True)
        for index, param in enumerate(opt.params):
            grad = values(max(param.numel(), 8), seed=index, device=device)[: param.numel()]
            param.main_grad.copy_(grad.view(param.shape))
        before = [grad.clone() for grad in opt.grads_to_clip()]
        oracle = float(torch.cat([grad.double().flatten() for grad in before]).norm())
        norm64 = opt.statistics(Wanted.of(2.0, zeros=False)).norm64
        above = float(opt.clip_grad_norm(2 * oracle))
        unchanged = all(torch.equal(a, b) for a, b in zip(opt.grads_to_clip(), before, strict=True))
        returned = float(opt.clip_grad_norm(oracle / 3))
        want = [grad.clone() for grad in before]
        torch._foreach_mul_(want, clip_coefficient(oracle / 3, norm64))
        exact = all(torch.equal(a, b) for a, b in zip(opt.grads_to_clip(), want, strict=True))
        close = all(math.isclose(value, oracle, rel_tol=1e-6) for value in (above, returned))
        checks.append((f"{kind.__name__}.clip_grad_norm on the kernel: the oracle's norm, torch's clipped bits, "
                       "nothing changed above the norm", close and exact and unchanged,
                       f"norm {returned:.7g} vs {oracle:.7g}; clipped {'exact' if exact else 'DIFFER'}; "
                       f"above the norm unchanged: {unchanged}"))
    return checks


def _optimizer(kind: type[FlatOptimizer], dtypes: list[torch.dtype], device: torch.device, *, kernel: bool) -> Any:
    """``kind`` over :func:`model_params` with AdamW: ``inner_factory``'s rule (the kernel), or the rule naming
    torch's fused AdamW (the flat step before the kernel)."""
    rule = inner_factory("adamw", **ADAMW) if kernel else ElementwiseRule(torch.optim.AdamW, {**ADAMW, "fused": True})
    groups = setup_process_groups_for_optimizer(ALL_OFF, use_distributed_optimizer=kind is ShardedOptimizer)
    opt = kind(model_params(dtypes, device), groups, inner=rule)  # type: ignore[call-arg]
    inner = opt.inner
    if not isinstance(inner, FlatStep) or (inner._fused is not None) != kernel:
        raise RuntimeError(f"{kind.__name__} over {dtypes} does not step {'in' if kernel else 'without'} the kernel")
    return opt


def _rounded_mains(opt: Any) -> bool:
    """Whether every model parameter is its main param rounded to its dtype, bit for bit."""
    if isinstance(opt, ShardedOptimizer):
        whole = opt.main_shard.detach()
        mains = [whole[o : o + p.numel()].view(p.shape) for p, o in zip(opt.params, opt.buffer.offsets, strict=True)]
    else:
        mains = opt.main_params
    return all(torch.equal(p.detach(), m.detach().to(p.dtype)) for p, m in zip(opt.params, mains, strict=True))


def _bf16_steps(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    """Largest difference in units of the bf16 rounding step at the value (0: identical)."""
    worst = 0.0
    for a, b in zip(got, want, strict=True):
        diff = (a.detach().float() - b.detach().float()).abs()
        worst = max(worst, float((diff / (b.detach().float().abs() * 2.0**-7)).nan_to_num().max()))
    return worst


def fused_optimizer_checks(device: torch.device) -> list[Check]:
    checks = []
    bf16, mixed = [torch.bfloat16], [torch.bfloat16, torch.float32, torch.float16]
    for kind, dtypes, what in (
        (MixedPrecisionOptimizer, bf16, "mixed precision, bf16 model"),
        (MixedPrecisionOptimizer, mixed, "mixed precision, bf16/fp32/fp16 model"),
        (ShardedOptimizer, bf16, "sharded, one rank"),
    ):
        opt = _optimizer(kind, dtypes, device, kernel=True)
        units = worst_units(torch.optim.AdamW, ADAMW, flat_steps(opt, range(FUSED_STEPS)))
        reference = _optimizer(kind, dtypes, device, kernel=False)
        flat_steps(reference, range(FUSED_STEPS))
        steps = _bf16_steps(opt.params, reference.params)
        rounded = _rounded_mains(opt)
        checks.append((f"one-kernel step, {what}: float64 rule to rounding, params = mains rounded, "
                       "<= 1 bf16 step from torch's fused AdamW", units <= 1.0 and rounded and steps <= 1.0,
                       f"worst {units:.2f}; params exact: {rounded}; {steps:.2f} bf16 steps from torch"))
    for first, then in ((True, False), (False, True)):
        saved = _optimizer(MixedPrecisionOptimizer, bf16, device, kernel=first)
        flat_steps(saved, range(2))
        resumed = _optimizer(MixedPrecisionOptimizer, bf16, device, kernel=then)
        resumed.load_state_dict(saved.state_dict())
        records = flat_steps(resumed, range(2, FUSED_STEPS))
        units = worst_units(torch.optim.AdamW, ADAMW, records, first_step=3)
        counts = [r["step"] for r in records]
        same = _same_form(saved.state_dict()["inner"], resumed.state_dict()["inner"])
        names = ("the kernel", "torch's fused AdamW")
        checks.append((f"one-kernel step: state from {names[not first]} resumed by {names[not then]}",
                       units <= 1.0 and counts == [3.0, 4.0] and same,
                       f"steps 3-4: worst {units:.2f}, counts {counts}; state of the same form: {same}"))
    return checks


def _same_form(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two inner state dicts hold the same keys, and tensors of the same dtype, shape and device."""
    def form(state: dict[str, Any]) -> Any:
        return {i: {k: (v.dtype, v.shape, v.device) for k, v in e.items()} for i, e in state["state"].items()}
    return bool(form(a) == form(b))


# --------------------------------------------------------------------------------------------------- driver


def rng_checks(world: int, device: torch.device) -> list[Check]:
    """The RNG tracker on this device's generators, with TP = world: the data-parallel stream is the same on every
    rank, the model-parallel stream differs per TP rank, and a fork leaves the outer stream where it was."""
    pg = registry.build(ParallelLayout(num_ranks=world, tp=world), name="gpu-check-rng")
    model_parallel_manual_seed(1234, pg)
    outside = torch.rand(4, device=device)
    with get_rng_tracker().fork():
        inside = torch.rand(4, device=device)
    after = torch.rand(4, device=device)
    everyone = [torch.empty(3, 4, device=device) for _ in range(world)]
    dist.all_gather(everyone, torch.stack([outside, inside, after]))
    fresh = torch.Generator(device=device).manual_seed(1234)
    first, second = torch.rand(4, device=device, generator=fresh), torch.rand(4, device=device, generator=fresh)
    outsides = len({tuple(e[0].tolist()) for e in everyone})
    insides = len({tuple(e[1].tolist()) for e in everyone})
    restored = torch.equal(outside, first) and torch.equal(after, second)
    where = f"RNG on {device.type}"
    return [
        (f"{where}: data-parallel stream identical on every TP rank", outsides == 1, f"{outsides} distinct draw(s)"),
        (f"{where}: model-parallel stream distinct per TP rank", insides == world, f"{insides} distinct of {world}"),
        (f"{where}: a fork restores the outer stream", restored, "draws match a fresh generator seeded 1234"),
    ]


def all_checks(device: torch.device) -> list[Check]:
    world = dist.get_world_size()
    checks = expert_grads_with_expert_tp(world, device) + rng_checks(world, device) + fused_step_checks(device)
    checks += stats_api_checks(world, device)
    for name, sizes in layouts_for(world).items():
        checks += layout_checks(name, sizes, world, device)
    return checks


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="pgregistry optimizer checks under torchrun")
    parser.add_argument("--backend", choices=("nccl", "gloo"), default="nccl" if torch.cuda.is_available() else "gloo")
    parser.add_argument("--timeout", type=positive_seconds, default=120.0, help="collective timeout in seconds")
    args = parser.parse_args(argv)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    # run_checks refuses NCCL without CUDA (exit 2, naming the fix): the card's name is read only where there is one.
    where = torch.cuda.get_device_name() if args.backend == "nccl" and torch.cuda.is_available() else "cpu"
    title = f"gpu_check: backend {args.backend}, {where}, torch {torch.__version__}"
    return run_checks(title, args.backend, all_checks, timeout=args.timeout)


if __name__ == "__main__":
    sys.exit(main())

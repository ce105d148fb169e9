"""A MIMO-style job: an encoder and a language model, each on its own layout, trained with one
optimizer.

``python -m examples.mimo_modules`` (or ``--colocated``) runs it in a local 8-rank gloo world
(``pgregistry.testing.run_world``); ``torchrun --nproc-per-node 8 examples/mimo_modules.py`` runs it
the usual way.

* disjoint (Megatron-Core MIMO's non-colocated job): the encoder on ranks 0-3 at DP 4, the language
  model on ranks 4-7 at TP 2 x PP 2;
* ``--colocated``: both on all 8 ranks, the encoder at DP 8, the language model at TP 2 x PP 2 x
  DP 2.

Each rank builds the modules' collections (:func:`pgregistry.modules.build_modules`), seeds each
module's RNG streams, and trains the modules it runs: the encoder is a data-parallel MLP; the
language model two pipeline stages (activations sent between them) of a tensor-parallel residual MLP
(column- then row-parallel, all-reduced over TP). One
:class:`~pgregistry.modules.MultiModuleOptimizer` (Adam) clips every module's grads by the job-wide
norm and steps them. Beside it, every rank trains the unsharded float64 copy of both modules on the
whole batches with the same rule: each step's job-wide norm must match that float64 oracle of both
modules' full grads. At the end every module is checkpointed into its own directory and loaded into
fresh models and a fresh optimizer, which must hold the same weights and take the same next step.

The two modules exchange nothing here (MIMO's encoder feeds the language model through a bridge
between spans): what this shows is the job-wide bookkeeping across spans, which needs no such
traffic.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pgregistry import ParallelLayout
from pgregistry import modules as mm
from pgregistry.collection import group_rank, group_size
from pgregistry.params import mark_tensor_parallel
from pgregistry.rng import DATA_PARALLEL_RNG

HIDDEN, WIDE, BATCH, STEPS, LR, MAX_NORM, SEED = 8, 16, 16, 3, 0.02, 1.0, 1234
NAMING: dict[str, Any] = {
    "language": {"layer_offsets": [0]}
}  # its stages are named layers.<stage>. already


def layouts(colocated: bool) -> dict[str, ParallelLayout]:
    if colocated:
        return {
            "encoder": ParallelLayout(num_ranks=8),
            "language": ParallelLayout(num_ranks=8, tp=2, pp=2),
        }
    return {
        "encoder": ParallelLayout(num_ranks=4),
        "language": ParallelLayout(num_ranks=4, tp=2, pp=2, rank_offset=4),
    }


def _full(name: str, *shape: int) -> torch.Tensor:
    """The unsharded float64 initial value of parameter ``name`` (the same on every rank)."""
    generator = torch.Generator().manual_seed(sum(map(ord, name)) * 7919)
    return torch.randn(*shape, generator=generator, dtype=torch.float64) / math.sqrt(shape[-1])


def _batch(module: str, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s whole batch of ``module``: inputs and targets (float64, the same on every
    rank)."""
    generator = torch.Generator().manual_seed(1000 * step + len(module))
    return (
        torch.randn(BATCH, HIDDEN, generator=generator, dtype=torch.float64),
        torch.randn(BATCH, HIDDEN, generator=generator, dtype=torch.float64),
    )


# ------------------------------------------------------------------------------------------- models


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Parameter(_full("encoder.fc1", WIDE, HIDDEN).float())
        self.fc2 = nn.Parameter(_full("encoder.fc2", HIDDEN, WIDE).float())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x @ self.fc1.T) @ self.fc2.T


class _CopyToTP(torch.autograd.Function):
    """Identity forward; the grads of the TP ranks' partial products summed backward (Megatron's
    ``f``)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.clone()
        if ctx.group is not None:
            dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """The TP ranks' partial outputs summed forward; identity backward (Megatron's ``g``)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        x = x.clone()
        if group is not None:
            dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class Stage(nn.Module):
    """One pipeline stage of the language model on one TP rank: ``h + W2 relu(W1 h)``, scaled by a
    norm weight; ``W1`` split by rows (column-parallel), ``W2`` by columns (row-parallel), the norm
    replicated over TP."""

    def __init__(self, stage: int, tp_group: Any) -> None:
        super().__init__()
        tp, rank = group_size(tp_group), group_rank(tp_group)
        self.tp_group = tp_group
        fc1 = _full(f"language.{stage}.fc1", WIDE, HIDDEN).chunk(tp, 0)[rank]
        fc2 = _full(f"language.{stage}.fc2", HIDDEN, WIDE).chunk(tp, 1)[rank]
        self.fc1 = mark_tensor_parallel(nn.Parameter(fc1.float().contiguous()), 0)
        self.fc2 = mark_tensor_parallel(nn.Parameter(fc2.float().contiguous()), 1)
        self.norm = nn.Parameter(torch.ones(HIDDEN))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        x = _CopyToTP.apply(h, self.tp_group)
        y = _ReduceFromTP.apply(torch.relu(x @ self.fc1.T) @ self.fc2.T, self.tp_group)
        return (h + y) * self.norm


class Language(nn.Module):
    """This rank's stage of the language model, registered as ``layers.<stage>`` (global layer
    names)."""

    def __init__(self, pg: Any) -> None:
        super().__init__()
        self.stage = group_rank(pg.get("pp"))
        self.layers = nn.ModuleDict({str(self.stage): Stage(self.stage, pg.get("tp"))})
        # this TP rank's stages, by pipeline rank
        self.peers = dist.get_process_group_ranks(pg.get("pp"))

    def loss(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor | None:
        """Forward and backward through both stages (activations and their grads sent between them);
        the loss on the last stage, ``None`` on the first."""
        stage = self.layers[str(self.stage)]
        if self.stage == 0:
            h = stage(x)
            dist.send(h.detach(), self.peers[1])
            grad = torch.empty_like(h)
            dist.recv(grad, self.peers[1])
            h.backward(grad)
            return None
        h = torch.empty(x.shape)
        dist.recv(h, self.peers[0])
        h.requires_grad_()
        loss = (stage(h) - target).square().mean()
        loss.backward()
        dist.send(h.grad, self.peers[0])  # type: ignore[arg-type]
        return loss


def reference_loss(
    weights: dict[str, torch.Tensor], module: str, x: torch.Tensor, t: torch.Tensor
) -> torch.Tensor:
    """The unsharded model's loss in float64 (the mean over the batch)."""
    if module == "encoder":
        return (
            (torch.relu(x @ weights["encoder.fc1"].T) @ weights["encoder.fc2"].T - t)
            .square()
            .mean()
        )
    h = x
    for stage in (0, 1):
        y = torch.relu(h @ weights[f"language.{stage}.fc1"].T) @ weights[f"language.{stage}.fc2"].T
        h = (h + y) * weights[f"language.{stage}.norm"]
    return (h - t).square().mean()


# ------------------------------------------------------------------------------------------ the job


def _models(modules: mm.MultiModuleCollection) -> dict[str, nn.Module]:
    models: dict[str, nn.Module] = {}
    if "encoder" in modules.here():
        models["encoder"] = Encoder()
    if "language" in modules.here():
        models["language"] = Language(modules["language"])
    return models


def _forward_backward(
    models: dict[str, nn.Module], modules: mm.MultiModuleCollection, step: int
) -> None:
    """Each module this rank runs, on its data-parallel rank's slice of the step's batch (mean over
    the slice)."""
    for name, model in models.items():
        x, target = _batch(name, step)
        dp = modules[name].get("dp")
        size, rank = group_size(dp), group_rank(dp)
        mine = slice(rank * BATCH // size, (rank + 1) * BATCH // size)
        x, target = x[mine].float(), target[mine].float()
        if name == "encoder":
            (model(x) - target).square().mean().backward()
        else:
            model.loss(x, target)  # type: ignore[operator]


def _reference_step(
    weights: dict[str, torch.Tensor], adam: torch.optim.Optimizer, step: int
) -> float:
    """One float64 step of both unsharded modules: the job-wide norm of their full grads, clipped,
    Adam."""
    adam.zero_grad()
    for module in ("encoder", "language"):
        reference_loss(weights, module, *_batch(module, step)).backward()
    grads = [w.grad.flatten() for w in weights.values()]  # type: ignore[union-attr]
    norm = float(torch.cat(grads).norm())
    coeff = min(MAX_NORM / (norm + 1e-6), 1.0)
    for w in weights.values():
        w.grad.mul_(coeff)  # type: ignore[union-attr]
    adam.step()
    return norm


def _reference() -> tuple[dict[str, torch.Tensor], torch.optim.Optimizer]:
    weights = {
        "encoder.fc1": _full("encoder.fc1", WIDE, HIDDEN),
        "encoder.fc2": _full("encoder.fc2", HIDDEN, WIDE),
    }
    for stage in (0, 1):
        weights[f"language.{stage}.fc1"] = _full(f"language.{stage}.fc1", WIDE, HIDDEN)
        weights[f"language.{stage}.fc2"] = _full(f"language.{stage}.fc2", HIDDEN, WIDE)
        weights[f"language.{stage}.norm"] = torch.ones(HIDDEN, dtype=torch.float64)
    for w in weights.values():
        w.requires_grad_()
    return weights, torch.optim.Adam(weights.values(), lr=LR)


def run(colocated: bool, directory: Path) -> dict[str, Any]:
    """The job on this rank (every rank of an 8-rank world calls it); returns what it measured."""
    modules = mm.build_modules(
        layouts(colocated), language_model="language", disjoint=not colocated
    )
    # each module's own streams: fork one around the module's dropout
    trackers = mm.seed_modules(SEED, modules)
    models = _models(modules)
    optimizer = mm.build_optimizer(models, modules, optimizer="adam", lr=LR, mixed_precision=False)
    weights, adam = _reference()
    out: dict[str, Any] = {
        "rank": dist.get_rank(),
        "here": modules.here(),
        "seeds": {name: tracker.seeds()[DATA_PARALLEL_RNG] for name, tracker in trackers.items()},
        "norms": [],
        "oracle": [],
    }
    for step in range(STEPS):
        optimizer.zero_grad()
        _forward_backward(models, modules, step)
        optimizer.sync_grads()
        stepped, norm, _ = optimizer.step(MAX_NORM)
        assert stepped
        out["norms"].append(norm)
        out["oracle"].append(_reference_step(weights, adam, step))

    # Every module into its own directory, over its own ranks; then into fresh models and a fresh
    # optimizer.
    mm.save_checkpoint(directory, models, modules, optimizer, naming=NAMING)
    fresh = _models(modules)
    with torch.no_grad():
        for model in fresh.values():
            for param in model.parameters():
                param.zero_()
    fresh_optimizer = mm.build_optimizer(
        fresh, modules, optimizer="adam", lr=LR, mixed_precision=False
    )
    mm.load_checkpoint(directory, fresh, modules, fresh_optimizer, naming=NAMING)
    out["loaded_same"] = _same(models, fresh)
    next_norms = []
    for opt, ms in ((optimizer, models), (fresh_optimizer, fresh)):
        opt.zero_grad()
        _forward_backward(ms, modules, STEPS)
        opt.sync_grads()
        next_norms.append(opt.step(MAX_NORM)[1])
    out["next_norms"] = next_norms
    out["next_same"] = _same(models, fresh)
    return out


def _same(models: dict[str, nn.Module], others: dict[str, nn.Module]) -> bool:
    return all(
        torch.equal(a, b)
        for name, model in models.items()
        for a, b in zip(model.parameters(), others[name].parameters(), strict=True)
    )


def failures(results: list[dict[str, Any]]) -> list[str]:
    """Every check the ranks' results fail (empty when the job is right)."""
    problems = []
    for got in results:
        where = f"rank {got['rank']} ({', '.join(got['here'])})"
        for step, (norm, oracle) in enumerate(zip(got["norms"], got["oracle"], strict=True)):
            if not math.isclose(norm, oracle, rel_tol=1e-5):
                problems.append(
                    f"{where} step {step}: job-wide norm {norm} "
                    f"but the float64 oracle's is {oracle}"
                )
        if not got["loaded_same"]:
            problems.append(f"{where}: the loaded weights differ from the saved ones")
        if not got["next_same"] or got["next_norms"][0] != got["next_norms"][1]:
            problems.append(f"{where}: the loaded job does not take the same next step")
    seeds = [seed for got in results for seed in got["seeds"].items()]
    for name in ("encoder", "language"):
        if {seed for module, seed in seeds if module == name} & {
            seed for module, seed in seeds if module != name
        }:
            problems.append(f"module {name!r} shares an RNG seed with another module")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--colocated", action="store_true", help="both modules on all 8 ranks")
    args = parser.parse_args(argv)
    if "RANK" in os.environ:  # under torchrun: this process is one rank
        dist.init_process_group("gloo")
        where = [tempfile.mkdtemp(prefix="pgregistry-mimo-") if dist.get_rank() == 0 else None]
        # one checkpoint directory for every rank (on a shared file system)
        dist.broadcast_object_list(where)
        results: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(results, run(args.colocated, Path(str(where[0]))))
        rank = dist.get_rank()
        dist.destroy_process_group()
        if rank != 0:
            return 0
    else:
        from pgregistry.testing import run_world

        results = run_world(
            8, run, args.colocated, Path(tempfile.mkdtemp(prefix="pgregistry-mimo-")), timeout=60
        )
    problems = failures(results)
    print(
        f"{'colocated' if args.colocated else 'disjoint'} "
        f"job; rank 0 runs {', '.join(results[0]['here'])}:"
    )
    for step, (norm, oracle) in enumerate(
        zip(results[0]["norms"], results[0]["oracle"], strict=True)
    ):
        print(f"  step {step}: job-wide grad norm {norm:.6f}, float64 oracle {oracle:.6f}")
    for problem in problems:
        print(f"FAILED: {problem}", file=sys.stderr)
    if not problems:
        print(
            "  every rank matches the oracle; each module "
            "checkpointed, reloaded, and takes the same next step"
        )
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())

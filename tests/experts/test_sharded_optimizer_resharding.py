"""A sharded optimizer's Adam state, keyed by global names, saved at EP 4, reloaded at EP 2, EP 1, PP 2 and EP 4.

The toy MoE (TP 1) trains ``STEPS`` Adam steps with ``build_optimizer(..., sharded=True)`` at EP 4 on 8
ranks (dense dp 8, expert dp 2), saves its parameters (:func:`save_rank_files`) and optimizer pieces
(:func:`save_optimizer_shards`), then takes one more step: the uninterrupted run. Each later world loads the
previous world's files under its own layout (:func:`load_optimizer_shards` joins the pieces by global name and
cuts them for its shards), saves them again and takes the same one more step.

Oracle: the whole model (EP 1, one process, ``torch.optim.Adam``) trained on the same gradients, named by its own
``named_parameters()``. Every world's pieces must tile every parameter, expert or dense, exactly once, and their
main copies, ``exp_avg``, ``exp_avg_sq`` and ``step`` must equal the oracle's bit for bit, before and after the
step; so must every stored file and every rank's model parameters.

Why bit for bit and not within round-off: the gradients are exact. Each is the mean of ``CONTRIBUTIONS`` tensors of
multiples of 1/64 below 8 in magnitude; a rank holds a power-of-two multiple of a partial sum, the optimizer
divides it by the dp size (a power of two) and sums it over ranks, and every partial result fits in float32's
mantissa, so no reduction order or layout changes a bit. Adam is elementwise (each element's update is the same
sequence of correctly rounded operations however the flat buffer is cut into pieces), and there is no clipping
(the global norm would reduce in a layout-dependent order). Any difference is therefore a resharding error.
"""

from __future__ import annotations

import copy
import warnings
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch
import torch._dynamo  # noqa: F401  # imported once here; each forked rank would otherwise import it (~3 s)
import torch.distributed as dist
from checkpoint_support import flip_a_byte_of
from toy_moe import Key, ToyMoE, build_stage, set_values

from pgregistry import ProcessGroupFallbackWarning, attach
from pgregistry.checkpoint import (
    load_optimizer_shards,
    load_rank_files,
    save_optimizer_shards,
    save_rank_files,
)
from pgregistry.collection import ProcessGroupCollection
from pgregistry.experts import global_param_name_fn, is_expert_key, named_global_parameters
from pgregistry.layout import ParallelLayout
from pgregistry.optim import ChainedOptimizer, build_optimizer
from pgregistry.params import mark_expert
from pgregistry.registry import build
from pgregistry.testing import run_world

LR, BETAS = 0.01, (0.8, 0.9)
STEPS = 2  # before the save
CONTRIBUTIONS = 8  # a gradient is the mean of this many parts, split over the data-parallel ranks
ADAM_STATE = ("exp_avg", "exp_avg_sq", "step")

CHAIN = [
    ParallelLayout(num_ranks=8, ep=4),  # trains and saves: dense dp 8, expert dp 2
    ParallelLayout(num_ranks=8, ep=2),  # expert dp 4
    ParallelLayout(num_ranks=4, ep=2),  # dense dp 4, expert dp 2
    ParallelLayout(num_ranks=8, ep=1),  # expert dp 8: every expert on every rank, cut 8 ways
    ParallelLayout(num_ranks=8, pp=2, ep=4),  # two pipeline stages: dense dp 4, expert dp 1 (experts whole)
    ParallelLayout(num_ranks=8, ep=4),  # back to the start
]

Whole = dict[str, dict[str, torch.Tensor]]
"""Global name -> ``{"param", "exp_avg", "exp_avg_sq", "step"}``, the tensors flattened (``step`` is 0-d)."""


# --------------------------------------------------------------------------------------------------- gradients


def _parts(key: Key, shape: torch.Size, step: int) -> torch.Tensor:
    """The ``CONTRIBUTIONS`` parts of the gradient of parameter ``key`` at ``step``: multiples of 1/64 in [-8, 8)."""
    generator = torch.Generator()
    generator.manual_seed(zlib.crc32(repr((key, step, "grad")).encode()))
    return torch.randint(-512, 512, (CONTRIBUTIONS, *shape), generator=generator, dtype=torch.float32) / 64


def _local_grad(parts: torch.Tensor, replicas: int, replica: int, dp_size: int) -> torch.Tensor:
    """What one of ``replicas`` data-parallel ranks holds so that ``sync_grads`` makes it the mean of ``parts``.

    ``sync_grads`` divides by ``dp_size`` (``dp_cp``; CP is off here) and sums over the ``replicas`` ranks (``dp``
    for dense parameters, ``expt_dp`` for experts, whose grads already hold the tokens of their EP group), so
    replica ``r`` holds ``dp_size / CONTRIBUTIONS`` times the sum of its block of parts.
    """
    block = CONTRIBUTIONS // replicas
    return parts[replica * block : (replica + 1) * block].sum(0) * (dp_size / CONTRIBUTIONS)


@pytest.fixture(scope="module")
def oracle() -> list[Whole]:
    """The whole model after ``STEPS`` and after ``STEPS + 1`` steps of plain Adam on the mean gradients."""
    model = build_stage(0, 1, 0, 1)
    set_values(model)
    adam = torch.optim.Adam(model.parameters(), lr=LR, betas=BETAS, foreach=False)
    out = []
    for step in range(STEPS + 1):
        for param, key in model.catalog:
            param.grad = _parts(key, param.shape, step).sum(0) / CONTRIBUTIONS
        adam.step()
        if step >= STEPS - 1:
            out.append({name: _flat(param, adam.state[param]) for name, param in model.named_parameters()})
    return out


def _flat(param: torch.Tensor, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {
        "param": param.detach().reshape(-1).clone(),
        "exp_avg": state["exp_avg"].reshape(-1).clone(),
        "exp_avg_sq": state["exp_avg_sq"].reshape(-1).clone(),
        "step": state["step"].clone(),
    }


# --------------------------------------------------------------------------------------------------- ranks


def _step(
    model: ToyMoE, optimizer: ChainedOptimizer, layout: ParallelLayout, coords: dict[str, int], step: int
) -> None:
    optimizer.zero_grad()
    for param, key in model.catalog:
        expert = key[1] >= 0
        replicas, replica = (layout.expt_dp, coords["expt_dp"]) if expert else (layout.dp, coords["dp"])
        param.main_grad.copy_(_local_grad(_parts(key, param.shape, step), replicas, replica, layout.dp))
    optimizer.sync_grads()
    optimizer.step()


def _held(model: ToyMoE, optimizer: ChainedOptimizer) -> dict[str, Any]:
    """Copies of this rank's optimizer pieces (global name -> piece) and of its model parameters."""
    pieces = {name: piece for child in optimizer.state_dict()["children"] for name, piece in child["shards"].items()}
    params = {name: param.detach().clone() for name, param in named_global_parameters(model)}
    return {"pieces": copy.deepcopy(pieces), "params": params}


def _stage(layout: ParallelLayout, pgc: ProcessGroupCollection) -> ToyMoE:
    """This rank's toy model, its experts marked as such and its collection attached."""
    coords = layout.coords(dist.get_rank())
    model = build_stage(coords["ep"], layout.ep, coords["pp"], layout.pp)
    for param, key in model.catalog:
        if key[1] >= 0:
            mark_expert(param)
    attach(model, pgc)
    return model


def _rank(layout: ParallelLayout, load_from: Path | None, save_to: Path) -> dict[str, Any]:
    warnings.simplefilter("error", ProcessGroupFallbackWarning)  # the model's collection is complete
    pgc = build(layout)
    coords = layout.coords(dist.get_rank())
    model = _stage(layout, pgc)
    if load_from is None:
        set_values(model)
    else:
        load_rank_files(load_from, model)
    optimizer = build_optimizer(
        model, pgc, optimizer="adam", lr=LR, betas=BETAS, sharded=True, param_name_fn=global_param_name_fn(model)
    )
    if load_from is None:
        for step in range(STEPS):
            _step(model, optimizer, layout, coords, step)
    else:
        load_optimizer_shards(load_from, optimizer)
    loaded = _held(model, optimizer)
    save_rank_files(save_to, model)
    save_optimizer_shards(save_to, optimizer)
    _step(model, optimizer, layout, coords, STEPS)
    return {"loaded": loaded, "after": _held(model, optimizer)}


# --------------------------------------------------------------------------------------------------- checks


def _tile(pieces_of_ranks: list[dict[str, Any]], like: Whole) -> Whole:
    """Join the pieces of every rank into whole flat tensors, asserting that each element of each parameter of
    ``like`` is held by exactly one rank and that the pieces of a parameter agree on its ``step``."""
    counts = {name: torch.zeros(entry["param"].numel(), dtype=torch.int64) for name, entry in like.items()}
    whole: Whole = {name: {} for name in like}
    for rank, pieces in enumerate(pieces_of_ranks):
        for name, piece in pieces.items():
            assert name in like, f"rank {rank} holds {name!r}, which the model does not have"
            assert set(piece["state"]) == set(ADAM_STATE), (rank, name)
            window = slice(piece["offset"], piece["offset"] + piece["numel"])
            counts[name][window] += 1
            for what, value in {"param": piece["main"], **piece["state"]}.items():
                if what == "step":
                    assert torch.equal(whole[name].setdefault(what, value), value), (rank, name)
                    continue
                target = whole[name].setdefault(what, torch.full_like(like[name][what], float("nan")))
                target[window] = value
    for name, count in counts.items():
        assert bool((count == 1).all()), f"{name}: elements held {sorted(set(count.tolist()))} times"
    return whole


def _assert_equal(got: Whole, want: Whole, where: str) -> None:
    assert sorted(got) == sorted(want), where
    for name, entry in want.items():
        for what, tensor in entry.items():
            value = got[name][what]
            assert value.dtype == tensor.dtype and torch.equal(value, tensor), (where, name, what)


def _assert_params(results: list[dict[str, Any]], when: str, want: Whole, where: str) -> None:
    for rank, result in enumerate(results):
        for name, param in result[when]["params"].items():
            assert torch.equal(param.reshape(-1), want[name]["param"]), (where, rank, name)


def _stored(directory: Path) -> list[dict[str, Any]]:
    """Every rank's stored optimizer pieces, read back without pgregistry."""
    files = sorted(directory.glob("optimizer-rank-*.pt"))
    return [torch.load(path, weights_only=True)["state"] for path in files]


def _expert_cuts(results: list[dict[str, Any]]) -> set[tuple[str, int, int]]:
    """Where the experts' parameters are cut into pieces: ``(name, offset, numel)`` of every piece."""
    pieces = [(name, p) for r in results for name, p in r["loaded"]["pieces"].items() if is_expert_key(name)]
    return {(name, piece["offset"], piece["numel"]) for name, piece in pieces}


def test_sharded_adam_state_reshards_across_ep_and_pp(tmp_path: Path, oracle: list[Whole]) -> None:
    saved, stepped = oracle
    assert any(is_expert_key(name) for name in saved)
    uninterrupted: Whole | None = None
    first_cuts: set[tuple[str, int, int]] = set()
    previous: Path | None = None
    for hop, layout in enumerate(CHAIN):
        where = f"hop {hop}: world {layout.num_ranks}, EP {layout.ep}, PP {layout.pp}"
        directory = tmp_path / f"hop{hop}-ws{layout.num_ranks}-ep{layout.ep}-pp{layout.pp}"
        results = run_world(layout.num_ranks, _rank, layout, previous, directory)
        _assert_equal(_tile([r["loaded"]["pieces"] for r in results], saved), saved, where)
        _assert_params(results, "loaded", saved, where)
        _assert_equal(_tile(_stored(directory), saved), saved, f"{where}, stored")
        after = _tile([r["after"]["pieces"] for r in results], stepped)
        _assert_params(results, "after", stepped, where)
        if uninterrupted is None:
            uninterrupted, first_cuts = after, _expert_cuts(results)
        elif layout != CHAIN[0]:
            assert _expert_cuts(results) != first_cuts, f"{where}: the experts are cut as at the save"
        _assert_equal(after, uninterrupted, f"{where}, one step after loading, against the uninterrupted run")
        _assert_equal(after, stepped, f"{where}, one step after loading, against the oracle")
        previous = directory


# --------------------------------------------------------------------------------------------------- refusals


def _build(layout: ParallelLayout, *, sharded: bool) -> ChainedOptimizer:
    pgc = build(layout)
    model = _stage(layout, pgc)
    return build_optimizer(model, pgc, sharded=sharded, param_name_fn=global_param_name_fn(model))


def _save_two_ranks(directory: Path) -> None:
    layout = ParallelLayout(num_ranks=2, ep=2)
    with pytest.raises(ValueError, match="child 0 is a MixedPrecisionOptimizer"):
        save_optimizer_shards(directory, _build(layout, sharded=False))
    save_optimizer_shards(directory, _build(layout, sharded=True))


def _load_one_rank(complete: Path, incomplete: Path) -> None:
    optimizer = _build(ParallelLayout(num_ranks=1, ep=1), sharded=True)
    with pytest.raises(ValueError, match="does not hold exactly one checkpoint"):
        load_optimizer_shards(incomplete, optimizer)
    # The plain state-dict loader refuses another layout's pieces, and says what to use instead.
    piece_of_two = {"param_groups": [], "shards": torch.load(complete / "optimizer-rank-00000.pt")["state"]}
    with pytest.raises(ValueError, match="shards do not match: .*load_optimizer_shards"):
        optimizer.chained_optimizers[0].load_state_dict(piece_of_two)
    load_optimizer_shards(complete, optimizer)  # the complete one loads, from 2 ranks at EP 2 into 1 at EP 1


def test_optimizer_shard_files_refuse_what_they_cannot_load(tmp_path: Path) -> None:
    complete, incomplete = tmp_path / "complete", tmp_path / "incomplete"
    run_world(2, _save_two_ranks, complete)
    incomplete.mkdir()
    (incomplete / "optimizer-rank-00000.pt").write_bytes((complete / "optimizer-rank-00000.pt").read_bytes())
    run_world(1, _load_one_rank, complete, incomplete)


def _load_shards_from(directories: list[Path], strict: bool = True) -> str:
    optimizer = _build(ParallelLayout(num_ranks=2, ep=2), sharded=True)
    try:
        load_optimizer_shards(directories[dist.get_rank()], optimizer, strict=strict)
    except ValueError as exc:
        return str(exc)
    return "loaded"


def test_optimizer_shards_a_rank_cannot_read_fail_every_rank_without_a_hang(tmp_path: Path) -> None:
    # Rank 1 cannot read its directory: it used to raise alone while rank 0 went on into the dense child's
    # all-gather of the restored shard (over dp_cp, which rank 1 is in), and waited there for ever.
    complete, empty = tmp_path / "complete", tmp_path / "empty"
    run_world(2, _save_two_ranks, complete)
    empty.mkdir()
    assert run_world(2, _load_shards_from, [complete, empty], timeout=30.0) == [
        f"another rank could not load the optimizer shards of {complete} (rank 1: see its error)",
        f"no optimizer-rank-<rank>.pt files in {empty}",
    ]


def test_a_damaged_piece_one_rank_reads_fails_every_rank_naming_the_file_and_piece(tmp_path: Path) -> None:
    # Per-tensor checksums: a flipped bit in a stored piece used to load as a silently different main copy.
    run_world(2, _save_two_ranks, tmp_path)
    path = tmp_path / "optimizer-rank-00001.pt"
    pieces = torch.load(path, weights_only=True)["state"]
    name = next(name for name in pieces if is_expert_key(name))  # an expert of EP rank 1: only rank 1 reads it
    flip_a_byte_of(path, pieces[name]["main"])
    assert run_world(2, _load_shards_from, [tmp_path, tmp_path], timeout=30.0) == [
        f"another rank could not load the optimizer shards of {tmp_path} (rank 1: see its error)",
        f"{path} is damaged: the bytes of tensor '{name}/main' do not match the checksum stored when it was saved; "
        "restore the file from a copy",
    ]


def test_saved_pieces_of_a_parameter_no_optimizer_holds_are_refused_on_every_rank(tmp_path: Path) -> None:
    # The pieces of parameters no rank's optimizer held (another model's, more layers') were dropped silently.
    run_world(2, _save_two_ranks, tmp_path)
    path = tmp_path / "optimizer-rank-00000.pt"
    payload = torch.load(path, weights_only=True)
    payload["state"]["layers.9.extra.weight"] = next(iter(payload["state"].values()))
    torch.save(payload, path)
    refusal = (
        f"the optimizer shards of {tmp_path} hold 1 parameters no rank's optimizer holds, e.g. "
        "'layers.9.extra.weight' (another model, more layers or more experts?); pass strict=False to load a subset "
        "on purpose"
    )
    assert run_world(2, _load_shards_from, [tmp_path, tmp_path], timeout=30.0) == [refusal, refusal]
    assert run_world(2, _load_shards_from, [tmp_path, tmp_path], False, timeout=30.0) == ["loaded", "loaded"]

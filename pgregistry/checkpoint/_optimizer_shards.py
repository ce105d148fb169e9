"""The sharded optimizer-state format: pieces of flattened parameters keyed by global name.

This module reads and writes it.

A sharded (distributed) optimizer stores pieces of flattened parameters; keyed by global names (give
it :func:`pgregistry.experts.global_param_name_fn`), its pieces from every rank of one layout are
joined by :func:`merge_optimizer_shards` and cut for another layout by :func:`cut_optimizer_shards`.
:func:`save_optimizer_shards` / :func:`load_optimizer_shards` do both through per-rank files
(``optimizer-rank-<rank>.pt``, beside the parameters' ``rank-<rank>.pt``), so its state reloads
under another EP or data-parallel size.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Final

import torch

from pgregistry.checkpoint._agreement import (
    Scope,
    max_over_ranks,
    name_lost_ranks,
    raise_on_every_rank,
    run_agreed_step,
    same_on_every_rank,
    scope_of,
)
from pgregistry.checkpoint._directory import checkpoint_path
from pgregistry.checkpoint._rank_files import read_rank_contents, write_rank_file
from pgregistry.checkpoint._strict import check_strict
from pgregistry.collection import group_size
from pgregistry.optim._chained import ChainedOptimizer
from pgregistry.optim._sharded import ShardedOptimizer
from pgregistry.optim._state_check import first_few_quoted, refuse_faults

__all__ = [
    "cut_optimizer_shards",
    "load_optimizer_shards",
    "merge_optimizer_shards",
    "save_optimizer_shards",
]

_OPTIMIZER_FILE: Final = "optimizer-rank-"


def merge_optimizer_shards(
    shards: Iterable[Mapping[str, Mapping[str, Any]]],
) -> dict[str, dict[str, Any]]:
    """Whole flat per-parameter state from the pieces a sharded optimizer saved on every rank.

    The pieces are those of one layout.

    Each item of ``shards`` is one rank's ``name -> {"offset", "numel", "main", "state"}`` (the
    ``"shards"`` part of a sharded optimizer's state dict, as pgregistry's ``ShardedOptimizer``
    writes it): the piece ``[offset, offset + numel)`` of the flattened parameter ``name``, its main
    copy and its optimizer state. A state tensor of shape ``(numel,)`` is a piece of an elementwise
    state (Adam's moments); any other value (Adam's 0-d ``step``) belongs to the whole parameter and
    must be equal in every piece.

    Returns ``name -> {"main": flat tensor, "state": {key: flat tensor or value}}``. ``ValueError``
    when the pieces of a parameter overlap, leave a gap, or disagree on their state keys or
    per-parameter values.
    """
    pieces: dict[str, list[Mapping[str, Any]]] = {}
    for rank_shards in shards:
        for name, piece in rank_shards.items():
            pieces.setdefault(name, []).append(piece)
    return {
        name: _merge_pieces(name, sorted(found, key=lambda p: p["offset"]))
        for name, found in pieces.items()
    }


def _is_elementwise(value: Any, numel: int) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() == numel


def _merge_pieces(name: str, pieces: list[Mapping[str, Any]]) -> dict[str, Any]:
    end = 0
    for piece in pieces:
        if piece["offset"] != end:
            problem = "overlap" if piece["offset"] < end else "leave a gap"
            raise ValueError(
                f"the saved pieces of {name!r} {problem} at element {min(end, piece['offset'])}"
            )
        end += piece["numel"]
    keys = {tuple(sorted(piece["state"])) for piece in pieces}
    if len(keys) > 1:
        raise ValueError(
            f"the saved pieces of {name!r} hold different optimizer state keys: {sorted(keys)}"
        )
    state: dict[str, Any] = {}
    for key in next(iter(keys)):
        values = [piece["state"][key] for piece in pieces]
        if all(_is_elementwise(v, piece["numel"]) for v, piece in zip(values, pieces, strict=True)):
            state[key] = torch.cat([v.reshape(-1) for v in values])
            continue
        first = values[0]
        if not all(_same_value(first, v) for v in values[1:]):
            raise ValueError(
                f"the saved pieces of {name!r} disagree on the per-parameter state {key!r}"
            )
        state[key] = first
    return {"main": torch.cat([piece["main"].reshape(-1) for piece in pieces]), "state": state}


def _same_value(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a, b))
    return bool(a == b)


def cut_optimizer_shards(
    whole: Mapping[str, Mapping[str, Any]], template: Mapping[str, Mapping[str, Any]]
) -> dict[str, dict[str, Any]]:
    """This rank's pieces of :func:`merge_optimizer_shards` output, for ``template``'s layout.

    ``template`` is the ``"shards"`` part of the state dict of the optimizer to load into (it says
    which pieces this rank holds now); the result replaces it before ``optimizer.load_state_dict``.
    Tensors are copies. ``ValueError`` when a piece's parameter is missing or too short.
    """
    out: dict[str, dict[str, Any]] = {}
    for name, piece in template.items():
        if name not in whole:
            raise ValueError(f"the saved optimizer state lacks parameter {name!r}")
        start, numel = piece["offset"], piece["numel"]
        source = whole[name]
        total = source["main"].numel()
        if start + numel > total:
            raise ValueError(
                f"{name!r}: this rank's piece [{start}, "
                f"{start + numel}) exceeds the saved {total} elements"
            )
        out[name] = {
            "offset": start,
            "numel": numel,
            "main": _cut_slice(source["main"], start, numel),
            "state": {
                key: _cut_slice(value, start, numel)
                if _is_elementwise(value, total)
                else _copy_state_value(value)
                for key, value in source["state"].items()
            },
        }
    return out


def _cut_slice(tensor: torch.Tensor, start: int, numel: int) -> torch.Tensor:
    return tensor[start : start + numel].clone()


def _copy_state_value(value: Any) -> Any:
    """A per-parameter state value copied, so the cut state shares no tensor with the merged one."""
    return value.clone() if isinstance(value, torch.Tensor) else value


def _require_sharded_children(
    optimizer: ChainedOptimizer | ShardedOptimizer, owner: str
) -> list[ShardedOptimizer]:
    children = (
        optimizer.chained_optimizers if isinstance(optimizer, ChainedOptimizer) else [optimizer]
    )
    sharded: list[ShardedOptimizer] = []
    for index, child in enumerate(children):
        if not isinstance(child, ShardedOptimizer):
            raise ValueError(
                f"{owner} handles sharded optimizers (build_optimizer(..., "
                f"sharded=True)); child {index} is a {type(child).__name__}, "
                "whose state_dict() is keyed by parameter name already"
            )
        sharded.append(child)
    return sharded


def _refuse_tp_held(children: list[ShardedOptimizer], owner: str, *, sharded_only: bool) -> None:
    """``ValueError`` for a parameter held on several TP ranks (expert TP for an expert's).

    A sharded optimizer's pieces are cut by offset from each rank's own flattened tensor, which
    over TP is each TP rank's copy or piece under one global name: a save's pieces of two TP ranks
    overlap (the load refused them, naming no TP), so a save refuses any parameter under TP; a load
    at TP 2 of a TP 1 save gave a TP-sharded parameter's TP rank 1 the first elements of the whole,
    TP rank 0's rows, as its Adam state and main copy (its weights too) without a word, so a load
    refuses TP-sharded parameters (``sharded_only``; one replicated over TP loads whole).
    :func:`~pgregistry.checkpoint.save_rank_files` gathers TP pieces whole."""
    for child in children:
        group = child.stats_groups.expt_tp if child.expert else child.stats_groups.tp
        if group_size(group) == 1:
            continue
        for param in child.params:
            if sharded_only and not getattr(param, "tensor_model_parallel", False):
                continue
            axis = "expert TP" if child.expert else "TP"
            how = "sharded over" if sharded_only else "on"
            raise ValueError(
                f"{owner}: the optimizer holds {child.param_name(param)!r} {how} "
                f"{group_size(group)} {axis} ranks, each rank its own under that name; optimizer "
                "shards are cut from whole tensors held by one rank each. Checkpoint a TP model's "
                "optimizer with save_rank_files / load_rank_files (or save_distributed / "
                "load_distributed), which join its TP pieces whole"
            )


def _other_sizes(whole: Mapping[str, Mapping[str, Any]], child: ShardedOptimizer) -> list[str]:
    """The parameters of ``child`` whose saved whole (``whole``'s main copy) has another size.

    A piece is cut by offset from the saved whole, so a checkpoint of a larger parameter (a weight
    of 6 rows loaded into one of 4, a model of another size under the same names) gave each piece
    the whole's first elements without a word; the piece fits, the whole does not."""
    faults = []
    for param in child.params:
        name = child.param_name(param)
        if name in whole and whole[name]["main"].numel() != param.numel():
            faults.append(
                f"{name!r} holds {whole[name]['main'].numel()} elements in the checkpoint, "
                f"{param.numel()} here (a model of another size?)"
            )
    return faults


def _checkpoint_scope(children: list[ShardedOptimizer]) -> Scope:
    """The ranks the optimizer's checkpoint runs over: those of the collection it was built on."""
    return scope_of(children[0].stats_groups.collection)


def save_optimizer_shards(
    directory: str | Path, optimizer: ChainedOptimizer | ShardedOptimizer
) -> Path:
    """Write this rank's pieces of a sharded optimizer to ``directory/optimizer-rank-<rank>.pt``.

    The pieces are the ``"shards"`` of every child's state dict, keyed by the names the optimizer
    was built with: give it :func:`pgregistry.experts.global_param_name_fn` names and
    :func:`load_optimizer_shards` reloads them under another EP, PP or data-parallel size. Every
    rank of the optimizer's collection (the world, or a module's span) must call it, with a fresh
    directory per checkpoint (it may be the one :func:`save_rank_files` writes the parameters to).
    Hyper-parameters are not stored. The pieces must be whole-tensor pieces held by one rank each,
    so TP and GTP-remat must be off (unlike :func:`save_rank_files`, which gathers TP shards): a
    parameter held on several TP ranks is refused; the loader refuses overlapping pieces.

    Args:
        directory: a fresh directory for this checkpoint.
        optimizer: a :class:`~pgregistry.optim.ShardedOptimizer`, or a chained optimizer of them.

    Returns:
        The path of the file this rank wrote.

    Raises:
        ValueError: two parameters of the optimizer of one name (give it unique names); on every
            rank, nothing written, a parameter held on several TP (expert TP) ranks, an existing
            checkpoint in ``directory`` or a rank failing to write (its error names the file and
            the disk).
        RuntimeError: a rank lost, stuck or killed in one of the call's collectives: the call, the
            directory and the ranks that did not answer named.

    Example::

        save_optimizer_shards("ckpt/step-100", optimizer)
    """
    directory = checkpoint_path(directory, "save_optimizer_shards")
    shards: dict[str, Any] = {}
    children = _require_sharded_children(optimizer, "save_optimizer_shards")
    for child in children:
        for name, piece in child.state_dict()["shards"].items():
            if name in shards:
                raise ValueError(
                    f"two parameters of the optimizer are named {name!r}; give it unique names"
                )
            shards[name] = piece
    scope = _checkpoint_scope(children)
    with name_lost_ranks("save_optimizer_shards", directory, scope):
        run_agreed_step(
            lambda: _refuse_tp_held(children, "save_optimizer_shards", sharded_only=False),
            ValueError("save_optimizer_shards: another rank's optimizer holds TP pieces"),
            scope,
        )
        return write_rank_file(directory, _OPTIMIZER_FILE, shards, scope)


def load_optimizer_shards(
    directory: str | Path, optimizer: ChainedOptimizer | ShardedOptimizer, *, strict: bool = True
) -> None:
    """Load :func:`save_optimizer_shards` files written under any layout into a sharded optimizer.

    Each child's pieces are joined from every saved rank by name (:func:`merge_optimizer_shards`,
    which refuses gaps, overlaps and disagreeing per-parameter state) and cut for the shards this
    rank holds now (:func:`cut_optimizer_shards`); main copies and optimizer state are restored, and
    the parameters get the main copies. Collective: every rank must call it, on the same directory.
    Only the saved pieces of parameters this rank holds are read (the files are memory-mapped), but
    each is joined whole, so a rank holds the whole state of those parameters for a moment.
    Hyper-parameters stay those of ``optimizer``.

    Args:
        directory: the directory :func:`save_optimizer_shards` wrote.
        optimizer: a :class:`~pgregistry.optim.ShardedOptimizer`, or a chained optimizer of them, on
            any layout; a TP-sharded parameter's pieces would be cut from the whole's first
            elements, so it is refused (one replicated over TP loads whole).
        strict: refuse pieces of a parameter no rank's optimizer holds, as
            :func:`~pgregistry.checkpoint.load_rank_files` does (default); ``False`` loads a subset
            on purpose.

    Raises:
        ValueError: on every rank, before any loads: a parameter TP-sharded (expert TP) over
            several ranks; a parameter of the optimizer not in the checkpoint, or saved with
            another number of elements (a model of another size); with ``strict``, pieces of a
            parameter no rank's optimizer holds; files that mix checkpoints or saves; a file a rank
            cannot read; a piece read that is damaged (the file and the piece named).
        RuntimeError: a rank lost, stuck or killed in one of the call's collectives: the call, the
            directory and the ranks that did not answer named.

    Example::

        load_optimizer_shards("ckpt/step-100", optimizer_on_another_layout)
    """
    directory = checkpoint_path(directory, "load_optimizer_shards")
    check_strict(strict, "load_optimizer_shards")
    children = _require_sharded_children(optimizer, "load_optimizer_shards")
    scope = _checkpoint_scope(children)
    with name_lost_ranks("load_optimizer_shards", directory, scope):
        # Every child's pieces are cut and checked against it before any is loaded, and the ranks
        # agree that all of them fit: a child refusing after another loaded would leave a
        # half-loaded optimizer, and loading gathers the restored shards, so a rank raising alone
        # would leave its peers waiting in that collective.
        run_agreed_step(
            lambda: _refuse_tp_held(children, "load_optimizer_shards", sharded_only=True),
            ValueError("load_optimizer_shards: another rank's optimizer holds TP-sharded pieces"),
            scope,
        )
        saved: list[str] = []
        held: set[str] = set()
        try:
            files = read_rank_contents(directory, _OPTIMIZER_FILE, scope)
            saved = sorted({name for rank_file in files for name in rank_file.state})
            loads: list[dict[str, Any]] = []
            for child in children:
                current = child.state_dict()
                template = current["shards"]
                held |= template.keys()
                for (
                    rank_file
                ) in files:  # the saved pieces this rank reads, checked against their checksums
                    for name in template.keys() & rank_file.state.keys():
                        rank_file.verify(name)
                whole = merge_optimizer_shards(
                    {name: piece for name, piece in rank_file.state.items() if name in template}
                    for rank_file in files
                )
                load = {
                    "param_groups": current["param_groups"],
                    "shards": cut_optimizer_shards(whole, template),
                }
                subject = f"the optimizer shards of {directory} for child {len(loads)}"
                refuse_faults(subject, _other_sizes(whole, child) + child.state_dict_faults(load))
                loads.append(load)
            error = None
        except (ValueError, OSError) as exc:
            error = exc
        raise_on_every_rank(
            error,
            ValueError(f"another rank could not load the optimizer shards of {directory}"),
            scope,
        )
        if strict:
            _refuse_unheld(directory, saved, held, scope)
        for child, state in zip(children, loads, strict=True):
            child.load_state_dict(state)


def _refuse_unheld(directory: str | Path, saved: list[str], held: set[str], scope: Scope) -> None:
    """``ValueError`` on every rank when a saved parameter is held by no rank's optimizer.

    After one all-reduce that the ranks read the same names, and one of a flag per name."""
    if not same_on_every_rank(saved, scope):
        raise ValueError(
            f"ranks read different checkpoints: every rank must load the same one ({directory})"
        )
    union = max_over_ranks([int(name in held) for name in saved], scope)
    unheld = [name for name, used in zip(saved, union, strict=True) if not used]
    if unheld:
        raise ValueError(
            f"the optimizer shards of {directory} hold {len(unheld)} parameters no rank's "
            f"optimizer holds, e.g. {first_few_quoted(unheld, 5)} (another model, more "
            "layers or more experts?); pass strict=False to load a subset on purpose"
        )

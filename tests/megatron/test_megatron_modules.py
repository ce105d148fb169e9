"""Megatron-Core's multi-module objects in and out of pgregistry, against the real Megatron-Core in an 8-rank gloo
world: ``HyperCommGrid`` -> collection by identity of the grid's communicators (none created), Megatron-Core's own
MIMO optimizer collection (``_get_pg_collection_for_optimizer``) read back with the same layout,
``MultiModuleProcessGroupCollection`` both ways, and bad input refused on every rank. A kind the grid did not
create is off where it has one rank, else the grid's communicator over the same ranks.

The job is the MIMO shape: an encoder on ranks 0-3 (data parallel 4) and a language model on ranks 4-7 at TP 2,
PP 2, EP 2 with expert TP 1; each grid has the ``"expert"`` view Megatron-Core's MIMO optimizer reads.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from megatron_support import error_of, require_megatron

require_megatron()

from megatron.core.hyper_comm_grid import HyperCommGrid  # noqa: E402
from megatron.core.models.mimo.optimizer import _get_pg_collection_for_optimizer  # noqa: E402
from megatron.core.process_groups_config import MultiModuleProcessGroupCollection  # noqa: E402
from megatron.core.process_groups_config import ProcessGroupCollection as MegatronCollection  # noqa: E402

from pgregistry import registry  # noqa: E402
from pgregistry.collection import ProcessGroupCollection  # noqa: E402
from pgregistry.interop.megatron import from_hyper_comm_grid, from_megatron, to_megatron  # noqa: E402
from pgregistry.layout import ParallelLayout  # noqa: E402
from pgregistry.modules import MultiModuleCollection  # noqa: E402
from pgregistry.testing import run_world  # noqa: E402

WORLD = 8
ENCODER = ParallelLayout(num_ranks=4)
LANGUAGE = ParallelLayout(num_ranks=4, tp=2, pp=2, ep=2, expt_tp=1, rank_offset=4)
# The grid dims each collection field is read from (base view, then the "expert" view), as Megatron-Core's MIMO does.
BASE = {
    "tp": "tp", "cp": "cp", "dp": "dp", "pp": "pp", "dp_cp": ["dp", "cp"], "mp": ["tp", "pp"],
    "tp_dp_cp": ["tp", "cp", "dp"], "intra_dist_opt": ["tp", "cp", "dp", "pp"],
}
EXPERT = {"ep": "ep", "expt_tp": "expt_tp", "expt_dp": "expt_dp", "tp_ep_pp": ["expt_tp", "ep", "pp"]}
NOT_CREATED = ("embd", "pos_embd", "inter_dist_opt")
# Kinds the grids did not create, which need no communicator: off (one rank) or the grid's own over the same ranks.
FILLED = ("tp_cp", "tp_ep", "gtp_remat", "expt_gtp_remat")


def _grid(layout: ParallelLayout) -> HyperCommGrid:
    """A module's grid as Megatron-Core's MIMO users build one, with every group its optimizer reads created."""
    first, _ = layout.rank_range()
    grid = HyperCommGrid([layout.tp, layout.cp, layout.dp, layout.pp], ["tp", "cp", "dp", "pp"], rank_offset=first)
    grid.register_view(
        "expert", [layout.expt_tp, layout.ep, layout.expt_dp, layout.pp], ["expt_tp", "ep", "expt_dp", "pp"],
        shared_dims=["pp"],
    )
    for dims in BASE.values():
        grid.create_pg(dims)
    for dims in EXPERT.values():
        grid.create_pg(dims, view="expert")
    return grid


def _megatron_collection(grid: HyperCommGrid) -> MegatronCollection:
    """Megatron-Core's collection of every group the grid created."""
    fields = {field: grid.get_pg(dims) for field, dims in BASE.items()}
    fields.update({field: grid.get_pg(dims, view="expert") for field, dims in EXPERT.items()})
    return MegatronCollection(**fields)


def _identity(collection: ProcessGroupCollection, grid: HyperCommGrid) -> list[str]:
    """Fields that do not hold the grid's own communicator, or are set though the grid did not create them."""
    wrong = [f for f, dims in BASE.items() if collection.get(f) is not grid.get_pg(dims)]  # type: ignore[arg-type]
    wrong += [f for f, d in EXPERT.items() if collection.get(f) is not grid.get_pg(d, view="expert")]  # type: ignore[arg-type]
    wrong += [f for f in NOT_CREATED if collection.is_set(f)]  # type: ignore[arg-type]
    grids = [grid.get_pg(dims) for dims in BASE.values()] + [grid.get_pg(d, view="expert") for d in EXPERT.values()]
    filled = {f: collection.get(f) for f in FILLED}  # type: ignore[call-overload]
    wrong += [f for f, g in filled.items() if g is not None and not any(g is theirs for theirs in grids)]
    return wrong


def _same_after_round_trip(again: ProcessGroupCollection, original: ProcessGroupCollection) -> bool:
    """Every field holds what the original holds (UNSET included); an off one (None) went to Megatron-Core, which
    has no "off", as a group of this rank alone, and comes back as that group."""
    back = dict(again.items())
    for name, value in original.items():
        if value is None:
            group = back[name]
            if not isinstance(group, dist.ProcessGroup) or dist.get_process_group_ranks(group) != [dist.get_rank()]:
                return False
        elif back[name] is not value:
            return False
    return again.layout == original.layout


def _grids_and_modules() -> dict[str, Any]:
    rank = dist.get_rank()
    grids = {"encoder": _grid(ENCODER), "language": _grid(LANGUAGE)}
    c10d_groups = dist.distributed_c10d._world.group_count
    created = registry.communicators_created()
    collections = {name: from_hyper_comm_grid(grid, name=name) for name, grid in grids.items()}
    out: dict[str, Any] = {
        "new groups": (
            dist.distributed_c10d._world.group_count - c10d_groups, registry.communicators_created() - created
        ),
        "layouts": {name: c.layout for name, c in collections.items()},
        "members": {name: c.is_member for name, c in collections.items()},
        "identity": {name: _identity(c, grids[name]) for name, c in collections.items() if c.is_member},
    }
    # Megatron-Core collections of the modules this rank runs, made from the grids as a MIMO user makes them, read back.
    here = [name for name, grid in grids.items() if grid.is_current_rank_in_grid()]
    theirs = {name: _megatron_collection(grids[name]) for name in here}
    language = "language" if "language" in here else None
    back = from_megatron(MultiModuleProcessGroupCollection(module_pgs=theirs, language_model_module_name=language))
    out["from mimo"] = {
        "layouts": back.layouts(),
        "language_model": back.language_model,
        "here": back.here(),
        "same groups": all(
            back[name].get(f) is getattr(theirs[name], f) for name in here for f in vars(theirs[name])
        ),
    }
    # pgregistry's multi-module collection out to Megatron-Core and back: the same communicators.
    modules = MultiModuleCollection(collections, language_model="language", disjoint=True)
    megatron_modules = to_megatron(modules)
    again = from_megatron(megatron_modules)
    out["to megatron"] = (sorted(megatron_modules.module_pgs), megatron_modules.language_model_module_name)
    out["same tp"] = all(megatron_modules.module_pgs[n].tp is collections[n].tp for n in here)
    out["round trip"] = {name: _same_after_round_trip(again[name], collections[name]) for name in here}
    out["round trip layouts"] = again.layouts() == modules.layouts() and again.language_model == "language"
    # A later build of a grid's layout reuses the grid's communicators.
    built = registry.build(LANGUAGE, name="language built")
    out["build reuses"] = built.is_member and built.tp is collections["language"].tp
    out["bad"] = _bad_input(rank, grids, collections)
    return out


def _bad_input(
    rank: int, grids: dict[str, HyperCommGrid], collections: dict[str, ProcessGroupCollection]
) -> dict[str, str]:
    language_only = MultiModuleCollection({"language": collections["language"]}, language_model="language")
    here = [name for name in collections if collections[name].is_member]
    theirs = {name: _megatron_collection(grids[name]) for name in here}
    own_language = here[0]  # each rank names its own module the language model: they disagree
    # Megatron-Core's MIMO optimizer collection lacks cp, ep and expt_tp: several layouts would fit it.
    optimizers = {name: _get_pg_collection_for_optimizer(grids[name]) for name in here}
    return {
        "underdetermined": error_of(
            lambda: from_megatron(MultiModuleProcessGroupCollection(module_pgs=optimizers))
        ),
        "unknown dim": error_of(lambda: from_hyper_comm_grid(HyperCommGrid([2, 4], ["tp", "sp"]))),
        "not a grid": error_of(lambda: from_hyper_comm_grid(collections["encoder"])),
        "runs none": error_of(lambda: to_megatron(language_only)),
        "two language models": error_of(
            lambda: from_megatron(
                MultiModuleProcessGroupCollection(module_pgs=theirs, language_model_module_name=own_language)
            )
        ),
        "outside": error_of(lambda: to_megatron(collections["language"])),
    }


def test_hyper_comm_grids_and_multi_module_collections_pass_in_and_out_without_a_new_communicator() -> None:
    results = run_world(WORLD, _grids_and_modules, timeout=60)
    for rank, out in enumerate(results):
        encoder_rank = rank < 4
        assert out["new groups"] == (0, 0), (rank, out["new groups"])
        assert out["layouts"] == {"encoder": ENCODER, "language": LANGUAGE}
        assert out["members"] == {"encoder": encoder_rank, "language": not encoder_rank}
        assert out["identity"] == {("encoder" if encoder_rank else "language"): []}, out["identity"]
        mimo = out["from mimo"]
        assert mimo["layouts"] == {"encoder": ENCODER, "language": LANGUAGE}
        assert mimo["language_model"] == "language" and mimo["same groups"]
        assert mimo["here"] == (("encoder",) if encoder_rank else ("language",))
        assert out["to megatron"] == (["encoder"], None) if encoder_rank else (["language"], "language")
        assert out["same tp"] and out["round trip layouts"] and all(out["round trip"].values()), out
        assert out["build reuses"] is not encoder_rank
        bad = out["bad"]
        assert bad["unknown dim"].startswith("ValueError: HyperCommGrid dim 'sp' is none of the base dims")
        assert bad["not a grid"].startswith("TypeError: from_hyper_comm_grid expects megatron.core.hyper_comm_grid")
        if encoder_rank:
            assert bad["runs none"].startswith(f"ValueError: rank {rank} runs none of the modules of ")
            assert bad["outside"].startswith(
                f"ValueError: to_megatron was given layout 'language' {LANGUAGE!r}, which spans ranks 4-7; this rank "
                f"({rank}) is not one of them"
            )
        else:
            assert bad["runs none"] == "no error" and bad["outside"] == "no error"
        assert bad["underdetermined"].startswith(
            "ValueError: module 'encoder' lacks the groups ['cp', 'ep', 'expt_tp'], so its layout is not determined"
        )
        assert bad["two language models"] == "ValueError: ranks name different language models: ['encoder', 'language']"

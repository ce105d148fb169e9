"""Checkpoints keyed by global parameter names, so they reload under another layout.

The other layout may differ in expert or pipeline parallelism.

Every parameter and its optimizer state are stored under the parameter's global name
(:func:`pgregistry.experts.named_global_parameters`): experts numbered over the whole model, layers
over the whole pipeline. A checkpoint written with EP 4 and PP 2 therefore reloads with EP 2, EP 1
or PP 1: each rank asks for the names it holds now. Megatron-Core's optimizer state, keyed by
rank-local parameter order, does not.

Each tensor is written exactly once: a dense parameter by data-parallel (``dp_cp``) rank 0 of its
replicas and TP rank 0, an expert parameter by expert-data-parallel (``expt_dp``) rank 0 and
expert-TP rank 0. Tensors are stored whole: a TP-sharded parameter (and its optimizer state) is
all-gathered over its TP group along its ``partition_dim`` and cut again on load, so a checkpoint
also reloads at another TP size. GTP-remat sharding must be off (``gtp_remat``, ``expt_gtp_remat``
of size 1), and interleaved TP shards (``partition_stride`` above 1) are refused; so are TP
pieces of other shapes, dtypes or ``partition_dim`` values across a TP group, optimizer state of
them held unlike across it, DTensor parameters (``fully_shard``: each rank holds its own shard),
pipeline stages holding parameters of one global name (one layer offset given to two stages; a tied
copy marked ``shared`` may keep its original's name, written by the original's stage), and,
at EP above 1, expert parameters whose name holds no expert index (experts stacked in one tensor):
each would be stored as one rank's.

Every collective of a save or load runs over the ranks of the model's collection: the world, or, for
one module of a job whose layout covers part of the world, the module's span
(:mod:`~pgregistry.checkpoint._agreement`); such a checkpoint records the module's name and span and
loads into that module on those ranks only (:mod:`pgregistry.modules` saves each module of a job
into a directory of its own).

* :mod:`~pgregistry.checkpoint._by_name`: state keyed by global name (:func:`state_by_name`;
  :mod:`~pgregistry.checkpoint._optimizer_state`: :func:`load_optimizer_state_by_name`);
* :mod:`~pgregistry.checkpoint._strict`: the strict verdict every loader takes on every rank before
  copying;
* :mod:`~pgregistry.checkpoint._rank_files`: one ``torch.save`` file per rank
  (:func:`save_rank_files` / :func:`load_rank_files`);
* :mod:`~pgregistry.checkpoint._distributed`: ``torch.distributed.checkpoint``
  (:func:`save_distributed` / :func:`load_distributed`);
* :mod:`~pgregistry.checkpoint._optimizer_shards`: the sharded optimizer-state format (merge, cut,
  save, load);
* :mod:`~pgregistry.checkpoint._agreement`: the ranks a save or load runs over, and their verdicts
  taken alike;
* :mod:`~pgregistry.checkpoint._directory`: the ``directory`` of every save and load (a path, not
  empty, not a file; a DCP save never overwrites a checkpoint);
* :mod:`~pgregistry.checkpoint._disk`: one file written under a temporary name, renamed when the
  caller says; a failed write names the file;
* :mod:`~pgregistry.checkpoint._integrity`: the CRC-32 of every stored tensor, checked for the
  tensors a load reads.

The functions given model chunks find the global names with the keywords ``pg_collection``,
``num_experts`` and ``layer_offsets`` (:class:`~pgregistry.experts._names.NamingOptions`;
``pg_collection`` defaults to the collection attached to the model).

Every loader is strict by default, alike (:mod:`~pgregistry.checkpoint._strict`): what does not fit
is refused on every rank, naming it, before anything is copied. A rank lost during a save or load is
named on every survivor (:func:`~pgregistry.checkpoint._agreement.name_lost_ranks`).

Optimizer hyper-parameters (learning rate, betas, ...) are not stored: they come from the optimizer
loaded into.
"""

from __future__ import annotations

from pgregistry.checkpoint._by_name import state_by_name
from pgregistry.checkpoint._distributed import load_distributed, save_distributed
from pgregistry.checkpoint._optimizer_shards import load_optimizer_shards, save_optimizer_shards
from pgregistry.checkpoint._optimizer_state import load_optimizer_state_by_name
from pgregistry.checkpoint._rank_files import load_rank_files, save_rank_files

__all__ = [
    "load_distributed",
    "load_optimizer_state_by_name",
    "load_optimizer_shards",
    "load_rank_files",
    "save_distributed",
    "save_optimizer_shards",
    "save_rank_files",
    "state_by_name",
]

"""Expert-parallel ranks, and parameter names that do not depend on the parallel layout.

With expert parallelism (EP) each rank holds ``num_experts // ep_size`` experts and numbers them
from 0, so a rank-local name such as ``layers.3.mlp.experts.local_experts.0.linear_fc1.weight``
means a different expert on every EP rank; saved under local names, the experts of all ranks
overwrite each other (KempnerForge#202) and cannot be reloaded at another EP size. A *global* name
numbers experts over the whole model (``ep_rank * (num_experts // ep_size) + local_index``) and
layers over the whole pipeline, so it is the same on every layout. On the standard grid (EP 1, PP 1)
global names equal local ones: existing checkpoints keep loading.

* :mod:`~pgregistry.experts._ep`: the EP rank and size, from a collection;
* :mod:`~pgregistry.experts._keys`: state-dict expert keys renamed between local and global indices;
* :mod:`~pgregistry.experts._names`: global parameter names of model chunks.

Nothing here imports torch at load, so the key functions can be used on checkpoints without it.
"""

from __future__ import annotations

from pgregistry.experts._ep import get_ep_rank_and_size
from pgregistry.experts._keys import (
    expert_owner,
    global_expert_index,
    globalize_expert_keys,
    is_expert_key,
    localize_expert_keys,
)
from pgregistry.experts._names import (
    get_global_unique_param_name,
    global_param_name_fn,
    named_global_parameters,
)

__all__ = [
    "expert_owner",
    "get_ep_rank_and_size",
    "get_global_unique_param_name",
    "global_expert_index",
    "global_param_name_fn",
    "globalize_expert_keys",
    "is_expert_key",
    "localize_expert_keys",
    "named_global_parameters",
]

"""Megatron-Core 0.19.2's shape of a module built from a spec, small enough to build without a model config:
``Attention.__init__`` builds ``submodules.linear_proj(...)`` (a class the layer spec chose, here directly, through
a backend's method and through a ``ModuleSpec``) while it holds a collection (its shim's, or the one it was
given), and the linear layer reads ``gtp_remat`` through a ``use_mpu_process_groups`` shim, as
``RowParallelLinear.__init__`` does."""

from dataclasses import dataclass

from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.typed_torch import not_none


class RowLinear:
    def __init__(self, size, *, tp_group=None):
        self.size = size
        self.tp_group = tp_group
        self.gtp_remat_group = ProcessGroupCollection.use_mpu_process_groups(
            required_pgs=["gtp_remat"]
        ).gtp_remat


class FusedRowLinear(RowLinear):
    """Inherits ``RowLinear.__init__`` unchanged."""


class LocalBackend:
    def row_parallel_linear(self):
        return RowLinear


class FusedBackend:
    def row_parallel_linear(self):
        return FusedRowLinear


@dataclass
class AttentionSubmodules:
    linear_proj: type
    core_attention: type = None


class Attention:
    def __init__(self, submodules, pg_collection=None):
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"])
        self.pg_collection = pg_collection
        self.linear_proj = submodules.linear_proj(4, tp_group=self.pg_collection.tp)
        self.other_proj = build_module(submodules.linear_proj, 2, tp_group=self.pg_collection.tp)


def attention_spec(kind):
    if kind == "local":
        return AttentionSubmodules(linear_proj=LocalBackend().row_parallel_linear())
    if kind == "fused":
        return AttentionSubmodules(linear_proj=FusedBackend().row_parallel_linear())
    if kind == "spec":
        return AttentionSubmodules(linear_proj=ModuleSpec(module=not_none(FusedRowLinear), params={}))
    return AttentionSubmodules(linear_proj=RowLinear if kind == "plain" else FusedRowLinear)


def projection_groups(kind, pg_collection=None):
    """The ``gtp_remat`` groups the attention's two projections were built with (a layer's caller passes its
    collection, or none)."""
    attention = Attention(attention_spec(kind), pg_collection=pg_collection)
    return attention.linear_proj.gtp_remat_group, attention.other_proj.gtp_remat_group

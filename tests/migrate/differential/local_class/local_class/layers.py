"""Megatron-Core 0.19.2's shape of ``GPTModel``'s output layer, small enough to build without a model config:
``GPTModel.__init__`` assigns a local one of two classes (``TELMHeadColumnParallelLinear`` under MXFP8, else
``ColumnParallelLinear``) and builds it while it holds a collection (its shim's, or the one it was given); the
column layer reads ``gtp_remat`` through a ``use_mpu_process_groups`` shim, as ``ColumnParallelLinear.__init__``
does, and the head's ``__init__`` reads nothing and forwards to it through ``super().__init__``."""

import copy

from megatron.core.process_groups_config import ProcessGroupCollection


class ColumnLinear:
    def __init__(self, size, *, config=None, tp_group=None):
        self.size = size
        self.tp_group = tp_group
        self.gtp_remat_group = ProcessGroupCollection.use_mpu_process_groups(
            required_pgs=["gtp_remat"]
        ).gtp_remat


class HeadColumnLinear(ColumnLinear):
    def __init__(self, size, *, config=None, tp_group=None):
        if size < 1:
            raise ValueError(f"HeadColumnLinear needs a size, not {size}")
        head_config = copy.copy(config)
        super().__init__(size, config=head_config, tp_group=tp_group)
        self.head = True


class Model:
    def __init__(self, head, pg_collection=None):
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"])
        self.pg_collection = pg_collection
        output_layer_cls = (
            HeadColumnLinear
            if head
            else ColumnLinear
        )
        self.output_layer = output_layer_cls(4, config={}, tp_group=self.pg_collection.tp)


def output_layer_group(kind, pg_collection=None):
    """The ``gtp_remat`` group the model's output layer was built with (a model's caller passes its collection,
    or none)."""
    return Model(kind == "head", pg_collection=pg_collection).output_layer.gtp_remat_group

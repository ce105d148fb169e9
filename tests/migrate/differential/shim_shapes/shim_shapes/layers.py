"""The two shapes of ``use_mpu_process_groups`` shims in Megatron-Core 0.19.2's ``tensor_parallel/layers.py``
(``VocabParallelEmbedding.__init__``: read inline; ``ColumnParallelLinear.__init__``: a local read for one of its
two fields), in functions the harness can call without building a layer (which needs a model config)."""

from megatron.core.process_groups_config import ProcessGroupCollection


def embedding_gtp_remat_group():
    gtp_remat_group = ProcessGroupCollection.use_mpu_process_groups(
        required_pgs=["gtp_remat"]
    ).gtp_remat
    return gtp_remat_group


def linear_gtp_remat_group(is_expert):
    gtp_remat_size = 1
    _pg = ProcessGroupCollection.use_mpu_process_groups(
        required_pgs=["gtp_remat", "expt_gtp_remat"]
    )
    gtp_remat_group = _pg.expt_gtp_remat if is_expert else _pg.gtp_remat
    if gtp_remat_group is not None and gtp_remat_group.size() > 1:
        gtp_remat_size = gtp_remat_group.size()
    return gtp_remat_group, gtp_remat_size

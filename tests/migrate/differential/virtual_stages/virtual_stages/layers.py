"""The pipeline-stage reads with ``ignore_virtual=False`` of Megatron-LM's ``transformer_block.py``
(``get_num_layers_to_build``: a layer less on the first and last virtual stage) and
``multi_token_prediction.py`` (``get_mtp_num_layers_to_build``) at #3962's parent, less the layer arithmetic
that needs a model config, and ``mtp_on_this_rank`` of Megatron-Core 0.19.2."""

from megatron.core import parallel_state
from megatron.core import parallel_state as mpu


def layers_to_build(num_layers_to_build, vp_stage, embedding=True, loss=True):
    if parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage) and embedding:
        num_layers_to_build -= 1
        assert num_layers_to_build >= 0, "Not enough layers in the first virtual pipeline stage"

    if parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage) and loss:
        num_layers_to_build -= 1
        assert num_layers_to_build >= 0, "Not enough layers in the last virtual pipeline stage"
    return num_layers_to_build


def mtp_num_layers_to_build(mtp_num_layers, vp_stage=None):
    if mpu.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage):
        return mtp_num_layers if mtp_num_layers else 0
    else:
        return 0


def mtp_on_this_rank(mtp_num_layers, vp_stage=None, ignore_virtual=True):
    """Megatron-Core 0.19.2's ``mtp_on_this_rank`` without a custom pipeline layout: ``ignore_virtual``
    passed on, not a literal."""
    if mtp_num_layers is not None:
        return parallel_state.is_pipeline_last_stage(ignore_virtual=ignore_virtual, vp_stage=vp_stage)
    return False

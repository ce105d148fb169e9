"""The pipeline-stage reads with ``ignore_virtual=False`` of Megatron-LM's ``transformer_block.py``
(``get_num_layers_to_build``: a layer less on the first and last virtual stage) and
``multi_token_prediction.py`` (``get_mtp_num_layers_to_build``) at #3962's parent, less the layer arithmetic
that needs a model config."""

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

"""A tree of the ``is_pipeline_first/last_stage(ignore_virtual=False, vp_stage=...)`` reads Megatron-LM's #3962
removed by hand, for the harness."""

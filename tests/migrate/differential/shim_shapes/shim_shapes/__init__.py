"""A tree of the ``use_mpu_process_groups`` shim shapes Megatron-LM's #6234 removed by hand, for the harness."""

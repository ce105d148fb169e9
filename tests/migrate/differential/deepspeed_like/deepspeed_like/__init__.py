"""A DeepSpeed-like tree for the migration harness: code that reads process groups from an ``mpu`` object its user
passes in (DeepSpeed's ``InferenceEngine(model, mpu=...)``, ``deepspeed.initialize(mpu=...)``), not from
Megatron-Core's ``parallel_state``. ``pgregistry migrate`` must leave these reads alone (issue 40, item 6)."""

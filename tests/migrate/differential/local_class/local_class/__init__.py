"""A tree of a layer built from a local assigned classes (Megatron-Core's ``output_layer_cls(...)``), for the
harness."""

"""A tree of modules built from a spec (Megatron-Core's ``submodules.linear_proj(...)``), for the harness."""

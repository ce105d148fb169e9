"""An end-to-end example: a small MoE model trained on its own grids in a local gloo world, checked
against float64.

Run it from the repository root with ``python -m examples.moe_demo`` (``make demo``). The job lives
in :mod:`examples.moe_demo.job`; the sharded model and its float64 unsharded twin in
:mod:`examples.moe_demo.model`; the autograd-aware collectives it needs in
:mod:`examples.moe_demo.comm`. It uses pgregistry only through its public API; it is not part of the
package.
"""

"""The end-to-end demonstration: a small MoE model trained on its own grids in a local gloo world.

``pgregistry demo`` (what ``make demo`` runs) lives in :mod:`pgregistry.demo.job`; the sharded model and its
float64 unsharded twin in :mod:`pgregistry.demo.model`; the autograd-aware collectives it needs in
:mod:`pgregistry.demo.comm`.
"""

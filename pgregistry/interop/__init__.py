"""Bridges to training frameworks that have their own process-group objects (optional extras).

:mod:`pgregistry.interop.megatron` converts collections to and from Megatron-Core's (``pip install
pgregistry[megatron]``); :mod:`pgregistry.interop.torchtitan` builds torchtitan's ``ParallelDims``
meshes from a collection and reads one off them (``pip install pgregistry[torchtitan]``). Nothing
here is imported by ``import pgregistry``.
"""

__all__: list[str] = []

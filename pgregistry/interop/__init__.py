"""Bridges to training frameworks that have their own process-group objects (optional extras).

:mod:`pgregistry.interop.megatron` converts collections to and from Megatron-Core's (``pip install
pgregistry[megatron]``). Nothing here is imported by ``import pgregistry``.
"""

__all__: list[str] = []

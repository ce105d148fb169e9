"""A fork's module that takes Megatron-Core's accessors by a star import and overrides one with its own."""

from megatron.core.parallel_state import *  # noqa: F403


def get_tensor_model_parallel_rank():
    return 99


def own_and_star_ranks():
    return get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()  # noqa: F405

"""A user's stand-in for Megatron-Core's parallel_state (a test double, a CPU-only path): its own answers."""


def get_tensor_model_parallel_rank():
    return 70


def get_tensor_model_parallel_world_size():
    return 80

"""Reads of parallel_state in the shapes real trees write them (issue 40, the hostile probe)."""

import functools
import inspect

import megatron.core.parallel_state as mpu_module
import torch
from megatron.core import parallel_state
from megatron.core import parallel_state as ps
from megatron.core.parallel_state import *  # noqa: F403


def aliased():
    return ps.get_tensor_model_parallel_rank(), mpu_module.get_tensor_model_parallel_world_size()


def imported_inside():
    import megatron.core.parallel_state as mpu

    return mpu.get_tensor_model_parallel_rank()


def conditional_import(flag):
    if flag:
        from megatron.core import parallel_state as cps

        return cps.get_tensor_model_parallel_world_size()
    return "not imported"


def star_imported():
    return get_tensor_model_parallel_rank()  # noqa: F405


def in_lambda_and_comprehensions(n):
    size = lambda: ps.get_tensor_model_parallel_world_size()  # noqa: E731
    ranks = [ps.get_tensor_model_parallel_rank() + i for i in range(n)]
    total = sum(ps.get_tensor_model_parallel_rank() for _ in range(n))
    return size(), ranks, total


def nested_and_closure():
    def inner():
        return ps.get_tensor_model_parallel_rank()

    def later():
        return ps.get_tensor_model_parallel_world_size()

    return inner(), later


def with_nonlocal():
    value = None

    def set_it():
        nonlocal value
        value = ps.get_tensor_model_parallel_rank()

    set_it()
    return value


_LAST = None


def with_global():
    global _LAST
    _LAST = ps.get_tensor_model_parallel_rank()
    return _LAST


def guarded_by_initialized():
    if parallel_state.model_parallel_is_initialized():
        return parallel_state.get_tensor_model_parallel_rank()
    return "not initialised"


def walrus():
    if (rank := ps.get_tensor_model_parallel_rank()) > 0:
        return rank
    return "first"


def passes_through(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return fn(*args, **kwargs)

    return wrapper


@passes_through
def decorated(x):
    return x + ps.get_tensor_model_parallel_rank()


def class_made_inside():
    class Local:
        rank = ps.get_tensor_model_parallel_rank()

        def size(self):
            return ps.get_tensor_model_parallel_world_size()

    return Local.rank, Local().size()


def all_reduce_over_tp(x):
    torch.distributed.all_reduce(x, group=ps.get_tensor_model_parallel_group())
    return x


def initialize_then_read():
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=2, create_gloo_process_groups=False)
    return ps.get_tensor_model_parallel_rank()


def on_a_match_capture(state):
    match state:
        case ps:
            return ps.get_tensor_model_parallel_rank()


def on_a_fallback_import(use_fake):
    if use_fake:
        from hostile import fake_mpu as mpu
    else:
        from megatron.core import parallel_state as mpu
    return mpu.get_tensor_model_parallel_rank(), mpu.get_tensor_model_parallel_world_size()


def hybrid_stack_spec():
    return "stack spec", ps.get_tensor_model_parallel_world_size()


def resolve_stack_spec(stack_spec):
    # Megatron-Bridge 0.6.2's MambaModelProvider: a stack spec is called with the config when it takes parameters
    if len(inspect.signature(stack_spec).parameters) > 0:
        return stack_spec("config")
    return stack_spec()


def build_with_the_default_spec():
    spec = resolve_stack_spec(hybrid_stack_spec)
    return spec, hybrid_stack_spec()  # called by name too, so the tool threads it

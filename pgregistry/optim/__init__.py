"""Optimizers taking a process-group collection: mixed-precision, sharded, chained; on flat buffers.

:func:`build_optimizer` is the entry point: it splits a model's dense and routed-expert parameters,
validates the collection and returns a :class:`ChainedOptimizer` of a
:class:`MixedPrecisionOptimizer` or :class:`ShardedOptimizer` per kind. A training step::

    loss.backward()
    optimizer.sync_grads()           # grads / dp_cp size, summed over dp_cp (expt_dp for experts)
    optimizer.clip_grad_norm(1.0)    # global norm with each child's own groups
    optimizer.step()
    optimizer.zero_grad()
"""

from pgregistry.optim._base import FlatOptimizer, InnerFactory, ParamNameFn
from pgregistry.optim._builder import build_optimizer, inner_factory
from pgregistry.optim._chained import ChainedOptimizer
from pgregistry.optim._flat_step import ElementwiseRule, FlatStep
from pgregistry.optim._mixed_precision import MixedPrecisionOptimizer
from pgregistry.optim._param_state import ParamState, ParamStateOptimizer, as_param_state_optimizer
from pgregistry.optim._setup import OptimizerProcessGroups, setup_process_groups_for_optimizer
from pgregistry.optim._sharded import ShardedOptimizer

__all__ = [
    "ChainedOptimizer",
    "ElementwiseRule",
    "FlatOptimizer",
    "FlatStep",
    "InnerFactory",
    "MixedPrecisionOptimizer",
    "OptimizerProcessGroups",
    "ParamNameFn",
    "ParamState",
    "ParamStateOptimizer",
    "ShardedOptimizer",
    "as_param_state_optimizer",
    "build_optimizer",
    "inner_factory",
    "setup_process_groups_for_optimizer",
]

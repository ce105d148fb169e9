"""Grad statistics over a process-group collection: duplicate filters, norms, zero counts, clipping.

A global grad statistic must count each distinct piece of the model exactly once:

* :mod:`~pgregistry.grad_stats._filters`: which rank counts each gradient (TP, expert TP and GTP
  duplicates, shared copies) and which group sums it (:class:`StatsGroups`);
* :mod:`~pgregistry.grad_stats._reductions`: the one reduction path: local shares by group, one
  reducer issuing every collective in an order every rank agrees on;
* :mod:`~pgregistry.grad_stats._local`: local shares of lists of grads (the one-read kernel, host
  blocks, torch);
* :mod:`~pgregistry.grad_stats._fused`: the one-read kernel's launches and tables on CUDA, its
  Triton kernels in :mod:`~pgregistry.grad_stats._triton_kernels` (imported only where triton is);
* :mod:`~pgregistry.grad_stats._dtensors`: DTensor grads (FSDP2, ``parallelize_module``), each
  local piece counted as its placements and roles say;
* :mod:`~pgregistry.grad_stats._lists`: norms, zero counts and clipping of grads already filtered by
  group;
* :mod:`~pgregistry.grad_stats._plan`: a model's classification, kept between calls while it cannot
  be stale;
* :mod:`~pgregistry.grad_stats._compiled`: that plan's steady-state checks compiled, built once per
  machine (the Python checks run where they cannot be built);
* :mod:`~pgregistry.grad_stats._devices`: the device a statistic is computed and reduced on;
* :mod:`~pgregistry.grad_stats._arguments`: the checks of ``max_norm`` and ``norm_type``, one set
  for every entry point;
* :mod:`~pgregistry.grad_stats._classification`: the refusal of a marked expert module's parameter
  that does not say whether it is replicated across EP;
* :mod:`~pgregistry.grad_stats._functional`: :func:`grad_norm`, :func:`count_zeros`,
  :func:`grad_norm_and_zeros`, :func:`clip_grad_norm_` and :func:`classify_grads` on a model and its
  collection.
"""

from __future__ import annotations

from pgregistry.grad_stats._devices import backend_device, reduction_device
from pgregistry.grad_stats._filters import (
    StatsGroups,
    is_counted,
    param_is_not_gtp_duplicate,
    param_is_not_shared,
    param_is_not_tensor_parallel_duplicate,
    reduce_group_of,
)
from pgregistry.grad_stats._functional import (
    check_expert_classification,
    classify_grads,
    clip_grad_norm_,
    count_zeros,
    grad_norm,
    grad_norm_and_zeros,
)
from pgregistry.grad_stats._lists import clip_grads_, norm_of_grads, zeros_of_grads
from pgregistry.grad_stats._reductions import CLIP_EPSILON, reduce_over_groups

__all__ = [
    "CLIP_EPSILON",
    "StatsGroups",
    "backend_device",
    "check_expert_classification",
    "classify_grads",
    "clip_grad_norm_",
    "clip_grads_",
    "count_zeros",
    "grad_norm",
    "grad_norm_and_zeros",
    "is_counted",
    "norm_of_grads",
    "param_is_not_gtp_duplicate",
    "param_is_not_shared",
    "param_is_not_tensor_parallel_duplicate",
    "reduce_group_of",
    "reduce_over_groups",
    "reduction_device",
    "zeros_of_grads",
]

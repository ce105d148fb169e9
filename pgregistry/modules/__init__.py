"""Several modules in one job, each on its own layout: the job-wide collection and what uses it.

A module (a vision encoder, a language model, an RL actor or critic) runs on a layout over a span of
the world, its own or shared with others. :class:`MultiModuleCollection` holds every module's
collection on every rank; :func:`grad_norm`, :func:`count_zeros` and :func:`clip_grad_norm_` are the
job-wide grad statistics over the modules, each grad counted once across the whole job;
:class:`MultiModuleOptimizer` (:func:`build_optimizer`) steps every module's optimizer as one, with
that norm and a job-wide verdict on whether to step; :func:`seed_modules` gives each module RNG
streams of its own; :func:`save_checkpoint` and :func:`load_checkpoint` keep each module's
checkpoint in a directory of its own, written and read over the module's span only.
"""

from pgregistry.modules._checkpoint import load_checkpoint, save_checkpoint
from pgregistry.modules._collection import MultiModuleCollection, build_modules
from pgregistry.modules._optimizer import MultiModuleOptimizer, build_optimizer
from pgregistry.modules._rng import seed_modules
from pgregistry.modules._stats import clip_grad_norm_, count_zeros, grad_norm

__all__ = [
    "MultiModuleCollection",
    "MultiModuleOptimizer",
    "build_modules",
    "build_optimizer",
    "clip_grad_norm_",
    "count_zeros",
    "grad_norm",
    "load_checkpoint",
    "save_checkpoint",
    "seed_modules",
]

"""Several modules in one job, each on its own layout: the job-wide collection of modules and what uses it.

A module (a vision encoder, a language model, an RL actor or critic) runs on a layout over a span of the world,
its own or shared with others. :class:`MultiModuleCollection` holds every module's collection on every rank.
"""

from pgregistry.modules._collection import MultiModuleCollection, build_modules

__all__ = ["MultiModuleCollection", "build_modules"]

"""A ``language_model`` that names none of the job's modules is refused, by ``build_modules`` and by
``MultiModuleCollection`` itself, on every rank, naming the modules it could name.
"""

from __future__ import annotations

from modules_support import error_of

from pgregistry import modules as mm
from pgregistry.layout import ParallelLayout
from pgregistry.testing import run_world

LAYOUTS = {"vision": ParallelLayout(num_ranks=1), "llm": ParallelLayout(num_ranks=1, rank_offset=1)}


def _refusals() -> dict[str, str]:
    built = mm.build_modules(LAYOUTS)
    return {
        "build_modules": error_of(lambda: mm.build_modules(LAYOUTS, language_model="lm")),
        "MultiModuleCollection": error_of(lambda: mm.MultiModuleCollection(dict(built), language_model="lm")),
    }


def test_a_language_model_naming_no_module_is_refused_on_every_rank() -> None:
    expected = "ValueError: language_model 'lm' is none of the modules ['vision', 'llm']; name one of them or None"
    for refusals in run_world(2, _refusals, timeout=60):
        assert refusals == {"build_modules": expected, "MultiModuleCollection": expected}

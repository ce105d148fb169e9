"""The options of :func:`pgregistry.modules.build_optimizer`.

Checked on every rank before any optimizer is built.

Each module's optimizer is :func:`pgregistry.optim.build_optimizer` with the job's options updated
by the module's own (``per_module``). An option that fails there fails on that module's ranks only,
while every other rank has gone on into the job's agreement and waits in it; and torch's own refusal
of a bad value (``lr='x'``) names no option. So every rank checks every module's options here,
whether it runs the module or not, and the job's agreement raises the same error on every rank,
naming the module and the option. :func:`describe_options` gives what every rank must agree on: the
options' values where they are plain data, their types where they are code.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

from pgregistry._runtime.agreement import Fault, combine_faults
from pgregistry.optim import build_optimizer as build_module_optimizer
from pgregistry.optim._options import describe_options, option_error

__all__ = ["describe_options", "options_error"]


def options_error(
    options: Mapping[str, Any], per_module: Mapping[str, Any], modules: list[str]
) -> Fault:
    """Why the job's ``options`` or a module's ``per_module`` entry is refused, or ``None``.

    Every module's entry is checked, so that every rank finds the same faults."""
    faults = [_option_error(option, value) for option, value in options.items()]
    for name in modules:
        own = per_module.get(name, {})
        if not isinstance(own, Mapping):
            faults.append(
                TypeError(
                    f"module {name!r}: per_module[{name!r}] "
                    f"must be a mapping of options, got {own!r}"
                )
            )
            continue
        for option, value in own.items():
            fault = _option_error(option, value)
            if fault is not None:
                faults.append(type(fault)(f"module {name!r}: {fault}"))
    return combine_faults(*faults)


def _option_keywords() -> set[str]:
    """The keywords of :func:`pgregistry.optim.build_optimizer` that options may set."""
    parameters = inspect.signature(build_module_optimizer).parameters.values()
    return {p.name for p in parameters if p.kind is inspect.Parameter.KEYWORD_ONLY}


def _option_error(option: str, value: Any) -> Exception | None:
    """Why :func:`pgregistry.optim.build_optimizer` refuses ``value`` for ``option``, or ``None``.

    Checked against torch's ranges for the update rules' numbers."""
    if option not in _option_keywords():
        return TypeError(
            f"{option!r} is no option of pgregistry.optim.build_optimizer "
            f"({sorted(_option_keywords())})"
        )
    return option_error(option, value)

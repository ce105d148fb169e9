"""Whether a release's pipeline-stage accessors are those the fallback helper reproduces.

``parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)`` asks two
things: is ``vp_stage`` the first virtual stage (of the virtual pipeline size, a schedule setting
``initialize_model_parallel`` stores, no process group), and is this rank first in the pipeline
group. Given a collection, the fallback helper
(:func:`~pgregistry.migrate._fallback_helper.virtual_stage_allows`) answers the first as the
accessor does, from ``parallel_state``'s virtual pipeline size, and the second from the collection's
``pp``; without one it calls the accessor itself.

That is exact only for the accessors' form of Megatron-Core 0.13 on (:data:`FORM`). Megatron-LM's
trees of 2025-04-29 to 2025-05-20 took the virtual stage from the global virtual pipeline rank
instead, and asserted it equal to ``vp_stage``; before, ``vp_stage=`` did not exist. So a read with
``ignore_virtual=False`` is rewritten only where the code's ``parallel_state.py`` defines both
accessors exactly as :data:`FORM` does (docstrings aside), or where none was found (Megatron-Core
0.19's assumed, as for the field table).
"""

from __future__ import annotations

import ast

__all__ = ["FORM", "has_virtual_stage_form"]

#: The two accessors as Megatron-Core 0.13 to 0.19.2 define them (the form the helper reproduces).
FORM = """
def is_pipeline_first_stage(ignore_virtual=True, vp_stage=None):
    if not ignore_virtual and get_virtual_pipeline_model_parallel_world_size() is not None:
        assert vp_stage is not None, "vp_stage must be passed if virtual pipeline is enabled"

        if vp_stage != 0:
            return False
    return get_pipeline_model_parallel_rank() == 0


def is_pipeline_last_stage(ignore_virtual=True, vp_stage=None):
    if not ignore_virtual and get_virtual_pipeline_model_parallel_world_size() is not None:
        assert vp_stage is not None, "vp_stage must be passed if virtual pipeline is enabled"

        if vp_stage != (get_virtual_pipeline_model_parallel_world_size() - 1):
            return False
    return get_pipeline_model_parallel_rank() == (get_pipeline_model_parallel_world_size() - 1)
"""


def _function_definitions(tree: ast.Module) -> dict[str, str]:
    """The module-level functions of ``tree`` by name, dumped without their docstrings."""
    found: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            body = node.body
            if (
                body
                and isinstance(body[0], ast.Expr)
                and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)
            ):
                body = body[1:]
            found[node.name] = ast.dump(
                ast.FunctionDef(
                    node.name,
                    node.args,
                    body,
                    node.decorator_list,
                    node.returns,
                    node.type_comment,
                    **({"type_params": node.type_params} if hasattr(node, "type_params") else {}),
                )
            )
    return found


_WANTED = _function_definitions(ast.parse(FORM))


def has_virtual_stage_form(parallel_state_text: bytes) -> bool:
    """Whether ``parallel_state_text`` defines both stage accessors exactly as :data:`FORM` does.

    ``parallel_state_text`` is a release's ``parallel_state.py``; the accessors are
    ``is_pipeline_first_stage`` and ``is_pipeline_last_stage``. False for text Python does not
    parse."""
    try:
        defined = _function_definitions(ast.parse(parallel_state_text))
    except (SyntaxError, ValueError):
        return False
    return all(defined.get(name) == dump for name, dump in _WANTED.items())

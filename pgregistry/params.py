"""Parameter roles: how a parameter is laid out over the rank grid, as attributes set by helpers.

Grad statistics (:mod:`pgregistry.grad_stats`) and the replication audit (:mod:`pgregistry.audit`) decide whether a
local gradient is a distinct piece of the model or a copy of one from these roles alone:

* ``tensor_model_parallel`` (with ``partition_dim``, ``partition_stride``): sharded over TP (expert TP for
  experts), so every TP rank holds a different piece;
* ``allreduce=False``: a routed-expert parameter, distinct per EP rank and reduced over the expert groups;
  ``allreduce=True`` set explicitly: it lives in an expert module but is replicated across EP;
* ``shared``: a second copy of another parameter (tied embeddings on the last pipeline stage), never counted.
  Megatron-Core sets it itself, directly on the parameter (with ``shared_embedding``, which it also sets on the
  first stage's copy, the one that counts), as it does ``allreduce`` and ``tensor_model_parallel``;
* ``is_gtp_weight_remat``: sharded over the GTP-remat axis (expert GTP-remat for experts).

Roles are set by the ``mark_*`` helpers, never by hand. A copy made outside a module carries them only through
:func:`copy_param_roles` (Megatron-LM PR 6470: a mixed-precision copy that dropped ``allreduce=False`` turned every
expert into a dense parameter). A missing classification is an error, never a default (xorl: per-expert LoRA
factors defaulted to EP-replicated, the norm low by 1/sqrt(ep); see ``docs/known_bugs.md``):
:func:`pgregistry.grad_stats.check_expert_classification` refuses parameters of a marked expert module that say neither
``allreduce=False`` nor ``allreduce=True``.

Roles belong to the parameter's slot in its module as well as to the parameter object, because torch-native
sharding replaces the object: ``fully_shard`` (FSDP2) and ``parallelize_module`` register a new ``nn.Parameter``
(holding a DTensor) under the same name. Every role a ``mark_*`` helper sets on a parameter registered on a module
is also written to that module's role table (one entry per parameter name), and :func:`restore_param_roles` puts
the table's roles back on whatever parameter now fills the slot, so marking before or after sharding gives the
same roles. The slots a parameter fills are learnt from torch's global parameter-registration hook, installed when
this module is imported: a parameter registered on a module before that (a model built before any
``pgregistry.params`` import) and marked before sharding keeps its roles only as attributes of the object, which
sharding drops; mark such models after sharding, or import the helpers first.

Roles set without a helper (Megatron-Core sets ``shared``, ``shared_embedding``, ``allreduce`` and
``tensor_model_parallel`` as plain attributes, after registering the parameter) never reach the role table. So the
registration hook also keeps, per slot, the attribute dictionary of the parameter it registered (the object's own
``__dict__``, which later plain assignments write into): when ``fully_shard`` puts a new parameter in the slot
(bypassing the hook, through ``module._parameters``), :func:`restore_param_roles` reads the roles from the recorded
dictionary, whether the old parameter is still alive or not.

:func:`role_generation` counts every change made through this module (a helper's mark, a registration, a
restored role): a cached classification (:mod:`pgregistry.grad_stats._plan`) made at one generation is stale at
the next; plain attribute assignments it checks itself.

That check must not depend on how the parameters are passed: a model, its chunks, ``list(model.parameters())``,
a generator or a name -> parameter mapping. A model is walked module by module; bare tensors are recognised by
their own mark, ``in_expert_module``, which :func:`mark_expert_module` puts on every parameter under the module,
including parameters and submodules registered after the mark (through torch's module registration hooks, since
modules are usually marked at the top of their ``__init__``).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any, Final, TypeVar

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

__all__ = [
    "ROLE_ATTRIBUTES",
    "copy_param_roles",
    "is_expert_module",
    "is_expert_param",
    "mark_expert",
    "mark_expert_module",
    "mark_expert_replicated",
    "mark_gtp_sharded",
    "mark_shared",
    "mark_tensor_parallel",
    "param_roles",
    "restore_param_roles",
    "role_generation",
]

T = TypeVar("T", bound=torch.Tensor)

ROLE_ATTRIBUTES: Final[tuple[str, ...]] = (
    "tensor_model_parallel",
    "partition_dim",
    "partition_stride",
    "allreduce",
    "shared",
    "shared_embedding",
    "is_gtp_weight_remat",
    "in_expert_module",
    # Set by Megatron-Core and read by its optimizers and checkpoints: expert TP and QKV-split layout (Muon), the
    # padding of a GTP shard. Its copy helpers carry them over to main-parameter copies, so this does too.
    "expert_tp",
    "is_qkv",
    "qkv_split_shapes",
    "pad_length",
)
"""Every attribute that carries a parameter role; :func:`copy_param_roles` copies those present."""

_EXPERT_MODULE_FLAG: Final = "_pgregistry_expert_module"
_INSIDE_EXPERT_MODULE: Final = "_pgregistry_inside_expert_module"
"""Set on a marked expert module and every module under it: parameters registered on them get the mark."""
_IN_EXPERT_MODULE: Final = "in_expert_module"
_ROLE_TABLE: Final = "_pgregistry_param_roles"
"""Module attribute: parameter name -> the roles marked on the parameter in that slot."""
_SLOT_ATTRIBUTES: Final = "_pgregistry_slot_attributes"
"""Module attribute: parameter name -> the attribute dictionary of the parameter last seen in that slot."""
_SET_DIRECTLY: Final = tuple(name for name in ROLE_ATTRIBUTES if name != _IN_EXPERT_MODULE)
"""The roles read from a slot's previous parameter: all but pgregistry's own ``in_expert_module`` mark, which a
model walk derives from the module (and which marks bare tensors only)."""

_generation = 0


def role_generation() -> int:
    """A counter of the role changes made through this module (marks, copies, registrations, restored roles)."""
    return _generation


def _changed() -> None:
    global _generation
    _generation += 1



# ----------------------------------------------------------------------------------------------------- roles


def mark_tensor_parallel(param: T, partition_dim: int, stride: int = 1) -> T:
    """Declare ``param`` sharded over TP (expert TP for an expert) along tensor dim ``partition_dim``."""
    if not isinstance(partition_dim, int) or not 0 <= partition_dim < max(param.dim(), 1):
        raise ValueError(
            f"partition_dim {partition_dim!r} is not a dim of a parameter of shape {tuple(param.shape)}"
        )
    if not isinstance(stride, int) or stride < 1:
        raise ValueError(f"stride must be a positive integer, got {stride!r}")
    return _set_roles(param, tensor_model_parallel=True, partition_dim=partition_dim, partition_stride=stride)


def mark_expert(param: T) -> T:
    """Declare ``param`` a routed-expert parameter: distinct per EP rank, reduced over the expert groups."""
    return _set_roles(param, allreduce=False)


def mark_expert_replicated(param: T) -> T:
    """Declare ``param`` (in an expert module) replicated across EP, such as a LoRA factor shared by experts."""
    return _set_roles(param, allreduce=True)


def mark_shared(param: T) -> T:
    """Declare ``param`` a second copy of a parameter counted elsewhere (tied embeddings on the last stage)."""
    return _set_roles(param, shared=True)


def mark_gtp_sharded(param: T) -> T:
    """Declare ``param`` sharded over the GTP-remat axis (expert GTP-remat for experts)."""
    return _set_roles(param, is_gtp_weight_remat=True)


def copy_param_roles(src: torch.Tensor, dst: T) -> T:
    """Copy every role attribute present on ``src`` to ``dst`` (mixed-precision main params, optimizer views)."""
    for name, value in param_roles(src).items():
        setattr(dst, name, value)
    _changed()
    return dst


def param_roles(param: torch.Tensor) -> dict[str, Any]:
    """The role attributes present on ``param``, by name."""
    return {name: getattr(param, name) for name in ROLE_ATTRIBUTES if hasattr(param, name)}


def restore_param_roles(model: nn.Module | Sequence[nn.Module]) -> None:
    """Put the roles of each parameter slot of ``model`` back on the parameter now filling it: those marked with
    a helper (the slot's role table) and those the slot's previous parameter carried as plain attributes (set by
    Megatron-Core, or by hand, before ``fully_shard`` replaced it).

    A role already on the parameter wins (marking after sharding overrides marking before).
    The grad-statistics entry points call this on every model they are given, so a user need not.
    """
    for chunk in [model] if isinstance(model, nn.Module) else model:
        for module in chunk.modules():
            table: dict[str, dict[str, Any]] = module.__dict__.get(_ROLE_TABLE, {})
            seen: dict[str, dict[str, Any]] = module.__dict__.get(_SLOT_ATTRIBUTES, {})
            for name, param in module._parameters.items():
                if param is None:
                    continue
                previous = seen.get(name)
                if previous is not None and previous is not vars(param):
                    _give(param, {key: previous[key] for key in _SET_DIRECTLY if key in previous})
                    seen[name] = vars(param)
                _give(param, table.get(name, {}))


def _give(param: torch.Tensor, roles: dict[str, Any]) -> None:
    """Set each of ``roles`` that ``param`` does not carry yet."""
    for attribute, value in roles.items():
        if not hasattr(param, attribute):
            setattr(param, attribute, value)
            _changed()


_SLOTS: WeakIdKeyDictionary = WeakIdKeyDictionary()
"""Parameter -> ``[(weakref to module, name), ...]``: the module slots it was registered in."""


def _set_roles(param: T, **roles: Any) -> T:
    """Set ``roles`` on ``param`` and in the role table of every module slot it was registered in."""
    for attribute, value in roles.items():
        setattr(param, attribute, value)
    _changed()
    for module_ref, name in _SLOTS.get(param, ()):
        module = module_ref()
        if module is not None and module._parameters.get(name) is param:
            module.__dict__.setdefault(_ROLE_TABLE, {}).setdefault(name, {}).update(roles)
    return param


def _on_parameter_registration(module: nn.Module, name: str, param: nn.Parameter) -> None:
    """torch's global parameter-registration hook: remember the slot, and carry roles into a replacement.

    A parameter replacing a marked one under the same name (``parallelize_module``, ``distribute_module``, a user's
    ``nn.Parameter(distribute_tensor(...))``) receives the roles it does not carry itself; a marked parameter
    writes its roles to the slot's table; the slot remembers the parameter's attribute dictionary (see the module
    docstring).
    """
    _changed()
    previous = module._parameters.get(name)
    if previous is not None and previous is not param:
        _give(param, param_roles(previous))
    module.__dict__.setdefault(_SLOT_ATTRIBUTES, {})[name] = vars(param)
    slots = _SLOTS.setdefault(param, [])
    # FSDP2 re-registers the same parameters every step on modules with their own __setattr__: record a slot once.
    if not any(slot_module() is module and slot_name == name for slot_module, slot_name in slots):
        slots.append((weakref.ref(module), name))
    roles = param_roles(param)
    if roles:
        module.__dict__.setdefault(_ROLE_TABLE, {})[name] = roles
    if getattr(module, _INSIDE_EXPERT_MODULE, False):
        setattr(param, _IN_EXPERT_MODULE, True)


torch.nn.modules.module.register_module_parameter_registration_hook(_on_parameter_registration)


def is_expert_param(param: torch.Tensor) -> bool:
    """Whether ``param`` is a routed-expert parameter (``allreduce is False``)."""
    return getattr(param, "allreduce", True) is False


# --------------------------------------------------------------------------------------------- expert modules


def mark_expert_module(module: nn.Module) -> nn.Module:
    """Declare ``module`` as holding routed experts: each of its parameters must carry an explicit ``allreduce``.

    Every parameter under ``module``, now or registered later, is marked ``in_expert_module`` so the check also
    applies when only the tensors are passed.
    """
    setattr(module, _EXPERT_MODULE_FLAG, True)
    _mark_inside(module)
    return module


def _mark_inside(module: nn.Module) -> None:
    _changed()
    for inner in module.modules():
        setattr(inner, _INSIDE_EXPERT_MODULE, True)
    for param in module.parameters():
        setattr(param, _IN_EXPERT_MODULE, True)


def _on_module_registered(module: nn.Module, name: str, submodule: nn.Module | None) -> None:
    _changed()
    if submodule is not None and getattr(module, _INSIDE_EXPERT_MODULE, False):
        _mark_inside(submodule)


# Submodules registered under a marked expert module after the mark (modules are usually marked at the top of
# their __init__) are marked too; the hook only reads one attribute of the module being built.
torch.nn.modules.module.register_module_module_registration_hook(_on_module_registered)


def is_expert_module(module: nn.Module) -> bool:
    """Whether :func:`mark_expert_module` was applied to ``module``."""
    return getattr(module, _EXPERT_MODULE_FLAG, False) is True

"""Parameter roles: how a parameter is laid out over the rank grid, as attributes set by helpers.

Grad statistics (:mod:`pgregistry.grad_stats`) and the replication audit (:mod:`pgregistry.audit`)
decide whether a local gradient is a distinct piece of the model or a copy of one from these roles
alone:

* ``tensor_model_parallel`` (with ``partition_dim``, ``partition_stride``): sharded over TP (expert
  TP for experts), so every TP rank holds a different piece;
* ``allreduce=False``: a routed-expert parameter, distinct per EP rank and reduced over the expert
  groups; ``allreduce=True`` set explicitly: it lives in an expert module but is replicated across
  EP;
* ``shared``: a second copy of another parameter (tied embeddings on the last pipeline stage), never
  counted. Megatron-Core sets it itself, directly on the parameter (with ``shared_embedding``, which
  it also sets on the first stage's copy, the one that counts), as it does ``allreduce`` and
  ``tensor_model_parallel``;
* ``is_gtp_weight_remat``: sharded over the GTP-remat axis (expert GTP-remat for experts).

Roles are set by the ``mark_*`` helpers, never by hand. A copy made outside a module carries them
only through :func:`copy_param_roles` (Megatron-LM PR 6470: a mixed-precision copy that dropped
``allreduce=False`` turned every expert into a dense parameter). A missing classification is an
error, never a default (xorl: per-expert LoRA factors defaulted to EP-replicated, the norm low by
1/sqrt(ep); see ``docs/known_bugs.md``): :func:`pgregistry.grad_stats.check_expert_classification`
refuses parameters of a marked expert module that say neither ``allreduce=False`` nor
``allreduce=True``.

Roles belong to the parameter, and follow it into its replacements: torch-native sharding replaces
the object. ``fully_shard`` (FSDP2) puts a new ``nn.Parameter`` holding a DTensor in the slot,
bypassing torch's registration hooks (through ``module._parameters``); ``parallelize_module`` and
``nn.Parameter(distribute_tensor(...))`` register one. So torch's global parameter-registration
hook, installed when this module is imported, records per module slot the parameter that filled it
(its id, type, shape and dtype) and its attribute dictionary (the object's own ``__dict__``, which
later plain assignments, Megatron-Core's included, write into). The roles go into a replacement of
the same parameter only (:func:`restore_param_roles` and the hook), never into an unrelated
parameter assigned into the slot, which starts with the roles it carries itself (a fresh
``nn.Parameter`` put where Megatron-Core marked ``shared`` is counted). A replacement is the same
parameter when

* it is the same object whose attribute dictionary torch swapped (``module._apply`` through
  ``swap_tensors``, as ``to_empty`` does for DTensor parameters), or its copy made with a copy of
  its module (``copy.deepcopy``, which drops a parameter's attributes);
* ``fully_shard`` made it: torch stamps the original with ``_fsdp_orig_uid`` and its ``FSDPParam``
  of this slot holds the same uid beside the sharded parameter now in the slot (FSDP2's own
  bookkeeping; releases that take the original's id as its uid are compared by id, and one that
  keeps no uid trusts the slot's record);
* it holds the original's memory (``nn.Parameter(p.data)``, a Replicate distribution that kept the
  storage);
* it is a DTensor of the original's global shape and dtype whose local piece equals, bit for bit,
  the piece of the original its placements select (a Shard distribution: ``parallelize_module``);
* it has the original's shape and either the original is on the meta device (it holds no values:
  this is its materialisation) or torch's ``load_state_dict(assign=True)`` puts it there (the
  checkpoint's tensor under the parameter's own name).

The hook is installed as soon as both ``pgregistry`` and torch are imported, whichever comes first
(:mod:`pgregistry._runtime.role_hooks`), so a model built after ``import pgregistry`` keeps
Megatron-Core's plain attributes through ``fully_shard`` whatever else was imported when: no result
depends on import order. A model built before ``pgregistry`` is imported at all is known from its
first model walk on; roles set on it as plain attributes before a ``fully_shard`` that came before
that walk went with the objects ``fully_shard`` dropped, and nothing can bring them back:
:func:`restore_param_roles` refuses such a model (``RuntimeError`` naming those parameters and the
import to move), on every rank that holds one, rather than give a number computed without them.

:func:`role_generation` counts every change made through this module (a helper's mark, a
registration, a restored role): a cached classification (:mod:`pgregistry.grad_stats._plan`) made at
one generation is stale at the next; plain attribute assignments it checks itself.

That check must not depend on how the parameters are passed: a model, its chunks,
``list(model.parameters())``, a generator or a name -> parameter mapping. A model is walked module
by module; bare tensors are recognised by their own mark, ``in_expert_module``, which
:func:`mark_expert_module` puts on every parameter under the module, including parameters and
submodules registered after the mark (through torch's module registration hooks, since modules are
usually marked at the top of their ``__init__``).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any, Final, TypeVar

import torch
from torch import nn

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
    # Set by Megatron-Core and read by its optimizers and checkpoints: expert TP and QKV-split
    # layout (Muon), the padding of a GTP shard. Its copy helpers carry them over to main-parameter
    # copies, so this does too.
    "expert_tp",
    "is_qkv",
    "qkv_split_shapes",
    "pad_length",
)
"""Every attribute that carries a parameter role; :func:`copy_param_roles` copies those present."""

_EXPERT_MODULE_FLAG: Final = "_pgregistry_expert_module"
_INSIDE_EXPERT_MODULE: Final = "_pgregistry_inside_expert_module"
"""Set on a marked expert module and all modules under it: their parameters get the mark."""
_IN_EXPERT_MODULE: Final = "in_expert_module"
_SLOTS: Final = "_pgregistry_slots"
"""Module attribute: parameter name -> ``(id of the module, identity, attribute dictionary)`` of the
parameter last known to fill that slot (see the module docstring); a module id not the holder's own
marks a record copied with its module. The identity is the object's id, type, shape and dtype, not a
weak reference: ``swap_tensors`` (``to_empty`` of DTensor parameters) refuses a tensor with weak
references."""
_FSDP_UID: Final = "_fsdp_orig_uid"
"""The attribute ``fully_shard`` stamps on each parameter it shards.

It is torch's ``_get_orig_param_uid``.
"""
_SET_DIRECTLY: Final = tuple(name for name in ROLE_ATTRIBUTES if name != _IN_EXPERT_MODULE)
"""The roles read from a slot's recorded dictionary: all but pgregistry's own ``in_expert_module``
mark, which a model walk derives from the module (and which marks bare tensors only)."""

_generation = 0


def role_generation() -> int:
    """A counter of the role changes made through this module.

    Marks, copies, registrations and restored roles each add to it, so a kept classification knows
    when to look again.

    Returns:
        The counter's value.

    Example:
        >>> import torch
        >>> before = role_generation()
        >>> _ = mark_shared(torch.nn.Parameter(torch.zeros(2)))
        >>> role_generation() > before
        True
    """
    return _generation


def _bump_generation() -> None:
    global _generation
    _generation += 1


# -------------------------------------------------------------------------------------------- roles


def mark_tensor_parallel(param: T, partition_dim: int, stride: int = 1) -> T:
    """Declare ``param`` sharded over TP (expert TP for an expert) along dim ``partition_dim``.

    Sets Megatron-Core's attributes: ``tensor_model_parallel=True``, ``partition_dim``,
    ``partition_stride``. Each rank then counts its own slice in the grad statistics.

    Args:
        param: the parameter.
        partition_dim: the dim it is cut along.
        stride: Megatron-Core's ``partition_stride`` (1: one contiguous slice per rank).

    Returns:
        ``param``, marked.

    Raises:
        TypeError: ``param`` not a tensor; ``partition_dim`` or ``stride`` not an int.
        ValueError: ``partition_dim`` not a dim of ``param``; ``stride`` below 1.

    Example:
        >>> import torch
        >>> column_parallel = torch.nn.Linear(2, 4)  # this rank's rows of the weight
        >>> weight = mark_tensor_parallel(column_parallel.weight, partition_dim=0)
        >>> param_roles(weight)
        {'tensor_model_parallel': True, 'partition_dim': 0, 'partition_stride': 1}
    """
    _require_tensor(param, "mark_tensor_parallel")
    for option, value in (("partition_dim", partition_dim), ("stride", stride)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"mark_tensor_parallel: {option} must be an int, got {value!r}")
    if not 0 <= partition_dim < max(param.dim(), 1):
        raise ValueError(
            f"partition_dim {partition_dim!r} is not a dim "
            f"of a parameter of shape {tuple(param.shape)}"
        )
    if stride < 1:
        raise ValueError(f"stride must be a positive integer, got {stride!r}")
    return _set_roles(
        param, tensor_model_parallel=True, partition_dim=partition_dim, partition_stride=stride
    )


def mark_expert(param: T) -> T:
    """Declare ``param`` a routed-expert parameter: distinct per EP rank.

    Its grads are reduced over the expert groups. Sets Megatron-Core's ``allreduce=False``.

    Args:
        param: the parameter.

    Returns:
        ``param``, marked.

    Raises:
        TypeError: ``param`` not a tensor.

    Example:
        >>> import torch
        >>> experts = torch.nn.ModuleList(torch.nn.Linear(2, 2) for _ in range(2))
        >>> for param in experts.parameters():
        ...     _ = mark_expert(param)
        >>> all(is_expert_param(param) for param in experts.parameters())
        True
    """
    _require_tensor(param, "mark_expert")
    return _set_roles(param, allreduce=False)


def mark_expert_replicated(param: T) -> T:
    """Declare ``param`` of an expert module replicated across EP (a LoRA factor shared by experts).

    Sets ``allreduce=True``, the explicit classification an expert module's parameters need.

    Args:
        param: the parameter.

    Returns:
        ``param``, marked.

    Raises:
        TypeError: ``param`` not a tensor.

    Example:
        >>> import torch
        >>> lora_a = mark_expert_replicated(torch.nn.Parameter(torch.zeros(4, 2)))
        >>> param_roles(lora_a), is_expert_param(lora_a)
        ({'allreduce': True}, False)
    """
    _require_tensor(param, "mark_expert_replicated")
    return _set_roles(param, allreduce=True)


def mark_shared(param: T) -> T:
    """Declare ``param`` a second copy of a parameter counted elsewhere.

    Tied embeddings on the last pipeline stage are one. Sets ``shared=True``: the grad statistics do
    not count it.

    Args:
        param: the parameter.

    Returns:
        ``param``, marked.

    Raises:
        TypeError: ``param`` not a tensor.

    Example:
        >>> import torch
        >>> tied_copy = mark_shared(torch.nn.Parameter(torch.zeros(4, 2)))
        >>> param_roles(tied_copy)
        {'shared': True}
    """
    _require_tensor(param, "mark_shared")
    return _set_roles(param, shared=True)


def mark_gtp_sharded(param: T) -> T:
    """Declare ``param`` sharded over the GTP-remat axis (expert GTP-remat for experts).

    Sets ``is_gtp_weight_remat=True``.

    Args:
        param: the parameter.

    Returns:
        ``param``, marked.

    Raises:
        TypeError: ``param`` not a tensor.

    Example:
        >>> import torch
        >>> param_roles(mark_gtp_sharded(torch.nn.Parameter(torch.zeros(4, 2))))
        {'is_gtp_weight_remat': True}
    """
    _require_tensor(param, "mark_gtp_sharded")
    return _set_roles(param, is_gtp_weight_remat=True)


def copy_param_roles(src: torch.Tensor, dst: T) -> T:
    """Copy every role attribute present on ``src`` to ``dst``.

    For the tensors that stand in for a parameter: mixed-precision main params, optimizer views.

    Args:
        src: the parameter whose roles to copy.
        dst: the tensor that receives them.

    Returns:
        ``dst``, with ``src``'s roles.

    Raises:
        TypeError: ``src`` or ``dst`` not a tensor.

    Example:
        >>> import torch
        >>> param = torch.nn.Parameter(torch.zeros(4, 2, dtype=torch.bfloat16))
        >>> param = mark_tensor_parallel(param, partition_dim=0)
        >>> main = copy_param_roles(param, param.detach().float())
        >>> param_roles(main) == param_roles(param)
        True
    """
    _require_tensor(src, "copy_param_roles")
    _require_tensor(dst, "copy_param_roles")
    for name, value in param_roles(src).items():
        setattr(dst, name, value)
    _bump_generation()
    return dst


def param_roles(param: torch.Tensor) -> dict[str, Any]:
    """The role attributes present on ``param``, by name.

    Args:
        param: the parameter.

    Returns:
        Role attribute -> value, for those ``param`` carries (``tensor_model_parallel``,
        ``allreduce``, ``shared``, ...).

    Example:
        >>> import torch
        >>> param = torch.nn.Parameter(torch.zeros(2))
        >>> param_roles(param), param_roles(mark_gtp_sharded(param))
        ({}, {'is_gtp_weight_remat': True})
    """
    return {name: getattr(param, name) for name in ROLE_ATTRIBUTES if hasattr(param, name)}


def restore_param_roles(model: nn.Module | Sequence[nn.Module]) -> None:
    """Put the roles recorded for each parameter slot of ``model`` back on the parameter in it.

    Only when it is a replacement of the same parameter (see the module docstring): those marked
    with a helper and those set as plain attributes (by Megatron-Core, or by hand) before
    ``fully_shard`` or ``to_empty`` replaced the object or its attribute dictionary. An unrelated
    parameter put in the slot keeps only its own roles, and becomes the slot's. A role already on
    the parameter wins (marking after sharding overrides marking before). The grad-statistics entry
    points call this whenever they classify a model afresh (a kept plan is remade when a slot's
    parameter changes), so a user need not.

    Args:
        model: the model, or its chunks.

    Raises:
        RuntimeError: parameters ``fully_shard`` replaced before pgregistry was imported (no slot
            record, a sharded parameter of FSDP2's), named: their roles cannot be known, so nothing
            is computed from them; the message names the import to move.

    Example:
        On every rank of a 2-rank gloo world (as :func:`pgregistry.testing.run_world` starts it):

        >>> import torch
        >>> from torch.distributed.fsdp import fully_shard
        >>> model = torch.nn.Module()
        >>> model.proj = torch.nn.Linear(2, 4)
        >>> _ = mark_tensor_parallel(model.proj.weight, partition_dim=0)
        >>> _ = fully_shard(model, mesh=torch.distributed.init_device_mesh("cpu", (2,)))
        >>> restore_param_roles(model)  # model.proj.weight, now a DTensor, is TP-sharded again
        >>> type(model.proj.weight.data).__name__, param_roles(model.proj.weight)["partition_dim"]
        ('DTensor', 0)
    """
    originals: dict[int, int | None] | None = None
    unseen: list[str] = []
    for chunk in [model] if isinstance(model, nn.Module) else model:
        for prefix, module in chunk.named_modules():
            slots: dict[str, tuple[int, tuple[Any, ...], dict[str, Any]]] | None = (
                module.__dict__.get(_SLOTS)
            )
            for name, param in module._parameters.items():
                if param is None:
                    continue
                recorded = slots.get(name) if slots is not None else None
                if (
                    recorded is None
                ):  # a slot filled before this module was imported: known from now on
                    if originals is None:
                        originals = _fsdp_originals(model)
                    if (
                        id(param) in originals
                    ):  # its roles went with the object fully_shard dropped: refused below
                        unseen.append(f"{prefix}.{name}" if prefix else name)
                    else:
                        _record_param(module, name, param)
                    continue
                owner, held, attributes = recorded
                if attributes is vars(param):
                    continue
                # A record copied with its module (copy.deepcopy, which drops a parameter's
                # attributes) belongs to the copy of the parameter it recorded.
                same = owner != id(module) or held == _param_identity(param)
                if not same:
                    if originals is None:
                        originals = _fsdp_originals(model)
                    if id(param) in originals:  # fully_shard's: of the recorded parameter?
                        uid = originals[id(param)]
                        same = uid is None or uid == attributes.get(_FSDP_UID, held[0])
                if same:
                    _give_roles(
                        param, {key: attributes[key] for key in _SET_DIRECTLY if key in attributes}
                    )
                _record_param(module, name, param)
    if unseen:
        raise RuntimeError(
            f"the roles of {len(unseen)} parameter(s) cannot be known: {unseen} were replaced "
            "by fully_shard before pgregistry was imported, and roles set on them as plain "
            "attributes before that (Megatron-Core's shared, allreduce, "
            "tensor_model_parallel) went with the objects fully_shard replaced, so a "
            "statistic read without them could count a tied embedding twice. Move `import "
            "pgregistry` above the code that builds the model (the top of the training script)"
        )


def _fsdp_originals(model: nn.Module | Sequence[nn.Module]) -> dict[int, int | None]:
    """``id(sharded parameter) -> uid of the parameter it replaced``, from ``model``'s FSDP2 states.

    Over the FSDP2 states of ``model``'s modules: FSDP2's own record of which parameter each sharded
    one stands for. torch 2.13 stamps the uid on the original (``_fsdp_orig_uid``); some releases
    take the original's id instead; ``None`` where the release keeps none (the sharded parameter
    then stands for the slot's recorded one)."""
    if not torch.distributed.is_available():
        return {}
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch before 2.6
        from torch.distributed._composable.fsdp import FSDPModule

    out: dict[int, int | None] = {}
    for chunk in [model] if isinstance(model, nn.Module) else model:
        for module in chunk.modules():
            if isinstance(module, FSDPModule):
                state = module._get_fsdp_state()
                groups = getattr(state, "_fsdp_param_groups", None)
                if groups is None:  # a release with one group per state
                    groups = [group] if (group := state._fsdp_param_group) is not None else []
                for group in groups:
                    for fsdp_param in group.fsdp_params:
                        out[id(fsdp_param.sharded_param)] = getattr(
                            fsdp_param, "_orig_param_uid", None
                        )
    return out


def _give_roles(param: torch.Tensor, roles: dict[str, Any]) -> None:
    """Set each of ``roles`` that ``param`` does not carry yet."""
    for attribute, value in roles.items():
        if not hasattr(param, attribute):
            setattr(param, attribute, value)
            _bump_generation()


def _record_param(module: nn.Module, name: str, param: torch.Tensor) -> None:
    """Make ``param`` the parameter known to fill ``module``'s slot ``name``."""
    module.__dict__.setdefault(_SLOTS, {})[name] = (id(module), _param_identity(param), vars(param))


def _param_identity(param: torch.Tensor) -> tuple[Any, ...]:
    """What stays of a parameter object when torch swaps its contents in place.

    Its id, type, shape and dtype. An id is reused only by an object made after the recorded one is
    gone, which takes two replacements behind torch's back (``module._parameters[name] = ...``) with
    no restore between them: the first records nothing, the second could pass for the first's
    predecessor."""
    return (id(param), type(param), param.shape, param.dtype)


def _is_same_param(new: torch.Tensor, old: torch.Tensor) -> bool:
    """Whether ``new``, registered where ``old`` was, is the same parameter (module docstring).

    Called by the registration hook only when ``old`` has roles ``new`` lacks, so the comparison of
    values (a distribution's piece, once) never runs for FSDP2's per-step re-registration of its own
    parameters."""
    from torch.distributed.tensor import DTensor

    if new.shape != old.shape:
        return False
    if (
        old.is_meta or _loading_a_state_dict()
    ):  # its materialisation, or its checkpoint's tensor under its name
        return True
    if new.dtype != old.dtype:
        return False
    if isinstance(new, DTensor) and _FSDP_UID in vars(old):
        # fully_shard, through a module's own __setattr__: it stamped the original just before.
        return True
    if not isinstance(new, DTensor):
        return not isinstance(old, DTensor) and _same_memory(new, old)
    if isinstance(old, DTensor):
        return False
    local = new.to_local()
    if local.is_meta:
        return False
    if _same_memory(local, old):
        return True
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(
        old.shape, new.device_mesh, new.placements
    )
    if tuple(local.shape) != tuple(shape):
        return False
    piece = old.detach()
    for dim, (start, size) in enumerate(zip(offset, shape, strict=True)):
        piece = piece.narrow(dim, start, size)
    return bool(torch.equal(local.detach(), piece.to(local.device)))


_LOAD_FROM_STATE_DICT: Final = nn.Module._load_from_state_dict.__code__


def _loading_a_state_dict() -> bool:
    """Whether torch's ``load_state_dict(assign=True)`` registers the parameter.

    Its ``_load_from_state_dict`` is among the few callers above the hook: ``register_parameter``
    and ``__setattr__`` in between."""
    frame = sys._getframe(1)
    for _ in range(6):
        if frame.f_code is _LOAD_FROM_STATE_DICT:
            return True
        if frame.f_back is None:
            return False
        frame = frame.f_back
    return False


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` (of one shape) view the same elements of one memory."""
    return (
        a.device == b.device
        and a.data_ptr() != 0
        and a.data_ptr() == b.data_ptr()
        and a.stride() == b.stride()
    )


def _set_roles(param: T, **roles: Any) -> T:
    """Set ``roles`` on ``param`` (in its attribute dictionary, the one its slots record)."""
    for attribute, value in roles.items():
        setattr(param, attribute, value)
    _bump_generation()
    return param


def _require_tensor(value: object, helper: str) -> None:
    """``TypeError`` naming what ``helper`` (a parameter helper) was given instead of a tensor."""
    if isinstance(value, nn.Module):
        raise TypeError(
            f"{helper} takes a parameter, but was given a {type(value).__name__} module: mark "
            "each of its parameters (module.weight, "
            f"...){'; mark_expert_module marks a module of experts' if 'expert' in helper else ''}"
        )
    if not isinstance(value, torch.Tensor):
        raise TypeError(
            f"{helper} takes a parameter (a torch.Tensor), but was given a {type(value).__name__}"
        )


def _on_parameter_registration(module: nn.Module, name: str, param: nn.Parameter) -> None:
    """torch's global parameter-registration hook, run as a module registers a parameter.

    It carries roles into a replacement of the same parameter, and records the slot's parameter (see
    the module docstring).

    ``parallelize_module``, ``distribute_module``, a user's
    ``nn.Parameter(distribute_tensor(p...))`` and ``fully_shard`` on a module with its own
    ``__setattr__`` register the replacement here, with the parameter it replaces still in the slot;
    an unrelated parameter assigned into the slot receives nothing.
    """
    _bump_generation()
    previous = module._parameters.get(name)
    if previous is not None and previous is not param:
        missing = {
            key: value for key, value in param_roles(previous).items() if not hasattr(param, key)
        }
        if missing and _is_same_param(param, previous):
            _give_roles(param, missing)
    _record_param(module, name, param)
    if _is_inside_expert_module(module):
        setattr(param, _IN_EXPERT_MODULE, True)


torch.nn.modules.module.register_module_parameter_registration_hook(_on_parameter_registration)


def is_expert_param(param: torch.Tensor) -> bool:
    """Whether ``param`` is a routed-expert parameter (``allreduce is False``).

    Args:
        param: the parameter.

    Returns:
        ``True`` for a routed-expert parameter.

    Example:
        >>> import torch
        >>> is_expert_param(torch.zeros(2)), is_expert_param(mark_expert(torch.zeros(2)))
        (False, True)
    """
    return getattr(param, "allreduce", True) is False


# ----------------------------------------------------------------------------------- expert modules


def mark_expert_module(module: nn.Module) -> nn.Module:
    """Declare ``module`` as holding routed experts, each parameter with an explicit ``allreduce``.

    Every parameter under ``module``, now or registered later, is marked ``in_expert_module``, so
    the grad statistics refuse one without an explicit ``allreduce`` also when only the tensors are
    passed.

    Args:
        module: the experts' module.

    Returns:
        ``module``, marked.

    Raises:
        TypeError: a tensor (:func:`mark_expert` marks a parameter) or anything else that is not a
            module.

    Example:
        >>> import torch
        >>> experts = torch.nn.Linear(2, 2)  # a layer's experts (layer.mlp.experts)
        >>> _ = mark_expert_module(experts)
        >>> for param in experts.parameters():
        ...     _ = mark_expert(param)
        >>> is_expert_module(experts), all(map(is_expert_param, experts.parameters()))
        (True, True)
    """
    if isinstance(module, torch.Tensor):
        raise TypeError(
            f"mark_expert_module takes a module, but was given a {type(module).__name__} of shape "
            f"{tuple(module.shape)}: use mark_expert (or mark_expert_replicated) for a parameter"
        )
    if not isinstance(module, nn.Module):
        raise TypeError(
            f"mark_expert_module takes an nn.Module, but was given a {type(module).__name__}"
        )
    setattr(module, _EXPERT_MODULE_FLAG, True)
    _mark_inside(module)
    return module


def _mark_inside(module: nn.Module) -> None:
    _bump_generation()
    for inner in module.modules():
        setattr(inner, _INSIDE_EXPERT_MODULE, True)
    for param in module.parameters():
        setattr(param, _IN_EXPERT_MODULE, True)


def _on_module_registered(module: nn.Module, name: str, submodule: nn.Module | None) -> None:
    _bump_generation()
    if submodule is not None and _is_inside_expert_module(module):
        _mark_inside(submodule)


def _is_inside_expert_module(module: nn.Module) -> bool:
    """Whether ``module`` lies in a marked expert module, read from its own ``__dict__``.

    Never through its class's ``__getattr__``: the hooks run inside a module's ``__init__``, and a
    module may not answer ``getattr`` until it ends. ``torch.compile``'s ``OptimizedModule``
    registers its ``_orig_mod`` first, and its ``__getattr__`` then raised ``KeyError:
    '_orig_mod'``, so no model could be compiled once pgregistry and torch were imported. The mark
    is set with ``setattr``, which stores a plain value in the module's ``__dict__`` (a module whose
    ``__setattr__`` forwards it, as ``OptimizedModule`` does to ``_orig_mod``, registers nothing
    itself: its inner module does)."""
    return vars(module).get(_INSIDE_EXPERT_MODULE, False) is True


# Submodules registered under a marked expert module after the mark (modules are usually marked at
# the top of their __init__) are marked too; the hook only reads one attribute of the module being
# built.
torch.nn.modules.module.register_module_module_registration_hook(_on_module_registered)


def is_expert_module(module: nn.Module) -> bool:
    """Whether :func:`mark_expert_module` was applied to ``module``.

    Args:
        module: the module.

    Returns:
        ``True`` when it was marked.

    Example:
        >>> import torch
        >>> experts = mark_expert_module(torch.nn.Module())
        >>> is_expert_module(experts), is_expert_module(torch.nn.Linear(2, 2))
        (True, False)
    """
    return getattr(module, _EXPERT_MODULE_FLAG, False) is True

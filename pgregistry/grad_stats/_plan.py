"""A model's grad-statistics classification, made once and kept for as long as it cannot be stale.

Classifying a grad takes Python work per parameter (its roles, its placements), a few microseconds
each: at 20,000 parameters that was most of a call. :class:`Plan` does it once for named parameters
on one collection's groups:

* by roles (:func:`~pgregistry.grad_stats._filters.is_counted`,
  :func:`~pgregistry.grad_stats._filters.reduce_group_of`),
  once per plan;
* by the grads' layout (none, plain, DTensor and its placements; each DTensor grad read through its
  local piece, so plain grads and DTensor pieces go through the same one-read kernel, the placement
  reductions after), again only when the grads' types or DTensor specs change;
* by the pieces' (device, dtype), sizes, addresses and contiguity
  (:func:`~pgregistry.grad_stats._local.plan_kind`), again only when those change; where only the
  addresses changed (new grads each step, ``zero_grad(set_to_none=True)``) and every piece that
  moved has the device and shape the kinds were planned for, the kinds and their host blocks are
  kept and only the one-read kernel's launch offsets, which hold addresses, are made again
  (:meth:`Plan._replan_launches`).

The grads a rank holds but does not count (duplicates, ``shared`` copies) are read too, into seen
parts (:func:`~pgregistry.grad_stats._reductions.nonfinite_part`) under the group their counted copy
is summed over, whenever a norm is wanted: a NaN or an inf in any of them makes the norm NaN or
infinite wherever the counted copy's would.

A call then checks, at C speed (``map`` over the tensors, no Python work per parameter), that the
grads' types, DTensor specs, addresses, sizes (and, where the kernel reads, contiguity) are those
the plan was made for, and reads. Where the grads are plain tensors and the very objects the reads
were planned for (a flat buffer's views, as pgregistry's optimizers set them, or grads zeroed in
place), it checks their identity and addresses only (:class:`_Planned`): each grad is the object its
weak reference gives while none of them died (each reference's callback notes its death: the plan
keeps no grad alive), compared by identity (no int made a grad), and each grad's address. The same
object has the same type, and at the same address the same storage; a grad resized or
restrided in place at its address (``resize_``, ``as_strided_``) is the one change this does not
see. Where every kind is read by the one-read kernel in full and the call wants only what the kernel
gives (the 2-norm, the zero count), the compiled check still checks every grad but lists only the
pieces the launches read (each kind's first and base piece, :func:`_launch_positions`), ``None`` at
the others' positions: making each grad's Python reference into the list was most of that pass
(issue 38). A call that reads through torch (other norms, the exact norm's second read) gets every
piece.

:class:`Kept` holds one plan per model (or per list of tensors) and checks what the classification
itself depends on: the collection, the parameter set (the modules' child and parameter dictionaries
that were empty by length, the contents of those that held something by identity,
:meth:`Kept._current_holder_contents`), the roles (the classification's role attributes of the
parameters that had one; the others held to no attributes, or to no role among them;
:func:`~pgregistry.params.role_generation` for marks made with the helpers). Anything that differs
makes a new plan. The dictionaries checked are those the modules held when the plan was made: torch
changes them in place (a deletion from a ``ModuleList`` or ``Sequential`` too, before it renumbers
into a new one), so a change through torch is seen; code that assigns a module a new dictionary
behind torch's back, without changing the old one, is not (seeing it would read every module's
attributes each call: twice the parameter-set check's time at 20,000 parameters).

At 20,000 parameters a call is bound by fetching each object's memory, not by the Python around it,
so every check fetches each object once (several facts of one tensor read together, into flat lists
the garbage collector does not track; the roles key by key over blocks of parameters whose
attribute dictionaries stay in cache). Memory: a plan keeps references, a few per parameter, and the
launch tables of the one-read kernel (``docs/performance.md`` states the measured size and the floor
of what a call must read).
"""

from __future__ import annotations

import functools
import operator
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from itertools import chain, compress, repeat
from types import ModuleType
from typing import TYPE_CHECKING, Any, Final, cast

import attrs
import torch
from torch.distributed import ProcessGroup
from torch.utils.weak import WeakIdKeyDictionary

from pgregistry._runtime.agreement import any_rank_has
from pgregistry._runtime.meta_tensors import meta_tensor_error
from pgregistry._runtime.overlapping_tensors import first_overlap
from pgregistry._runtime.resolve import (
    Params,
    Source,
    fill_unset_fields,
    grid_reads,
    params_of_source,
)
from pgregistry.collection import GroupName, ProcessGroupCollection
from pgregistry.grad_stats._classification import holds_experts, require_classified_experts
from pgregistry.grad_stats._compiled import steady_checks
from pgregistry.grad_stats._devices import reduction_device
from pgregistry.grad_stats._dtensors import MeshAxes, classify_dtensor_grad, decision_of, is_partial
from pgregistry.grad_stats._filters import (
    EXPERT_STATS_FIELDS,
    STATS_FALLBACK,
    StatsGroups,
    is_counted,
    reduce_group_of,
    role_verdicts,
)
from pgregistry.grad_stats._local import (
    KindPlan,
    parts_of,
    plan_kind,
    read_kind,
    replan_launch,
    scale_kind,
)
from pgregistry.grad_stats._reductions import (
    Clipping,
    GroupKey,
    Shares,
    Wanted,
    makes_norm_float64,
    nonfinite_part,
)
from pgregistry.params import role_generation

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

__all__ = ["Kept", "Plan", "Read", "check_or_make_plan"]

ROLE_KEYS: Final = ("allreduce", "tensor_model_parallel", "is_gtp_weight_remat", "shared")
"""The role attributes a grad's classification depends on (the classification check also reads
``in_expert_module``, which only :mod:`pgregistry.params` sets, counted by its generation)."""

_GRAD: Final = operator.attrgetter("grad")
_LOCAL: Final = operator.attrgetter("_local_tensor")
_SPEC: Final = operator.attrgetter("_spec")
_MODULES: Final = operator.attrgetter("_modules")
_PARAMETERS: Final = operator.attrgetter("_parameters")
_DTYPE: Final = operator.attrgetter("dtype")
_KIND_READS: Final = (operator.attrgetter("device"), operator.attrgetter("shape"))
"""What a piece's kind and host blocks depend on beyond its piece facts (address, size, dtype and
contiguity: :func:`_piece_facts`): its device (with the dtype, its kind) and its shape (the host
concatenates small tensors by trailing shape). A piece at its planned address is on its planned
device (one address space: CUDA's unified addressing), so only a piece that moved is read for them
(:meth:`Plan._replan_launches`)."""
_ADDRESS: Final = torch._C.TensorBase.data_ptr
_ADDRESSES_AT: Final[Callable[[list[Any], list[int], list[int]], bool] | None] = getattr(
    torch._C, "_tensors_data_ptrs_at_indices_equal", None
)
"""Whether each tensor at the given positions is at the given address: torch's own C++ loop over a
list (in its CUDA builds; its CUDA graph trees check their static inputs with it), each tensor's
``data_ptr`` as :data:`_ADDRESS` reads it, but no Python int made, kept in a list and compared per
tensor. It asks no subclass's ``__torch_function__``: the answer is the memory the kernel reads (a
subclass answering otherwise would only miss, and be checked in full). ``None`` where torch lacks
it (its CPU-only builds)."""


_NO_ROLE: Final = frozenset(ROLE_KEYS).isdisjoint
"""Whether a parameter's attribute dictionary holds none of :data:`ROLE_KEYS`."""

_ROLE_BLOCK: Final = 512
"""How many parameters' roles are read together, one key after another
(:meth:`Kept._role_values`): their attribute dictionaries stay in cache from one key to the next."""


def _make_picker(indices: Sequence[int], size: int) -> Callable[[Sequence[Any]], list[Any]]:
    """A function taking the items at ``indices`` from a sequence of ``size`` items, at C speed.

    Where ``indices`` are all of them in order, the list itself (no copy: callers never change what
    it gives)."""
    if not indices:
        return lambda items: []
    if size == len(indices) and all(map(operator.eq, indices, range(size))):
        return _as_list
    if len(indices) == 1:
        index = indices[0]
        return lambda items: [items[index]]
    getter = operator.itemgetter(*indices)
    return lambda items: list(getter(items))


def _as_list(items: Sequence[Any]) -> list[Any]:
    return items if type(items) is list else list(items)


_END: Final = object()
"""Ends a stream of objects compared by :func:`_same_stream` (private: no module, parameter or
tensor is it)."""


def _same_stream(current: Iterable[object], held: list[object]) -> bool:
    """Whether ``current`` yields the objects of ``held`` in order, by identity, at C speed.

    Both end with :data:`_END` (``current``'s own last item: no iterator around it to add the
    marker, 1-7% of this check on the 2-core machine). No list of them is made (at 20,000
    parameters, the 30,000 items' list took half this check there). ``map`` stops at the shorter of
    the two: ``current``'s end marker meets a held object where it is shorter, and a current object
    meets ``held``'s end marker where it is longer, so only the same objects in the same number
    compare equal."""
    return all(map(operator.is_, current, held))


def _same_objects(a: Sequence[object], b: Sequence[object]) -> bool:
    """Whether two sequences hold the same objects (identity), at C speed."""
    return len(a) == len(b) and all(map(operator.is_, a, b))


def _all_empty(dicts: list[dict[Any, Any]]) -> bool:
    """Whether every dictionary of ``dicts`` is empty.

    ``any`` tests each one's truth through its type's length slot in C (no ``len`` call, no int made
    per dictionary), a quarter of the time of ``any(map(len, dicts))`` on the 2-core machine, at
    2,000 and 20,000 dictionaries alike."""
    return not any(dicts)


@attrs.frozen(slots=True)
class _Kind:
    """One (device, dtype) list of pieces: where they are among the pieces, how to read them."""

    take: Callable[[Sequence[torch.Tensor]], list[torch.Tensor]]
    plan: KindPlan
    positions: list[int]
    """Its pieces' positions among the pieces, in its order (what :attr:`take` takes)."""

    @property
    def read_by_kernel_alone(self) -> bool:
        """Whether the kernel reads every piece of the kind: no piece left to torch or the host."""
        return bool(self.plan.kernel) and not self.plan.rest and not self.plan.blocks

    def launch_positions(self) -> tuple[int, int]:
        """The positions of the two pieces the kernel's launches read where it reads every piece.

        Its first (the launches' device and dtype, :func:`~pgregistry.grad_stats._local.read_kind`,
        :func:`~pgregistry.grad_stats._local.scale_kind`) and its launch's base, from which the
        kernel addresses every piece (:class:`~pgregistry.grad_stats._fused.Launch`)."""
        assert self.read_by_kernel_alone and self.plan.launch is not None
        return self.positions[0], self.positions[self.plan.launch.base]


@attrs.define(slots=True)
class _Planned:
    """The plain grads a layout's reads were planned for, known by identity while they all live.

    Each is held by a weak reference (a plan must not keep grads alive: a training loop that sets
    them to ``None`` frees them) whose callback notes its death (``deaths``: a C-speed
    ``list.append``, nothing run per grad on a call), and by its address. While no death is noted,
    each reference gives its grad, which the grad read now is compared with by identity
    (``operator.is_``: no int made a grad, as ``id`` makes, and no list of ids kept)."""

    references: list[weakref.ref[torch.Tensor]]
    """A weak reference to each piece (each parameter's grad but the ``None`` ones, in order)."""
    take_none: Callable[[Sequence[Any]], list[Any]]
    """Takes the grads of the parameters that had none, which must still have none."""
    addresses: list[int]
    """Each piece's address."""
    deaths: list[weakref.ref[torch.Tensor]]
    """The references whose grad died: while empty, every reference gives its live grad."""
    positions: list[int]
    """Every piece's position, for :data:`_ADDRESSES_AT` (which takes a list); empty without it."""
    checks: ModuleType | None
    """The compiled checks (:func:`~pgregistry.grad_stats._compiled.steady_checks`), or ``None``
    where they are not built (the Python check, :meth:`pieces_of`, runs)."""
    rows: torch.Tensor | None
    """For the compiled check, each parameter's grad as one row: its tensor's address (``_cdata``,
    0 for no grad) and its data's; ``None`` without it."""
    kept: torch.Tensor | None
    """For the compiled check, which pieces a read by the kernel alone needs (one bool a piece,
    :func:`_launch_positions`): a call whose reads touch no other piece
    (:func:`_reads_by_kernel_alone`) is given only those (:meth:`pieces_from`). ``None`` where
    every piece is needed (a kind some piece of which torch or the host reads; no piece to leave
    out) or without the compiled check."""

    @classmethod
    def of(
        cls, grads: list[Any], pieces: list[torch.Tensor], needed: Sequence[int] | None = None
    ) -> _Planned:
        """The record of ``pieces``, the plain grads among ``grads`` (the others ``None``).

        ``needed``: the positions of the pieces a read by the kernel alone needs
        (:func:`_launch_positions`), ``None`` where it needs every piece."""
        deaths: list[weakref.ref[torch.Tensor]] = []
        references = list(map(weakref.ref, pieces, repeat(deaths.append)))
        nones = list(compress(range(len(grads)), map(operator.is_, grads, repeat(None))))
        positions = list(range(len(pieces))) if _ADDRESSES_AT is not None else []
        addresses = list(map(_ADDRESS, pieces))
        checks = steady_checks()
        rows = checks.planned_rows(grads) if checks is not None else None
        take_none = _make_picker(nones, len(grads))
        kept = None
        if checks is not None and needed is not None and len(needed) < len(pieces):
            kept = torch.zeros(len(pieces), dtype=torch.bool)
            kept[list(needed)] = True
        return cls(references, take_none, addresses, deaths, positions, checks, rows, kept)

    def mask_for(self, wanted: Wanted) -> torch.Tensor | None:
        """:attr:`kept` where the reads ``wanted`` asks for are the kernel's alone, else None."""
        return self.kept if _reads_by_kernel_alone(wanted) else None

    def pieces_from(
        self,
        params: Sequence[torch.Tensor],
        take_plain: Callable[[Sequence[Any]], list[Any]],
        kept: torch.Tensor | None = None,
    ) -> tuple[list[Any] | None, list[Any] | None]:
        """The pieces if the grads of ``params`` are the very grads planned for; the grads read.

        The pieces are ``None`` where the grads are not those; the grads are ``None`` where this did
        not read them as a list (so a miss reads them once). In one compiled pass where built
        (:attr:`rows`): deaths first, as :meth:`pieces_of` does, since while none is noted every
        planned grad lives, so its tensor's address names it alone and a grad at that address is
        the planned object; then each grad, read as autograd holds it, compared with its row. With
        ``kept`` (:meth:`mask_for`), every grad is checked alike but only the kept pieces are in
        the list, ``None`` at the others' positions: making each grad's Python reference and
        appending it was most of the pass. Else :meth:`pieces_of` on the grads read here, every
        piece."""
        if self.checks is None:
            grads = _grads_of(params)
            return self.pieces_of(grads, take_plain), grads
        if self.deaths:
            return None, None
        pieces: list[Any] | None = self.checks.planned_pieces(_as_list(params), self.rows, kept)
        return pieces, None

    def pieces_of(
        self, grads: list[Any], take_plain: Callable[[Sequence[Any]], list[Any]]
    ) -> list[Any] | None:
        """The pieces of ``grads`` when they are the very grads planned for, else ``None``.

        Every one alive, each parameter's grad, or ``None``, the same object, each still at its
        address. The same object has the same type and, at the same address, the same storage (a
        grad re-pointed at other storage, ``grad.data = ...`` or ``set_``, moves); only an in-place
        change of a grad's sizes or strides at its address (``resize_``, ``as_strided_``) would pass
        unseen. Reads no type, size or contiguity: identity from the list and the references, the
        addresses from the grads' storages. Deaths first: a dead grad's reference gives ``None``,
        as the grad of a parameter whose grad was set to ``None`` is."""
        if self.deaths:
            return None
        pieces = take_plain(grads)
        if not self._are_planned(grads, pieces):
            return None
        return pieces if self._at_planned_addresses(pieces) else None

    def _are_planned(self, grads: list[Any], pieces: list[Any]) -> bool:
        """Whether ``pieces`` are the planned grads and the other ``grads`` still ``None``.

        Each piece the object its reference gives (asked only while no death is noted: a dead
        grad's reference gives ``None``); the other grads are those of the parameters that had
        none."""
        return all(map(operator.is_, pieces, map(operator.call, self.references))) and all(
            map(operator.is_, self.take_none(grads), repeat(None))
        )

    def _at_planned_addresses(self, pieces: list[Any]) -> bool:
        """Whether every piece (the planned grads, by identity) is still at its address.

        In one C++ loop where torch has it (:data:`_ADDRESSES_AT`), else as a list of addresses."""
        if _ADDRESSES_AT is not None:
            return _ADDRESSES_AT(pieces, self.addresses, self.positions)
        return list(map(_ADDRESS, pieces)) == self.addresses


@attrs.define(slots=True)
class _Layout:
    """What one call's grads look like, and what is derived from it (see the module docstring)."""

    types: list[type]
    specs: list[object]
    take_plain: Callable[[Sequence[Any]], list[Any]]
    take_dtensor: Callable[[Sequence[Any]], list[Any]]
    partial: list[tuple[int, str, torch.Tensor]]
    targets: list[tuple[Any, list[int]]]
    """(target, positions among the pieces).

    A target is a reduction group, or ``(field, slot)`` summed over a field first.
    """
    watched: list[tuple[Any, list[int]]]
    """The pieces this rank does not count, by their counted copy's target.

    They are read for their NaN or inf only.
    """
    fields: dict[GroupName, ProcessGroup | None]
    reads_by_kernel: bool = False
    facts: list[int] | None = None
    """Each piece's address, size, dtype and (where the kernel reads) contiguity: what reads depend
    on (:func:`_piece_facts`)."""
    planned_for: _Planned | None = None
    """The grad objects the reads were planned for (plain grads only), by which a call whose grads
    are those same objects at the same addresses skips reading their types, sizes and contiguity
    (:meth:`_Planned.pieces_of`). Dropped whenever the reads are planned anew (for other pieces):
    it only ever names pieces the current reads were planned for."""
    misses: int = 0
    """Calls in a row whose grads were not the objects planned for. Grads a loop replaces every step
    (``zero_grad(set_to_none=True)``) are planned for again after 1, 2, 4, 8, ... such calls only,
    at the old addresses or at new ones (a pass that makes a weak reference per grad, about twice
    the host floor at 20,000 parameters on the 2-core machine, for grads that die before the next
    call); grads replaced once are planned for again at once."""
    kind_facts: list[Any] | None = None
    """Each piece's :data:`_KIND_READS` when the kinds were planned: where only the pieces'
    addresses changed and these are the same for the pieces that moved, the kinds hold and only
    their launches are made again (:meth:`Plan._replan_launches`)."""
    kinds: list[tuple[Any, list[_Kind]]] = attrs.field(factory=list)
    watched_kinds: list[tuple[Any, list[_Kind]]] = attrs.field(factory=list)
    every: list[_Kind] = attrs.field(factory=list)
    wide: bool = False
    """Whether a piece is float64 (the norm is then returned in float64)."""


@attrs.frozen(slots=True)
class Read:
    """One call's grads read into shares, and its local pieces, which clipping scales.

    The pieces are every grad's local tensor, duplicates included, at their positions; where the
    read was the kernel's alone (:meth:`_Planned.pieces_from` with a mask), only those its launches
    read, ``None`` at the others' positions, and :attr:`references` gives every piece
    (:meth:`every_piece`)."""

    shares: Shares
    pieces: list[Any]
    every: list[_Kind]
    references: list[weakref.ref[torch.Tensor]] | None = None
    """Where :attr:`pieces` holds only the pieces the launches read, each piece's weak reference;
    ``None`` where it holds every piece."""

    def every_piece(self) -> list[torch.Tensor]:
        """Every piece, at its position, also where the read was the kernel's alone.

        From the plan's weak references there: the read found each of them alive, the very grad its
        parameter holds, and the call holds the parameters."""
        if self.references is None:
            return cast("list[torch.Tensor]", self.pieces)
        pieces = list(map(operator.call, self.references))
        assert all(map(operator.is_not, pieces, repeat(None))), "a grad read was freed since"
        return cast("list[torch.Tensor]", pieces)

    def clip_(self, clipping: Clipping) -> None:
        """Scale every local grad by ``clipping``'s coefficient, one call per kind.

        Where the read was the kernel's alone, each kind's launch scales every piece from the two
        pieces it was given (:meth:`_Kind.launch_positions`)."""
        for kind in self.every:
            scale_kind(kind.take(self.pieces), kind.plan, clipping)


class Plan:
    """The classification of ``named`` parameters on ``groups``; see the module docstring."""

    def __init__(self, named: Sequence[tuple[str, torch.Tensor]], groups: StatsGroups) -> None:
        self.names = [name for name, _ in named]
        self.groups = groups
        params = [param for _, param in named]
        self.classes = [(is_counted(p, groups), reduce_group_of(p, groups)) for p in params]
        self.reduce_groups: tuple[GroupKey, GroupKey] = (groups.dense_reduce, groups.expert_reduce)
        self._layout: _Layout | None = None

    @functools.cached_property
    def axes(self) -> MeshAxes:
        reduce_groups = dict(enumerate(self.reduce_groups))
        return MeshAxes(self.groups.collection, reduce_groups)  # type: ignore[arg-type]

    def read(self, params: Sequence[torch.Tensor], wanted: Wanted) -> Read:
        """Read the grads of ``params`` (the plan's parameters, in its order) into shares."""
        layout = self._layout
        grads: list[Any] | None = None
        if layout is not None:
            planned_for = layout.planned_for
            if planned_for is not None:
                kept = planned_for.mask_for(wanted)
                planned, grads = planned_for.pieces_from(params, layout.take_plain, kept)
                if planned is not None:  # the grads the reads were planned for, where they were
                    layout.misses = 0
                    references = planned_for.references if kept is not None else None
                    return self._read_pieces(layout, planned, [], params, wanted, references)
            layout.misses += 1
        if grads is None:
            grads = _grads_of(params)
        types = list(map(type, grads))
        if layout is None or types != layout.types:
            layout = self._layout = self._make_layout(params, grads, types)
        dtensors = layout.take_dtensor(grads)
        locals_: list[torch.Tensor] = []
        if (
            dtensors
        ):  # each DTensor's spec and local tensor read together: its object is fetched once
            both = list(
                chain.from_iterable(zip(map(_SPEC, dtensors), map(_LOCAL, dtensors), strict=True))
            )
            specs, locals_ = both[0::2], both[1::2]
            if not _same_objects(specs, layout.specs):
                if any(a != b for a, b in zip(specs, layout.specs, strict=True)):
                    layout = self._layout = self._make_layout(params, grads, types)
                else:
                    layout.specs = specs
        partial = [(index, name, grads[index]) for index, name, _ in layout.partial]
        pieces = layout.take_plain(grads)
        if dtensors or partial:
            pieces = [*pieces, *locals_, *(_LOCAL(grad) for _, _, grad in partial)]
        try:
            facts = _piece_facts(pieces, layout.reads_by_kernel)
        except RuntimeError:  # a piece without storage (a sparse grad)
            self._make_layout(params, grads, types)  # raises, naming it
            raise
        same = facts == layout.facts
        if not same:
            if not self._replan_launches(layout, pieces, facts):
                self._plan_kinds(layout, pieces, facts)
            layout.planned_for = None  # planned for other pieces: never to be taken for these reads
        if not (dtensors or partial) and layout.misses & (layout.misses - 1) == 0:
            layout.planned_for = _Planned.of(grads, pieces, _launch_positions(layout, len(pieces)))
        return self._read_pieces(layout, pieces, partial, params, wanted)

    def _read_pieces(
        self,
        layout: _Layout,
        pieces: list[torch.Tensor],
        partial: list[tuple[int, str, Any]],
        params: Sequence[torch.Tensor],
        wanted: Wanted,
        references: list[weakref.ref[torch.Tensor]] | None = None,
    ) -> Read:
        """Read ``pieces`` (checked against ``layout``) and ``partial`` DTensor grads to shares.

        ``references``: where ``pieces`` holds only the pieces the kernel's launches read
        (:attr:`Read.references`), every piece's weak reference."""
        device = reduction_device(pieces, self.reduce_groups)
        shares = Shares(wanted, device, self.reduce_groups)
        shares.wide = layout.wide
        for field, group in layout.fields.items():
            shares.add_first(field, group, self.reduce_groups, 0, None)
        for target, kinds in layout.kinds:
            for kind in kinds:
                for part in read_kind(kind.take(pieces), kind.plan, wanted, device):
                    _add_part(shares, target, part, layout.fields, self.reduce_groups)
        # The verdict on a norm covers the grads not counted here too; the scaled read follows it.
        watch = wanted.p is not None and wanted.divisor is None
        norm_only = Wanted(wanted.p, zeros=False)
        for target, kinds in layout.watched_kinds if watch else ():
            for kind in kinds:
                for part in read_kind(kind.take(pieces), kind.plan, norm_only, device):
                    _add_part(
                        shares, target, nonfinite_part(part), layout.fields, self.reduce_groups
                    )
        for (
            index,
            name,
            grad,
        ) in partial:  # the pending reduction, on a copy, every call (collective)
            entry = self._dtensor_entry(name, params[index], grad)
            target = self._target_of(entry.outer, entry.expert)
            if entry.counted:
                for part in parts_of([entry.local], wanted, device):
                    _add_part(shares, target, part, layout.fields, self.reduce_groups)
            elif watch:
                for part in parts_of([entry.local], norm_only, device):
                    _add_part(
                        shares, target, nonfinite_part(part), layout.fields, self.reduce_groups
                    )
        return Read(shares, pieces, layout.every, references)

    # -------------------------------------------------------------------------------- derived state

    def _make_layout(
        self, params: Sequence[torch.Tensor], grads: list[Any], types: list[type]
    ) -> _Layout:
        """Classify the grads by their layout.

        Python work per grad: only when the grads' types or specs change.
        """
        from torch.distributed.tensor import DTensor

        plain: list[int] = []
        dtensor: list[int] = []
        partial: list[tuple[int, str, torch.Tensor]] = []
        first_holder: dict[int, int] = {}
        for index, grad in enumerate(grads):
            if grad is None:
                continue
            if (first := first_holder.setdefault(id(grad), index)) != index:
                raise ValueError(
                    f"parameters {self.names[first]!r} and {self.names[index]!r} share one .grad "
                    "tensor, which would be counted and scaled twice: give each its own grad"
                )
            if grad.layout != torch.strided:
                raise TypeError(
                    f"the grad of {self.names[index]!r} is {grad.layout} (e.g. from "
                    "nn.Embedding(sparse=True)); grad statistics need dense (torch.strided) grads"
                )
            if grad.is_meta:  # checked once per layout, so a steady-state call pays nothing
                raise meta_tensor_error(f"the grad of {self.names[index]!r}")
            if not isinstance(grad, DTensor):
                plain.append(index)
            elif is_partial(grad):
                partial.append((index, self.names[index], grad))
            else:
                dtensor.append(index)
        overlap = first_overlap([grads[index] for index in plain])
        if overlap is not None:
            one, other = (self.names[plain[position]] for position in overlap)
            raise ValueError(
                f"the grads of parameters {one!r} and {other!r} overlap in memory (views of one "
                "tensor sharing elements), which would be counted and scaled twice: give each "
                "parameter a grad of its own"
            )
        targets: dict[Any, list[int]] = {}
        watched: dict[Any, list[int]] = {}
        for position, index in enumerate(plain):
            counted, group = self.classes[index]
            (targets if counted else watched).setdefault(group, []).append(position)
        fields: dict[GroupName, ProcessGroup | None] = {}
        for position, index in enumerate(dtensor, start=len(plain)):
            entry = self._dtensor_entry(self.names[index], params[index], grads[index])
            if entry.outer is not None:
                fields[entry.outer] = self.groups.collection.get(entry.outer)
            target = self._target_of(entry.outer, entry.expert)
            (targets if entry.counted else watched).setdefault(target, []).append(position)
        # Decided without the pending reduction: read() does it, every call.
        for index, name, grad in partial:
            param = params[index]
            verdicts = role_verdicts(param, self.groups)
            decision = decision_of(name, param, grad, self.axes, verdicts)  # type: ignore[arg-type]
            if decision.outer is not None:
                fields[decision.outer] = self.groups.collection.get(decision.outer)
        return _Layout(
            types=types,
            specs=[grads[index]._spec for index in dtensor],
            take_plain=_make_picker(plain, len(grads)),
            take_dtensor=_make_picker(dtensor, len(grads)),
            partial=partial,
            targets=list(targets.items()),
            watched=list(watched.items()),
            fields=fields,
        )

    def _dtensor_entry(self, name: str, param: torch.Tensor, grad: DTensor) -> Any:
        return classify_dtensor_grad(
            name, param, grad, self.axes, role_verdicts(param, self.groups)
        )

    def _target_of(self, outer: GroupName | None, expert: bool) -> Any:
        """Where a DTensor grad's piece is added (its seen part, when not counted here).

        ``(field, slot)`` when summed over a field first, else its reduction group (``None``: no
        reduction)."""
        return (outer, int(expert)) if outer is not None else self.reduce_groups[int(expert)]

    @staticmethod
    def _replan_launches(layout: _Layout, pieces: list[torch.Tensor], facts: list[int]) -> bool:
        """Plan anew only what depends on the pieces' addresses, where nothing else changed.

        Where ``facts`` (read as the layout's are) differ from the layout's in addresses only (the
        same element counts, dtypes and contiguity) and every piece that moved has the device and
        shape the kinds were planned for (read for those pieces only: :data:`_KIND_READS`), each
        kind keeps its pieces, its route and its host blocks, and only its launch's offsets are
        made again (:func:`~pgregistry.grad_stats._local.replan_launch`): no grouping by device and
        dtype, no host blocks (Python work per tensor). Else ``False``, and nothing changed: the
        kinds must be planned in full."""
        held, kind_held = layout.facts, layout.kind_facts
        step = 4 if layout.reads_by_kernel else 3
        if (
            held is None
            or kind_held is None
            or len(facts) != len(held)
            or any(facts[start::step] != held[start::step] for start in range(1, step))
        ):
            return False
        moved = list(map(operator.ne, facts[::step], held[::step]))  # each piece: whether it moved
        if not _same_kinds_where_moved(pieces, moved, kind_held):
            return False
        replanned: dict[int, _Kind] = {}  # by the old kind: every piece's kinds may be a target's

        def with_new_launch(kind: _Kind) -> _Kind:
            if not kind.plan.kernel:
                return kind
            new = replanned.get(id(kind))
            if new is None:
                plan = replan_launch(kind.plan, kind.take(pieces))
                new = replanned[id(kind)] = attrs.evolve(kind, plan=plan)
            return new

        layout.kinds = [
            (target, list(map(with_new_launch, kinds))) for target, kinds in layout.kinds
        ]
        layout.watched_kinds = [
            (target, list(map(with_new_launch, kinds))) for target, kinds in layout.watched_kinds
        ]
        layout.every = list(map(with_new_launch, layout.every))
        layout.facts = facts
        return True

    @staticmethod
    def _plan_kinds(layout: _Layout, pieces: list[torch.Tensor], facts: list[int]) -> None:
        """Group each target's pieces (and all of them) by kind and plan their reads.

        ``facts`` are the pieces' facts as the call read them, with ``layout.reads_by_kernel`` from
        before this plan: kept where the new kinds read contiguity as those were read, else read
        again (one pass over the pieces less for each plan made anew)."""
        read_contiguity = layout.reads_by_kernel
        layout.kinds = [
            (target, _group_into_kinds(pieces, positions)) for target, positions in layout.targets
        ]
        layout.watched_kinds = [
            (target, _group_into_kinds(pieces, positions)) for target, positions in layout.watched
        ]
        # A target holding every piece holds them in order (positions ascend): its kinds are every
        # piece's, not grouped and planned a second time.
        whole = [
            kinds
            for (_, positions), (_, kinds) in zip(layout.targets, layout.kinds, strict=True)
            if len(positions) == len(pieces)
        ]
        layout.every = whole[0] if whole else _group_into_kinds(pieces, range(len(pieces)))
        layout.wide = any(makes_norm_float64(kind.plan.dtype) for kind in layout.every)
        layout.reads_by_kernel = any(
            kind.plan.kernel for _, kinds in layout.kinds for kind in kinds
        ) or any(kind.plan.kernel for kind in layout.every)
        layout.facts = (
            facts
            if layout.reads_by_kernel == read_contiguity
            else _piece_facts(pieces, layout.reads_by_kernel)
        )
        layout.kind_facts = _kind_facts(pieces)


def _grads_of(params: Sequence[torch.Tensor]) -> list[Any]:
    """Each parameter's ``.grad``, at C speed, without asking a subclass's ``__torch_function__``.

    torch's getter first asks a tensor subclass's ``__torch_function__`` (a lookup through the
    class, a third of the getter's cost for FSDP2's DTensor parameters, whose ``__torch_function__``
    is torch's disabled one); that question is skipped here: the grad is what autograd or the caller
    stored, whatever a subclass would say about reading it."""
    with torch._C.DisableTorchFunctionSubclass():
        return list(map(_GRAD, params))


def _piece_facts(pieces: list[torch.Tensor], contiguity: bool) -> list[int]:
    """Each piece's address, element count, dtype and (with ``contiguity``) contiguity, in one list.

    One piece after another: the reads go piece by piece (a ``zip`` of ``map`` calls, C speed), so
    each tensor's metadata comes from memory once, not once per pass (at 20,000 grads, separate
    passes were bound by those fetches), and the flat list allocates nothing the garbage collector
    tracks (a tuple a piece set off a few dozen collections a call). ``RuntimeError`` for a piece
    without storage (a sparse grad). In one compiled pass where built and every piece is a plain
    tensor (:func:`~pgregistry.grad_stats._compiled.steady_checks`): the same list, no Python call
    a fact (four method calls a piece took 0.8 us on the 2-core machine)."""
    checks = steady_checks()
    if checks is not None:
        facts: list[int] | None = checks.piece_facts(pieces, contiguity)
        if facts is not None:
            return facts
    reads: list[Callable[[Any], Any]] = [
        torch.Tensor.data_ptr,
        torch.Tensor.numel,
        _DTYPE,  # a grad of another dtype at a planned address is read in its own (and its offsets)
        *([torch.Tensor.is_contiguous] if contiguity else []),
    ]
    return _facts_of(pieces, reads)


def _kind_facts(pieces: list[torch.Tensor]) -> list[Any]:
    """Each piece's :data:`_KIND_READS` (its device, its shape), one piece after another.

    In one compiled pass where built and every piece is a plain tensor (the same objects: a device
    and a ``torch.Size`` a piece, 1.6 us a piece through Python's attribute reads on the 2-core
    machine), else :func:`_facts_of`."""
    checks = steady_checks()
    if checks is not None:
        facts: list[Any] | None = checks.kind_facts(pieces)
        if facts is not None:
            return facts
    return _facts_of(pieces, _KIND_READS)


def _same_kinds_where_moved(pieces: list[torch.Tensor], moved: list[bool], held: list[Any]) -> bool:
    """Whether every piece ``moved`` flags has the :data:`_KIND_READS` ``held`` gives for it.

    ``held`` is :func:`_kind_facts` of the pieces the kinds were planned for. In one compiled pass
    where built and every flagged piece is a plain tensor (comparing each device and shape where it
    lies, none made: making them for 20,000 pieces, as :func:`_kind_facts` does, took 17 ms on the
    2-core machine), else the facts of the moved pieces read and compared as lists."""
    checks = steady_checks()
    if checks is not None:
        same: bool | None = checks.same_kinds_where_moved(pieces, moved, held)
        if same is not None:
            return same
    width = len(_KIND_READS)
    # at C speed: a Python loop over them took 8 ms a call at 20,000 pieces (2-core machine)
    columns = [compress(held[read::width], moved) for read in range(width)]
    planned_for_moved = list(chain.from_iterable(zip(*columns, strict=True)))
    return bool(_kind_facts(list(compress(pieces, moved))) == planned_for_moved)


def _facts_of(pieces: list[torch.Tensor], reads: Sequence[Callable[[Any], Any]]) -> list[Any]:
    """What each of ``reads`` gives of each piece, one piece after another, in one flat list.

    Read piece by piece (a ``zip`` of ``map`` calls, C speed): each tensor's metadata comes from
    memory once (:func:`_piece_facts`)."""
    return list(chain.from_iterable(zip(*(map(read, pieces) for read in reads), strict=True)))


def _add_part(
    shares: Shares, target: Any, part: torch.Tensor, fields: Mapping[GroupName, Any], groups: Any
) -> None:
    if isinstance(target, tuple):
        field, slot = target
        shares.add_first(field, fields[field], groups, slot, part)
    else:
        shares.add(target, part)


def _group_into_kinds(pieces: Sequence[torch.Tensor], positions: Iterable[int]) -> list[_Kind]:
    positions = list(positions)
    if not positions:
        return []
    chosen = [pieces[position] for position in positions]
    grouped = torch._C._group_tensors_by_device_and_dtype([list[torch.Tensor | None](chosen)], True)
    kinds = []
    for (device, dtype), (lists, indices) in grouped.items():
        tensors = cast("list[torch.Tensor]", lists[0])
        kind_positions = [positions[i] for i in indices]
        take = _make_picker(kind_positions, len(pieces))
        kinds.append(_Kind(take, plan_kind(tensors, device, dtype), kind_positions))
    return kinds


def _reads_by_kernel_alone(wanted: Wanted) -> bool:
    """Whether a kind the kernel reads in full is read for ``wanted`` by the kernel alone.

    The 2-norm and the zero count are what the kernel gives (with the 2-norm, the grads not counted
    here are read for the 2-norm too); the other norms read every piece through torch, and so does
    the exact norm's second read (``divisor``) (:func:`~pgregistry.grad_stats._local.read_kind`)."""
    return wanted.divisor is None and (wanted.p == 2.0 or (wanted.p is None and wanted.zeros))


def _launch_positions(layout: _Layout, count: int) -> list[int] | None:
    """The positions among ``count`` pieces that a read by the kernel alone needs, else ``None``.

    Where every kind of ``layout`` (each target's, each watched target's, every piece's) is read by
    the kernel in full, only each kind's first and base piece (:meth:`_Kind.launch_positions`) and
    the first piece (the reduction's device,
    :func:`~pgregistry.grad_stats._devices.reduction_device`); ``None`` where some piece is read by
    torch or the host, or there is none. Made with the record of the planned grads
    (:meth:`_Planned.of`), which is dropped whenever the kinds or their launches are made again
    (:attr:`_Layout.planned_for`): the positions are those of the current kinds."""
    kinds = [
        *chain.from_iterable(kinds for _, kinds in layout.kinds),
        *chain.from_iterable(kinds for _, kinds in layout.watched_kinds),
        *layout.every,
    ]
    if not count or not all(kind.read_by_kernel_alone for kind in kinds):
        return None
    return sorted({0, *chain.from_iterable(kind.launch_positions() for kind in kinds)})


# --------------------------------------------------------------------------------------- kept plans


class Kept:
    """A plan and what made it: the collection, the parameter set, the roles (module docstring)."""

    def __init__(self, source: Source, given: ProcessGroupCollection, owner: str) -> None:
        params = params_of_source(source)
        self.given = given
        self.unneeded = _fields_left_off(params, given)
        collection = fill_unset_fields(given, STATS_FALLBACK, owner, unneeded=self.unneeded)
        require_classified_experts(params, collection)
        self.collection = collection
        self._reads_grid = bool(grid_reads(given, STATS_FALLBACK, self.unneeded))
        self.plan = Plan(params.named, StatsGroups.from_collection(collection))
        self.params = [param for _, param in params.named]
        self._chunk_refs = [weakref.ref(chunk) for chunk in source.chunks[1:]]
        modules = list(
            dict.fromkeys(chain.from_iterable(chunk.modules() for chunk in source.chunks))
        )
        holders = [*map(_MODULES, modules), *map(_PARAMETERS, modules)]
        self._empty_holders = [holder for holder in holders if not holder]
        self._full_holders = [holder for holder in holders if holder]
        self._checks: ModuleType | None = None  # decided once the roles' dictionaries are known
        # live: made once, read each call; the end marker last (_same_stream)
        self._held_views = [*(holder.values() for holder in self._full_holders), (_END,)]
        self._held = list(self._current_holder_contents())
        self._tensor_refs: list[weakref.ref[Any]] | None = None
        self._take_params: Callable[[Sequence[Any]], list[Any]] | None = None
        if (
            source.tensors is not None
        ):  # the plan must not keep a list's tensors alive: weak references
            self._tensor_refs = [weakref.ref(tensor) for tensor in source.tensors]
            first = {
                id(tensor): position
                for position, tensor in reversed(list(enumerate(source.tensors)))
            }
            self._take_params = _make_picker(
                [first[id(param)] for param in self.params], len(source.tensors)
            )
            self.params = []
        attributes = list(map(vars, self.plan_params(source) or []))
        self._bare = [held for held in attributes if not held]
        self._roleless = [held for held in attributes if held and _NO_ROLE(held)]
        roled = [held for held in attributes if not _NO_ROLE(held)]
        self._roled_blocks = [
            roled[start : start + _ROLE_BLOCK] for start in range(0, len(roled), _ROLE_BLOCK)
        ]
        self._roles = self._role_values()
        self.generation = role_generation()
        exact = all(type(held) is dict for held in chain(holders, attributes))
        self._checks = steady_checks() if exact else None
        """The compiled checks (:mod:`~pgregistry.grad_stats._compiled`) where built and every
        dictionary checked is an exact ``dict`` (whose order is its entries'), else ``None``."""

    def plan_params(self, source: Source) -> list[torch.Tensor] | None:
        """The parameters of ``source`` in plan order if their set is the plan's, else ``None``."""
        if self._tensor_refs is None:
            if source.tensors is not None or len(source.chunks) != len(self._chunk_refs) + 1:
                return None
            if not _same_objects(source.chunks[1:], list(map(operator.call, self._chunk_refs))):
                return None
            if self._checks is not None:
                same = self._checks.same_holders(
                    self._empty_holders, self._full_holders, self._held
                )
            else:
                same = _all_empty(self._empty_holders) and _same_stream(
                    self._current_holder_contents(), self._held
                )
            return self.params if same else None
        tensors = source.tensors
        if tensors is None or not _same_objects(
            tensors, list(map(operator.call, self._tensor_refs))
        ):
            return None
        assert self._take_params is not None
        return self._take_params(tensors)

    def _current_holder_contents(self) -> Iterator[Any]:
        """What the modules' child and parameter dictionaries not empty at first hold now, in order.

        Those not empty when the plan was made. With the empty ones still empty (most: a leaf module
        has no children, a container no parameters; one truth test each, :func:`_all_empty`), equal
        flattened contents mean the same modules and parameters in the same order: a parameter could
        only have moved between two dictionaries next to each other in that order, which leaves
        every statistic as it was (its roles are its own, not its module's), so the non-empty
        dictionaries' lengths are not read. Read through the dictionaries' values views, made with
        the plan (a view is live): a call makes no view per dictionary (17-33% of this check on the
        2-core machine). An iterator ending with :data:`_END`: :func:`_same_stream` compares it
        with what they held, one object after another."""
        return chain.from_iterable(self._held_views)

    def _role_values(self) -> list[list[Any]]:
        """The roles of the parameters that had one (``None`` where unset), key by key in blocks.

        For each block of :data:`_ROLE_BLOCK` such parameters, each of :data:`ROLE_KEYS` in turn:
        one list a key and block, read by ``map`` over the block's attribute dictionaries. No tuple
        is made a parameter (the four keys of each parameter read in turn and zipped took 1.4-1.5x
        the time at 2,000 parameters on the 2-core machine), and a block's dictionaries stay in
        cache from one key to the next (one pass a key over all of them took about 1.3x the time at
        20,000 parameters there; ``docs/performance.md``)."""
        return [
            list(map(dict.get, block, repeat(key)))
            for block in self._roled_blocks
            for key in ROLE_KEYS
        ]

    def _same_roles(self) -> bool:
        """Whether every parameter's roles are those the plan was made with.

        Parameters without attributes then still have none (:func:`_all_empty`), those whose
        attributes held no role still hold none (FSDP2 marks its parameters with ``_is_param``), and
        the roles of the others are equal."""
        if self._checks is not None:
            same: bool = self._checks.same_roles(
                self._bare, self._roleless, self._roled_blocks, ROLE_KEYS, self._roles
            )
            return same
        return (
            _all_empty(self._bare)
            and all(map(_NO_ROLE, self._roleless))
            and self._role_values() == self._roles
        )

    def current(
        self, source: Source, given: ProcessGroupCollection, owner: str
    ) -> list[torch.Tensor] | None:
        """The parameters to read if nothing the plan depends on changed, else ``None``.

        What it depends on: the collection given (and the fields the plan read from the global grid,
        read again, each time with its warning), the parameter set, the roles."""
        if self.generation != role_generation() or not (given is self.given or given == self.given):
            return None
        params = self.plan_params(source)
        if params is None or not self._same_roles():
            return None
        if not self._reads_grid:
            return params
        collection = fill_unset_fields(given, STATS_FALLBACK, owner, unneeded=self.unneeded)
        return params if collection is self.collection or collection == self.collection else None


def _fields_left_off(params: Params, given: ProcessGroupCollection) -> tuple[GroupName, ...]:
    """The expert fields the statistics of ``params`` leave off.

    Those of :data:`EXPERT_STATS_FIELDS`, when no rank of the model's ``mp`` group holds an expert
    parameter, so a model without experts reads none from the global grid.

    Decided once per plan, and alike on every rank of ``mp`` (each TP and pipeline rank of a
    replica, as ``build_optimizer`` decides), so a stage without experts takes the groups its peers
    with experts take (or raises as they do): one MAX all-reduce, only when the answer changes what
    is read (the collection leaves an expert field to the global grid,
    :func:`~pgregistry._runtime.resolve.grid_reads`; a collection that sets them, as
    ``pgregistry.build``'s do, needs none). The ranks of ``mp`` make their plans at the same call:
    what makes a plan anew (another collection, parameter set or role) happens to the whole
    model."""
    if grid_reads(given, EXPERT_STATS_FIELDS) == grid_reads(
        given, EXPERT_STATS_FIELDS, EXPERT_STATS_FIELDS
    ):
        return ()
    experts = any_rank_has(holds_experts(params), given.get("mp") if given.is_set("mp") else None)
    return () if experts else EXPERT_STATS_FIELDS


_KEPT: WeakIdKeyDictionary = WeakIdKeyDictionary()
"""First model chunk -> its kept plan (gone with the model)."""
_KEPT_TENSORS: list[Kept] = []
"""The kept plan of the last list of tensors (it refers to them weakly)."""


def check_or_make_plan(
    source: Source, given: ProcessGroupCollection, owner: str
) -> tuple[Plan, list[torch.Tensor], ProcessGroupCollection]:
    """The kept plan of what an entry point was given, checked or made anew.

    ``source`` is what it was given, taken apart by the door
    (:func:`~pgregistry._runtime.resolve.source_of`), on the collection the door resolved
    (``given``): checked (:meth:`Kept.current`), else made anew (normalised once, the
    grad-statistics fields the model needs filled, :func:`_fields_left_off`, unclassified experts
    refused, classified). Returns its plan, its parameters in the plan's order, and the filled
    collection."""
    kept = (
        _KEPT.get(source.chunks[0])
        if source.chunks
        else (_KEPT_TENSORS[0] if _KEPT_TENSORS else None)
    )
    params = kept.current(source, given, owner) if kept is not None else None
    if kept is None or params is None:
        kept = Kept(source, given, owner)
        if source.chunks:
            _KEPT[source.chunks[0]] = kept
        elif source.tensors:
            _KEPT_TENSORS[:] = [kept]
        params = kept.plan_params(source)
        assert params is not None
    return kept.plan, params, kept.collection

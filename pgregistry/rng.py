"""RNG streams for model-parallel training, seeded from the model's own process groups.

Tensor-parallel shards of one weight must draw different random numbers (else every shard of a
weight is the same), while data-parallel replicas must draw the same ones (else replicas diverge).
Megatron-Core solves this with named RNG streams ("trackers") that a region of code enters with
``fork(name)``; this module keeps its tracker names and seed formulas, so a user migrating gets
bit-identical streams:

=======================  ========================================================================
tracker                  seed
=======================  ========================================================================
``data-parallel-rng``    ``seed``
``model-parallel-rng``   ``seed + 2718 + tp_rank``
``expert-parallel-rng``  ``seed + 1024 + 100 * ep_rank + expt_tp_rank``
``gtp-remat-rng``        model-parallel seed ``+ 65536 * (1 + gtp_remat_rank)``, if gtp_remat > 1
``egtp-remat-rng``       expert seed ``+ 32768 + 65536 * (1 + expt_gtp_remat_rank)``, likewise
=======================  ========================================================================

The ``seed`` above is the base seed: the job's seed plus the pipeline offset ``100 * pp_rank`` (and
``10 * dp_rank`` when data-parallel replicas are initialised differently), which
:func:`model_parallel_manual_seed` adds as Megatron's training loop does, so pipeline stages never
share a stream.

What differs from Megatron-Core:

* ranks are read from a :class:`~pgregistry.collection.ProcessGroupCollection` (``None`` = axis off
  = rank 0), never from integers cached elsewhere; without a collection the global grid is read and
  :class:`~pgregistry.fallback.ProcessGroupFallbackWarning` is emitted;
* the tracker handles a list of ``torch.Generator`` objects: the CPU default generator and, when
  CUDA is available, every CUDA device's default generator, so the same code seeds CPU-only and GPU
  runs;
* :func:`check_seed_plan` computes every rank's seeds from a
  :class:`~pgregistry.layout.ParallelLayout` and reports collisions, which the formulas above do
  produce (for instance ``100 * ep + expt_tp == 1694 + tp`` at ``tp=6, ep=17, expt_tp=0`` gives one
  rank equal model- and expert-parallel seeds, which the tracker refuses).
"""

from __future__ import annotations

import contextlib
import itertools
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Final, Literal

import attrs
import torch

from pgregistry._runtime.flags import require_flag
from pgregistry._runtime.integers import as_integer, non_negative_int, positive_int
from pgregistry._runtime.resolve import resolve_pg_collection
from pgregistry.collection import GroupName, ProcessGroupCollection, group_rank, group_size
from pgregistry.layout import ParallelLayout, require_layout

__all__ = [
    "DATA_PARALLEL_RNG",
    "EGTP_REMAT_RNG",
    "EXPERT_PARALLEL_RNG",
    "GTP_REMAT_RNG",
    "MODEL_PARALLEL_RNG",
    "RNGState",
    "RNGStatesTracker",
    "SeedCollision",
    "check_seed_plan",
    "check_seed_plan_size",
    "get_rng_tracker",
    "model_parallel_manual_seed",
    "seed_plan",
    "tracker_seeds",
]

DATA_PARALLEL_RNG: Final = "data-parallel-rng"
MODEL_PARALLEL_RNG: Final = "model-parallel-rng"
EXPERT_PARALLEL_RNG: Final = "expert-parallel-rng"
GTP_REMAT_RNG: Final = "gtp-remat-rng"
EGTP_REMAT_RNG: Final = "egtp-remat-rng"

_MODEL_PARALLEL_OFFSET: Final = 2718
_EXPERT_PARALLEL_OFFSET: Final = 1024
_EXPERT_RANK_STRIDE: Final = 100
_GTP_REMAT_STRIDE: Final = 65536
_EGTP_REMAT_OFFSET: Final = 32768
_PIPELINE_STRIDE: Final = 100
_DATA_PARALLEL_STRIDE: Final = 10
_MAX_SEED: Final = 2**64

RNGState = tuple[torch.Tensor, ...]
"""The state of one RNG stream: a ``ByteTensor`` per generator the tracker drives.

CPU first, then CUDA.
"""


# ------------------------------------------------------------------------------------------ tracker


def _default_generators() -> tuple[torch.Generator, ...]:
    """The CPU default generator, then each CUDA device's default generator if CUDA is available."""
    generators: list[torch.Generator] = [torch.default_generator]
    if torch.cuda.is_available():
        torch.cuda.init()
        generators.extend(torch.cuda.default_generators)
    return tuple(generators)


class RNGStatesTracker:
    """Named RNG streams, each a saved state of every generator the tracker drives.

    ``fork(name)`` swaps the stream's state into the generators, runs the block, stores the advanced
    state back and restores the generators' previous state, also when the block raises. A stream can
    be forked again later and continues where it stopped. Forks nest as in Megatron-Core: entering a
    fork first stores the progress of the stream being left, and leaving it resumes that stream
    where it now is, so forking a stream that is already forked (a -> b -> a, or a -> a) draws the
    same numbers as the same draws made one after the other.

    Args:
        generators: the generators to drive (default: the CPU default generator plus every CUDA
            device's default generator when CUDA is available, chosen on the first :meth:`add` so
            that creating a tracker never initialises CUDA). A tracker over private
            ``torch.Generator`` objects is what tests use.

    Example:
        >>> import torch
        >>> tracker = RNGStatesTracker()
        >>> tracker.add("model-parallel-rng", 3953)
        >>> with tracker.fork("model-parallel-rng"):
        ...     drawn = torch.rand(3)  # draws from the TP rank's own stream
        >>> torch.equal(drawn, torch.rand(3, generator=torch.Generator().manual_seed(3953)))
        True
    """

    def __init__(self, generators: Sequence[torch.Generator] | None = None) -> None:
        self._explicit_generators = tuple(generators) if generators is not None else None
        self._generators: tuple[torch.Generator, ...] | None = self._explicit_generators
        self._states: dict[str, RNGState] = {}
        self._seeds: dict[int, str] = {}
        self._current: str | None = None

    @property
    def generators(self) -> tuple[torch.Generator, ...]:
        """The generators every stream's state covers, in state order."""
        if self._generators is None:
            self._generators = _default_generators()
        return self._generators

    def reset(self) -> None:
        """Forget every stream and seed (the generators' current states are left as they are).

        Raises:
            RuntimeError: inside a :meth:`fork`, naming the stream.
        """
        if self._current is not None:
            raise RuntimeError(f"cannot reset the RNG tracker inside fork({self._current!r})")
        self._states.clear()
        self._seeds.clear()
        self._generators = self._explicit_generators

    def add(self, name: str, seed: int) -> None:
        """Register stream ``name`` seeded with ``seed``; the generators' current states are kept.

        Two streams with one seed would draw the same numbers, which is never intended, so a seed
        already used is refused.

        Args:
            name: the stream's name, a non-empty str.
            seed: an integer in [0, 2**64).

        Raises:
            ValueError: ``name`` is already registered or ``""``; ``seed`` is already used by
                another stream (naming it) or outside [0, 2**64).
            TypeError: ``name`` is no str.

        Example:
            >>> import torch
            >>> tracker = RNGStatesTracker([torch.Generator()])
            >>> tracker.add("model-parallel-rng", 3953)
            >>> tracker.add("expert-parallel-rng", 3953)
            Traceback (most recent call last):
            ValueError: seed 3953 for RNG tracker 'expert-parallel-rng' is already used by ...
        """
        _check_name(name)
        seed = _check_seed(seed, name)
        if name in self._states:
            raise ValueError(f"RNG tracker {name!r} already exists")
        if seed in self._seeds:
            raise ValueError(
                f"seed {seed} for RNG tracker {name!r} is already "
                f"used by RNG tracker {self._seeds[seed]!r}"
            )
        generators = self.generators
        saved = _capture_states(generators)
        try:
            for generator in generators:
                generator.manual_seed(seed)
            self._states[name] = _capture_states(generators)
        finally:
            _restore_states(generators, saved)
        self._seeds[seed] = name

    def names(self) -> tuple[str, ...]:
        """Registered stream names, in registration order.

        Returns:
            The names, those restored by :meth:`set_states` included.
        """
        return tuple(self._states)

    def seeds(self) -> dict[str, int]:
        """Stream name -> the seed it was added with (none if set by :meth:`set_states` alone).

        Returns:
            A new dict; streams restored from states carry no seed.
        """
        return {name: seed for seed, name in self._seeds.items()}

    def get_states(self) -> dict[str, RNGState]:
        """A copy of every stream's state, for checkpoints.

        Returns:
            Stream name -> one ``uint8`` state tensor per generator, in :attr:`generators` order
            (clones: drawing later changes none of them).
        """
        return {name: tuple(t.clone() for t in state) for name, state in self._states.items()}

    def set_states(self, states: Mapping[str, RNGState]) -> None:
        """Set all streams' states (from :meth:`get_states` of a tracker of as many generators).

        Each state is checked against the generator it is for (a ``uint8`` tensor of that
        generator's state size): a state of another size or dtype was taken, and failed at the
        stream's first ``fork`` in torch's words, naming no stream. The streams are replaced
        whole; their seeds are not restored (:meth:`seeds`).

        Args:
            states: stream name -> one state tensor per generator.

        Raises:
            ValueError: a state of another count, dtype or size, naming the stream and the
                generator (nothing is set then); an empty name.
            TypeError: a name that is no str.
            RuntimeError: inside a :meth:`fork`.

        Example:
            >>> import torch
            >>> saved = RNGStatesTracker([torch.Generator()])
            >>> saved.add("model-parallel-rng", 3953)
            >>> restored = RNGStatesTracker([torch.Generator()])
            >>> restored.set_states(saved.get_states())
            >>> restored.names(), restored.seeds()
            (('model-parallel-rng',), {})
        """
        if self._current is not None:
            raise RuntimeError(f"cannot set RNG states inside fork({self._current!r})")
        generators = self.generators
        count = len(generators)
        checked: dict[str, RNGState] = {}
        for name, state in states.items():
            _check_name(name)
            state = tuple(state)
            if len(state) != count or not all(isinstance(t, torch.Tensor) for t in state):
                raise ValueError(
                    f"state of RNG tracker {name!r} must be {count} "
                    f"tensors (one per generator), got {len(state)} items"
                )
            for index, (generator, tensor) in enumerate(zip(generators, state, strict=True)):
                own = generator.get_state()
                if tensor.dtype != own.dtype or tensor.shape != own.shape:
                    raise ValueError(
                        f"state of RNG tracker {name!r} for generator {index} ({generator.device}) "
                        f"is a {tensor.dtype} tensor of shape {tuple(tensor.shape)}, but that "
                        f"generator's state is {own.dtype} of shape {tuple(own.shape)}: was it "
                        "saved by a tracker of other generators?"
                    )
            checked[name] = tuple(t.clone() for t in state)
        self._states = checked

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG) -> Iterator[None]:
        """Run the block on stream ``name``; the outer state is restored on exit, even on error.

        The stream continues where its last fork stopped.

        Args:
            name: a registered stream (default: the model-parallel one).

        Yields:
            Nothing: the block runs with the stream's state in the generators.

        Raises:
            ValueError: ``name`` is not registered, listing those that are.

        Example:
            >>> import torch
            >>> generator = torch.Generator()
            >>> tracker = RNGStatesTracker([generator])
            >>> tracker.add("dropout", 1234)
            >>> with tracker.fork("dropout"):
            ...     first = torch.rand(2, generator=generator)
            >>> with tracker.fork("dropout"):  # continues where the first fork stopped
            ...     second = torch.rand(2, generator=generator)
            >>> seeded = torch.Generator().manual_seed(1234)
            >>> torch.equal(torch.cat([first, second]), torch.rand(4, generator=seeded))
            True
        """
        if name not in self._states:
            known = ", ".join(repr(n) for n in self._states) or "none"
            raise ValueError(f"RNG tracker {name!r} is not registered (registered: {known})")
        generators = self.generators
        outer_name, outer = self._current, _capture_states(generators)
        if outer_name is not None:
            self._states[outer_name] = outer  # a nested fork of the same stream continues from here
        _restore_states(generators, self._states[name])
        self._current = name
        try:
            yield
        finally:
            self._states[name] = _capture_states(generators)
            _restore_states(
                generators, self._states[outer_name] if outer_name is not None else outer
            )
            self._current = outer_name


def _capture_states(generators: Sequence[torch.Generator]) -> RNGState:
    return tuple(generator.get_state() for generator in generators)


def _restore_states(generators: Sequence[torch.Generator], state: RNGState) -> None:
    for generator, generator_state in zip(generators, state, strict=True):
        generator.set_state(generator_state)


def _check_name(name: object) -> None:
    """``TypeError`` for a stream name that is no str, ``ValueError`` for an empty one.

    A stream named ``None`` or ``5`` would be registered, and never reached by ``fork()`` of the
    name the user meant."""
    if not isinstance(name, str):
        raise TypeError(
            f"RNG tracker name must be a non-empty str, got {name!r} ({type(name).__name__})"
        )
    if not name:
        raise ValueError("RNG tracker name must be a non-empty str, got ''")


def _check_seed(seed: object, what: str) -> int:
    """``seed`` as an int (an integer of any type: ``np.int64`` too), or ``ValueError``.

    It must lie in [0, 2**64), torch's range; a bool or a float is no seed."""
    number = as_integer(seed)
    if number is None or not 0 <= number < _MAX_SEED:
        raise ValueError(f"seed for {what} must be an integer in [0, 2**64), got {seed!r}")
    return number


_default_tracker = RNGStatesTracker()


def get_rng_tracker() -> RNGStatesTracker:
    """The process-wide tracker (Megatron-Core's ``get_cuda_rng_tracker``).

    It drives the default generators.

    Returns:
        The one :class:`RNGStatesTracker` :func:`model_parallel_manual_seed` seeds by default.

    Example:
        On a rank of a gloo world (one rank, as :func:`pgregistry.testing.run_world` starts it):

        >>> import torch
        >>> from pgregistry import ParallelLayout, build
        >>> _ = model_parallel_manual_seed(1234, build(ParallelLayout(num_ranks=1)))
        >>> get_rng_tracker().seeds()["model-parallel-rng"]  # 1234 + 2718 + the TP rank
        3952
        >>> with get_rng_tracker().fork():  # dropout inside a TP region draws from this stream
        ...     mask = torch.nn.functional.dropout(torch.ones(4), p=0.5)
    """
    return _default_tracker


# -------------------------------------------------------------------------------------------- seeds


def tracker_seeds(
    seed: int,
    *,
    tp_rank: int = 0,
    ep_rank: int = 0,
    expt_tp_rank: int = 0,
    gtp_remat_rank: int = 0,
    gtp_remat_size: int = 1,
    expt_gtp_remat_rank: int = 0,
    expt_gtp_remat_size: int = 1,
) -> dict[str, int]:
    """Tracker name -> seed for one rank, by Megatron-Core's formulas (see the module docstring).

    Pure arithmetic: :func:`model_parallel_manual_seed` and :func:`seed_plan` both use it.

    Args:
        seed: the base seed (the job's seed plus the pipeline and data-parallel offsets).
        tp_rank: the rank in the TP group.
        ep_rank: the rank in the EP group.
        expt_tp_rank: the rank in the expert TP group.
        gtp_remat_rank: the rank in the GTP-remat group.
        gtp_remat_size: its size; its stream appears only when it is above 1.
        expt_gtp_remat_rank: the rank in the expert GTP-remat group.
        expt_gtp_remat_size: its size; its stream appears only when it is above 1.

    Returns:
        Tracker name -> seed.

    Raises:
        ValueError: ``seed`` not an integer in [0, 2**64); a rank that is no integer of 0 or more
            (-1, torch's rank of a process outside a group, gave seeds of another rank's
            neighbours), a size that is no positive integer, a GTP-remat rank not below its size.

    Example:
        >>> tracker_seeds(1234, tp_rank=1)
        {'data-parallel-rng': 1234, 'model-parallel-rng': 3953, 'expert-parallel-rng': 2258}
    """
    gtp_size = positive_int(gtp_remat_size, "gtp_remat_size")
    egtp_size = positive_int(expt_gtp_remat_size, "expt_gtp_remat_size")
    ranks = {
        "tp_rank": tp_rank,
        "ep_rank": ep_rank,
        "expt_tp_rank": expt_tp_rank,
        "gtp_remat_rank": gtp_remat_rank,
        "expt_gtp_remat_rank": expt_gtp_remat_rank,
    }
    rank = {name: non_negative_int(value, name) for name, value in ranks.items()}
    for name, size in (("gtp_remat_rank", gtp_size), ("expt_gtp_remat_rank", egtp_size)):
        if rank[name] >= size:
            raise ValueError(f"{name} {rank[name]} is not a rank of a group of size {size}")
    return _offset_seeds(
        _check_seed(seed, "the base seed"),
        rank["tp_rank"],
        rank["ep_rank"],
        rank["expt_tp_rank"],
        rank["gtp_remat_rank"],
        gtp_size,
        rank["expt_gtp_remat_rank"],
        egtp_size,
    )


def _offset_seeds(
    seed: int,
    tp_rank: int,
    ep_rank: int,
    expt_tp_rank: int,
    gtp_remat_rank: int,
    gtp_remat_size: int,
    expt_gtp_remat_rank: int,
    expt_gtp_remat_size: int,
) -> dict[str, int]:
    """:func:`tracker_seeds` without the range check.

    For :func:`check_seed_plan` to report what is out of range.
    """
    model_seed = seed + _MODEL_PARALLEL_OFFSET + tp_rank
    expert_seed = seed + _EXPERT_PARALLEL_OFFSET + _EXPERT_RANK_STRIDE * ep_rank + expt_tp_rank
    seeds = {
        DATA_PARALLEL_RNG: seed,
        MODEL_PARALLEL_RNG: model_seed,
        EXPERT_PARALLEL_RNG: expert_seed,
    }
    if gtp_remat_size > 1:
        seeds[GTP_REMAT_RNG] = model_seed + _GTP_REMAT_STRIDE * (1 + gtp_remat_rank)
    if expt_gtp_remat_size > 1:
        seeds[EGTP_REMAT_RNG] = (
            expert_seed + _EGTP_REMAT_OFFSET + _GTP_REMAT_STRIDE * (1 + expt_gtp_remat_rank)
        )
    return seeds


_SEED_FIELDS: Final[tuple[GroupName, ...]] = (
    "pp",
    "tp",
    "ep",
    "expt_tp",
    "gtp_remat",
    "expt_gtp_remat",
)


def seed_fields(data_parallel_random_init: bool) -> tuple[GroupName, ...]:
    """The collection fields :func:`rank_seeds` reads.

    The entry points resolve these (and only these) before they seed, so a collection that leaves
    another field unset still seeds.

    Args:
        data_parallel_random_init: whether each data-parallel rank gets its own seeds (Megatron's
            flag of that name), which adds ``dp``.

    Returns:
        :data:`_SEED_FIELDS`, then ``dp`` with ``data_parallel_random_init``.

    Example:
        >>> seed_fields(data_parallel_random_init=True)
        ('pp', 'tp', 'ep', 'expt_tp', 'gtp_remat', 'expt_gtp_remat', 'dp')
    """
    return _SEED_FIELDS + (("dp",) if data_parallel_random_init else ())


def rank_seeds(
    seed: int, collection: ProcessGroupCollection, *, data_parallel_random_init: bool
) -> dict[str, int]:
    """Tracker name -> seed of this rank, from the job's ``seed`` and a resolved collection.

    Reads this rank's place in each :func:`seed_fields` group and applies Megatron-Core's formulas
    (:func:`tracker_seeds`); seeds nothing (:func:`model_parallel_manual_seed` does).

    Args:
        seed: the job's seed, the same on every rank.
        collection: a collection with its :func:`seed_fields` set (``None``: the axis is off, rank
            0 of 1).
        data_parallel_random_init: whether each data-parallel rank gets its own seeds.

    Returns:
        Tracker name -> seed, for :meth:`RNGStatesTracker.add`.

    Raises:
        AttributeError: a field of :func:`seed_fields` is unset, naming it.
        ValueError: this rank is in no group of one of them; ``seed`` not an integer in [0, 2**64).
            Seeds the offsets carry past 2**64 are returned; :meth:`RNGStatesTracker.add` refuses
            them.

    Example:
        >>> from pgregistry.collection import ProcessGroupCollection
        >>> every_axis_off = ProcessGroupCollection(**dict.fromkeys(seed_fields(False)))
        >>> rank_seeds(1234, every_axis_off, data_parallel_random_init=False)
        {'data-parallel-rng': 1234, 'model-parallel-rng': 3952, 'expert-parallel-rng': 2258}
    """
    rank = {name: group_rank(collection.get(name)) for name in _SEED_FIELDS}
    dp_rank = group_rank(collection.get("dp")) if data_parallel_random_init else 0
    return tracker_seeds(
        _base_seed(seed, rank["pp"], dp_rank, data_parallel_random_init),
        tp_rank=rank["tp"],
        ep_rank=rank["ep"],
        expt_tp_rank=rank["expt_tp"],
        gtp_remat_rank=rank["gtp_remat"],
        gtp_remat_size=group_size(collection.get("gtp_remat")),
        expt_gtp_remat_rank=rank["expt_gtp_remat"],
        expt_gtp_remat_size=group_size(collection.get("expt_gtp_remat")),
    )


def _base_seed(seed: int, pp_rank: int, dp_rank: int, data_parallel_random_init: bool) -> int:
    base = _check_seed(seed, "the job") + _PIPELINE_STRIDE * pp_rank
    if data_parallel_random_init:
        base += _DATA_PARALLEL_STRIDE * dp_rank
    return base


def model_parallel_manual_seed(
    seed: int,
    pg_collection: ProcessGroupCollection | None = None,
    *,
    data_parallel_random_init: bool = False,
    tracker: RNGStatesTracker | None = None,
) -> dict[str, int]:
    """Seed the default stream and register this rank's RNG streams from the job's ``seed``.

    The base seed is ``seed + 100 * pp_rank`` (plus ``10 * dp_rank`` with
    ``data_parallel_random_init``), as Megatron's training loop computes it before seeding, so
    pipeline stages draw different streams; the streams are then those of :func:`tracker_seeds`, and
    the seeds are exactly those :func:`seed_plan` lists for this rank. The tracker is reset and its
    generators are seeded with the data-parallel seed (the stream outside any fork). Ranks are read
    from the collection's ``pp``, ``tp``, ``ep``, ``expt_tp``, ``gtp_remat``, ``expt_gtp_remat``
    (and ``dp``) groups, where ``None`` is an axis that is off (rank 0 of 1).

    Args:
        seed: the job's seed, the same on every rank. Not checked: seeding is local (no
            collective), so a seed that differs across ranks (``1234 + rank``) seeds each rank as
            given, and weights meant to be replicated then start apart; the rank offsets are added
            here.
        pg_collection: the collection (default: the global grid, with a
            :class:`~pgregistry.fallback.ProcessGroupFallbackWarning`, as for an UNSET field).
        data_parallel_random_init: add the data-parallel offset, so data-parallel ranks draw
            differently too.
        tracker: the tracker to seed (default: :func:`get_rng_tracker`).

    Returns:
        Tracker name -> seed, for this rank.

    Raises:
        TypeError: ``pg_collection`` neither a collection nor ``None``;
            ``data_parallel_random_init`` not ``True`` or ``False`` (``"no"`` read as true).
        ValueError: a seed outside [0, 2**64) (base seed plus offsets; :func:`check_seed_plan` finds
            them ahead); two streams of one seed on this rank; a collection this rank is not a
            member of, or destroyed.
        RuntimeError: the tracker is inside a fork.

    Example:
        On every rank of a 2-rank world (as :func:`pgregistry.testing.run_world` starts it):

        >>> import torch
        >>> from pgregistry import ParallelLayout, build
        >>> pg = build(ParallelLayout(num_ranks=2, tp=2))
        >>> seeds = model_parallel_manual_seed(1234, pg)
        >>> seeds["model-parallel-rng"] - 1234 - 2718 == torch.distributed.get_rank()  # TP rank
        True
        >>> weight = torch.empty(2, 2)
        >>> with get_rng_tracker().fork():  # the model-parallel stream
        ...     _ = torch.nn.init.normal_(weight)
    """
    require_flag(data_parallel_random_init, "data_parallel_random_init")
    fields = seed_fields(data_parallel_random_init)
    collection = resolve_pg_collection(
        pg_collection, owner="model_parallel_manual_seed", fallback=fields
    )
    seeds = rank_seeds(seed, collection, data_parallel_random_init=data_parallel_random_init)
    tracker = tracker if tracker is not None else _default_tracker
    tracker.reset()
    for generator in tracker.generators:
        generator.manual_seed(seeds[DATA_PARALLEL_RNG])
    for name, tracker_seed in seeds.items():
        tracker.add(name, tracker_seed)
    return seeds


# -------------------------------------------------------------------------------------------- plans


_STREAM_AXES: Final[Mapping[str, tuple[str, ...]]] = {
    DATA_PARALLEL_RNG: ("pp",),
    MODEL_PARALLEL_RNG: ("pp", "tp"),
    EXPERT_PARALLEL_RNG: ("pp", "ep", "expt_tp"),
    GTP_REMAT_RNG: ("pp", "tp", "gtp_remat"),
    EGTP_REMAT_RNG: ("pp", "ep", "expt_tp", "expt_gtp_remat"),
}
"""Tracker -> the coordinates that tell its streams apart.

Ranks differing in any of them must draw differently.

Pipeline stages hold different layers, so they must not share a stream (Megatron adds ``100 *
pp_rank`` for that); tensor-parallel shards of one weight must differ (model-parallel); distinct
experts and expert TP shards must differ (expert-parallel); GTP-remat shards must differ (GTP). With
``data_parallel_random_init`` the dense data-parallel coordinate is added to every tracker's list.
Context-parallel ranks and the remaining data-parallel replicas hold the same weights and share
streams by design."""


_PROGRESS_EVERY: Final = 16384
"""Ranks between two ``progress`` callbacks of :func:`seed_plan` and :func:`check_seed_plan`."""


def seed_plan(
    layout: ParallelLayout,
    seed: int,
    *,
    data_parallel_random_init: bool = False,
    progress: Callable[[int], None] | None = None,
) -> dict[int, dict[str, int]]:
    """Rank -> tracker name -> seed, for every rank of ``layout``, without any process group.

    The seeds are those each rank's trackers get from ``model_parallel_manual_seed(seed, pg,
    data_parallel_random_init=...)`` with the collection ``pg`` built from ``layout``: the pipeline
    (and data-parallel) offsets included.

    Args:
        layout: the layout whose ranks to list.
        seed: the job's seed.
        data_parallel_random_init: as for :func:`model_parallel_manual_seed`.
        progress: called with the number of ranks done every 16384 ranks (a plan of millions of
            ranks takes minutes: the command line reports it).

    Returns:
        Global rank -> tracker name -> seed.

    Raises:
        ValueError: ``seed`` not an integer in [0, 2**64).
        TypeError: ``layout`` no :class:`~pgregistry.layout.ParallelLayout`;
            ``data_parallel_random_init`` not ``True`` or ``False``.

    Example:
        >>> from pgregistry.layout import ParallelLayout
        >>> plan = seed_plan(ParallelLayout(num_ranks=8, tp=2, pp=2), 1234)
        >>> plan[4]  # pipeline stage 1: the base seed is 1234 + 100
        {'data-parallel-rng': 1334, 'model-parallel-rng': 4052, 'expert-parallel-rng': 2358}
    """
    return {
        rank: seeds
        for rank, _, seeds in _rank_seeds(layout, seed, data_parallel_random_init, progress)
    }


def _rank_seeds(
    layout: ParallelLayout,
    seed: int,
    data_parallel_random_init: bool,
    progress: Callable[[int], None] | None,
) -> Iterator[tuple[int, dict[str, int], dict[str, int]]]:
    """``(rank, coordinates, tracker name -> seed)`` for every rank of ``layout``, in rank order."""
    require_layout(layout)
    require_flag(data_parallel_random_init, "data_parallel_random_init")
    sizes = layout.axis_sizes()
    first = layout.rank_range()[0]
    for rank in range(*layout.rank_range()):
        if progress is not None and (rank - first) % _PROGRESS_EVERY == 0 and rank > first:
            progress(rank - first)
        coords = layout.coords(rank)
        base = _base_seed(seed, coords["pp"], coords["dp"], data_parallel_random_init)
        # Unchecked: a base seed pushed past 2**64 by the pipeline offset is reported by
        # check_seed_plan.
        yield (
            rank,
            coords,
            _offset_seeds(
                base,
                coords["tp"],
                coords["ep"],
                coords["expt_tp"],
                coords["gtp_remat"],
                sizes["gtp_remat"],
                coords["expt_gtp_remat"],
                sizes["expt_gtp_remat"],
            ),
        )


@attrs.frozen(slots=True, kw_only=True)
class SeedCollision:
    """A seed plan's fault: streams that must differ share one seed, or a seed is out of range.

    Attributes:
        kind: ``"across_ranks"``: ranks whose coordinates ``axes`` differ (so their ``trackers[0]``
            streams must differ) share ``seed``. ``"within_rank"``: on each of ``ranks`` the
            ``trackers`` share ``seed``, which :meth:`RNGStatesTracker.add` refuses at start-up.
            ``"out_of_range"``: on each of ``ranks`` the tracker ``trackers[0]`` gets a seed outside
            ``[0, 2**64)`` (the base seed plus Megatron-Core's offsets), which
            :func:`model_parallel_manual_seed` refuses.
        seed: the shared seed; for ``"out_of_range"``, the one of the first such rank.
        trackers: the tracker, or the trackers sharing the seed on one rank.
        ranks: one rank per distinct coordinate tuple (``"across_ranks"``), else every rank it
            holds.
        axes: the axes the ranks' coordinates differ in (empty unless ``"across_ranks"``).
        coords: each rank's coordinates, in ``axes`` order (empty unless ``"across_ranks"``).

    :func:`check_seed_plan` returns them; :meth:`describe` is the line for people,
    :meth:`to_dict` the record for JSON.

    Example:
        >>> from pgregistry.layout import ParallelLayout
        >>> collision = check_seed_plan(ParallelLayout(num_ranks=4, tp=2), 2**64 - 50)[0]
        >>> collision.kind, collision.trackers, collision.ranks
        ('out_of_range', ('model-parallel-rng',), (0, 1, 2, 3))
        >>> print(collision.describe())  # doctest: +NORMALIZE_WHITESPACE
        seed 18446744073709554284 of tracker model-parallel-rng on each of ranks 0, 1, 2, 3
        (4 ranks) is outside [0, 2**64), which model_parallel_manual_seed refuses:
        use a smaller seed
    """

    kind: Literal["across_ranks", "within_rank", "out_of_range"]
    seed: int
    trackers: tuple[str, ...]
    ranks: tuple[int, ...]
    axes: tuple[str, ...] = ()
    coords: tuple[tuple[int, ...], ...] = ()

    @classmethod
    def out_of_range_in(cls, plan: Mapping[int, Mapping[str, int]]) -> list[SeedCollision]:
        """The ``"out_of_range"`` collisions of a :func:`seed_plan`: its seeds outside [0, 2**64).

        The job's seed is checked, but the pipeline and tracker offsets can carry a rank's seeds
        past 2**64, which :func:`model_parallel_manual_seed` refuses on that rank; ``pgregistry
        seed-plan`` refuses to print such a plan, with these collisions' messages.

        Args:
            plan: rank -> tracker name -> seed, as :func:`seed_plan` returns it.

        Returns:
            One ``"out_of_range"`` collision per tracker with such seeds, naming every rank where
            it happens; empty when every seed is in range.

        Example:
            >>> from pgregistry.layout import ParallelLayout
            >>> plan = seed_plan(ParallelLayout(num_ranks=2), 2**64 - 2000)
            >>> [(c.trackers, c.ranks) for c in SeedCollision.out_of_range_in(plan)]
            [(('model-parallel-rng',), (0, 1))]
        """
        out_of_range = _OutOfRange()
        for rank, seeds in plan.items():
            out_of_range.note(rank, seeds)
        return out_of_range.collisions()

    def describe(self) -> str:
        """One line for people.

        Returns:
            The seed, the trackers, and the ranks with their coordinates (ranks sharing a seed)
            or the first eight of them and their count (one rank's trackers, a seed out of range,
            which also says what to do); the class example shows one.
        """
        if self.kind != "across_ranks":
            shown = ", ".join(map(str, self.ranks[:8])) + (", ..." if len(self.ranks) > 8 else "")
            where = (
                f"rank {shown}"
                if len(self.ranks) == 1
                else f"each of ranks {shown} ({len(self.ranks)} ranks)"
            )
            if self.kind == "out_of_range":
                return (
                    f"seed {self.seed} of tracker {self.trackers[0]} on {where} is outside "
                    "[0, 2**64), which model_parallel_manual_seed refuses: use a smaller seed"
                )
            return f"seed {self.seed} is used by trackers {', '.join(self.trackers)} on {where}"
        pairs = "; ".join(
            f"rank {rank} ({', '.join(f'{a}={c}' for a, c in zip(self.axes, coords, strict=True))})"
            for rank, coords in zip(self.ranks, self.coords, strict=True)
        )
        return (
            f"seed {self.seed} of tracker {self.trackers[0]} "
            f"is shared by ranks that must differ: {pairs}"
        )

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready record.

        Returns:
            The fields by name, tuples as lists (``pgregistry seed-plan --check --json`` prints
            them).
        """
        return {
            "kind": self.kind,
            "seed": self.seed,
            "trackers": list(self.trackers),
            "ranks": list(self.ranks),
            "axes": list(self.axes),
            "coords": [list(c) for c in self.coords],
        }


def check_seed_plan(
    layout: ParallelLayout,
    seed: int,
    *,
    data_parallel_random_init: bool = False,
    progress: Callable[[int], None] | None = None,
) -> list[SeedCollision]:
    """Every seed collision of :func:`seed_plan`, without any process group.

    Three kinds are reported (:class:`SeedCollision`): ranks that must draw differently on a tracker
    (the coordinates of ``_STREAM_AXES`` differ) but get one seed for it, grouped by tracker and
    seed; trackers that share a seed on one rank, grouped by the trackers and seed over every rank
    where it happens; and trackers whose seed leaves ``[0, 2**64)`` on some ranks, grouped by
    tracker. :func:`check_seed_plan_size` tells what the check holds before it runs.

    Args:
        layout: the layout whose plan to check.
        seed: the job's seed.
        data_parallel_random_init: as for :func:`model_parallel_manual_seed` (data-parallel ranks
            must then differ too).
        progress: as for :func:`seed_plan`.

    Returns:
        The collisions; empty when there is none.

    Raises:
        ValueError: ``seed`` not an integer in [0, 2**64).
        TypeError: ``layout`` no :class:`~pgregistry.layout.ParallelLayout`;
            ``data_parallel_random_init`` not ``True`` or ``False``.

    Example:
        >>> from pgregistry.layout import ParallelLayout
        >>> check_seed_plan(ParallelLayout(num_ranks=4, tp=2), 1234)
        []
        >>> too_large = check_seed_plan(ParallelLayout(num_ranks=4, tp=2), 2**64 - 50)
        >>> [(collision.kind, collision.trackers) for collision in too_large]
        [('out_of_range', ('model-parallel-rng',)), ('out_of_range', ('expert-parallel-rng',))]
    """
    axes = _check_axes(data_parallel_random_init)
    # (tracker, seed) -> coordinate tuple -> first rank holding it
    streams: dict[tuple[str, int], dict[tuple[int, ...], int]] = {}
    # (trackers, seed) -> ranks
    shared: dict[tuple[tuple[str, ...], int], list[int]] = {}
    out_of_range = _OutOfRange()
    for rank, coords, seeds in _rank_seeds(layout, seed, data_parallel_random_init, progress):
        out_of_range.note(rank, seeds)
        by_seed: dict[int, list[str]] = {}
        for tracker, tracker_seed in seeds.items():
            key = tuple(coords[a] for a in axes[tracker])
            streams.setdefault((tracker, tracker_seed), {}).setdefault(key, rank)
            by_seed.setdefault(tracker_seed, []).append(tracker)
        for tracker_seed, trackers in by_seed.items():
            if len(trackers) > 1:
                shared.setdefault((tuple(trackers), tracker_seed), []).append(rank)
    collisions = [
        SeedCollision(
            kind="across_ranks",
            seed=tracker_seed,
            trackers=(tracker,),
            ranks=tuple(holders.values()),
            axes=axes[tracker],
            coords=tuple(holders),
        )
        for (tracker, tracker_seed), holders in streams.items()
        if len(holders) > 1
    ]
    collisions.extend(
        SeedCollision(kind="within_rank", seed=tracker_seed, trackers=trackers, ranks=tuple(ranks))
        for (trackers, tracker_seed), ranks in shared.items()
    )
    return collisions + out_of_range.collisions()


class _OutOfRange:
    """Tracker -> (its first seed outside ``[0, 2**64)``, the ranks with one), rank by rank."""

    def __init__(self) -> None:
        self.found: dict[str, tuple[int, list[int]]] = {}

    def note(self, rank: int, seeds: Mapping[str, int]) -> None:
        for tracker, tracker_seed in seeds.items():
            if not 0 <= tracker_seed < _MAX_SEED:
                self.found.setdefault(tracker, (tracker_seed, []))[1].append(rank)

    def collisions(self) -> list[SeedCollision]:
        return [
            SeedCollision(
                kind="out_of_range", seed=first_seed, trackers=(tracker,), ranks=tuple(ranks)
            )
            for tracker, (first_seed, ranks) in self.found.items()
        ]


def _check_axes(data_parallel_random_init: bool) -> dict[str, tuple[str, ...]]:
    """Tracker -> the coordinates :func:`check_seed_plan` tells its streams apart by."""
    extra = ("dp",) if data_parallel_random_init else ()
    return {tracker: tracker_axes + extra for tracker, tracker_axes in _STREAM_AXES.items()}


_SHARED_COMBINATIONS_COUNTED: Final = 2**16
"""The most rank combinations :func:`check_seed_plan_size` tries.

Combinations of (tp, ep, expt_tp, gtp_remat, expt_gtp_remat).
"""


def check_seed_plan_size(
    layout: ParallelLayout, seed: int, *, data_parallel_random_init: bool = False
) -> tuple[int, int]:
    """``(streams, listed)``: what :func:`check_seed_plan` of ``layout`` holds, by its sizes alone.

    So the command line estimates its memory before it starts (the check keeps no per-rank record
    otherwise).

    Args:
        layout: the layout whose plan the check would hold.
        seed: the job's seed.
        data_parallel_random_init: as for :func:`check_seed_plan`.

    Returns:
        ``streams``, exact: the distinct (tracker, coordinates) streams the check keys (without
        ``data_parallel_random_init`` a few per pipeline stage and TP/EP rank, whatever the
        data-parallel size; with it about one per rank and tracker). ``listed``, an estimate of the
        (rank, collision) entries of the within-rank and out-of-range collisions, which list every
        rank they hold: each tracker whose largest seed could reach 2**64 counts every rank; the
        within-rank collisions count the share of the (tp, ep, expt_tp, gtp_remat, expt_gtp_remat)
        rank combinations (the first :data:`_SHARED_COMBINATIONS_COUNTED` of them) whose trackers
        share seeds: what pipeline and data-parallel ranks add is the same for every tracker of a
        rank.

    Raises:
        ValueError: ``seed`` not an integer in [0, 2**64).
        TypeError: ``layout`` no :class:`~pgregistry.layout.ParallelLayout`;
            ``data_parallel_random_init`` not ``True`` or ``False``.

    Example:
        >>> from pgregistry.layout import ParallelLayout
        >>> check_seed_plan_size(ParallelLayout(num_ranks=4, tp=2), 1234)
        (5, 0)
    """
    require_layout(layout)
    require_flag(data_parallel_random_init, "data_parallel_random_init")
    sizes = layout.axis_sizes()
    streams = 0
    active = [t for t in _STREAM_AXES if t not in (GTP_REMAT_RNG, EGTP_REMAT_RNG)]
    active += [GTP_REMAT_RNG] if sizes["gtp_remat"] > 1 else []
    active += [EGTP_REMAT_RNG] if sizes["expt_gtp_remat"] > 1 else []
    for tracker in active:
        streams += min(
            layout.num_ranks,
            math.prod(sizes[a] for a in _check_axes(data_parallel_random_init)[tracker]),
        )
    top = _base_seed(seed, sizes["pp"] - 1, sizes["dp"] - 1, data_parallel_random_init)
    highest = _offset_seeds(
        top,
        sizes["tp"] - 1,
        sizes["ep"] - 1,
        sizes["expt_tp"] - 1,
        sizes["gtp_remat"] - 1,
        sizes["gtp_remat"],
        sizes["expt_gtp_remat"] - 1,
        sizes["expt_gtp_remat"],
    )
    listed = layout.num_ranks * sum(1 for value in highest.values() if value >= _MAX_SEED)
    ranges = [range(sizes[a]) for a in ("tp", "ep", "expt_tp", "gtp_remat", "expt_gtp_remat")]
    tried = shared = 0
    for tp, ep, etp, gtp, egtp in itertools.islice(
        itertools.product(*ranges), _SHARED_COMBINATIONS_COUNTED
    ):
        seeds = _offset_seeds(
            0, tp, ep, etp, gtp, sizes["gtp_remat"], egtp, sizes["expt_gtp_remat"]
        )
        tried += 1
        shared += len(seeds) - len(set(seeds.values()))
    return streams, listed + math.ceil(layout.num_ranks * shared / tried)

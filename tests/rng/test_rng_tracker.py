"""RNGStatesTracker: registration rules, fork semantics, state round trips, on CPU generators."""

from __future__ import annotations

import re

import pytest
import torch

from pgregistry.rng import (
    DATA_PARALLEL_RNG,
    MODEL_PARALLEL_RNG,
    RNGStatesTracker,
    get_rng_tracker,
)


def _draw(generator: torch.Generator, n: int = 5) -> torch.Tensor:
    return torch.rand(n, generator=generator)


def _fresh(seed: int) -> torch.Generator:
    generator = torch.Generator()
    generator.manual_seed(seed)
    return generator


def test_add_keeps_the_outer_state_and_fork_draws_the_seeded_stream() -> None:
    generator = _fresh(7)
    outer = _fresh(7)
    tracker = RNGStatesTracker([generator])
    tracker.add("a", 1234)
    assert torch.equal(_draw(generator), _draw(outer))  # add did not move the generator
    expected = _fresh(1234)
    with tracker.fork("a"):
        assert torch.equal(_draw(generator), _draw(expected))
    assert torch.equal(_draw(generator), _draw(outer))  # the outer stream continues where it was
    with tracker.fork("a"):
        assert torch.equal(_draw(generator), _draw(expected))  # the stream continues, it does not restart


def test_fork_restores_the_outer_state_when_the_block_raises() -> None:
    generator = _fresh(3)
    tracker = RNGStatesTracker([generator])
    tracker.add("a", 99)
    before = generator.get_state()
    with pytest.raises(KeyError, match="boom"), tracker.fork("a"):
        _draw(generator)
        raise KeyError("boom")
    assert torch.equal(generator.get_state(), before)
    expected = _fresh(99)
    _draw(expected)
    with tracker.fork("a"):
        assert torch.equal(_draw(generator), _draw(expected))  # the draws made before the raise are kept


def test_fork_drives_every_generator() -> None:
    first, second = _fresh(1), _fresh(2)
    tracker = RNGStatesTracker([first, second])
    tracker.add("a", 5)
    with tracker.fork("a"):
        assert torch.equal(_draw(first), _draw(_fresh(5)))
        assert torch.equal(_draw(second), _draw(_fresh(5)))
    assert torch.equal(_draw(first), _draw(_fresh(1)))
    assert torch.equal(_draw(second), _draw(_fresh(2)))


def test_duplicate_name_or_seed_is_refused_naming_both() -> None:
    tracker = RNGStatesTracker([torch.Generator()])
    tracker.add("model", 10)
    with pytest.raises(ValueError, match="'model' already exists"):
        tracker.add("model", 11)
    with pytest.raises(ValueError, match=r"seed 10 for RNG tracker 'expert' is already used by RNG tracker 'model'"):
        tracker.add("expert", 10)
    assert tracker.names() == ("model",)
    assert tracker.seeds() == {"model": 10}


@pytest.mark.parametrize("seed", [-1, 2**64, 1.5, True, "3"])
def test_bad_seed_is_refused(seed: object) -> None:
    tracker = RNGStatesTracker([torch.Generator()])
    with pytest.raises(ValueError, match="seed for 'a'|seed for a"):
        tracker.add("a", seed)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "name, error, shown", [(None, TypeError, "None (NoneType)"), (5, TypeError, "5 (int)"), ("", ValueError, "''")]
)
def test_a_stream_name_that_is_no_non_empty_str_is_refused_naming_it(
    name: object, error: type[Exception], shown: str
) -> None:
    # `add(None, 5)` registered a stream named None, which `fork()` of a str never reaches.
    tracker = RNGStatesTracker([torch.Generator()])
    message = re.escape(f"RNG tracker name must be a non-empty str, got {shown}")
    with pytest.raises(error, match=message):
        tracker.add(name, 5)  # type: ignore[arg-type]
    with pytest.raises(error, match=message):
        tracker.set_states({name: (torch.Generator().get_state(),)})  # type: ignore[dict-item]
    assert tracker.names() == () and tracker.seeds() == {}


def test_unknown_fork_and_reset_inside_a_fork_are_refused() -> None:
    tracker = RNGStatesTracker([torch.Generator()])
    tracker.add("a", 1)
    with pytest.raises(ValueError, match=r"'b' is not registered \(registered: 'a'\)"), tracker.fork("b"):
        pass
    with tracker.fork("a"):
        with pytest.raises(RuntimeError, match="cannot reset"):
            tracker.reset()


def test_reforking_a_forked_stream_draws_as_in_sequence() -> None:
    # Megatron-Core's tracker allows a -> a and a -> b -> a; code migrated from it nests forks. Oracle: plain
    # generators seeded alike, drawn one after the other.
    generator = _fresh(3)
    tracker = RNGStatesTracker([generator])
    tracker.add("a", 11)
    tracker.add("b", 22)
    a, b, outer = _fresh(11), _fresh(22), _fresh(3)
    with tracker.fork("a"):
        assert torch.equal(_draw(generator), _draw(a))
        with tracker.fork("a"):
            assert torch.equal(_draw(generator), _draw(a))
        assert torch.equal(_draw(generator), _draw(a))
        with tracker.fork("b"):
            assert torch.equal(_draw(generator), _draw(b))
            with tracker.fork("a"):
                assert torch.equal(_draw(generator), _draw(a))
            assert torch.equal(_draw(generator), _draw(b))
        assert torch.equal(_draw(generator), _draw(a))
    assert torch.equal(_draw(generator), _draw(outer))
    with tracker.fork("a"), pytest.raises(KeyError), tracker.fork("a"):
        _draw(generator)  # a raising inner fork keeps its draws and the nesting
        raise KeyError("boom")
    _draw(a)
    with tracker.fork("a"):
        assert torch.equal(_draw(generator), _draw(a))


def test_reset_forgets_names_and_seeds() -> None:
    tracker = RNGStatesTracker([torch.Generator()])
    tracker.add("a", 1)
    tracker.reset()
    assert tracker.names() == ()
    tracker.add("a", 1)  # neither the name nor the seed is taken any more


def test_get_and_set_states_round_trip() -> None:
    generator = _fresh(0)
    tracker = RNGStatesTracker([generator])
    tracker.add("a", 42)
    with tracker.fork("a"):
        _draw(generator)
    saved = tracker.get_states()
    with tracker.fork("a"):
        first = _draw(generator)
    with tracker.fork("a"):
        _draw(generator)
    tracker.set_states(saved)
    with tracker.fork("a"):
        assert torch.equal(_draw(generator), first)
    other = RNGStatesTracker([_fresh(0)])
    other.set_states(saved)
    with other.fork("a"):
        assert torch.equal(_draw(other.generators[0]), first)


def test_set_states_checks_the_generator_count() -> None:
    tracker = RNGStatesTracker([torch.Generator(), torch.Generator()])
    with pytest.raises(ValueError, match="must be 2 tensors"):
        tracker.set_states({"a": (torch.Generator().get_state(),)})


def test_get_states_returns_copies() -> None:
    generator = _fresh(0)
    tracker = RNGStatesTracker([generator])
    tracker.add("a", 42)
    saved = tracker.get_states()
    saved["a"][0].zero_()
    with tracker.fork("a"):
        assert torch.equal(_draw(generator), _draw(_fresh(42)))


def test_default_tracker_drives_the_cpu_default_generator() -> None:
    tracker = get_rng_tracker()
    assert tracker is get_rng_tracker()
    saved_cpu = torch.get_rng_state()
    try:
        tracker.reset()
        torch.manual_seed(5)
        tracker.add(MODEL_PARALLEL_RNG, 77)
        tracker.add(DATA_PARALLEL_RNG, 78)
        assert tracker.generators[0] is torch.default_generator
        with tracker.fork():  # model-parallel by default
            inside = torch.rand(4)
        after = torch.rand(4)
        assert torch.equal(inside, torch.rand(4, generator=_fresh(77)))
        assert torch.equal(after, torch.rand(4, generator=_fresh(5)))
    finally:
        tracker.reset()
        torch.set_rng_state(saved_cpu)

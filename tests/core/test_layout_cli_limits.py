"""``pgregistry layout`` and ``seed-plan`` on a world too large to list: exit 2 with a message before enumerating
anything, and advice that would help.

At 2**31 ranks ``layout`` used to die in the allocator (a raw traceback, exit 1) after trying to enumerate every
group: the world is now refused at construction (torch.distributed's ranks are C ints), and a world that is
addressable but whose listing would not fit in memory is refused from the layout's shapes, estimated up front.
With ``--show 0`` it advised ``--show 0``. ``seed-plan --check`` at 2**31 - 1 ranks ran for hours, silent; it now
has the same guard. The memory available is fixed in these tests (the estimate is compared with it), so their
outcome does not depend on the machine.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest

from pgregistry.cli import _limits as limits
from pgregistry.cli import main

_LARGEST = 2**31 - 1
_GiB = 2**30


@pytest.fixture
def free_memory(monkeypatch: pytest.MonkeyPatch) -> Callable[[int], None]:
    """Set the memory this machine has available, in GiB: ``free_memory(16)``."""

    def set_free(gib: int) -> None:
        monkeypatch.setattr(limits, "available_memory", lambda: gib * _GiB)

    return set_free


def _refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1
    return captured.err


def test_two_to_the_31_ranks_is_refused_as_unaddressable(capsys: pytest.CaptureFixture[str]) -> None:
    err = _refused(["layout", "--num-ranks", str(2**31)], capsys)
    assert err == (
        "pgregistry layout: error: num_ranks 2147483648 is more ranks than torch.distributed can address "
        "(at most 2147483647 = 2**31 - 1: ranks are C ints)\n"
    )


def test_a_listing_larger_than_memory_is_refused_with_the_estimate(
    free_memory: Callable[[int], None], capsys: pytest.CaptureFixture[str]
) -> None:
    # Every group of every kind spans the whole world here, so the default listing prints billions of ranks: an
    # estimate of hundreds of GiB. The enumeration alone (32 bytes a rank: 64 GiB) fits in 256 GiB.
    free_memory(256)
    err = _refused(["layout", "--num-ranks", str(_LARGEST)], capsys)
    match = re.fullmatch(
        r"pgregistry layout: error: listing 2147483647 ranks \((\d+) of them printed\) needs about ([\d.]+) GiB of "
        r"memory, more than the 256\.0 GiB available; lower --show \(--show 0 prints only the group counts and "
        r"sizes\)\n",
        err,
    )
    assert match is not None, err
    assert int(match.group(1)) > _LARGEST and float(match.group(2)) > 256


def test_with_show_0_the_advice_is_not_show_0(
    free_memory: Callable[[int], None], capsys: pytest.CaptureFixture[str]
) -> None:
    # It used to advise "lower --show (--show 0 prints only the group counts and sizes)" to a --show 0 already given.
    free_memory(16)
    err = _refused(["layout", "--num-ranks", str(_LARGEST), "--show", "0"], capsys)
    assert err == (
        "pgregistry layout: error: listing 2147483647 ranks (0 of them printed) needs about 64.0 GiB of memory, more "
        "than the 16.0 GiB available; enumerating the groups alone needs about 64.0 GiB, whatever --show and --rank "
        "say: run it where more memory is free\n"
    )


def test_with_rank_the_advice_is_to_leave_it_out(
    free_memory: Callable[[int], None], capsys: pytest.CaptureFixture[str]
) -> None:
    free_memory(256)
    err = _refused(["layout", "--num-ranks", str(_LARGEST), "--show", "0", "--rank", "5"], capsys)
    assert err.endswith("; leave out --rank (it lists that rank's groups in full)\n"), err


@pytest.mark.parametrize(
    ("check", "doing", "gib"), [(True, "checking the seed plan", 1152), (False, "the seed plan", 6144)]
)
def test_seed_plan_of_too_many_ranks_is_refused_with_the_estimate(
    check: bool, doing: str, gib: int, free_memory: Callable[[int], None], capsys: pytest.CaptureFixture[str]
) -> None:
    # --check at 2**31 - 1 ranks used to run for hours (about 10 microseconds a rank) with no output.
    free_memory(256)
    argv = ["seed-plan", "--num-ranks", str(_LARGEST), "--seed", "1", *(["--check"] if check else [])]
    assert _refused(argv, capsys) == (
        f"pgregistry seed-plan: error: {doing} of 2147483647 ranks needs about {gib}.0 GiB of memory, more than the "
        "256.0 GiB available; it holds every rank's seeds: run it where more memory is free\n"
    )

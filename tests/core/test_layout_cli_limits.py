"""``pgregistry layout`` and ``seed-plan`` on a world too large to list: exit 2 with a message before enumerating
anything, and advice that would help.

At 2**31 ranks ``layout`` used to die in the allocator (a raw traceback, exit 1) after trying to enumerate every
group: the world is now refused at construction (torch.distributed's ranks are C ints), and a world that is
addressable but whose listing would not fit in memory is refused from the layout's shapes, estimated up front.
With ``--show 0`` it advised ``--show 0``. ``seed-plan --check`` at 2**31 - 1 ranks ran for hours, silent; it now
has the same guard, with estimates held to what tracemalloc sees the plan and its check hold, a time limit from the
rate of the first ranks, and progress on stderr. The memory available is fixed in these tests (the estimate is
compared with it), so their outcome does not depend on the machine.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import tracemalloc
from collections.abc import Callable

import pytest

from pgregistry.cli import _limits as limits
from pgregistry.cli import main
from pgregistry.cli._seed_plan import estimate_plan_bytes
from pgregistry.layout import ParallelLayout
from pgregistry.rng import check_seed_plan, check_seed_plan_size

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
    ("argv", "doing", "gib", "advice"),
    [
        (
            ["--check", "--data-parallel-random-init"], "checking the seed plan", 3072,
            "with --data-parallel-random-init every data-parallel rank has streams of its own, which the check holds: "
            "run it where more memory is free",
        ),
        (
            [], "the seed plan", 6144,
            "it holds every rank's seeds: run it where more memory is free, or check it (--check)",
        ),
    ],
)
def test_seed_plan_of_too_many_ranks_is_refused_with_the_estimate(
    argv: list[str], doing: str, gib: int, advice: str, free_memory: Callable[[int], None],
    capsys: pytest.CaptureFixture[str],
) -> None:
    # --check at 2**31 - 1 ranks used to run for hours (about 10 microseconds a rank) with no output.
    free_memory(256)
    argv = ["seed-plan", "--num-ranks", str(_LARGEST), "--seed", "1", *argv]
    assert _refused(argv, capsys) == (
        f"pgregistry seed-plan: error: {doing} of 2147483647 ranks needs about {gib}.0 GiB of memory, more than the "
        f"256.0 GiB available; {advice}\n"
    )


# ------------------------------------------------------------------------------------ seed-plan's true estimates

_RANKS = 2**13


def _held(run: Callable[[], object]) -> int:
    """The peak bytes Python allocates while ``run`` runs, by tracemalloc."""
    tracemalloc.start()
    try:
        run()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize(
    ("sizes", "seed", "random_init"),
    [
        ({}, 1, False),  # every rank the same streams: the check holds almost nothing
        ({}, 1, True),  # a stream per rank and tracker
        ({"tp": 8, "pp": 4}, 1, True),  # many seeds shared across ranks: fewer, larger records
        ({}, 2**64 - 50, False),  # every rank out of range on two trackers: each listed
    ],
)
def test_the_seed_check_memory_estimate_is_within_a_small_factor_of_what_it_holds(
    sizes: dict[str, int], seed: int, random_init: bool
) -> None:
    # It was 576 bytes a rank whatever the layout: 24.1 GiB at 45 M ranks, where the check held under 1 GiB.
    layout = ParallelLayout(num_ranks=_RANKS, **sizes)
    estimate = estimate_plan_bytes(layout, seed, True, random_init)
    held = _held(lambda: check_seed_plan(layout, seed, data_parallel_random_init=random_init))
    slack = 512 * 1024  # what the check holds whatever the layout (its generator, the interpreter's caches)
    assert held <= estimate + slack and estimate <= 4 * held + slack, (estimate, held)


def test_the_seed_plan_memory_estimate_is_within_a_small_factor_of_what_printing_it_holds() -> None:
    argv = ["seed-plan", "--num-ranks", str(_RANKS // 2), "--seed", "1", "--tp", "4", "--ep", "2", "--gtp-remat", "2"]
    layout = ParallelLayout(num_ranks=_RANKS // 2, tp=4, ep=2, gtp_remat=2)
    with open(os.devnull, "w") as devnull, contextlib.redirect_stdout(devnull):
        held = _held(lambda: main(argv))
    estimate = estimate_plan_bytes(layout, 1, False, False)
    assert held <= estimate <= 4 * held, (estimate, held)


@pytest.mark.parametrize(
    ("sizes", "seed"),
    [
        ({}, 2**64 - 50),  # model- and expert-parallel seeds out of range on every rank
        # 2718 + tp_rank == 1024 + 100 * ep_rank + expt_tp_rank at tp_rank 6, ep_rank 17: one rank in 8 * 19
        ({"tp": 8, "ep": 19, "expt_tp": 1}, 1),
    ],
)
def test_the_listed_estimate_counts_the_ranks_the_collisions_list(sizes: dict[str, int], seed: int) -> None:
    layout = ParallelLayout(num_ranks=8 * 19 * 16, **sizes)
    listed = sum(len(c.ranks) for c in check_seed_plan(layout, seed) if c.kind != "across_ranks")
    assert listed > 0
    assert check_seed_plan_size(layout, seed)[1] == listed


def _seed_plan(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["seed-plan", "--seed", "1", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_a_check_longer_than_the_time_limit_is_refused_from_its_first_ranks() -> None:
    # 2**31 - 1 ranks hold a few streams only, so the memory guard admits them; at about 10 microseconds a rank
    # the check would then run for hours in silence. Refused once the first ranks have given the rate. In a
    # subprocess, so that a check that is not refused ends at its timeout, not pytest's.
    done = subprocess.run(
        [sys.executable, "-m", "pgregistry", "seed-plan", "--seed", "1", "--num-ranks", str(_LARGEST), "--check",
         "--time-limit", "1"],
        capture_output=True, text=True, timeout=60,
    )
    err = done.stderr
    assert (done.returncode, done.stdout) == (2, ""), err
    assert re.fullmatch(
        r"pgregistry seed-plan: error: checking the seed plan of 2147483647 ranks would take about [\d.]+ (min|h) "
        r"here \([\d.]+ microseconds a rank over the first 16384\), more than --time-limit 1 \(minutes\); raise "
        r"--time-limit \(0 for no limit\), or check the layout with fewer data-parallel replicas: without "
        r"--data-parallel-random-init the seeds do not depend on the data-parallel size, so it has the same "
        r"collisions\n",
        err,
    ), err


def test_a_long_check_reports_its_progress_on_stderr(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _seed_plan(capsys, "--num-ranks", str(3 * 16384), "--check", "--progress", "0.001")
    assert (code, out) == (0, "no seed collisions in 49152 ranks\n"), err
    lines = err.splitlines()
    assert re.fullmatch(
        r"pgregistry seed-plan: checking the seed plan of 49152 ranks: about \d+ s here \([\d.]+ microseconds a "
        r"rank over the first 16384\)",
        lines[0],
    ), lines
    assert lines[1:] and all(
        re.fullmatch(r"pgregistry seed-plan: 32768 of 49152 ranks \(66%\), about \d+ s left", line)
        for line in lines[1:]
    ), lines
    assert _seed_plan(capsys, "--num-ranks", str(2 * 16384), "--check", "--progress", "0")[2] == ""


def test_a_comparison_larger_than_memory_is_refused_with_the_estimate(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Found by a hostile-input audit: ``layout --num-ranks 1073741824 --compare tp=2 tp=4`` had no memory guard; it
    held 21 GiB within a minute, still enumerating every group of both layouts as Python tuples. It is now refused up
    front from the layouts' sizes (2 KiB a rank of each layout: at most 884 bytes measured with tracemalloc at 16384
    ranks on four pairs of layouts, 613 with ``ru_maxrss`` between 65536 and 262144 ranks). Here the memory is set to
    1 MiB, so a small world shows the refusal without the machine's memory at stake."""
    monkeypatch.setattr(limits, "available_memory", lambda: 2**20)
    err = _refused(["layout", "--num-ranks", "1024", "--compare", "tp=2", "tp=4"], capsys)
    assert err == (
        "pgregistry layout: error: comparing layouts of 1024 and 1024 ranks needs about 0.0 GiB of memory, more than "
        "the 0.0 GiB available; every group of both is enumerated: compare smaller layouts (a share of the world with "
        "the same sizes shows the same groups), or run it where more memory is free\n"
    )
    monkeypatch.setattr(limits, "available_memory", lambda: 2**30)
    assert main(["layout", "--num-ranks", "1024", "--compare", "tp=2", "tp=4"]) == 0

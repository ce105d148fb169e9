"""``pgregistry layout`` on a world too large to list: exit 2 with a message before enumerating anything.

At 2**31 ranks it used to die in the allocator (a raw traceback, exit 1) after trying to enumerate every group:
the world is now refused at construction (torch.distributed's ranks are C ints), and a world that is addressable
but whose listing would not fit in memory is refused from the layout's shapes, estimated up front.
"""

from __future__ import annotations

import re
import time

import pytest

from pgregistry.cli import main

_LARGEST = 2**31 - 1


def _refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    start = time.monotonic()
    assert main(["layout", *argv]) == 2
    assert time.monotonic() - start < 30.0  # refused from arithmetic: nothing of the world was enumerated
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1
    return captured.err


def test_two_to_the_31_ranks_is_refused_as_unaddressable(capsys: pytest.CaptureFixture[str]) -> None:
    err = _refused(["--num-ranks", str(2**31)], capsys)
    assert err == (
        "pgregistry layout: error: num_ranks 2147483648 is more ranks than torch.distributed can address "
        "(at most 2147483647 = 2**31 - 1: ranks are C ints)\n"
    )


def test_a_listing_larger_than_memory_is_refused_with_the_estimate(capsys: pytest.CaptureFixture[str]) -> None:
    # Every group of every kind spans the whole world here, so the default listing prints billions of ranks:
    # an estimate of hundreds of GiB, more than any machine this suite runs on has free.
    err = _refused(["--num-ranks", str(_LARGEST)], capsys)
    match = re.fullmatch(
        r"pgregistry layout: error: listing 2147483647 ranks \((\d+) of them printed\) needs about ([\d.]+) GiB of "
        r"memory, more than the ([\d.]+) GiB available; lower --show \(--show 0 prints only the group counts and "
        r"sizes\)\n",
        err,
    )
    assert match is not None, err
    assert int(match.group(1)) > _LARGEST and float(match.group(2)) > float(match.group(3))

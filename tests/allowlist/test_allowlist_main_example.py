"""``pgregistry.allowlist.main``'s docstring example, run as it stands in a project with one new read.

It is a code block (it scans the working directory and reads its allowlist): the test makes a
project whose allowlist allows nothing (written by ``update`` before the read was added), adds a
read of Megatron-Core's global TP group, changes into it and runs the block verbatim. The example
says 1: the check fails, naming the read.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from fixtures.docstring_examples import example_code

from pgregistry.allowlist import main

READ = "from megatron.core import parallel_state\n\ntp = parallel_state.get_tensor_model_parallel_group()\n"


def test_the_main_example_is_1_for_a_read_the_allowlist_does_not_allow(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("tp = None\n")
    assert main(["update"]) == 0  # an allowlist that allows no read
    (tmp_path / "train.py").write_text(READ)
    capsys.readouterr()
    names = {"main": main}
    exec(example_code(main), names)  # noqa: S102 - the docstring's example, verbatim
    assert names["code"] == 1
    assert "train.py:3" in capsys.readouterr().out

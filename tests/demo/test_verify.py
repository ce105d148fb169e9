"""``pgregistry verify``: its checks in gloo worlds, and the command under torchrun."""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from pgregistry import ParallelLayout, ProcessGroupCollection, grad_stats, registry, rng
from pgregistry.cli import _build_parser as build_parser
from pgregistry.cli._torchrun_checks import report_checks
from pgregistry.cli._verify import _checks_on_this_rank, nodes_share_hosts
from pgregistry.testing import run_world


def _args(gpus_per_node: int = 8, intra_node: str = "tp,expt_tp,cp", **sizes: int) -> argparse.Namespace:
    base = {"tp": 1, "cp": 1, "pp": 1, "ep": 1, "expt_tp": None, "gtp_remat": 1, "expt_gtp_remat": 1}
    base.update(sizes)
    return argparse.Namespace(
        order=None, backend="gloo", seed=1234, gpus_per_node=gpus_per_node, intra_node=intra_node, **base,
    )


@pytest.mark.parametrize(
    "sizes",
    [
        {"tp": 2, "ep": 4, "expt_tp": 1},
        {"tp": 2, "pp": 2, "ep": 2, "expt_tp": 1},
        {"gtp_remat": 2, "cp": 2, "ep": 2, "expt_gtp_remat": 2},
    ],
    ids=["tp2-ep4", "tp2-pp2-ep2", "gtp2-cp2-egtp2"],
)
def test_every_check_passes_on_a_correct_build(sizes: dict[str, int]) -> None:
    for rank, checks in enumerate(run_world(8, _checks_on_this_rank, _args(**sizes), torch.device("cpu"))):
        failed = [(name, detail) for name, ok, detail in checks if not ok]
        assert not failed, f"rank {rank}: {failed}"
        assert len(checks) == 12


def test_placement_check_fails_when_tp_crosses_nodes() -> None:
    # tp 4 on nodes of 2 ranks: every tp group spans two nodes (node = rank // 2, by hand: [0,1,2,3] -> {0, 1}).
    for checks in run_world(8, _checks_on_this_rank, _args(gpus_per_node=2, tp=4), torch.device("cpu")):
        by_name = {name: (ok, detail) for name, ok, detail in checks}
        ok, detail = by_name["placement: tp, cp, expt_tp groups stay on nodes of 2 ranks"]
        assert not ok
        assert detail.startswith("tp groups cross nodes: 2 of 2 groups of 4 ranks span up to 2 nodes of 2 GPUs")
        assert "expt_tp groups cross nodes" in detail
        assert by_name["placement: each node's 2 consecutive ranks share one host"] == (True, "")
    for checks in run_world(8, _checks_on_this_rank, _args(gpus_per_node=2, tp=4, intra_node=""),
                            torch.device("cpu")):
        assert ("placement: no kind groups stay on nodes of 2 ranks", True, "") in checks


def test_nodes_share_hosts_names_a_split_node() -> None:
    assert nodes_share_hosts(["a", "a", "b", "b"], 2) == (
        "placement: each node's 2 consecutive ranks share one host", True, "",
    )
    # Round-robin (Slurm's cyclic distribution): rank r on host r % 2.
    name, ok, detail = nodes_share_hosts(["a", "b", "a", "b"], 2)
    assert not ok
    assert detail == "node 0 (ranks 0-1) on ['a', 'b']; node 1 (ranks 2-3) on ['a', 'b']"


def test_verify_under_torchrun_prints_a_table_and_exits_zero() -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "-m", "pgregistry", "verify", "--tp", "2", "--ep", "2", "--expt-tp", "1"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=90, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "12 passed, 0 failed" in done.stdout
    assert "[PASS] placement: tp, cp, expt_tp groups stay on nodes of 2 ranks" in done.stdout


def test_verify_outside_torchrun_is_a_usage_error() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    done = subprocess.run([sys.executable, "-m", "pgregistry", "verify"], capture_output=True, text=True,
                          timeout=60, env=env)
    assert done.returncode == 2
    assert "torchrun" in done.stderr


def test_ranks_per_node_unknown_is_bad_input_on_every_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)  # the world's ranks inherit this environment
    with pytest.raises(ValueError, match="ranks per node unknown: LOCAL_WORLD_SIZE is not set"):
        run_world(2, _checks_on_this_rank, _args(gpus_per_node=None), torch.device("cpu"))  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------- bad input, refused


def _verify_as_a_world_of_one(*argv: str, **env: str) -> subprocess.CompletedProcess[str]:
    """``python -m pgregistry verify ARGV`` with the environment torchrun gives a world of one rank (its own exit
    code, which torchrun would fold into 1)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    environment = {
        **os.environ, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1", **env,
    }
    return subprocess.run([sys.executable, "-m", "pgregistry", "verify", *argv], capture_output=True, text=True,
                          timeout=90, env=environment)


def test_nccl_without_cuda_says_so() -> None:
    # It used to die in torch.cuda.set_device: "AttributeError: module 'torch._C' has no attribute
    # '_cuda_setDevice'" on a CPU-only build, a traceback and exit 1.
    done = _verify_as_a_world_of_one("--backend", "nccl", CUDA_VISIBLE_DEVICES="")
    assert (done.returncode, done.stdout) == (2, ""), done.stderr
    assert re.fullmatch(r"pgregistry verify: error: --backend nccl needs CUDA, and torch \S+ here has none "
                        r"\((a CPU-only build|no GPU visible)\); use --backend gloo\n", done.stderr), done.stderr


@pytest.mark.parametrize("timeout", ["0", "-1", "inf", "nan", "soon"])
def test_a_timeout_that_is_no_positive_number_of_seconds_is_refused(
    timeout: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["verify", "--timeout", timeout])
    assert info.value.code == 2
    assert "pgregistry verify: error: argument --timeout: " in capsys.readouterr().err


def test_an_unwritable_json_path_is_refused_before_the_run(tmp_path: Path) -> None:
    # It used to be found when rank 0 wrote the report, after every check had run: FileNotFoundError, exit 1.
    path = tmp_path / "missing" / "x.json"
    done = _verify_as_a_world_of_one("--json", str(path))
    assert (done.returncode, done.stdout) == (2, ""), done.stderr  # no check ran, no table
    assert done.stderr == f"pgregistry verify: error: --json {path}: directory {path.parent} does not exist\n"


# ------------------------------------------------------------------------------------------- each check can fail


def _crossed_tp_and_dp() -> None:
    """The collection verify builds holds the dp communicator in its tp field, set behind the collection's own checks
    (one that knows its layout refuses it, and so does one assembled by hand: its mp no longer holds tp's ranks)."""
    real = registry.build

    def build(layout: ParallelLayout, **options: Any) -> ProcessGroupCollection:
        built = real(layout, **options)
        if options.get("name") != "verify":
            return built
        crossed = ProcessGroupCollection(**dict(built.items()))
        crossed._values["tp"] = built.get("dp")  # type: ignore[attr-defined]
        return crossed

    registry.build = build  # type: ignore[assignment]


def _grad_norm_off_by_a_thousandth() -> None:
    real = grad_stats.grad_norm
    grad_stats.grad_norm = lambda *args, **kwargs: real(*args, **kwargs) * 1.001  # type: ignore[assignment]


def _seeded_with_the_next_seed() -> None:
    real = rng.model_parallel_manual_seed
    rng.model_parallel_manual_seed = lambda seed, *args, **kwargs: real(seed + 1, *args, **kwargs)  # type: ignore


def _verify_with(plant: Callable[[], None], json_path: str) -> int:
    plant()  # in this rank's process only
    args = _args(gpus_per_node=4, tp=2, ep=2, expt_tp=1)
    return report_checks("t", lambda device: _checks_on_this_rank(args, device), torch.device("cpu"), json_path)


_GROUPS = "groups: every communicator holds the layout's ranks"
_NORM = "float64 oracle: 2.0-norm of random grads"
_SEEDS = "RNG: this rank's tracker seeds equal the layout's seed plan"


@pytest.mark.parametrize(
    ("plant", "failing", "detail", "passing"),
    [
        # A crossed communicator also skews what is computed over it (norms, seeds): only its own check is named.
        (_crossed_tp_and_dp, _GROUPS, "tp: [0, 2] != [0, 1]", []),
        (_grad_norm_off_by_a_thousandth, _NORM, " vs ", [_GROUPS, _SEEDS]),
        (_seeded_with_the_next_seed, _SEEDS, " != ", [_GROUPS, _NORM]),
    ],
    ids=["wrong-group", "wrong-grad-norm", "wrong-seed"],
)
def test_each_check_fails_when_its_subject_is_wrong(
    plant: Callable[[], None], failing: str, detail: str, passing: list[str], tmp_path: Path
) -> None:
    report = tmp_path / "report.json"
    assert run_world(4, _verify_with, plant, str(report)) == [1] * 4  # verify's exit code, on every rank
    rows = {row["check"]: row for row in json.loads(report.read_text())}
    assert rows[failing]["passed"] is False and rows[failing]["failing_ranks"], rows[failing]
    assert detail in rows[failing]["detail"], rows[failing]
    assert all(rows[name]["passed"] for name in passing), [rows[name] for name in passing]

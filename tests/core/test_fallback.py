"""The fallback path: ProcessGroupFallbackWarning under each warning filter, and the resolvers with and without a
global grid (real gloo worlds where a grid is needed)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
from fixtures.groups import SizeRankGroup

from pgregistry import ParallelLayout, ProcessGroupCollection, ProcessGroupFallbackWarning
from pgregistry import registry as reg
from pgregistry.fallback import (
    forget_fallback_warnings,
    gtp_replica_rank,
    resolve_gtp_remat_group,
    resolve_process_groups,
    warn_global_process_group_fallback,
)
from pgregistry.testing import run_world

_ERROR_FLAG = "error::pgregistry.ProcessGroupFallbackWarning"


def _run_python(code: str, *flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *flags, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=60
    )


def _names(caught: list[warnings.WarningMessage]) -> list[str]:
    """The group names of the fallback warnings in ``caught``, in order."""
    out = []
    for record in caught:
        if issubclass(record.category, ProcessGroupFallbackWarning):
            match = re.search(r"process group '(\w+)'", str(record.message))
            assert match is not None
            out.append(match.group(1))
    return out


# ------------------------------------------------------------------------------------------------ the warning


def _owner(argument: str = "tp", owner: str = "Owner") -> None:
    """Stands for library code that falls back: its warning points at whoever called it (stacklevel 2)."""
    warn_global_process_group_fallback(owner, argument)


def test_category_is_importable_at_interpreter_start_without_torch() -> None:
    done = _run_python(
        """
        import sys, warnings, pgregistry
        assert 'torch' not in sys.modules, 'import pgregistry imported torch'
        assert issubclass(pgregistry.ProcessGroupFallbackWarning, UserWarning)
        assert warnings.filters[0][:3] == ('error', None, pgregistry.ProcessGroupFallbackWarning), warnings.filters
        print('ok')
        """,
        "-W", _ERROR_FLAG,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


def test_warns_once_per_owner_and_argument_under_default_filters() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.resetwarnings()  # the interpreter's defaults: action "default"
        _owner("tp")
        _owner("tp")  # another line: still deduplicated
        for _ in range(3):
            _owner("dp")
        _owner("tp", owner="Other")
    assert _names(caught) == ["tp", "dp", "tp"]
    assert [str(c.message).split()[0] for c in caught] == ["Owner", "Owner", "Other"]
    assert "Owner was not given process group 'tp' and falls back to the global grid" in str(caught[0].message)
    assert {c.filename for c in caught} == {__file__}  # it points at the owner's caller


def test_forget_lets_each_pair_warn_again() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.resetwarnings()
        _owner("tp")
        forget_fallback_warnings()
        _owner("tp")
    assert _names(caught) == ["tp", "tp"]


def test_error_filter_raises_every_time() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", ProcessGroupFallbackWarning)
        for _ in range(3):
            with pytest.raises(ProcessGroupFallbackWarning, match="Owner was not given process group 'tp'"):
                _owner("tp")


_RAISES_EVERY_TIME = """
    from pgregistry import ProcessGroupFallbackWarning
    from pgregistry.fallback import warn_global_process_group_fallback
    raised = 0
    for _ in range(3):  # at the top level too, where the stack is shallower than stacklevel
        try:
            warn_global_process_group_fallback("Owner", "tp")
        except ProcessGroupFallbackWarning:
            raised += 1
    print(raised)
    """


def test_error_flag_raises_every_time_in_a_fresh_interpreter() -> None:
    done = _run_python(_RAISES_EVERY_TIME, "-W", _ERROR_FLAG)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "3"


def test_pythonwarnings_and_later_options_keep_their_meaning() -> None:
    env = {**os.environ, "PYTHONWARNINGS": _ERROR_FLAG}
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_RAISES_EVERY_TIME)], capture_output=True, text=True, env=env,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "3"
    # A later, broader option wins over the earlier one, as it does for Python's own categories.
    done = _run_python(_RAISES_EVERY_TIME, "-W", _ERROR_FLAG, "-W", "ignore::UserWarning")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "0"


def test_default_filters_in_a_fresh_interpreter_print_once() -> None:
    done = _run_python(
        """
        from pgregistry.fallback import warn_global_process_group_fallback
        def a(): warn_global_process_group_fallback("Owner", "tp")
        def b(): warn_global_process_group_fallback("Owner", "tp")
        a(); b(); a()
        """
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("ProcessGroupFallbackWarning") == 1


def test_always_and_ignore_are_honoured() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ProcessGroupFallbackWarning)
        for _ in range(3):
            _owner("tp")
    assert _names(caught) == ["tp"] * 3
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("ignore", ProcessGroupFallbackWarning)
        _owner("dp")
        # Ignored calls do not count as warned: under the default action it still warns once afterwards.
        warnings.simplefilter("default", ProcessGroupFallbackWarning)
        _owner("dp")
        _owner("dp")
    assert _names(caught) == ["dp"]


def _resolving_owner() -> None:
    resolve_process_groups(None, ["tp", "not_a_group"], owner="Owner")


def test_filters_match_the_calling_module_and_the_warning_points_at_the_caller() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("ignore", ProcessGroupFallbackWarning)
        warnings.filterwarnings("always", category=ProcessGroupFallbackWarning, module=__name__)
        _owner("tp")
        _owner("tp")
        with pytest.raises(ValueError, match="not_a_group"):
            _resolving_owner()  # checks every name before it resolves any
    assert _names(caught) == ["tp", "tp"]
    assert {c.filename for c in caught} == {__file__}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ProcessGroupFallbackWarning)
        warnings.filterwarnings("error", category=ProcessGroupFallbackWarning, module="some.other.module")
        _owner("tp")
    assert _names(caught) == ["tp"]


# ------------------------------------------------------------------------------------------------ resolvers, no grid


def test_set_fields_are_returned_as_they_are_without_warning() -> None:
    tp = SizeRankGroup(2)
    collection = ProcessGroupCollection(tp=tp, cp=None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("error", ProcessGroupFallbackWarning)
        assert resolve_process_groups(collection, ("tp", "cp"), owner="Owner") == {"tp": tp, "cp": None}
        assert resolve_gtp_remat_group(ProcessGroupCollection(gtp_remat=None), False, owner="Owner") is None
        group = SizeRankGroup(4)
        assert resolve_gtp_remat_group(ProcessGroupCollection(expt_gtp_remat=group), True, owner="O") is group
    assert caught == []


def test_unknown_name_is_a_value_error() -> None:
    with pytest.raises(ValueError, match=r"Unknown attribute: 'dp_pc'; did you mean 'dp_cp'\?"):
        resolve_process_groups(ProcessGroupCollection(tp=None), ["dp_pc"], owner="Owner")


def test_missing_global_grid_is_a_runtime_error_naming_owner_and_group() -> None:
    assert reg.global_collection_or_none() is None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ProcessGroupFallbackWarning)
        with pytest.raises(RuntimeError, match=r"^MyOptimizer needs process group 'dp': .*no global grid"):
            resolve_process_groups(ProcessGroupCollection(tp=None), ["tp", "dp"], owner="MyOptimizer")
        with pytest.raises(RuntimeError, match=r"^MyLinear needs process group 'expt_gtp_remat'"):
            resolve_gtp_remat_group(None, True, owner="MyLinear")
        with pytest.raises(RuntimeError, match="the global grid is not initialised"):
            reg.global_collection()
    assert _names(caught) == ["dp"]  # it warned before finding nothing to fall back to


def test_gtp_replica_rank_is_zero_without_torch_distributed() -> None:
    assert not dist.is_initialized()
    assert gtp_replica_rank(torch.zeros(1)) == 0


# ------------------------------------------------------------------------------------------------ resolvers, grid

_GRID = ParallelLayout(world_size=8, tp=2, cp=2, ep=2, etp=1, gtp_remat=2)  # dp 1, expt_dp 4, dp_cp 2
_GRID_NO_GTP = ParallelLayout(world_size=8, tp=2, cp=2, ep=2, etp=1, expt_gtp_remat=2)  # dp 2, dp_cp 4


def _ranks(group: Any) -> list[int] | None:
    return None if group is None else dist.get_process_group_ranks(group)


def _resolve_on_a_grid() -> dict[str, Any]:
    out: dict[str, Any] = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ProcessGroupFallbackWarning)
        # Before any grid: a distributed job still needs one to fall back to.
        try:
            gtp_replica_rank(torch.zeros(1))
        except RuntimeError as exc:
            out["no_grid"] = str(exc)
        grid = reg.initialize_global_grid(_GRID)
        assert reg.global_collection() is grid
        caught.clear()
        resolved = resolve_process_groups(ProcessGroupCollection(tp=None), ["tp", "dp_cp", "ep"], owner="O")
        out["resolved"] = {name: _ranks(group) for name, group in resolved.items()}
        out["same_objects"] = resolved["dp_cp"] is grid.get("dp_cp") and resolved["ep"] is grid.get("ep")
        out["resolve_warned"] = _names(caught)
        caught.clear()
        out["gtp"] = _ranks(resolve_gtp_remat_group(None, False, owner="O"))
        out["egtp_none"] = resolve_gtp_remat_group(ProcessGroupCollection(), True, owner="O")
        out["gtp_warned"] = _names(caught)  # only the 2-rank dense axis warns; expert GTP is 1 rank (None)
        caught.clear()
        dense, expert = torch.zeros(1), torch.zeros(1)
        expert.allreduce = False  # type: ignore[attr-defined]
        out["replica"] = [gtp_replica_rank(dense), gtp_replica_rank(expert)]
        out["replica_warned"] = _names(caught)
        caught.clear()
        tagged = torch.zeros(1)
        tagged.gtp_replica_group = grid.get("tp")  # type: ignore[attr-defined]
        off = torch.zeros(1)
        off.gtp_replica_group = None  # type: ignore[attr-defined]
        out["replica_explicit"] = [
            gtp_replica_rank(dense, grid.get("ep")), gtp_replica_rank(tagged), gtp_replica_rank(off),
        ]
        out["explicit_warned"] = _names(caught)
        # A grid without the dense GTP axis: its fallback changes nothing and stays quiet.
        reg.destroy()
        assert reg.global_collection_or_none() is None
        reg.initialize_global_grid(_GRID_NO_GTP)
        caught.clear()
        out["gtp_off"] = resolve_gtp_remat_group(None, False, owner="O2")
        out["egtp_on"] = _ranks(resolve_gtp_remat_group(None, True, owner="O2"))
        out["off_warned"] = _names(caught)
        try:
            reg.initialize_global_grid(_GRID_NO_GTP)
        except RuntimeError as exc:
            out["twice"] = str(exc)
        reg.destroy()
    return out


def test_resolvers_read_the_global_grid_and_warn() -> None:
    results = run_world(8, _resolve_on_a_grid)
    for rank, out in enumerate(results):
        mine = _GRID.groups_of(rank)
        assert "gtp_replica_rank needs process group 'dp_cp'" in out["no_grid"]
        assert out["resolved"] == {"tp": None, "dp_cp": list(mine["dp_cp"]), "ep": list(mine["ep"])}
        assert out["same_objects"]
        assert out["resolve_warned"] == ["dp_cp", "ep"]
        assert out["gtp"] == list(mine["gtp_remat"]) and len(out["gtp"]) == 2
        assert out["egtp_none"] is None
        assert out["gtp_warned"] == ["gtp_remat"]
        coords = _GRID.coords(rank)
        assert out["replica"] == [mine["dp_cp"].index(rank), coords["expt_dp"]]
        assert out["replica_warned"] == ["dp_cp", "expt_dp"]
        assert out["replica_explicit"] == [coords["ep"], coords["tp"], 0]
        assert out["explicit_warned"] == []
        assert out["gtp_off"] is None
        assert out["egtp_on"] == list(_GRID_NO_GTP.groups_of(rank)["expt_gtp_remat"])
        assert out["off_warned"] == ["expt_gtp_remat"]
        assert "already initialised" in out["twice"]

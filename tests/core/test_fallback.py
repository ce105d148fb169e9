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
import torch.distributed as dist
from fixtures.groups import SizeRankGroup

from pgregistry import ParallelLayout, ProcessGroupCollection, ProcessGroupFallbackWarning
from pgregistry import registry as reg
from pgregistry._runtime.resolve import resolve_pg_collection
from pgregistry.fallback import _forget_fallback_warnings as forget_fallback_warnings
from pgregistry.fallback import warn_fallback
from pgregistry.global_grid import global_collection, initialize_global_grid
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
    """Stands for user code that falls back: the warning points at its first frame outside pgregistry."""
    warn_fallback(owner, argument)


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
        # Two call sites: Python's own "default" action shows a warning once per location besides.
        warn_fallback("Owner", "tp")
        forget_fallback_warnings()
        warn_fallback("Owner", "tp")
    assert _names(caught) == ["tp", "tp"]


def test_error_filter_raises_every_time() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", ProcessGroupFallbackWarning)
        for _ in range(3):
            with pytest.raises(ProcessGroupFallbackWarning, match="Owner was not given process group 'tp'"):
                _owner("tp")


_RAISES_EVERY_TIME = """
    from pgregistry import ProcessGroupFallbackWarning
    from pgregistry.fallback import warn_fallback
    raised = 0
    for _ in range(3):  # at the top level too, where the stack is shallower than stacklevel
        try:
            warn_fallback("Owner", "tp")
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


def test_the_category_without_its_module_is_applied_and_the_spelling_given_once() -> None:
    # Python looks a bare category name up among the builtins only: it printed "unknown warning category" and a
    # fallback was not an error, with no word on the spelling that works.
    bare = "error::ProcessGroupFallbackWarning"
    environment = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    for done in (
        _run_python(_RAISES_EVERY_TIME, "-W", bare),
        subprocess.run(
            [sys.executable, "-c", textwrap.dedent(_RAISES_EVERY_TIME)], capture_output=True, text=True,
            env={**environment, "PYTHONWARNINGS": bare}, timeout=60,
        ),
    ):
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == "3"
        note = (
            "pgregistry: the -W / PYTHONWARNINGS option 'error::ProcessGroupFallbackWarning' names the category "
            "without its module (Python's notice above: it ignored it); pgregistry applies it as "
            "'error::pgregistry.ProcessGroupFallbackWarning': spell it so\n"
        )
        assert done.stderr.count(note) == 1, done.stderr
    # A bare name close to the category's is a misspelling of it, refused as the prefixed one is.
    done = _run_python("import pgregistry", "-W", "error::ProcessGroupFalbackWarning")
    assert done.returncode != 0
    assert "did you mean 'pgregistry.ProcessGroupFallbackWarning'" in done.stderr, done.stderr


def test_default_filters_in_a_fresh_interpreter_print_once() -> None:
    done = _run_python(
        """
        from pgregistry.fallback import warn_fallback
        def a(): warn_fallback("Owner", "tp")
        def b(): warn_fallback("Owner", "tp")
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
    resolve_pg_collection(ProcessGroupCollection(tp=None), owner="Owner", fallback=["tp", "not_a_group"])  # type: ignore[list-item]


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


# ------------------------------------------------------------------------------------------------ the door, no grid


def test_a_fallback_inside_pgregistry_is_attributed_to_the_callers_module() -> None:
    """A migration config filters by the user's module (``error::...:mypackage.trainer``): the warning an entry
    point emits must carry the first frame outside pgregistry, not the door's."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("ignore", ProcessGroupFallbackWarning)
        warnings.filterwarnings("always", category=ProcessGroupFallbackWarning, module=re.escape(__name__))
        with pytest.raises(RuntimeError, match="no global grid"):
            resolve_pg_collection(ProcessGroupCollection(tp=None), owner="Owner", fallback=("dp",))
    assert _names(caught) == ["dp"]
    assert caught[0].filename == __file__


def test_set_fields_are_returned_as_they_are_without_warning() -> None:
    tp = SizeRankGroup(2)
    collection = ProcessGroupCollection(tp=tp, cp=None, gtp_remat=None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("error", ProcessGroupFallbackWarning)
        assert resolve_pg_collection(collection, owner="Owner", fallback=("tp", "cp", "gtp_remat")) is collection
    assert caught == []


@pytest.mark.parametrize(
    ("owner", "argument", "named"),
    [(None, "tp", "owner"), ([], "tp", "owner"), ("Owner", ["tp"], "argument"), ("Owner", "", "argument")],
)
def test_warn_fallback_names_an_owner_or_argument_that_is_no_str(owner: Any, argument: Any, named: str) -> None:
    """A list failed as 'unhashable type' under default filters only; None or '' warned naming nothing."""
    forget_fallback_warnings()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        with pytest.raises(TypeError, match=f"warn_fallback's {named} must be a non-empty str"):
            warn_fallback(owner, argument)
    assert caught == []


def test_unknown_name_is_a_value_error() -> None:
    with pytest.raises(ValueError, match=r"Unknown attribute: 'dp_pc'; did you mean 'dp_cp'\?"):
        resolve_pg_collection(ProcessGroupCollection(tp=None), owner="Owner", fallback=["dp_pc"])  # type: ignore[list-item]


def test_missing_global_grid_is_a_runtime_error_naming_owner_and_group() -> None:
    assert global_collection(None) is None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ProcessGroupFallbackWarning)
        with pytest.raises(RuntimeError, match=r"^MyOptimizer needs process group 'dp': .*no global grid"):
            resolve_pg_collection(ProcessGroupCollection(tp=None), owner="MyOptimizer", fallback=("tp", "dp"))
        with pytest.raises(RuntimeError, match=r"^MyLinear was not given a ProcessGroupCollection and no global"):
            resolve_pg_collection(None, owner="MyLinear", fallback=("expt_gtp_remat",))
        with pytest.raises(RuntimeError, match="the global grid is not initialised"):
            global_collection()
    assert _names(caught) == ["dp"]  # it warned before finding nothing to fall back to


# ------------------------------------------------------------------------------------------------ the door, grid

_GRID = ParallelLayout(num_ranks=8, tp=2, cp=2, ep=2, expt_tp=1, gtp_remat=2)  # dp 1, expt_dp 4, dp_cp 2
_GRID_NO_GTP = ParallelLayout(num_ranks=8, tp=2, cp=2, ep=2, expt_tp=1, expt_gtp_remat=2)  # dp 2, dp_cp 4


def _ranks(group: Any) -> list[int] | None:
    return None if group is None else dist.get_process_group_ranks(group)


def _resolve_on_a_grid() -> dict[str, Any]:
    out: dict[str, Any] = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ProcessGroupFallbackWarning)
        grid = initialize_global_grid(_GRID)
        assert global_collection() is grid
        caught.clear()
        fields = ("tp", "dp_cp", "ep", "gtp_remat", "expt_gtp_remat")
        resolved = resolve_pg_collection(ProcessGroupCollection(tp=None), owner="O", fallback=fields)
        out["resolved"] = {name: _ranks(resolved.get(name)) for name in fields}
        out["same_objects"] = resolved.get("dp_cp") is grid.get("dp_cp") and resolved.get("ep") is grid.get("ep")
        out["resolve_warned"] = _names(caught)
        caught.clear()
        out["whole"] = resolve_pg_collection(None, owner="O", fallback=fields) is grid
        out["whole_warned"] = [str(c.message).split(" was")[0] for c in caught]
        # A grid without the dense GTP axis: its fallback warns like any other, one-rank axis or not.
        reg.destroy()
        assert global_collection(None) is None
        initialize_global_grid(_GRID_NO_GTP)
        caught.clear()
        off = resolve_pg_collection(ProcessGroupCollection(), owner="O2", fallback=("gtp_remat", "expt_gtp_remat"))
        out["gtp_off"] = off.get("gtp_remat")
        out["egtp_on"] = _ranks(off.get("expt_gtp_remat"))
        out["off_warned"] = _names(caught)
        try:
            initialize_global_grid(_GRID_NO_GTP)
        except RuntimeError as exc:
            out["twice"] = str(exc)
        reg.destroy()
    return out


def test_the_door_reads_the_global_grid_and_warns_for_each_field_gtp_too() -> None:
    results = run_world(8, _resolve_on_a_grid)
    for rank, out in enumerate(results):
        mine = _GRID.groups_of(rank)
        assert out["resolved"] == {
            "tp": None, "dp_cp": list(mine["dp_cp"]), "ep": list(mine["ep"]),
            "gtp_remat": list(mine["gtp_remat"]), "expt_gtp_remat": None,
        }
        assert out["same_objects"]
        assert out["resolve_warned"] == ["dp_cp", "ep", "gtp_remat", "expt_gtp_remat"]
        assert out["whole"] and out["whole_warned"] == ["O"]
        assert out["gtp_off"] is None
        assert out["egtp_on"] == list(_GRID_NO_GTP.groups_of(rank)["expt_gtp_remat"])
        assert out["off_warned"] == ["gtp_remat", "expt_gtp_remat"]
        assert "already initialised" in out["twice"]


def test_a_misspelled_pgregistry_category_on_the_command_line_is_an_error_naming_the_right_one() -> None:
    done = _run_python("import pgregistry", "-W", "error::pgregistry.ProcessGroupFallbakWarning")
    assert done.returncode != 0
    assert "names no pgregistry warning category; did you mean 'pgregistry.ProcessGroupFallbackWarning'" in done.stderr
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--co", os.devnull],
        capture_output=True, text=True, timeout=60,
        env={**os.environ, "PYTHONWARNINGS": "error::pgregistry.fallback.ProcessGroupFallbakWarning"},
    )
    assert done.returncode != 0
    assert "did you mean 'pgregistry.fallback.ProcessGroupFallbackWarning'" in done.stdout + done.stderr

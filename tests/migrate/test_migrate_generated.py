"""``pgregistry migrate`` keeps the behaviour of generated programs: many small modules that read Megatron-Core's
global process-group state in the shapes real trees use (tests/fixtures/program_generator.py), each migrated by the
command and run side by side with its original by the differential harness (tests/fixtures/differential.py): a
4-rank gloo world on Megatron-Core's real ``parallel_state``, modes a to e. Compared: the value or exception, the
groups of each collective (by their ranks), the warnings other than fallback ones; no fallback warning with a whole
collection, none twice for one field. The original is the oracle.

Mode d (the collection of one grid given while another is global) is accounted for read by read. The generator
knows each read it planted and what the migration should make of it (answered by the collection, rewritten but
reached by no collection so falling back, or left as it is); the tool's report says which it left. Each read must be
treated as expected, and its program must behave as the original does when run on the second grid with every read
the collection should answer answered by the first grid's ``parallel_state`` instead (:func:`_mixed_outcome`): the
reads left and the fallbacks read the global grid, every other read is compared exactly. Each fallback warning
given in mode d must be one an executed read should give, and each such read must give one.

``make test`` runs a fixed seed and a modest count; ``PGREGISTRY_GENERATED_PROGRAMS=2000`` (and
``PGREGISTRY_GENERATED_SEED``) runs more, in packages of 100 programs, each migrated and run in its own world."""

from __future__ import annotations

import dataclasses
import inspect
import os
import re
import subprocess
import sys
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("libcst")
pytest.importorskip("megatron.core.parallel_state")

from fixtures.differential import (  # noqa: E402
    GRID_ARGUMENTS,
    Case,
    Loaded,
    Tree,
    differences,
    load_cases,
    outcome_of_side,
    run_in_world,
    run_uninitialised,
    tells_the_grids_apart,
)
from fixtures.program_generator import (  # noqa: E402
    COLLECTION,
    FALLBACK,
    LEFT,
    SHIM,
    Program,
    Read,
    generate_programs,
    in_one_package,
)

SEED = int(os.environ.get("PGREGISTRY_GENERATED_SEED", "20261207"))
COUNT = int(os.environ.get("PGREGISTRY_GENERATED_PROGRAMS", "40"))
_PER_PACKAGE = 100
#: The grids of modes a to c (and d's collection), and d's global grid, by turns: most fields' ranks differ.
_GRIDS = (
    ({"tp": 2, "cp": 2}, {"pp": 2, "ep": 2}),
    ({"pp": 2, "ep": 2}, {"tp": 2, "cp": 2}),
    ({"gtp": 2}, {"tp": 2, "cp": 2}),  # GTP remat: the data-parallel groups with and without it differ
    ({"ep": 2, "egtp": 2}, {"pp": 2, "ep": 2}),
)
#: A read the tool's report lists as left: ``path:line callee (family)``, below a line giving the reason.
_LEFT_LINE = re.compile(r"^ {6}(\S+?\.py):(\d+) (\S+) \(\w+\)$")
_REASON_LINE = re.compile(r"^  \d+ (.+)$")
#: A fallback warning: the function that read, and the field.
_FALLBACK_WARNING = re.compile(r"^(\S+) was not given process group '(\w+)'")


@dataclasses.dataclass(frozen=True)
class _Generated:
    """The programs of one run: their packages, a case each, and each case's program."""

    trees: dict[str, Tree]
    cases: list[Case]
    programs: dict[str, Program]  # by case id


def _packages(root: Path) -> _Generated:
    """The generated programs written under ``root``, a package per hundred, with a case for each."""
    generated = _Generated({}, [], {})
    for start in range(0, COUNT, _PER_PACKAGE):
        package = f"generated_{start // _PER_PACKAGE}"
        (root / package).mkdir(parents=True)
        (root / package / "__init__.py").write_text("")
        generated.trees[package] = Tree(package, root, package, installed=False, distributions={})
        programs = in_one_package(generate_programs(SEED, min(_PER_PACKAGE, COUNT - start), start))
        for index, program in enumerate(programs):
            (root / package / f"{program.name}.py").write_text(program.source)
            first, second = _GRIDS[index % len(_GRIDS)]
            case = Case(tree=package, module=f"{package}.{program.name}", function="entry",
                        call="fn(rank_tensor(4))", grid=first, second_grid=second, partial=program.partial,
                        label=",".join(program.shapes))
            generated.cases.append(case)
            generated.programs[case.id] = program
    return generated


def _with_modes(loaded: Loaded) -> Loaded:
    """A migrated entry that takes the collection runs in every mode, one that does not (its reads left as they
    are, or none threaded to it) without a collection only (a and e)."""
    takes = "pg_collection" in inspect.signature(loaded.migrated.function).parameters
    case = dataclasses.replace(loaded.case, modes=("a", "b", "c", "d", "e") if takes else ("a", "e"))
    return Loaded(case, loaded.original, loaded.migrated)


# -- which reads the tool left ---------------------------------------------------------------------------------------


def _reads_left(root: Path, package: str) -> dict[tuple[str, int, str], list[str]]:
    """The reads the tool's report lists as left in ``package`` (under ``root``), by (module, line, callee), each
    with its reasons (one per read of that callee on that line)."""
    command = "import sys; from pgregistry.cli import main; sys.exit(main(sys.argv[1:]))"
    done = subprocess.run(
        [sys.executable, "-c", command, "migrate", "--diff", "--isolated", "--preset", "megatron", package],
        cwd=root, capture_output=True, text=True, timeout=80,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    if done.returncode != 0:
        raise RuntimeError(f"pgregistry migrate --diff on {package} exited {done.returncode}:\n{done.stderr[-3000:]}")
    left: dict[tuple[str, int, str], list[str]] = defaultdict(list)
    reason = ""
    for line in done.stderr.splitlines():
        if found := _LEFT_LINE.match(line):
            module = found[1].removesuffix(".py").replace("/", ".")
            left[(module, int(found[2]), found[3])].append(reason)
        elif found := _REASON_LINE.match(line):
            reason = found[1]
    return left


def _treatment_differences(generated: _Generated, left: Mapping[tuple[str, int, str], list[str]]) -> list[str]:
    """Each read the tool left that the generator expected rewritten, or the reverse, and each read it left that
    no program planted."""
    found = []
    unplanted = {key: list(reasons) for key, reasons in left.items()}
    for case in generated.cases:
        for read in generated.programs[case.id].reads:
            reasons = unplanted.get((case.module, read.line, read.accessor))
            reason = reasons.pop() if reasons else None
            if (reason is not None) != (read.expected == LEFT):
                expected = f"{read.expected} ({read.because})" if read.because else read.expected
                did = f"left it ({reason})" if reason is not None else "rewrote it"
                found.append(f"{case.id}: {read.describe()}: the generator expected {expected}; the tool {did}")
    found += [
        f"{module} line {line}: the tool left {callee} ({reasons[0]}), which no shape planted"
        for (module, line, callee), reasons in unplanted.items()
        if reasons
    ]
    return found


# -- mode d's oracle: the original with each read answered by the grid the rewrite should read -----------------------


def _state_names() -> list[str]:
    """The globals ``parallel_state``'s accessors read (as ``fixtures.differential`` takes them)."""
    from megatron.core import parallel_state

    return [name for name in vars(parallel_state) if name.startswith("_") and name.isupper()]


def _grid_key(arguments: Mapping[str, Any]) -> tuple[tuple[str, Any], ...]:
    """A grid's key: ``initialize_model_parallel``'s arguments that size its axes."""
    return tuple(sorted((k, v) for k, v in arguments.items() if k != "create_gloo_process_groups"))


@contextmanager
def _keeping_each_grids_state(states: dict[tuple[tuple[str, Any], ...], dict[str, Any]]) -> Iterator[None]:
    """While the harness runs, each grid's ``parallel_state`` globals as they were just before it was destroyed,
    by the grid's arguments: the groups stay alive (no gloo groups are made, and only those are destroyed)."""
    from megatron.core import parallel_state

    initialise, destroy = parallel_state.initialize_model_parallel, parallel_state.destroy_model_parallel
    current: list[tuple[tuple[str, Any], ...]] = []

    def initialise_and_remember(*args: Any, **kwargs: Any) -> Any:
        current[:] = [_grid_key(kwargs)]
        return initialise(*args, **kwargs)

    def remember_and_destroy(*args: Any, **kwargs: Any) -> Any:
        states[current[0]] = {name: getattr(parallel_state, name) for name in _state_names()}
        return destroy(*args, **kwargs)

    parallel_state.initialize_model_parallel = initialise_and_remember
    parallel_state.destroy_model_parallel = remember_and_destroy
    try:
        yield
    finally:
        parallel_state.initialize_model_parallel, parallel_state.destroy_model_parallel = initialise, destroy


def _set_parallel_state(state: Mapping[str, Any]) -> None:
    from megatron.core import parallel_state

    for name, value in state.items():
        setattr(parallel_state, name, value)


@contextmanager
def _parallel_state_of(state: Mapping[str, Any]) -> Iterator[None]:
    """``parallel_state``'s globals set to ``state`` (a grid's, kept), then as they were."""
    from megatron.core import parallel_state

    saved = {name: getattr(parallel_state, name) for name in state}
    _set_parallel_state(state)
    try:
        yield
    finally:
        _set_parallel_state(saved)


def _remat_dp_is_dp() -> bool:
    """Whether the data-parallel group with GTP remat spans the ranks of the one without (GTP remat off). No field
    of Megatron-Core's collection holds it; its ``dp`` stands for it then, and only then."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    with_remat = parallel_state.get_data_parallel_group()
    return dist.get_process_group_ranks(with_remat) == dist.get_process_group_ranks(
        parallel_state.get_data_parallel_group(with_gtp_remat=False)
    )


def _profile_answering_reads(
    reads: tuple[Read, ...], filename: str, first: Mapping[str, Any], executed: list[tuple[Read, str]]
) -> Callable[..., Any]:
    """A profile function that runs each planted read the collection should answer on the first grid's
    ``parallel_state`` (``first``), the others on the global one, appending each read run to ``executed`` with
    what answers it (:data:`COLLECTION`, :data:`FALLBACK`: the global grid with the warning, :data:`SHIM`,
    :data:`LEFT`).

    A read a collection should answer (the one given, or a shim's of the global grid) falls back where that grid's
    accessor raises there (a group Megatron-Core made on other ranks only: its collection holds ``None``), and a
    read of ``dp_gtp_remat`` where the collection has nothing of its ranks (:func:`_remat_dp_is_dp`)."""
    from megatron.core import parallel_state

    at = {(read.line, read.column, read.end_column): read for read in reads}
    positions: dict[Any, list[Any]] = {}
    second = {name: getattr(parallel_state, name) for name in first}
    remat_dp_is_dp = {}
    for grid, state in ((COLLECTION, first), (SHIM, second)):
        with _parallel_state_of(state):
            remat_dp_is_dp[grid] = _remat_dp_is_dp()
    swapped: list[Any] = []

    def falls_back(read: Read, caller: Any) -> bool:
        if read.field == "dp_gtp_remat" and not remat_dp_is_dp[read.expected]:
            return True
        with _parallel_state_of(first if read.expected == COLLECTION else second):
            try:
                eval(read.call, caller.f_globals, caller.f_locals)
            except Exception:
                return True
        return False

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "return" and swapped and swapped[-1] is frame:
            swapped.pop()
            _set_parallel_state(second)
        if event != "call" or frame.f_back is None or frame.f_back.f_code.co_filename != filename or swapped:
            return
        caller = frame.f_back
        code = caller.f_code
        if code not in positions:
            positions[code] = list(code.co_positions())
        line, _, column, end = positions[code][caller.f_lasti // 2]
        read = at.get((line, column, end))
        if read is None:
            return
        answer = read.expected
        if answer in (COLLECTION, SHIM) and falls_back(read, caller):
            answer = FALLBACK
        if answer == COLLECTION:
            swapped.append(frame)
            _set_parallel_state(first)
        executed.append((read, answer))

    return profile


def _mixed_outcome(item: Loaded, reads: tuple[Read, ...], rank: int, states: Mapping[Any, Any]) -> dict[str, Any]:
    """The original's outcome on mode d's global grid with every read the collection should answer run on the
    first grid's ``parallel_state``: what the migrated function must do in mode d. ``expected warnings``: the
    (function, field) of each fallback a read run should warn of."""
    first = states[_grid_key({GRID_ARGUMENTS[k]: v for k, v in item.case.grid.items()})]
    second = states[_grid_key({GRID_ARGUMENTS[k]: v for k, v in item.case.second_grid.items()})]
    executed: list[tuple[Read, str]] = []
    with _parallel_state_of(second):
        profile = _profile_answering_reads(reads, item.original.function.__code__.co_filename, first, executed)
        sys.setprofile(profile)
        try:
            outcome = outcome_of_side(item.case, item.original, rank, None)
        finally:
            sys.setprofile(None)
    outcome["expected warnings"] = sorted(
        {(f"{item.case.module}.{read.owner}", read.field) for read, answer in executed if answer == FALLBACK}
    )
    outcome["reads run"] = [(read.line, read.column, answer) for read, answer in executed]
    return outcome


def _outcomes_in_world(
    loaded: Mapping[str, Loaded], reads: Mapping[str, tuple[Read, ...]]
) -> dict[str, dict[str, Any]]:
    """The harness's outcomes on this rank (modes a to d), and mode d's oracle of each case that runs it."""
    import torch.distributed as dist

    states: dict[Any, dict[str, Any]] = {}
    with _keeping_each_grids_state(states):
        out = run_in_world(loaded)
    for key, item in loaded.items():
        if "d" in item.case.modes:
            out[key]["mixed"] = _mixed_outcome(item, reads[key], dist.get_rank(), states)
    return out


def _run_with_oracle(
    loaded: Mapping[str, Loaded], reads: Mapping[str, tuple[Read, ...]]
) -> tuple[list[dict[str, Any]], Any]:
    """Every rank's outcomes, a world per package, and this process's (mode e)."""
    from pgregistry.testing import run_world

    ranks: list[dict[str, Any]] = [{} for _ in range(4)]
    for tree in sorted({item.case.tree for item in loaded.values()}):
        of_tree = {key: item for key, item in loaded.items() if item.case.tree == tree}
        for merged, part in zip(ranks, run_world(4, _outcomes_in_world, of_tree, reads, timeout=60), strict=True):
            merged.update(part)
    return ranks, run_uninitialised(loaded)


def _oracle_differences(case: Case, per_process: list[dict[str, Any]], reads: tuple[Read, ...]) -> list[str]:
    """Where mode d's oracle of a program whose reads all answer from the collection is not the original's own
    outcome on the first grid: a read its profile function did not find (and ran on the second grid).

    Its reads in functions, that is (those at import read no grid), and those run (one Megatron-Core made on other
    ranks only falls back there); a read left may have been cached on another grid (``lru_cache``), so not run."""
    if any(read.owner and read.expected != COLLECTION for read in reads):
        return []
    found = []
    for rank, result in enumerate(per_process):
        mixed, original = result["mixed"], result["original"]
        if all(answer == COLLECTION for _, _, answer in mixed["reads run"]) and any(
            mixed[key] != original[key] for key in ("value", "raised", "groups")
        ):
            gave, expected = mixed["raised"] or mixed["value"], original["raised"] or original["value"]
            found.append(f"{case.id} rank {rank}: mode d's oracle, every read run on the first grid, gave {gave!r}, "
                         f"the original there {expected!r}")
    return found


def _fallback_differences(case: Case, per_process: list[dict[str, Any]], reads: tuple[Read, ...]) -> list[str]:
    """Mode d's fallback warnings against those of the reads run that should fall back, on each rank."""
    found = []
    for rank, result in enumerate(per_process):
        warned = {m.groups() for w in result["d"]["warned"] if (m := _FALLBACK_WARNING.match(w))}
        expected = set(map(tuple, result["mixed"]["expected warnings"]))
        for owner, field in sorted(warned ^ expected):
            named = [r.describe() for r in reads if f"{case.module}.{r.owner}" == owner and r.field == field]
            did = "fell back" if (owner, field) in warned else "gave no fallback warning"
            found.append(f"{case.id} mode d rank {rank}: {owner} {did} for {field!r}: reads {named}")
    return found


@pytest.mark.timeout(max(110, COUNT // 2))  # a longer run: about 0.3 s a program
def test_generated_programs_behave_as_their_originals(tmp_path: Path) -> None:
    generated = _packages(tmp_path / "generated")
    left: dict[tuple[str, int, str], list[str]] = {}
    for package in generated.trees:
        left.update(_reads_left(tmp_path / "generated", package))
    found = _treatment_differences(generated, left)
    loaded = load_cases(generated.trees, generated.cases, tmp_path / "migrated")
    found += [value for value in loaded.values() if not isinstance(value, Loaded)]
    runnable = {key: _with_modes(value) for key, value in loaded.items() if isinstance(value, Loaded)}
    reads = {key: generated.programs[key].reads for key in runnable}
    ranks, uninitialised = _run_with_oracle(runnable, reads)
    blind = fell_back = excused = compared = 0
    for key, item in runnable.items():
        for mode in item.case.modes:
            per_process: list[dict[str, Any]] = (
                [uninitialised[key]] if mode == "e" else [rank[key] for rank in ranks]
            )
            fell_back += mode == "b" and any(result[mode]["warned"] for result in per_process)
            if mode == "d":
                found += _fallback_differences(item.case, per_process, reads[key])
                found += _oracle_differences(item.case, per_process, reads[key])
                runs = {run for result in per_process for run in result["mixed"]["reads run"]}
                excused += sum(1 for run in runs if run[2] != COLLECTION)
                compared += sum(1 for run in runs if run[2] == COLLECTION)
                blind += not tells_the_grids_apart(per_process)
                per_process = [{**result, "original": result["mixed"]} for result in per_process]
            found += differences(item.case, per_process, mode)
    threaded = sum(len(item.case.modes) == 5 for item in runnable.values())
    print(f"{len(generated.cases)} programs (seed {SEED}): {threaded} take a collection, {fell_back} of them fall "
          f"back somewhere given a whole one; in mode d, {compared} reads run answered by the collection, "
          f"{excused} reading the global grid (left or falling back), {blind} programs the same on both grids; "
          f"{len(found)} differences")
    print(*found, sep="\n")  # all of them, under -s; the assertion shows the first
    assert not found, "\n".join(found[:40])

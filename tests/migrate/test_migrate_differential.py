"""``pgregistry migrate`` keeps behaviour, proven by running it (issue 40): functions of real trees (megatron/core of
the installed Megatron-Core, Megatron-Bridge 0.6.2, NeMo 3.0.0, a DeepSpeed-like tree, a tree of shim shapes) and
their migrated twins, run side by side in a 4-rank gloo world on Megatron-Core's real ``parallel_state``, in five
modes (see tests/fixtures/differential.py). The oracle is always the original function, run in the same world:
nothing the tool computes is compared with itself, and only behaviour is compared, never the rewritten text.

The cases are data (tests/migrate/differential/*.toml, and held-back files named in
``PGREGISTRY_DIFFERENTIAL_RECIPES``). A mode today's tool fails is a strict xfail naming the issue's class: a fix
turns it into a failure that says to remove the mark. The trees come from ``make setup`` (the corpus step); without
them their cases skip, unless ``PGREGISTRY_REQUIRE_CORPUS=1`` (``make test``)."""

from __future__ import annotations

import os
from typing import Any

import pytest

pytest.importorskip("libcst")
pytest.importorskip("megatron.core.parallel_state")

from fixtures.differential import (  # noqa: E402
    MODES,
    Case,
    Loaded,
    differences,
    load_cases,
    load_recipes,
    run_cases,
    tells_the_grids_apart,
)

TREES, CASES = load_recipes()


def _params() -> list[Any]:
    params = []
    for case in CASES:
        for mode in case.modes:
            marks = []
            if mode in case.today:
                marks.append(pytest.mark.xfail(strict=True, reason=case.today[mode]))
            params.append(pytest.param(case, mode, id=f"{case.id}-{mode}", marks=marks))
    return params


@pytest.fixture(scope="session")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every case's functions migrated, loaded and run, once per session."""
    present = {name for name, tree in TREES.items() if (tree.root / tree.folder).is_dir()}
    missing = sorted({case.tree for case in CASES} - present)
    if missing and os.environ.get("PGREGISTRY_REQUIRE_CORPUS") == "1":
        pytest.fail(f"trees missing: {missing} ({[str(TREES[name].root) for name in missing]}); run make setup")
    cases = [case for case in CASES if case.tree in present]
    loaded = load_cases(TREES, cases, tmp_path_factory.mktemp("differential"))
    runnable = {key: value for key, value in loaded.items() if isinstance(value, Loaded)}
    ranks, uninitialised = run_cases(runnable)
    return {"loaded": loaded, "ranks": ranks, "uninitialised": uninitialised, "missing": missing}


def _named(outcome: dict[str, Any], case: Case, function: str | None = None) -> list[str]:
    """The fallback warnings naming the function that reads (the case's reader, else the function itself; or
    ``function``), or a function nested in it (a hook it returns)."""
    owner = case.owner if function is None else f"{case.module}.{function}"
    return [message for message in outcome["warned"] if message.startswith((owner + " ", owner + "."))]


@pytest.mark.timeout(480)  # the first test also migrates the trees and runs every case, one world a tree
@pytest.mark.parametrize(("case", "mode"), _params())
def test_the_migrated_function_behaves_as_the_original(outcomes: dict[str, Any], case: Case, mode: str) -> None:
    if case.tree in outcomes["missing"]:
        pytest.skip(f"tree {case.tree} not installed (make setup fetches it)")
    loaded = outcomes["loaded"][case.id]
    assert isinstance(loaded, Loaded), loaded
    if mode == "e":
        per_process = [outcomes["uninitialised"][case.id]]
    else:
        per_process = [rank[case.id] for rank in outcomes["ranks"]]
    if mode == "d":  # a recipe whose original gives the same on both grids could not see a wrong group
        assert tells_the_grids_apart(per_process), f"{case.id}: the recipe cannot tell the two grids apart"
    assert differences(case, per_process, mode) == []
    for rank, result in enumerate(per_process):
        got = result[mode]
        where = f"{case.id} mode {mode} rank {rank}"
        if mode in ("a", "c") and case.warns:
            assert _named(got, case), f"{where}: no fallback warning naming {case.owner} (warned: {got['warned']})"
        if mode in ("a", "c") and case.reader:  # the function's own reads are skipped: it does not warn itself
            assert not _named(got, case, case.function), f"{where}: {case.function} warned {got['warned']}"
        if mode in ("a", "c") and not case.warns:
            why = case.left or "read no global state"
            assert not _named(got, case), f"{where}: {case.owner}: {why}, yet warned {got['warned']}"
        if mode in ("b", "d"):
            assert got["warned"] == [], f"{where}: fell back with a whole collection passed: {got['warned']}"


def test_the_recipes_cover_the_trees() -> None:
    """At least 30 functions in each of the five modes, 10 of them from Megatron-Bridge (issue 40, "Proven by running
    it"). NeMo 3.0.0 holds 9 functions that read parallel_state: the 2 of utils/callbacks/dist_ckpt_io.py cannot run
    against Megatron-Core 0.19.2 here (their module's megatron.core imports need tensorstore) and one is a closure of
    an optimizer's hook, so 6 are run."""
    functions = {(case.tree, case.module, case.function) for case in CASES}
    per_tree = {name: sum(1 for tree, _, _ in functions if tree == name) for name in TREES}
    assert len(functions) >= 30 and per_tree["bridge"] >= 10 and per_tree["nemo"] >= 6, per_tree
    per_mode = {mode: len({(c.tree, c.module, c.function) for c in CASES if mode in c.modes}) for mode in MODES}
    assert min(per_mode.values()) >= 30, per_mode

"""The docstring examples that need no process group or device run and print what they show.

A docstring example is documentation a reader copies: one that went stale would teach a wrong rank
set. Each module listed here must hold at least one example, so a module whose examples were all
dropped fails too. The examples of these modules are plain arithmetic (``pgregistry.rng`` imports
torch, but its seed plans are arithmetic over a layout; ``pgregistry.audit``'s reports are plain
records; ``pgregistry.params`` marks a tensor made in the example), checks of a caller's argument
(``pgregistry.mesh``, ``pgregistry.testing``, whose examples also start worlds of their own
through ``run_world`` from this process), names or lookups on small models and collections
assembled by hand (``pgregistry.attachments``, the grad statistics' groups and filters, the
collection ``pgregistry.doors`` is given), a warning caught (``pgregistry.fallback``) or this
process's state (``pgregistry.recovery``'s generation), grads and shares of groups that are off
(``None``: no collective), a torch optimizer's state, a command's listing and exit codes
(``pgregistry.cli``). The doctests of ``EXAMPLES_IN_A_WORLD`` need the default process group: they
run on every rank of a gloo world of the size their docstrings say (1, 2 or 4 ranks) instead;
those that need Megatron-Core or torchtitan run so in ``tests/megatron/test_megatron_doctests.py``
and ``tests/torchtitan/test_torchtitan_doctests.py``. An example a doctest cannot hold (a rank that
dies, files written) stays a code block (``Example::``) that its test runs verbatim
(``tests/fixtures/docstring_examples.py``).
"""

from __future__ import annotations

import ast
import doctest
import importlib
import io
from pathlib import Path

import pytest
from fixtures.docstring_examples import run_examples_of

from pgregistry.testing import run_world

MODULES_WITH_EXAMPLES = (
    "pgregistry.attachments",
    "pgregistry.audit",
    "pgregistry.cli",
    "pgregistry.collection",
    "pgregistry.doors",
    "pgregistry.experts._keys",
    "pgregistry.experts._names",
    "pgregistry.fallback",
    "pgregistry.grad_stats._devices",
    "pgregistry.grad_stats._filters",
    "pgregistry.grad_stats._lists",
    "pgregistry.grad_stats._reductions",
    "pgregistry.layout",
    "pgregistry.mesh",
    "pgregistry.optim._flat_step",
    "pgregistry.optim._param_state",
    "pgregistry.params",
    "pgregistry.placement",
    "pgregistry.recovery",
    "pgregistry.rng",
    "pgregistry.testing",
)

EXAMPLES_IN_A_WORLD = {
    "pgregistry.attachments.attach": 2,
    "pgregistry.audit.audit_grad_replication": 2,
    "pgregistry.checkpoint._by_name.state_by_name": 2,
    "pgregistry.checkpoint._optimizer_state.load_optimizer_state_by_name": 2,
    "pgregistry.doors.pg_group": 2,
    "pgregistry.doors.pg_rank": 2,
    "pgregistry.doors.pg_read": 2,
    "pgregistry.doors.pg_size": 2,
    "pgregistry.experts._ep.get_ep_rank_and_size": 4,
    "pgregistry.experts._names.global_param_name_fn": 2,
    "pgregistry.experts._names.named_global_parameters": 2,
    "pgregistry.fallback.ProcessGroupFallbackWarning": 2,
    "pgregistry.global_grid.global_collection": 2,
    "pgregistry.global_grid.initialize_global_grid": 2,
    "pgregistry.grad_stats._devices.backend_device": 1,
    "pgregistry.grad_stats._functional.check_expert_classification": 2,
    "pgregistry.grad_stats._functional.classify_grads": 2,
    "pgregistry.grad_stats._functional.clip_grad_norm_": 2,
    "pgregistry.grad_stats._functional.count_zeros": 2,
    "pgregistry.grad_stats._functional.grad_norm": 2,
    "pgregistry.grad_stats._functional.grad_norm_and_zeros": 2,
    "pgregistry.grad_stats._lists.clip_grads_": 2,
    "pgregistry.grad_stats._lists.norm_of_grads": 2,
    "pgregistry.mesh.from_device_mesh": 4,
    "pgregistry.mesh.to_device_mesh": 4,
    "pgregistry.mesh.with_hsdp_groups": 4,
    "pgregistry.modules._collection.MultiModuleCollection": 4,
    "pgregistry.modules._collection.build_modules": 4,
    "pgregistry.modules._optimizer.MultiModuleOptimizer": 4,
    "pgregistry.modules._optimizer.build_optimizer": 4,
    "pgregistry.modules._rng.seed_modules": 2,
    "pgregistry.modules._stats.clip_grad_norm_": 4,
    "pgregistry.modules._stats.count_zeros": 4,
    "pgregistry.modules._stats.grad_norm": 4,
    "pgregistry.optim._base.FlatOptimizer": 1,
    "pgregistry.optim._builder.build_optimizer": 2,
    "pgregistry.optim._builder.inner_factory": 2,
    "pgregistry.optim._chained.ChainedOptimizer": 2,
    "pgregistry.optim._flat_step.ElementwiseRule": 2,
    "pgregistry.optim._mixed_precision.MixedPrecisionOptimizer": 2,
    "pgregistry.optim._setup.OptimizerProcessGroups": 2,
    "pgregistry.optim._setup.setup_process_groups_for_optimizer": 2,
    "pgregistry.optim._sharded.ShardedOptimizer": 2,
    "pgregistry.params.restore_param_roles": 2,
    "pgregistry.recovery.commit": 2,
    "pgregistry.registry.BuildOptions": 2,
    "pgregistry.registry.build": 4,
    "pgregistry.registry.communicators_created": 4,
    "pgregistry.registry.destroy": 2,
    "pgregistry.rng.get_rng_tracker": 1,
    "pgregistry.rng.model_parallel_manual_seed": 2,
}
"""The objects whose doctests need the default process group, by dotted name -> the world's size.

Their docstrings say the size; each runs on every rank of a world of it."""


def _needs_a_world(test: doctest.DocTest) -> bool:
    return any(
        test.name == name or test.name.startswith(f"{name}.") for name in EXAMPLES_IN_A_WORLD
    )


@pytest.mark.parametrize("name", MODULES_WITH_EXAMPLES)
def test_the_docstring_examples_print_what_they_show(name: str) -> None:
    module = importlib.import_module(name)
    report = io.StringIO()
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    found = [test for test in doctest.DocTestFinder().find(module) if test.examples]
    assert found, f"{name} has no docstring example"
    for test in found:
        if not _needs_a_world(test):
            runner.run(test, out=report.write)
    assert runner.failures == 0, report.getvalue()


@pytest.mark.parametrize("size", sorted(set(EXAMPLES_IN_A_WORLD.values())))
def test_the_examples_that_need_a_world_print_what_they_show_on_every_rank(size: int) -> None:
    names = [name for name, wanted in EXAMPLES_IN_A_WORLD.items() if wanted == size]
    outcomes = run_world(size, run_examples_of, names, timeout=60)
    for rank, (counts, failures, report) in enumerate(outcomes):
        assert all(counts.values()), f"rank {rank}: no docstring example: {counts}"
        assert failures == 0, f"rank {rank}:\n{report}"


CODE_BLOCK_EXAMPLES = {
    "pgregistry.allowlist.main": "tests/allowlist/test_allowlist_main_example.py",
    "pgregistry.checkpoint._distributed.load_distributed": "tests/core/test_checkpoint_docstring_examples.py",
    "pgregistry.checkpoint._distributed.save_distributed": "tests/core/test_checkpoint_docstring_examples.py",
    "pgregistry.checkpoint._optimizer_shards.load_optimizer_shards": "tests/core/test_checkpoint_docstring_examples.py",
    "pgregistry.checkpoint._optimizer_shards.save_optimizer_shards": "tests/core/test_checkpoint_docstring_examples.py",
    "pgregistry.checkpoint._rank_files.load_rank_files": "tests/core/test_checkpoint_docstring_examples.py",
    "pgregistry.checkpoint._rank_files.save_rank_files": "tests/core/test_checkpoint_docstring_examples.py",
    "pgregistry.modules._checkpoint.load_checkpoint": "tests/modules/test_modules_checkpoint_examples.py",
    "pgregistry.modules._checkpoint.save_checkpoint": "tests/modules/test_modules_checkpoint_examples.py",
    "pgregistry.recovery.LeftWithReplica": "tests/recovery/test_recovery_examples.py",
    "pgregistry.recovery.Recovered": "tests/recovery/test_recovery_examples.py",
    "pgregistry.recovery.StoreLost": "tests/recovery/test_recovery_examples.py",
    "pgregistry.recovery.carry_optimizer_state": "tests/recovery/test_recovery_examples.py",
    "pgregistry.recovery.recover": "tests/recovery/test_recovery_examples.py",
}
"""Each object whose example is an ``Example::`` block -> the test that runs it verbatim."""

NOT_RUN = {"pgregistry.interop.megatron.seed_megatron_rng": "Megatron-Core seeds its RNG trackers on CUDA"}
"""``Example::`` blocks no test runs, and why (``scripts/megatron_parity.py`` checks the seeds on a GPU)."""


def _code_block_examples() -> set[str]:
    """The dotted name of every function or class of the package whose docstring has an ``Example::`` block."""
    root = Path(importlib.import_module("pgregistry").__file__).parent
    found = set()
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        pending = [(module, node) for node in ast.parse(path.read_text(encoding="utf-8")).body]
        while pending:
            prefix, node = pending.pop()
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                name = f"{prefix}.{node.name}"
                docstring = ast.get_docstring(node) or ""
                if any(line.strip() == "Example::" for line in docstring.splitlines()):
                    found.add(name)
                pending += [(name, child) for child in node.body]
    return found


def test_every_code_block_example_is_run_verbatim_by_a_test() -> None:
    assert _code_block_examples() == set(CODE_BLOCK_EXAMPLES) | set(NOT_RUN)
    root = Path(__file__).resolve().parents[2]
    for name, test in CODE_BLOCK_EXAMPLES.items():
        text = (root / test).read_text()
        assert "example_code(" in text and name.rpartition(".")[2] in text, f"{test} does not run {name}'s example"

"""Planted bugs, and the tests that must catch them: a test that cannot fail proves nothing.

    python scripts/mutants.py            # every mutant (make mutants)
    python scripts/mutants.py --only nan-clip-coefficient allowlist-written-in-place
    python scripts/mutants.py --list     # the mutants and their tests, nothing run

Each :class:`Mutant` is one bug this library exists to prevent, written as an edit: a file, a snippet that occurs
in it exactly once, its replacement, and the test node ids that must fail with it. The script copies the
repository's files (those git tracks, and those it does not ignore, as they are on disk) to a temporary directory,
runs every listed test there once unmutated (they must pass: a red suite can catch nothing), then applies one mutant
at a time to the copy, never to the working tree, and runs that mutant's tests with this interpreter's pytest, in
the copy, with ``PYTHONPATH`` pointing at it so the copy's ``pgregistry`` is the one imported. A mutant is caught
when every test listed for it fails; the table says which were and how long each took.

Exit 0: every mutant caught. 1: a mutant survived (a listed test passed with it, or pytest could not run it), or a
listed test failed unmutated. 2: the list went stale: a snippet not found exactly once, a file or a listed test
that no longer exists (``tests/core/test_mutants.py`` checks this on every ``make test``, without running a
mutant). When code moves, move its mutant with it (docs/reliability.md, "Planted bugs").
"""

from __future__ import annotations

import argparse
import ast
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PYTEST_TIMEOUT_S = 900  # one mutant's tests; each test has its own deadline (run_world's, pytest-timeout's 120 s)


@dataclass(frozen=True)
class Mutant:
    """One planted bug: in ``file`` (relative to the repository), ``find`` (exactly once) becomes ``replace``; every
    test of ``tests`` (pytest node ids; an id without parameters stands for all of them) must then fail."""

    name: str
    bug: str
    file: str
    find: str
    replace: str
    tests: tuple[str, ...]


MUTANTS: tuple[Mutant, ...] = (
    Mutant(
        name="expert-grads-with-dense-tp",
        bug="expert grads filtered with the dense TP group (Megatron-LM PR 6470)",
        file="pgregistry/grad_stats/_filters.py",
        find="_not_tp_duplicate(param, groups.expt_tp if expert else groups.tp)",
        replace="_not_tp_duplicate(param, groups.tp)",
        tests=(
            "tests/grad_stats/test_expert_grads_filtered_with_expert_tp.py::"
            "test_expert_grads_count_once_per_expert_tp_group",
        ),
    ),
    Mutant(
        name="gtp-duplicates-counted",
        bug="every GTP-remat replica of a replicated grad counted (the GTP duplicate filter off)",
        file="pgregistry/grad_stats/_filters.py",
        find='return bool(getattr(param, "is_gtp_weight_remat", False)) or group_rank(gtp_group) == 0',
        replace="return True",
        tests=("tests/grad_stats/test_grad_stats_layouts.py::test_layout_matches_unsharded_oracle[TP2-GTP2-EP2]",),
    ),
    Mutant(
        name="shared-copy-counted",
        bug="the last stage's copy of a tied embedding counted a second time",
        file="pgregistry/grad_stats/_filters.py",
        find='return not getattr(param, "shared", False)',
        replace="return True",
        tests=("tests/grad_stats/test_grad_stats_layouts.py::test_layout_matches_unsharded_oracle[TP2-CP2-PP2]",),
    ),
    Mutant(
        name="nan-clip-coefficient",
        bug="a non-finite norm clips by a NaN (or zero) coefficient, poisoning every grad",
        file="pgregistry/grad_stats/_reductions.py",
        find="return torch.where(a_norm, clipped, torch.ones_like(clipped))",
        replace="return clipped",
        tests=(
            "tests/grad_stats/test_grad_stats_nonfinite.py::"
            "test_a_non_finite_norm_leaves_every_grad_unscaled_on_every_rank",
        ),
    ),
    Mutant(
        name="range-scale-squared",
        bug="the 2-norm's range columns divided by S * S (2**1200, inf in float64): the middle column dropped "
        "beside a large square, float64 grads on both sides of 2**256 given too small a norm",
        file="pgregistry/grad_stats/_reductions.py",
        find="torch.sqrt(large + middle / _RANGE_SCALE / _RANGE_SCALE)",
        replace="torch.sqrt(large + middle / (_RANGE_SCALE * _RANGE_SCALE))",
        tests=(
            "tests/grad_stats/test_norms_beyond_the_accumulation_range.py::"
            "test_the_norm_is_exact_and_the_clip_scales_by_it[float64-2^256-p2]",
        ),
    ),
    Mutant(
        name="migrate-leaves-a-lengthened-argument-line",
        bug="a read rewritten on a call's one line of arguments makes it longer than the tree's line length: "
        "megatron-core's LLaVAModel got a 104-column line, where black gives each argument its own line",
        file="pgregistry/migrate/_rewrite.py",
        find="        return split_lengthened_argument_line(updated, original, indent, self.width, self.unit)",
        replace="        return updated",
        tests=("tests/migrate/test_migrate_layout.py::"
               "test_a_line_of_arguments_a_rewritten_read_made_too_long_gets_one_argument_a_line_as_black_splits_it",),
    ),
    Mutant(
        name="optimizer-statistics-refuse-a-norm-type-before-the-reduction",
        bug="an optimizer's or grad buffer's get_grad_norm given a norm_type refused on one rank raises there before "
        "the norm's all-reduce: its peers wait until the group's timeout",
        file="pgregistry/optim/_grad_statistics.py",
        find="        reduced = self.statistics(Wanted(given.p, zeros=zeros), given)",
        replace="        reduced = self.statistics(Wanted.of(norm_type, zeros=zeros), given)",
        tests=("tests/optim/test_optim_norm_type_refused_on_one_rank.py::"
               "test_a_norm_type_refused_on_one_rank_leaves_its_peer_an_error_not_a_wait[stages-buffer]",),
    ),
    Mutant(
        name="negative-norm-clip-coefficient",
        bug="a negative total_norm on a device (not read back) clips by a negative coefficient: every grad flipped",
        file="pgregistry/grad_stats/_reductions.py",
        find="a_norm = torch.isfinite(norm64) & (norm64 >= 0)",
        replace="a_norm = torch.isfinite(norm64)",
        tests=(
            "tests/grad_stats/test_clip_grads_total_norm.py::"
            "test_a_negative_norm_read_on_the_device_leaves_the_grads_unscaled",
        ),
    ),
    Mutant(
        name="nan-clip-coefficient-in-the-kernel",
        bug="the clip kernel's coefficient made from an infinite norm is 0: every grad erased",
        file="pgregistry/grad_stats/_triton_kernels.py",
        find=(
            'return tl.where(\n'
            '        norm < float("inf"), coefficient, 1.0\n'
            '    )  # a norm is never negative: NaN and inf fail here'
        ),
        replace='return coefficient  # a norm is never negative: NaN and inf fail here',
        tests=(
            "tests/grad_stats/test_fused_stats.py::test_clipping_from_the_norm_gives_the_bits_of_torchs_coefficient",
        ),
    ),
    Mutant(
        name="kept-plan-misses-a-submodule",
        bug="a kept classification misses a submodule registered behind a module's back into an empty dictionary",
        file="pgregistry/grad_stats/_plan.py",
        find=(

            'same = _all_empty(self._empty_holders) and _same_stream(\n'
            '                    self._current_holder_contents(), self._held\n'
            '                )'

        ),
        replace='same = _same_stream(self._current_holder_contents(), self._held)',
        tests=("tests/grad_stats/test_grad_stats_kept_plan.py::test_a_changed_parameter_set_is_seen",),
    ),
    Mutant(
        name="kept-plan-misses-the-last-parameter-removed",
        bug="a kept classification compares the parameter set's objects but not where the stream ends: the last "
        "module's last parameter removed goes unseen",
        file="pgregistry/grad_stats/_plan.py",
        find="self._held_views = [*(holder.values() for holder in self._full_holders), (_END,)]",
        replace="self._held_views = [holder.values() for holder in self._full_holders]",
        tests=(
            "tests/grad_stats/test_grad_stats_kept_plan.py::"
            "test_a_parameter_removed_or_added_at_the_end_of_the_parameter_set_is_seen",
        ),
    ),
    Mutant(
        name="kept-plan-misses-a-role",
        bug="a kept classification misses a role set as an attribute in the place of another attribute",
        file="pgregistry/grad_stats/_plan.py",
        find="and all(map(_NO_ROLE, self._roleless))",
        replace="and True",
        tests=(
            "tests/grad_stats/test_grad_stats_kept_plan.py::"
            "test_a_role_set_as_an_attribute_is_seen_whatever_the_parameter_held_before",
        ),
    ),
    Mutant(
        name="kept-plan-misses-a-role-on-a-bare-parameter",
        bug="a kept classification misses a role set as the first attribute of a parameter that had none",
        file="pgregistry/grad_stats/_plan.py",
        find="_all_empty(self._bare)",
        replace="True",
        tests=(
            "tests/grad_stats/test_grad_stats_kept_plan.py::"
            "test_a_role_set_as_an_attribute_is_seen_whatever_the_parameter_held_before",
        ),
    ),
    Mutant(
        name="kept-plan-misses-a-role-past-the-first-block",
        bug="a kept classification compares the roles of its first block of marked parameters only: a role changed "
        "on a later parameter of a model whose every parameter is marked goes unseen",
        file="pgregistry/grad_stats/_plan.py",
        find="            for block in self._roled_blocks\n",
        replace="            for block in self._roled_blocks[:1]\n",
        tests=(
            "tests/grad_stats/test_grad_stats_kept_plan.py::"
            "test_a_role_changed_past_the_first_block_of_marked_parameters_is_seen",
        ),
    ),
    Mutant(
        name="kept-plan-misses-new-storage",
        bug="a kept classification reads the old addresses after a grad was re-pointed at storage of another shape",
        file="pgregistry/grad_stats/_plan.py",
        find="same = facts == layout.facts",
        replace="same = layout.facts is not None",
        tests=("tests/grad_stats/test_grad_stats_kept_plan.py::test_changed_grads_are_seen",),
    ),
    Mutant(
        name="kept-plan-takes-a-freed-grads-none",
        bug="the kept reads take no note of a planned grad's death: a parameter whose grad was set to None (the "
        "planned grad freed, its weak reference giving None too) is taken for the planned grad",
        file="pgregistry/grad_stats/_plan.py",
        find="        if self.deaths:\n            return None\n        pieces = take_plain(grads)\n",
        replace="        pieces = take_plain(grads)\n",
        tests=(
            "tests/grad_stats/test_grad_stats_kept_plan.py::"
            "test_a_parameter_whose_planned_grad_was_freed_and_set_to_none_is_not_read_as_planned",
        ),
    ),
    Mutant(
        name="kept-plan-takes-a-new-grad-at-its-address",
        bug="the kept reads check the planned grads' addresses but not their identity: a new grad object of another "
        "shape at the address of the planned grad it replaced, alive, is read by the plan of the old one",
        file="pgregistry/grad_stats/_plan.py",
        find="return all(map(operator.is_, pieces, map(operator.call, self.references))) and all(",
        replace="return all(",
        tests=(
            "tests/grad_stats/test_grad_stats_kept_plan.py::"
            "test_a_new_grad_at_the_address_of_its_live_planned_grad_is_read_as_it_is",
        ),
    ),
    Mutant(
        name="kept-plan-skips-a-grad-where-there-was-none",
        bug="the kept reads do not check that the parameters which had no grad still have none: a grad given to one "
        "of them is left out of the statistics",
        file="pgregistry/grad_stats/_plan.py",
        find=" and all(\n            map(operator.is_, self.take_none(grads), repeat(None))\n        )",
        replace="",
        tests=(
            "tests/grad_stats/test_grad_stats_kept_plan.py::"
            "test_a_parameter_that_had_no_grad_and_has_one_now_is_not_read_as_planned",
            "tests/grad_stats/test_grad_stats_kept_plan.py::test_the_kept_reads_keep_no_grad_alive",
        ),
    ),
    Mutant(
        name="kept-plan-misses-a-moved-grad",
        bug="the kept reads skip the addresses of the grads planned for: a grad re-pointed at other storage is read "
        "by the plan of its old storage",
        file="pgregistry/grad_stats/_plan.py",
        find="return pieces if self._at_planned_addresses(pieces) else None",
        replace="return pieces",
        tests=("tests/grad_stats/test_grad_stats_kept_plan.py::test_changed_grads_are_seen",),
    ),
    Mutant(
        name="kept-plan-keeps-grads-planned-for-before-a-new-plan",
        bug="the kept reads, planned anew for grads replaced at new addresses (the 3rd call in a row), keep naming "
        "the grads planned for before: given back, they would be read by reads planned for other pieces",
        file="pgregistry/grad_stats/_plan.py",
        find="            layout.planned_for = None  # planned for other pieces: never to be taken for these reads\n",
        replace="",
        tests=(
            "tests/grad_stats/test_grad_stats_kept_plan.py::"
            "test_grads_planned_for_before_a_new_plan_are_not_taken_by_it",
        ),
    ),
    Mutant(
        name="address-only-replan-skips-the-dtype-check",
        bug="new grads that differ from the ones the kinds were planned for in their dtypes (the same element "
        "counts), at new addresses or at the planned ones, keep the kinds: a grad made float64 is read as float32, "
        "a bf16 grad at a float32 grad's address read at float32 offsets",
        file="pgregistry/grad_stats/_plan.py",
        find="        _DTYPE,  # a grad of another dtype",
        replace="        torch.Tensor.numel,  # a grad of another dtype",
        tests=(  # the Python reads' test (the compiled facts have their own mutant)
            "tests/grad_stats/test_grad_stats_kept_plan.py::"
            "test_a_new_grad_of_another_dtype_or_shape_is_planned_in_full[python-dtype]",
        ),
    ),
    Mutant(
        name="address-only-replan-skips-the-shape-check",
        bug="new grads that differ from the ones the kinds were planned for in their addresses and shapes (the same "
        "element counts) keep the host blocks, which concatenate small grads by trailing shape",
        file="pgregistry/grad_stats/_plan.py",
        find='_KIND_READS: Final = (operator.attrgetter("device"), operator.attrgetter("shape"))',
        replace='_KIND_READS: Final = (operator.attrgetter("device"),)',
        tests=(
            "tests/grad_stats/test_grad_stats_kept_plan.py::"
            "test_a_new_grad_of_another_dtype_or_shape_is_planned_in_full[python-shape]",
        ),
    ),
    Mutant(
        name="clip-scales-only-a-targets-pieces",
        bug="the kept plan takes the kinds of a target holding some of the pieces for every piece's: the clip leaves "
        "the pieces of the other targets (a duplicate not counted here, another reduction group) unscaled",
        file="pgregistry/grad_stats/_plan.py",
        find="            if len(positions) == len(pieces)\n",
        replace="            if positions\n",
        tests=("tests/grad_stats/test_grad_stats_layouts.py::test_layout_matches_unsharded_oracle[TP2-EP4-ETP1]",),
    ),
    Mutant(
        name="statistics-plan-resolves-again",
        bug="the kept plan resolves the collection again below the door (issue 39: a call bounces between rooms)",
        file="pgregistry/grad_stats/_plan.py",
        find="    params = kept.current(source, given, owner) if kept is not None else None\n",
        replace=(
            '    given = __import__("pgregistry._runtime.resolve", fromlist=["_"])'
            ".resolve_pg_collection(given, owner=owner)\n"
            "    params = kept.current(source, given, owner) if kept is not None else None\n"
        ),
        tests=("tests/grad_stats/test_one_way_down.py::test_a_call_resolves_once_and_never_climbs_back",),
    ),
    Mutant(
        name="allowlist-written-in-place",
        bug="the allowlist rewritten in place: a crash or a full disk half-way loses the old list",
        file="pgregistry/_source/storage.py",
        find="handle, temporary = _new_temporary(path)",
        replace="handle, temporary = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), str(path)",
        tests=(
            "tests/allowlist/test_allowlist_reliability.py::test_kill_9_during_update_leaves_the_old_file",
            "tests/allowlist/test_allowlist_reliability.py::"
            "test_a_full_disk_exits_2_with_one_line_and_keeps_the_old_file",
        ),
    ),
    Mutant(
        name="non-strict-load-by-default",
        bug="a checkpoint with keys no rank's model holds (more experts) loads silently",
        file="pgregistry/checkpoint/_rank_files.py",
        find="    strict: bool = True,\n",
        replace="    strict: bool = False,\n",
        tests=(
            "tests/experts/test_checkpoint_reliability.py::test_more_experts_than_the_model_has_is_an_error_naming_them",
            "tests/experts/test_checkpoint_reliability.py::test_unrelated_extra_keys_are_an_error_naming_them",
        ),
    ),
    Mutant(
        name="checksum-not-checked",
        bug="a flipped bit in a stored tensor loads as a silently different weight",
        file="pgregistry/checkpoint/_integrity.py",
        find="return [] if checksums == tensor_crc32(value) else [label]",
        replace="return []",
        tests=(
            "tests/experts/test_checkpoint_integrity.py::"
            "test_a_flipped_bit_in_a_tensor_is_named_with_its_file_and_tensor",
        ),
    ),
    Mutant(
        name="fallback-warning-dropped",
        bug="an entry point given no collection reads the global grid silently",
        file="pgregistry/_runtime/resolve.py",
        find='    warn_fallback(owner, "pg_collection")\n    return grid\n',
        replace="    return grid\n",
        tests=("tests/core/test_resolver.py::test_no_collection_is_the_global_grid_with_a_warning_never_ep_off",),
    ),
    Mutant(
        name="explicit-collection-beats-attached",
        bug="an explicit collection that disagrees with the one attached to the model silently wins",
        file="pgregistry/_runtime/resolve.py",
        find="if attached is not None and attached != pg_collection:",
        replace="if False:",
        tests=(
            "tests/core/test_resolver.py::"
            "test_an_explicit_collection_that_disagrees_with_the_attached_one_and_a_destroyed_one_are_refused",
        ),
    ),
    Mutant(
        name="not-member-read-as-none",
        bug="a middle stage's embedding field (NOT_MEMBER) read as None, i.e. rank 0 of a 1-rank group",
        file="pgregistry/collection.py",
        find="        if isinstance(value, NotMember):\n            raise ValueError(\n",
        replace=(
            '        if isinstance(value, NotMember):\n'
            '            return None\n'
            '            raise ValueError(\n'
        ),
        tests=(
            "tests/core/test_registry.py::"
            "test_a_rank_outside_the_embedding_groups_is_not_a_member_never_rank_0_of_1",
        ),
    ),
    Mutant(
        name="pipeline-seed-stride",
        bug="a wrong RNG seed offset: the pipeline stride 10, not Megatron-Core's 100",
        file="pgregistry/rng.py",
        find="_PIPELINE_STRIDE: Final = 100",
        replace="_PIPELINE_STRIDE: Final = 10",
        tests=("tests/rng/test_rng_seeds.py::test_seed_plan_matches_the_formulas",),
    ),
    Mutant(
        name="expert-gtp-axis-after-tp",
        bug="an order swap in the layout: the expert GTP-remat axis placed after expert TP, not after EP",
        file="pgregistry/layout.py",
        find='after=OrderToken.EP.value,',
        replace='after=OrderToken.TP.value,',
        tests=(
            "tests/core/test_layout_gtp_axes.py::test_dense_gtp_follows_tp_and_expert_gtp_follows_ep",
            "tests/megatron/test_megatron_parity.py::test_every_field_holds_megatrons_ranks_on_gloo_worlds",
        ),
    ),
    Mutant(
        name="split-families-overlap",
        bug="one split_group over overlapping rank sets (NCCL's split gives each rank one communicator: the rest hang)",
        file="pgregistry/_runtime/group_cache.py",
        find="            if taken.isdisjoint(ranks):\n",
        replace="            if True:\n",
        tests=(
            "tests/core/test_group_creation_paths.py::"
            "test_the_plan_deals_every_set_once_into_disjoint_families_about_one_per_kind",
        ),
    ),
    Mutant(
        name="build-left-before-peers-connected",
        bug="a rank leaves a build before its peers have created their groups (a destroy then closes their pairs)",
        file="pgregistry/_runtime/group_cache.py",
        find="        if missing:\n            all_reached(options.timeout)  # see _new_group\n",
        replace="",
        tests=(
            "tests/core/test_group_creation_paths.py::"
            "test_no_rank_leaves_a_build_before_every_rank_has_created_its_groups",
        ),
    ),
    Mutant(
        name="expert-grads-sharded-over-dense-dp",
        bug="the sharded optimizer reduce-scatters expert grads over the dense data-parallel group",
        file="pgregistry/optim/_sharded.py",
        find="self.shard_group = groups.intra_expt_dp if expert else groups.intra_dp_cp",
        replace="self.shard_group = groups.intra_dp_cp",
        tests=(
            "tests/optim/test_optim_sync.py::test_dense_grads_averaged_over_dp_cp_and_expert_grads_over_expt_dp",
        ),
    ),
    Mutant(
        name="expert-global-index",
        bug="a local expert's global index computed with the EP rank as the fast index",
        file="pgregistry/experts/_keys.py",
        find="return ep_rank * num_local + local_index",
        replace="return ep_rank + local_index * ep_size",
        tests=("tests/experts/test_experts_keys.py::test_reference_examples",),
    ),
    Mutant(
        name="fill-ignores-the-collections-composites",
        bug="an UNSET axis is read from the global grid though the collection's composite (tp_ep_pp=None) fixes it",
        file="pgregistry/_runtime/resolve.py",
        find=(
            '        if (implied is not None and implied[0] == 1) or (implied is None and name in skipped):\n'
        ),
        replace="        if implied is None and name in skipped:\n",
        tests=(
            "tests/megatron/test_megatron_custom_process_groups.py::"
            "test_megatron_tests_collection_builds_an_optimizer_with_the_oracles_norm",
        ),
    ),
    Mutant(
        name="optimizer-reads-expert-fields-of-a-dense-model",
        bug="build_optimizer reads the expert fields from the global grid for a model without experts",
        file="pgregistry/optim/_setup.py",
        find="    unneeded = () if experts else EXPERT_STATS_FIELDS\n",
        replace="    unneeded = ()\n",
        tests=(
            "tests/megatron/test_megatron_custom_process_groups.py::"
            "test_megatron_tests_collection_builds_an_optimizer_with_the_oracles_norm",
        ),
    ),
    Mutant(
        name="sharded-stats-over-part-of-an-instance",
        bug="a sharded optimizer reduces its norm over an intra_dist_opt that leaves out the TP peers",
        file="pgregistry/optim/_builder.py",
        find="    if sharded:\n        check_instance_holds_stats_groups(process_groups)\n",
        replace="",
        tests=(
            "tests/megatron/test_megatron_custom_process_groups.py::"
            "test_a_sharded_optimizer_over_part_of_its_instance_is_refused_on_every_rank",
        ),
    ),
    Mutant(
        name="hyper-comm-grid-axes-left-unset",
        bug="from_hyper_comm_grid leaves the axes a grid does not have UNSET (statistics then read the global grid)",
        file="pgregistry/interop/_megatron_grids.py",
        find="    fields.update(_not_created(layout, fields))\n",
        replace="",
        tests=(
            "tests/megatron/test_hyper_comm_grid_statistics.py::"
            "test_hyper_comm_grid_collections_give_the_oracles_job_wide_norm",
        ),
    ),
    Mutant(
        name="torchtitan-options-not-agreed",
        bug="to_parallel_dims accepts an spmd_backend / device_type that differs across ranks",
        file="pgregistry/interop/torchtitan.py",
        find=(
            '"to_parallel_dims",\n'
            '        options,\n'
            '        "; ".join(problems) or None,\n'
            '        failed=_CANNOT,\n'
            '        advice=_SAME_OPTIONS,'
        ),
        replace='"to_parallel_dims", {}, "; ".join(problems) or None, failed=_CANNOT, advice=_SAME_OPTIONS',
        tests=(
            "tests/torchtitan/test_torchtitan_agreement.py::"
            "test_options_that_differ_across_ranks_are_refused_on_every_rank",
            "tests/torchtitan/test_torchtitan_agreement.py::test_a_span_on_one_rank_is_refused_on_every_rank",
        ),
    ),
    Mutant(
        name="hsdp-split-refused-outside-the-span",
        bug="with_hsdp_groups of a span collection raises on the ranks outside the span only (the others wait)",
        file="pgregistry/mesh.py",
        find='    require_distributed("with_hsdp_groups")\n',
        replace=(
            '    require_distributed("with_hsdp_groups")\n'
            '    check_usable(pg_collection, "with_hsdp_groups")\n'
        ),
        tests=("tests/core/test_hsdp_spans.py::test_a_span_collection_is_split_by_every_rank_and_held_by_its_own",),
    ),
    Mutant(
        name="hyper-comm-grid-ep-left-to-the-global-grid",
        bug="a grid holding only what Megatron-Core's MIMO optimizer reads leaves ep to the global grid",
        file="pgregistry/interop/_megatron_grids.py",
        find="    _create_per_axis_groups(grid, layout, fields, enums)\n",
        replace="",
        tests=(
            "tests/megatron/test_hyper_comm_grid_statistics.py::"
            "test_a_grid_with_only_the_mimo_optimizers_groups_gets_its_ep_group_from_the_grid",
        ),
    ),
    Mutant(
        name="roles-follow-the-slot",
        bug="a fresh parameter assigned into a marked slot inherits the roles of the one it replaced (shared=True: "
        "not counted)",
        file="pgregistry/params.py",
        find="        if missing and _is_same_param(param, previous):\n",
        replace="        if missing:\n",
        tests=(
            "tests/dtensor/test_roles_follow_the_parameter.py::"
            "test_an_unrelated_parameter_put_in_a_marked_slot_gets_no_role[fresh-then-fully_shard]",
            "tests/dtensor/test_roles_follow_the_parameter.py::"
            "test_an_unrelated_parameter_put_in_a_marked_slot_gets_no_role[a-fresh-DTensor]",
            "tests/dtensor/test_roles_follow_the_parameter.py::"
            "test_a_fresh_parameter_where_megatron_marked_shared_is_counted",
        ),
    ),
    Mutant(
        name="nan-in-an-uncounted-grad",
        bug="a NaN or inf in a grad this rank holds but does not count (a duplicate, a shared copy) is dropped",
        file="pgregistry/grad_stats/_reductions.py",
        find="return torch.where(part.isfinite(), 0.0, part)",
        replace="return torch.zeros_like(part)",
        tests=(
            "tests/grad_stats/test_a_nan_in_a_grad_this_rank_does_not_count.py::"
            "test_a_non_finite_grad_this_rank_does_not_count_makes_the_norm_non_finite_on_every_rank",
            "tests/grad_stats/test_a_nan_in_a_grad_this_rank_does_not_count.py::"
            "test_the_optimizer_sees_a_non_finite_duplicate_on_every_rank",
        ),
    ),
    Mutant(
        name="optimizer-state-not-required",
        bug="a load given an optimizer takes a checkpoint saved without one and keeps the fresh state",
        file="pgregistry/checkpoint/_strict.py",
        find="_optimizer_faults(model, stored, optimizer) if strict and optimizer is not None else \"\"",
        replace="\"\"",
        tests=(
            "tests/experts/test_checkpoint_strict_loaders.py::"
            "test_rank_files_given_an_optimizer_refuse_a_checkpoint_without_its_state",
            "tests/experts/test_checkpoint_strict_loaders.py::"
            "test_dcp_given_an_optimizer_refuses_a_checkpoint_without_its_state",
            "tests/experts/test_checkpoint_strict_loaders.py::"
            "test_a_job_checkpoint_saved_without_the_optimizer_is_refused_on_every_rank",
        ),
    ),
    Mutant(
        name="inf-norm-nan-dropped-by-the-gather",
        bug="the inf-norm's maxima, gathered in their peak columns, are compared with the NaN dropped (as a MAX "
        "reduction may drop one): a NaN grad on one stage gives every stage a finite inf-norm",
        file="pgregistry/grad_stats/_reductions.py",
        find="    return torch.cat(peaks).amax() if peaks else _float64_zeros((), device)\n",
        replace="    return torch.cat(peaks).nan_to_num(0.0).amax() if peaks else _float64_zeros((), device)\n",
        tests=("tests/grad_stats/test_grad_stats_nonfinite.py::test_a_nan_reaches_every_rank_of_an_inf_norm",),
    ),
    Mutant(
        name="exact-norm-rescue-off",
        bug="a p-norm (p other than 1, 2, inf) whose sum |g|^p overflowed or underflowed is returned as the one "
        "reduction made it: inf (a clip skipped as for a NaN grad), 0 (a clip to 0.1 of grads of 0.5, p=1000, scales "
        "nothing), 1 for p=1e300",
        file="pgregistry/grad_stats/_reductions.py",
        find="    if not _needs_exact_norm(reduced.norm64, p):\n        return reduced\n",
        replace="    return reduced\n",
        tests=(
            "tests/grad_stats/test_norms_beyond_the_accumulation_range.py::"
            "test_the_norm_is_exact_and_the_clip_scales_by_it[float32-1e10-p4]",
            "tests/grad_stats/test_norms_beyond_the_accumulation_range.py::"
            "test_the_norm_is_exact_and_the_clip_scales_by_it[3-and-4-p1000]",
            "tests/grad_stats/test_norms_beyond_the_accumulation_range.py::"
            "test_the_norm_is_exact_and_the_clip_scales_by_it[half-p1000]",
            "tests/grad_stats/test_norms_beyond_the_accumulation_range.py::"
            "test_the_norm_is_exact_and_the_clip_scales_by_it[3-and-4-p1e300]",
        ),
    ),
    Mutant(
        name="exact-norm-rescues-an-infinite-grad",
        bug="the exact norm's scaled read runs though the largest |g| is infinite: an inf grad's norm comes back NaN",
        file="pgregistry/grad_stats/_reductions.py",
        find="    if not finite:\n        return reduced\n",
        replace="",
        tests=(
            "tests/grad_stats/test_norms_beyond_the_accumulation_range.py::"
            "test_a_nonfinite_grad_keeps_its_verdict_beside_an_overflow[inf-beside-1e10-p4]",
        ),
    ),
    Mutant(
        name="exact-norm-reads-duplicates-unscaled",
        bug="the exact norm's scaled read also reads the grads a rank holds but does not count (a TP duplicate), "
        "unscaled, for a verdict already made: their overflow makes the exact norm inf again (p other than 1, 2, inf)",
        file="pgregistry/grad_stats/_plan.py",
        find="        watch = wanted.p is not None and wanted.divisor is None\n",
        replace="        watch = wanted.p is not None\n",
        tests=(
            "tests/grad_stats/test_norms_beyond_the_accumulation_range.py::"
            "test_the_norm_is_exact_and_the_clip_scales_by_it[float32-1e10-p4]",
            "tests/grad_stats/test_norms_beyond_the_accumulation_range.py::"
            "test_the_norm_is_exact_and_the_clip_scales_by_it[3-and-4-p1000]",
        ),
    ),
    Mutant(
        name="exact-norm-float32-accumulation",
        bug="the 1- and 2-norm of float32/bf16 grads accumulate |g| and g*g in float32 again while the host read "
        "stays skipped: grads of 1e20 (p=2) and 1e38 summed (p=1) give inf, grads of 1e-25 (p=2) give 0",
        file="pgregistry/grad_stats/_reductions.py",
        find="return torch.float64 if makes_norm_float64(dtype) or p in (1.0, 2.0) else torch.float32",
        replace="return torch.float64 if makes_norm_float64(dtype) else torch.float32",
        tests=(
            "tests/grad_stats/test_norms_beyond_the_accumulation_range.py::"
            "test_the_norm_is_exact_and_the_clip_scales_by_it[float32-1e20-p2]",
            "tests/grad_stats/test_norms_beyond_the_accumulation_range.py::"
            "test_the_norm_is_exact_and_the_clip_scales_by_it[bf16-1e20-p2]",
            "tests/grad_stats/test_norms_beyond_the_accumulation_range.py::"
            "test_the_norm_is_exact_and_the_clip_scales_by_it[float32-1e-25-p2]",
            "tests/grad_stats/test_norms_beyond_the_accumulation_range.py::"
            "test_the_norm_is_exact_and_the_clip_scales_by_it[bf16-1e-25-p2]",
            "tests/grad_stats/test_norms_beyond_the_accumulation_range.py::"
            "test_the_norm_is_exact_and_the_clip_scales_by_it[float32-1e38-p1]",
        ),
    ),
    Mutant(
        name="host-float32-sum-kept-when-infinite",
        bug="on the host, the float32 first sum of float32/bf16 grads' 1- or 2-norm is kept though it is infinite "
        "(a square or a row sum beyond float32): grads of 1e20 give an infinite 2-norm, a clip skipped",
        file="pgregistry/grad_stats/_local.py",
        find="    return math.isfinite(value) and value >= numel * FLOAT32_SHARE_FLOOR\n",
        replace="    return value >= numel * FLOAT32_SHARE_FLOOR\n",
        tests=(
            "tests/grad_stats/test_host_float32_first_sum.py::"
            "test_the_host_norm_is_the_float64_norm[one-1e20-in-a-later-block-p2-float32]",
            "tests/grad_stats/test_host_float32_first_sum.py::"
            "test_the_host_norm_is_the_float64_norm[one-1e20-in-a-later-block-p2-bf16]",
            "tests/grad_stats/test_norms_beyond_the_accumulation_range.py::"
            "test_the_norm_is_exact_and_the_clip_scales_by_it[float32-1e20-p2]",
            "tests/grad_stats/test_norms_beyond_the_accumulation_range.py::"
            "test_the_norm_is_exact_and_the_clip_scales_by_it[bf16-1e20-p2]",
            "tests/grad_stats/test_norms_beyond_the_accumulation_range.py::"
            "test_the_norm_is_exact_and_the_clip_scales_by_it[float32-1e38-p1]",
        ),
    ),
    Mutant(
        name="host-float32-sum-kept-when-underflowed",
        bug="on the host, the float32 first sum of float32/bf16 grads' 2-norm is kept though its squares fell below "
        "float32's normal range: grads of 1e-25 give a norm of 0",
        file="pgregistry/grad_stats/_local.py",
        find="    return math.isfinite(value) and value >= numel * FLOAT32_SHARE_FLOOR\n",
        replace="    return math.isfinite(value)\n",
        tests=(
            "tests/grad_stats/test_host_float32_first_sum.py::"
            "test_the_host_norm_is_the_float64_norm[1e-25-p2-float32]",
            "tests/grad_stats/test_host_float32_first_sum.py::"
            "test_the_host_norm_is_the_float64_norm[1e-25-p2-bf16]",
            "tests/grad_stats/test_norms_beyond_the_accumulation_range.py::"
            "test_the_norm_is_exact_and_the_clip_scales_by_it[float32-1e-25-p2]",
            "tests/grad_stats/test_norms_beyond_the_accumulation_range.py::"
            "test_the_norm_is_exact_and_the_clip_scales_by_it[bf16-1e-25-p2]",
        ),
    ),
    Mutant(
        name="exact-norm-float32-kernel-lanes",
        bug="the one-read kernel squares float32/bf16 elements in float32 again (the loaded block cast to float32): "
        "grads of 1e20 give an infinite 2-norm, of 1e-25 a norm of 0, with no host read to catch it",
        file="pgregistry/grad_stats/_triton_kernels.py",
        find=".to(\n            tl.float64\n        )\n        squares += x * x\n",
        replace=".to(\n            tl.float32\n        )\n        squares += x * x\n",
        tests=(
            "tests/grad_stats/test_fused_stats.py::"
            "test_squares_beyond_float32s_range_are_exact_in_the_kernels_float64_lanes",
        ),
    ),
    Mutant(
        name="two-norm-float64-squares-not-ranged",
        bug="a float64 grad's squares are summed as they are, not by range: grads of 1e160 give an infinite 2-norm "
        "(a clip skipped), of 1e-170 a norm of 0",
        file="pgregistry/grad_stats/_reductions.py",
        find="        return self.p == 2.0\n",
        replace="        return False\n",
        tests=(
            "tests/grad_stats/test_norms_beyond_the_accumulation_range.py::"
            "test_the_norm_is_exact_and_the_clip_scales_by_it[float64-1e160-beside-1-p2]",
            "tests/grad_stats/test_norms_beyond_the_accumulation_range.py::"
            "test_the_norm_is_exact_and_the_clip_scales_by_it[float64-squares-overflowing-in-the-sum-over-ranks-only]",
            "tests/grad_stats/test_norms_beyond_the_accumulation_range.py::"
            "test_the_norm_is_exact_and_the_clip_scales_by_it[float64-1e-170-p2]",
            "tests/grad_stats/test_norms_beyond_the_accumulation_range.py::"
            "test_the_norm_is_exact_and_the_clip_scales_by_it[float64-1e160-stage-beside-a-float32-stage-p2]",
        ),
    ),
    Mutant(
        name="one-and-two-norm-read-on-the-host",
        bug="the 1- and 2-norm read the reduced norm on the host again, as every norm did on this branch: a device "
        "sync per clip on CUDA where torch's clip_grad_norm_ has none",
        file="pgregistry/grad_stats/_reductions.py",
        find="return self.p is not None and (self.infinite or self.p in (1.0, 2.0))",
        replace="return self.p is not None and self.infinite",
        tests=(
            "tests/grad_stats/test_norms_beyond_the_accumulation_range.py::"
            "test_the_norm_is_exact_and_the_clip_scales_by_it[float32-1e20-p1]",
            "tests/grad_stats/test_norms_beyond_the_accumulation_range.py::"
            "test_the_norm_is_exact_and_the_clip_scales_by_it[float32-1e-25-p1]",
        ),
    ),
    Mutant(
        name="exact-norm-decided-from-this-ranks-dtypes",
        bug="the 1- and 2-norm's host read skipped where this rank's grads are no wider than float32 and taken "
        "where they are float64 (a decision from each rank's dtypes): a float64 stage beside a float32 one reads "
        "on the host alone, and where its norm is untrusted enters the rescue's all-reduce alone and waits there",
        file="pgregistry/grad_stats/_reductions.py",
        find="    if reread is None or p is None or shares.wanted.exact_in_one_reduction:\n",
        replace="    if reread is None or p is None or (shares.wanted.exact_in_one_reduction and not shares.wide):\n",
        tests=(
            "tests/grad_stats/test_norms_beyond_the_accumulation_range.py::"
            "test_the_norm_is_exact_and_the_clip_scales_by_it[float64-1e160-stage-beside-a-float32-stage-p2]",
        ),
    ),
    Mutant(
        name="inf-norm-verdict-not-reduced-across-replicas",
        bug="the inf-norm's non-finite verdict is not all-reduced over intra_dist_opt: each data-parallel replica "
        "decides alone",
        file="pgregistry/grad_stats/_reductions.py",
        find="    if verdict_groups:\n        seen = _local_nonfinite_flags(rows, device)\n",
        replace="    if verdict_groups and not wanted.infinite:\n        seen = _local_nonfinite_flags(rows, device)\n",
        tests=(
            "tests/grad_stats/test_inf_norm_verdict_across_replicas.py::"
            "test_a_non_finite_grad_on_one_replica_gives_every_replica_the_same_inf_norm_verdict",
        ),
    ),
    Mutant(
        name="max-norm-refused-on-its-rank-alone",
        bug="MultiModuleOptimizer.step raises on the rank given a bad max_norm before the world all-reduce, and the "
        "other ranks wait in it (a string on one rank hung three)",
        file="pgregistry/modules/_optimizer.py",
        find=(
            '        error = combine_faults(bad_p, max_norm_error(max_norm) if max_norm is not None else None)\n'
        ),
        replace=(
            '        error = combine_faults(bad_p, max_norm_error(max_norm) if max_norm is not None else None)\n'
            '        if error is not None:\n'
            '            raise error\n'
        ),
        tests=(
            "tests/modules/test_modules_settings_agreed.py::"
            "test_a_string_or_nan_max_norm_on_one_rank_raises_on_every_rank_naming_it",
        ),
    ),
    Mutant(
        name="module-options-unchecked",
        bug="a per-module optimizer option is not checked on every rank: lr='x' for one module failed in torch on "
        "that module's ranks only, naming no option",
        file="pgregistry/modules/_options.py",
        find="        for option, value in own.items():",
        replace="        for option, value in {}.items():",
        tests=(
            "tests/modules/test_modules_settings_agreed.py::"
            "test_an_option_bad_for_one_module_raises_on_every_rank_of_the_job",
        ),
    ),
    Mutant(
        name="build-check-in-at-the-worlds-timeout",
        bug="a build's check-in waits the world's timeout, not the build's: a rank that never calls it holds the "
        "others for the process group's timeout",
        file="pgregistry/_runtime/attendance.py",
        find="    bound = timeout if timeout is not None else world_timeout()",
        replace="    bound = world_timeout()",
        tests=(
            "tests/core/test_registry_refusals.py::test_a_rank_that_never_calls_build_is_named_within_the_builds_timeout",
        ),
    ),
    Mutant(
        name="roll-call-waits-its-cap",
        bug="the roll call after a failed collective waits its 10 s cap, not the caller's shorter timeout",
        file="pgregistry/_runtime/attendance.py",
        find="min(bound.total_seconds(), _ROLL_CALL_S) + _MARGIN_S",
        replace="_ROLL_CALL_S + _MARGIN_S",
        tests=(
            "tests/core/test_attendance_roll_call.py::"
            "test_the_roll_call_waits_the_callers_timeout_and_hears_a_rank_that_answers_within_it",
        ),
    ),
    Mutant(
        name="roll-call-waits-twice-the-timeout",
        bug="the roll call after a failed collective waits twice the caller's timeout",
        file="pgregistry/_runtime/attendance.py",
        find="min(bound.total_seconds(), _ROLL_CALL_S) + _MARGIN_S",
        replace="2 * min(bound.total_seconds(), _ROLL_CALL_S) + _MARGIN_S",
        tests=(
            "tests/core/test_attendance_roll_call.py::"
            "test_the_roll_call_waits_the_callers_timeout_and_hears_a_rank_that_answers_within_it",
        ),
    ),
    Mutant(
        name="roll-call-waits-the-margin-only",
        bug="the roll call after a failed collective waits its margin only: a rank that fails later, within the "
        "timeout, is named as silent",
        file="pgregistry/_runtime/attendance.py",
        find="min(bound.total_seconds(), _ROLL_CALL_S) + _MARGIN_S",
        replace="_MARGIN_S",
        tests=(
            "tests/core/test_attendance_roll_call.py::"
            "test_the_roll_call_waits_the_callers_timeout_and_hears_a_rank_that_answers_within_it",
        ),
    ),
    Mutant(
        name="build-agreement-unbounded",
        bug="a build's world all-reduces wait the world's timeout, not the build's: a rank killed in a build left "
        "the ranks not connected to it waiting",
        file="pgregistry/_runtime/agreement.py",
        find="    if timeout is None:\n        dist.all_reduce(tensor, op=op)\n        return\n",
        replace="    dist.all_reduce(tensor, op=op)\n    return\n",
        tests=("tests/core/test_registry_refusals.py::test_a_rank_killed_in_a_build_is_named_on_every_other_rank",),
    ),
    Mutant(
        name="import-from-a-lower-layer",
        bug="rank arithmetic (placement) imports the registry, a layer below it in docs/architecture.md's map, for "
        "type checking only: the layering the doc states no longer holds",
        file="pgregistry/placement.py",
        find="if TYPE_CHECKING:\n    from pgregistry.layout import ParallelLayout\n",
        replace="if TYPE_CHECKING:\n    from pgregistry.layout import ParallelLayout\n"
        "    from pgregistry.registry import build\n",
        tests=("tests/core/test_layers.py::test_every_import_goes_to_the_same_or_a_higher_layer_of_the_module_map",),
    ),
    Mutant(
        name="shrink-ignores-expert-replicas",
        bug="a lost rank takes only its dense replica, not the expert replica (EP peers holding other experts)",
        file="pgregistry/layout.py",
        find=(
            'leaving = [\n'
            '            r for r in ranks if coords[r]["dp"] in dense_gone or coords[r]["expt_dp"] in expert_gone\n'
            '        ]'
        ),
        replace='leaving = [r for r in ranks if coords[r]["dp"] in dense_gone]',
        tests=(
            "tests/recovery/test_shrink.py::test_shrink_matches_an_independent_enumeration",
            "tests/recovery/test_shrink.py::test_expert_parallelism_across_replicas_takes_every_replica_it_spans",
            "tests/recovery/test_shrink.py::"
            "test_the_moe_layout_with_expert_tp_1_loses_one_expert_replica_and_the_dense_replicas_it_spans",
        ),
    ),
    Mutant(
        name="step-applied-without-commit",
        bug="commit() runs no collective: a rank whose peers failed mid-step applies the step alone",
        file="pgregistry/recovery.py",
        find="        if group_size(group) > 1:\n            dist.all_reduce(",
        replace="        if False:\n            dist.all_reduce(",
        tests=(
            "tests/recovery/test_recover_gloo.py::"
            "test_a_rank_killed_before_the_grad_sync_lets_no_survivor_step_alone",
        ),
    ),
    Mutant(
        name="optimizer-state-dropped-on-recovery",
        bug="the optimizer rebuilt after a recovery starts from empty state (the momentum lost)",
        file="pgregistry/recovery.py",
        find="    new.load_state_dict(old.state_dict())",
        replace="    del new",
        tests=("tests/recovery/test_recovery_checks.py::test_only_a_replicated_optimizer_carries_over",),
    ),
    Mutant(
        name="survivors-not-confirmed",
        bug="recovery takes the first decision as final: a rank that checked in and then died is still named a "
        "survivor, and the re-formation fails on the others (issue 41)",
        file="pgregistry/_runtime/survivors.py",
        find="        if confirmed == survivors:\n",
        replace="        if True:\n",
        tests=("tests/recovery/test_recover_gloo.py::test_a_survivor_lost_after_its_check_in_is_lost_like_the_first",),
    ),
    Mutant(
        name="store-lost-unnamed",
        bug="recover lets the store's network error through when the store's host died while the survivors agree: "
        "DistNetworkError 'Broken pipe', nothing saying the store was lost or what to do (issue 41)",
        file="pgregistry/recovery.py",
        find="    except dist.DistNetworkError as error:\n        raise StoreLost(",
        replace="    except ZeroDivisionError as error:\n        raise StoreLost(",
        tests=(
            "tests/recovery/test_recover_store_lost.py::"
            "test_the_stores_host_lost_is_named_on_every_survivor_as_not_survivable[agreement]",
        ),
    ),
    Mutant(
        name="store-lost-read-as-a-second-failure",
        bug="a store lost while the world is re-formed is reported as a lost survivor",
        file="pgregistry/recovery.py",
        find="        if not _store_answers(store):\n",
        replace="        if False:\n",
        tests=(
            "tests/recovery/test_recover_store_lost.py::"
            "test_the_stores_host_lost_is_named_on_every_survivor_as_not_survivable[re-formation]",
        ),
    ),
    Mutant(
        name="leaving-ranks-steps-compared",
        bug="recovery compares the committed steps of the ranks leaving with a lost one too: survivors that agree "
        "are refused because a rank that leaves applied another step",
        file="pgregistry/recovery.py",
        find='staying = {r: rec["step"] for r, rec in records.items() if r in shrunk.rank_map}',
        replace='staying = {r: rec["step"] for r, rec in records.items()}',
        tests=("tests/recovery/test_recover_gloo.py::test_only_the_steps_of_the_ranks_that_go_on_are_compared",),
    ),
    Mutant(
        name="committed-step-of-a-leaving-rank",
        bug="recovery resumes from the step the lowest checked-in rank committed, though that rank leaves",
        file="pgregistry/recovery.py",
        find="    return shrunk, next(iter(staying.values()))",
        replace='    return shrunk, records[min(records)]["step"]',
        tests=("tests/recovery/test_recover_gloo.py::test_only_the_steps_of_the_ranks_that_go_on_are_compared",),
    ),
    Mutant(
        name="statistics-read-expert-fields-of-a-dense-model",
        bug="grad_norm and count_zeros read the expert fields of a model without experts from the global grid",
        file="pgregistry/grad_stats/_plan.py",
        find="    return () if experts else EXPERT_STATS_FIELDS\n",
        replace="    return ()\n",
        tests=(
            "tests/megatron/test_megatron_dense_statistics.py::test_a_dense_models_statistics_read_no_expert_field",
        ),
    ),
    Mutant(
        name="migrate-fallback-silent",
        bug="a read pgregistry migrate rewrote falls back to parallel_state without the warning",
        file="pgregistry/migrate/_fallback_helper.py",
        find='_warn_of_fallback(field)\n    accessor, keywords = FALLBACKS[(field, kind)]',
        replace='accessor, keywords = FALLBACKS[(field, kind)]',
        tests=(
            "tests/migrate/test_migrate_world.py::"
            "test_a_rewritten_function_reads_the_groups_it_read_before_with_the_warning",
            "tests/migrate/test_fallback_helper.py::"
            "test_the_helper_reads_the_collections_field_else_exactly_what_the_accessor_returns",
        ),
    ),
    Mutant(
        name="module-fault-raised-alone",
        bug="a module's statistic that refuses its grads raises on that module's ranks only; the others wait",
        file="pgregistry/modules/_stats.py",
        find="agreed in the reduce\n            faults.append(",
        replace="agreed in the reduce\n            raise\n            faults.append(",
        tests=(
            "tests/modules/test_modules_module_fault.py::"
            "test_a_fault_in_one_modules_statistic_raises_on_every_rank_then_good_calls_match_the_oracle",
            "tests/modules/test_modules_module_fault.py::"
            "test_a_fault_in_one_modules_optimizer_statistic_raises_on_every_rank_and_nothing_steps",
        ),
    ),
    Mutant(
        name="chained-load-child-by-child",
        bug="a chained optimizer loads child by child, so a later child's refusal leaves the first ones loaded",
        file="pgregistry/optim/_chained.py",
        find=(

            'refuse_agreed(\n'
            '            "ChainedOptimizer.load_state_dict",\n'
            '            self.state_dict_faults(state_dict),\n'
            '            self.load_groups(),\n'
            '        )\n'
            '        for child, child_state in zip(self.chained_optimizers, state_dict["children"], strict=True):\n'
            '            child._load_checked_state_dict(child_state)'

        ),
        replace=(

            'for child, child_state in zip(self.chained_optimizers, state_dict["children"], strict=True):\n'
            '            child.load_state_dict(child_state)'

        ),
        tests=tuple(
            f"tests/optim/test_optim_load_state_dict.py::test_a_refused_load_changes_nothing[chained-{case}]"
            for case in ("extra", "float64", "reshaped", "short")
        ),
    ),
    Mutant(
        name="partial-collection-field-read-as-none",
        bug="a rewritten read takes None for a field a partial Megatron-Core collection was not built with",
        file="pgregistry/migrate/_fallback_helper.py",
        find="        return True, object.__getattribute__(collection, field)",
        replace="        return True, getattr(collection, field)",
        tests=(
            "tests/migrate/test_fallback_helper.py::"
            "test_the_helper_reads_the_collections_field_else_exactly_what_the_accessor_returns",
        ),
    ),
    Mutant(
        name="amax-choice-ignored",
        bug="migrate reads the data-parallel amax group where tp_only_amax_red= picks the tensor-parallel one",
        file="pgregistry/migrate/_plan.py",
        find="read.when, read.when_field = cst.Module([]).code_for_node(flag), tp_only.field",
        replace="read.when, read.when_field = cst.Module([]).code_for_node(flag), choice.field",
        tests=(
            "tests/migrate/test_migrate_world.py::"
            "test_a_rewritten_function_reads_the_groups_it_read_before_with_the_warning",
        ),
    ),
    Mutant(
        name="migrate-instantiation-passes-nothing",
        bug="migrate threads a class's __init__ but its instantiations pass no collection (VocabParallelEmbedding, "
            "issue 40's run of the Megatron-Core tests under -W error)",
        file="pgregistry/migrate/_engine.py",
        find="classes = {key: value for first in firsts for key, value in first.classes.items()}",
        replace="classes = {}",
        tests=(
            "tests/migrate/test_migrate_instantiation.py::"
            "test_instantiations_of_a_threaded_class_pass_the_collection_in_scope",
            "tests/migrate/test_migrate_instantiation.py::test_the_collection_given_at_the_top_reaches_the_class_read",
        ),
    ),
    Mutant(
        name="migrate-instantiation-unguarded",
        bug="migrate passes the collection to a class whose __new__, decorator or metaclass may not take it",
        file="pgregistry/migrate/_plan.py",
        find=(
            'or syntax.decorator_list\n'
            '                or syntax.keywords\n'
            '                or any('
        ),
        replace='or False\n                and any(',
        tests=("tests/migrate/test_migrate_instantiation.py::test_calls_the_rule_leaves_alone",),
    ),
    Mutant(
        name="migrate-spec-field-passes-nothing",
        bug="migrate passes no collection to a module built from a spec's field (Attention.__init__'s "
            "submodules.linear_proj(...): RowParallelLinear's gtp_remat read falls back under a caller holding one, "
            "issue 40's run of the Megatron-Core tests under -W error)",
        file="pgregistry/migrate/_engine.py",
        find=(
            "spec_fields = decide_spec_fields(\n"
            "            index, contents, threaded, name, add_reexported_names(subclasses.classes, packages)\n"
            "        )"
        ),
        replace="spec_fields = SpecFields()",
        tests=(
            "tests/migrate/test_migrate_spec_fields.py::"
            "test_a_field_holding_only_threaded_classes_is_passed_the_collection",
            "tests/migrate/test_migrate_spec_fields.py::test_the_collection_given_reaches_the_class_a_spec_names",
            "tests/migrate/test_migrate_differential.py::test_the_migrated_function_behaves_as_the_original["
            "spec-built:spec_built.layers.projection_groups[class-in-the-field]-b]",
            "tests/migrate/test_migrate_differential.py::test_the_migrated_function_behaves_as_the_original["
            "spec-built:spec_built.layers.projection_groups[ModuleSpec]-d]",
        ),
    ),
    Mutant(
        name="migrate-spec-field-unchecked",
        bug="migrate passes the collection to a spec's field that may hold a class without the parameter, or one "
            "giving it a meaning of its own (TypeError, or a partial collection where it built its own)",
        file="pgregistry/migrate/_spec_fields.py",
        find="        if threaded.get(key) == self.keyword:\n            return None\n        label",
        replace="        if True:\n            return None\n        label",
        tests=(
            "tests/migrate/test_migrate_spec_fields.py::test_a_field_that_may_hold_another_class_is_left_and_reported",
        ),
    ),
    Mutant(
        name="migrate-subclass-inheriting-init-passes-nothing",
        bug="migrate passes no collection to a subclass that inherits a threaded __init__ unchanged",
        file="pgregistry/migrate/_facts.py",
        find=(
            'return bool(node.bases) and not (\n'
            '        node.decorator_list or node.keywords or own & {"__init__", "__new__"}\n'
            '    )'
        ),
        replace='return False',
        tests=(
            "tests/migrate/test_migrate_instantiation.py::"
            "test_instantiations_of_a_threaded_class_pass_the_collection_in_scope",
            "tests/migrate/test_migrate_instantiation.py::test_the_collection_given_at_the_top_reaches_the_class_read",
        ),
    ),
    Mutant(
        name="migrate-subclass-any-base",
        bug="migrate passes the collection to a subclass whose own __init__, or an earlier base's, may not take it",
        file="pgregistry/migrate/_facts.py",
        find=(
            'return bool(node.bases) and not (\n'
            '        node.decorator_list or node.keywords or own & {"__init__", "__new__"}'
        ),
        replace=(
            'return (\n'
            '        bool(node.bases)\n'
            '        and not (node.decorator_list or node.keywords or own & {"__new__"})\n'
            '        or False'
        ),
        tests=(
            "tests/migrate/test_migrate_forwarding.py::"
            "test_an_init_forwarding_to_a_threaded_base_takes_the_collection_and_passes_it_on",
            "tests/migrate/test_migrate_forwarding.py::test_inits_the_forwarding_rule_leaves_alone",
        ),
    ),
    Mutant(
        name="migrate-subclass-last-base",
        bug="migrate takes a subclass's last base for the one whose __init__ it runs (the first's runs)",
        file="pgregistry/migrate/_facts.py",
        find="base = attribute_chain(node.bases[0]) if node.bases else None",
        replace="base = attribute_chain(node.bases[-1]) if node.bases else None",
        tests=("tests/migrate/test_migrate_instantiation.py::test_calls_the_rule_leaves_alone",),
    ),
    Mutant(
        name="migrate-forwarding-init-passes-nothing",
        bug="migrate gives a subclass's __init__ that forwards to a threaded base's through super().__init__ the "
            "parameter but passes it nothing (TELMHeadColumnParallelLinear: TEColumnParallelLinear's gtp_remat read "
            "falls back under GPTModel holding a collection, issue 40's run of the Megatron-Core tests under -W error)",
        file="pgregistry/migrate/_plan.py",
        find="        return name if (module, qualname) in forwarding else None",
        replace="        return None",
        tests=(
            "tests/migrate/test_migrate_forwarding.py::"
            "test_an_init_forwarding_to_a_threaded_base_takes_the_collection_and_passes_it_on",
            "tests/migrate/test_migrate_forwarding.py::test_the_collection_given_reaches_the_base_read",
            "tests/migrate/test_migrate_differential.py::test_the_migrated_function_behaves_as_the_original["
            "local-class:local_class.layers.output_layer_group[forwarding-head]-b]",
            "tests/migrate/test_migrate_differential.py::test_the_migrated_function_behaves_as_the_original["
            "local-class:local_class.layers.output_layer_group[forwarding-head]-d]",
        ),
    ),
    Mutant(
        name="migrate-forwarding-init-through-kwargs",
        bug="migrate threads an __init__ whose super().__init__ passes **kwargs (the call is left, so the "
            "collection given stops there)",
        file="pgregistry/migrate/_facts.py",
        find="        and all(k.arg is not None for c in calls if isinstance(c, ast.Call) for k in c.keywords)\n",
        replace="",
        tests=("tests/migrate/test_migrate_forwarding.py::test_inits_the_forwarding_rule_leaves_alone",),
    ),
    Mutant(
        name="migrate-local-classes-passes-nothing",
        bug="migrate passes no collection to a call of a local assigned classes (GPTModel.__init__'s "
            "output_layer_cls(...): ColumnParallelLinear's gtp_remat read falls back under a caller holding one, "
            "issue 40's run of the Megatron-Core tests under -W error)",
        file="pgregistry/migrate/_engine.py",
        find="                instruction.spec_fields.local_classes,\n",
        replace="                {},\n",
        tests=(
            "tests/migrate/test_migrate_forwarding.py::"
            "test_a_local_holding_only_classes_taking_the_keyword_is_passed_the_collection",
            "tests/migrate/test_migrate_forwarding.py::test_the_collection_given_reaches_the_base_read",
            "tests/migrate/test_migrate_differential.py::test_the_migrated_function_behaves_as_the_original["
            "local-class:local_class.layers.output_layer_group[column]-b]",
            "tests/migrate/test_migrate_differential.py::test_the_migrated_function_behaves_as_the_original["
            "local-class:local_class.layers.output_layer_group[forwarding-head]-d]",
        ),
    ),
    Mutant(
        name="migrate-local-classes-unchecked",
        bug="migrate passes the collection to a call of a local that may hold a class without the parameter "
            "(TypeError)",
        file="pgregistry/migrate/_spec_fields.py",
        find=(
            "        reason = _refusal_reason(tree, values, threaded_classes)\n"
            "        if not reason:\n"
            "            local_classes"
        ),
        replace="        reason = \"\"\n        if not reason:\n            local_classes",
        tests=("tests/migrate/test_migrate_forwarding.py::test_a_local_that_may_hold_another_class_is_left_and_reported",),
    ),
    Mutant(
        name="migrate-local-rebound-otherwise",
        bug="migrate reads a local's plain assignments as all its values though a loop (or with, unpacking, ...) "
            "binds it too",
        file="pgregistry/migrate/_spec_fields.py",
        find="    return {name for name, count in plain.items() if stored.get(name) == count} - other",
        replace="    return set(plain)",
        tests=("tests/migrate/test_migrate_forwarding.py::test_a_local_that_may_hold_another_class_is_left_and_reported",),
    ),
    Mutant(
        name="builder-reads-what-it-fills",
        bug="migrate rewrites a hand-written builder's reads into the fields of the collection it is filling",
        file="pgregistry/migrate/_plan.py",
        find="read.way, read.collection = Way.BUILDER, function.shim_name",
        replace="read.way, read.collection = Way.BUILDER, name",
        tests=(
            "tests/migrate/test_migrate_world.py::"
            "test_a_rewritten_function_reads_the_groups_it_read_before_with_the_warning",
            "tests/migrate/test_migrate_rewrites.py::"
            "test_a_function_that_builds_the_collection_from_the_globals_reads_one_shim_of_its_class",
        ),
    ),
    Mutant(
        name="migrate-argument-left-too-long",
        bug="migrate leaves an argument it made too long in a call of one argument a line over the line length",
        file="pgregistry/migrate/_rewrite.py",
        find="        updated = split_arguments(updated, original, indent, self.width, self.unit)\n",
        replace="",
        tests=(
            "tests/migrate/test_migrate_layout.py::test_a_conditional_argument_made_too_long_in_a_call_of_one_"
            "argument_a_line_is_split_as_black_splits_it",
            "tests/migrate/test_migrate_layout.py::"
            "test_a_call_argument_made_too_long_in_a_call_of_one_argument_a_line_gets_its_own_lines",
        ),
    ),
    Mutant(
        name="migrate-reformats-the-authors-arguments",
        bug="migrate splits an argument the author wrote too long, a change to a line it did not rewrite",
        file="pgregistry/migrate/_layout.py",
        find="            continue  # the author's own long line",
        replace="            pass  # the author's own long line",
        tests=(
            "tests/migrate/test_migrate_layout.py::test_a_conditional_argument_made_too_long_in_a_call_of_one_"
            "argument_a_line_is_split_as_black_splits_it",
        ),
    ),
    Mutant(
        name="skeleton-hides-callers",
        bug="migrate's skeleton stands in for the definitions that call a threaded function, so they never pass it",
        file="pgregistry/migrate/_skeleton.py",
        find="return bool((calls is not None and calls.search(text)) or (member and name.search(text)))",
        replace="return bool(member and name.search(text))",
        tests=("tests/migrate/test_migrate_skeleton.py::test_the_skeletons_rewrite_is_the_whole_files",),
    ),
    Mutant(
        name="skeleton-placeholders-counted-as-code",
        bug="migrate counts a touched class's names without its stood-in members, and drops an import they use",
        file="pgregistry/migrate/_rewrite.py",
        find=(
            'new.update(\n'
            '                    _count_reads_in_code(_restore_skeleton_text(plan, render.statement(statement)))\n'
            '                )'
        ),
        replace='new.update(_count_reads_in_code(render.statement(statement)))',
        tests=("tests/migrate/test_migrate_skeleton.py::test_the_skeletons_rewrite_is_the_whole_files",),
    ),
    Mutant(
        name="split-run-knows-one-share",
        bug="migrate split across processes tells each worker only the first worker's threaded functions",
        file="pgregistry/migrate/_engine.py",
        find="threaded.update({key: value for first in firsts for key, value in first.threaded.items()})",
        replace="threaded.update(firsts[0].threaded)",
        tests=("tests/migrate/test_migrate_skeleton.py::test_a_run_split_across_processes_is_the_run_in_one",),
    ),
    Mutant(
        name="unused-import-by-ascii-text",
        bug="migrate drops an import still read in an untouched function that spells it with a normalised letter",
        file="pgregistry/migrate/_rewrite.py",
        find="if word.search(text) or not text.isascii()]",
        replace="if word.search(text)]",
        tests=("tests/migrate/test_migrate_rewrites.py::"
               "test_an_import_the_rewrite_stops_reading_stays_while_another_function_reads_it",),
    ),
    Mutant(
        name="split-run-loses-a-dead-childs-files",
        bug="migrate split across processes forgets the files a child took to look through before it died",
        file="pgregistry/migrate/_engine.py",
        find="    if missed:  # taken by a child that failed after taking them: looked through here",
        replace="    if False:  # taken by a child that failed after taking them: looked through here",
        tests=("tests/migrate/test_migrate_skeleton.py::test_a_run_split_across_processes_is_the_run_in_one",),
    ),
    Mutant(
        name="split-run-loses-a-dead-childs-facts",
        bug="migrate split across processes forgets the facts of the files without reads a child took before it "
        "died: the functions only they hold are not threaded upward",
        file="pgregistry/migrate/_engine.py",
        find="path: facts[path] if path in facts else _file_facts(path, data, name)",
        replace="path: facts.get(path)",
        tests=("tests/migrate/test_migrate_skeleton.py::"
               "test_the_facts_of_files_a_dead_child_took_are_read_between_the_phases",),
    ),
    Mutant(
        name="migrate-second-phase-keeps-a-stale-skeleton",
        bug="migrate's second phase keeps the first phase's plan of a file though a definition its skeleton stood "
        "in for calls a function threaded upward, a spec's field or a forwarding __init__: that call passes nothing",
        file="pgregistry/migrate/_engine.py",
        find="if calls is None or not any(calls.search(text) for text in self.stood_in[path]):",
        replace="if True:",
        tests=("tests/migrate/test_migrate_upward.py::test_the_upward_closure_does_not_depend_on_skeletons_or_the_split",
               "tests/migrate/test_migrate_spec_fields.py::"
               "test_a_field_holding_only_threaded_classes_is_passed_the_collection"),
    ),
    Mutant(
        name="phases-child-holds-the-parents-end",
        bug="a forked worker (the scan's, migrate's) keeps the parent's end of its own pipe: SIGKILL the parent and "
        "the worker waits forever",
        file="pgregistry/_source/processes.py",
        find="parent_ends = [here_end, *(child.connection for child in started if not child.reaped)]",
        replace="parent_ends = [*(child.connection for child in started if not child.reaped)]",
        tests=("tests/migrate/test_phases.py::test_a_child_exits_when_the_process_running_the_phases_is_killed",),
    ),
    Mutant(
        name="migrate-field-table-of-one-release",
        bug="migrate writes 0.19's dp_cp_gtp_remat for code whose Megatron-Core predates GTP remat (dp_cp there)",
        file="pgregistry/_source/fields.py",
        find=(
            'if (\n'
            '        gtp_remat\n'
            '        and axis in _GTP_REMAT_AXES\n'
            '        and kind in _GTP_REMAT_KINDS\n'
            '        and flags.get("with_gtp_remat", True)\n'
            '    ):'
        ),
        replace='if axis in _GTP_REMAT_AXES and kind in _GTP_REMAT_KINDS and flags.get("with_gtp_remat", True):',
        tests=("tests/migrate/test_migrate_megatron_release.py::test_a_data_parallel_read_is_the_field_of_the_codes_release",
               "tests/migrate/test_migrate_megatron_release.py::"
               "test_migrate_rewrites_with_the_table_of_the_projects_megatron_core"),
    ),
    # One rank's load refused, every rank unchanged (issue 41): a load agrees before anything is copied.
    Mutant(
        name="optimizer-load-skips-the-agreement",
        bug="an optimizer's load_state_dict / load_param_state refuses on the faulty rank alone; its replicas load",
        file="pgregistry/optim/_state_check.py",
        find="partial(_peers_refusal, subject), groups)\n",
        replace="partial(_peers_refusal, subject), [])\n",
        tests=tuple(
            f"tests/experts/test_one_rank_load_refused_every_rank_unchanged.py::{test}[{load}]"
            for test in ("test_one_rank_refused_means_every_rank_refused_and_unchanged",
                         "test_every_rank_names_the_rank_with_the_fault")
            for load in ("load_state_dict", "load_param_state")
        ),
    ),
    Mutant(
        name="load-by-name-skips-the-agreement",
        bug="a checkpoint's optimizer state is loaded without agreeing first that it fits every rank's optimizer",
        file="pgregistry/checkpoint/_by_name.py",
        find="    by_param = run_agreed_step(check_state_pieces, elsewhere, scope)\n",
        replace="    by_param = check_state_pieces()\n",
        tests=tuple(
            "tests/experts/test_one_rank_load_refused_every_rank_unchanged.py::"
            f"test_one_rank_refused_means_every_rank_refused_and_unchanged[{load}]"
            for load in ("load_optimizer_state_by_name", "load_rank_files", "load_distributed")
        ),
    ),
    Mutant(
        name="migrate-reexport-alias-ignored",
        bug="migrate takes `from .common import f as g` in a package for a re-export of f under f, so the calls of "
        "g never pass the collection (issue 41, item 9)",
        file="pgregistry/migrate/_plan.py",
        find=(
            'imports += [\n'
            '                    (package, a.asname or a.name, module, a.name)\n'
            '                    for a in node.names\n'
            '                    if a.name != "*"\n'
            '                ]'
        ),
        replace='imports += [(package, a.name, module, a.name) for a in node.names if a.name != "*"]',
        tests=("tests/migrate/test_migrate_reexports.py::"
               "test_a_call_of_a_function_re_exported_under_another_name_passes_the_collection",),
    ),
    Mutant(
        name="migrate-write-checks-the-first-file-only",
        bug="migrate --write checks only the first file for a change on disk at write time: a file edited while "
        "the others were written is overwritten (issue 41, item 10)",
        file="pgregistry/migrate/_writing.py",
        find="        problem = _why_changed_on_disk(change)\n        try:",
        replace=(
            '        problem = _why_changed_on_disk(change) if not renamed else None\n'
            '        try:'
        ),
        tests=("tests/migrate/test_migrate_writing.py::"
               "test_a_file_changed_on_disk_while_the_others_are_written_is_not_overwritten_and_none_is_left_written",),
    ),
    Mutant(
        name="migrate-self-chain-in-every-method",
        bug="migrate takes a self.<a>.<b> chain one class assigns as in scope in the methods of every class: "
        "Bridge 0.6.2's self.dataset.pg_collection read with getattr in 21 unrelated files (issue 40)",
        file="pgregistry/migrate/_plan.py",
        find="return frozenset(chain for chain in chains if facts.ties_class(chain, cls))",
        replace="return chains",
        tests=("tests/migrate/test_migrate_threading.py::"
               "test_a_chain_of_self_is_in_scope_only_in_the_classes_the_tree_ties_it_to",
               "tests/migrate/test_migrate_threading.py::"
               "test_an_attribute_another_file_assigns_is_in_scope_only_where_a_class_declares_it"),
    ),
    Mutant(
        name="migrate-helper-argument-read-twice",
        bug="migrate rewrites get_tensor_model_parallel_group_if_none(self.tp_group, is_expert=self.is_expert) as "
        "'self.tp_group if self.tp_group is not None else ...': the group read twice, the flag only where it is None",
        file="pgregistry/migrate/_idioms.py",
        find="parameters = self._lambda_parameter_names(read, forwarded) if _read_once(read) else None",
        replace="parameters = None",
        tests=("tests/migrate/test_migrate_side_by_side.py::"
               "test_a_fallback_helpers_argument_and_flag_are_read_once_and_in_order",
               "tests/migrate/test_migrate_rewrites.py::test_existing_fallbacks_go_through_the_warning_lazily"),
    ),
    Mutant(
        name="migrate-drops-an-evaluated-keyword",
        bug="migrate rewrites is_pipeline_first_stage(ignore_virtual=True, vp_stage=self.vp_stage) without "
        "vp_stage=: the property the call read is no longer read",
        file="pgregistry/migrate/_plan.py",
        find="            reason = _expression_left_unread(read)\n",
        replace="            reason = None\n",
        tests=("tests/migrate/test_migrate_side_by_side.py::"
               "test_a_keyword_the_rewrite_would_drop_is_still_evaluated",
               "tests/migrate/test_migrate_rewrites.py::"
               "test_a_keyword_expression_a_target_would_not_evaluate_leaves_the_read"),
    ),
    Mutant(
        name="migrate-pgregistry-drops-check-initialized",
        bug="migrate --target pgregistry rewrites get_tensor_model_parallel_group(check_initialized=self.checked) "
        "without the keyword: the property the call read is no longer read",
        file="pgregistry/migrate/_plan.py",
        find="passed_on = () if read.site.family == HELPER else read.choice.forwarded",
        replace='passed_on = () if read.site.family == HELPER else (*read.choice.forwarded, "check_initialized")',
        tests=("tests/migrate/test_migrate_rewrites.py::"
               "test_a_keyword_expression_a_target_would_not_evaluate_leaves_the_read",),
    ),
    Mutant(
        name="migrate-shim-fallback-checked",
        bug="migrate dissolves a use_mpu_process_groups shim into reads that fall back to the checked getter, which "
        "asserts where the shim gave None (parallel_state not initialised; Megatron-LM #6234's gtp_remat shims)",
        file="pgregistry/migrate/_shims.py",
        find="keywords[name] = {CHECK: passed[CHECK]} if CHECK in passed else {}",
        replace="keywords[name] = {}",
        tests=("tests/migrate/test_fallback_helper.py::"
               "test_without_torch_distributed_a_dissolved_shims_reads_are_the_shims_fields",
               "tests/migrate/test_migrate_rewrites.py::"
               "test_a_shim_read_only_for_its_fields_becomes_the_reads_of_those_fields"),
    ),
    Mutant(
        name="migrate-shim-keyword-dropped",
        bug="migrate's dissolved shim reads do not pass the shim's check_initialized=False to the fallback: "
        "finalize_model_grads' gtp_remat all-reduce asserts without torch.distributed",
        file="pgregistry/migrate/_idioms.py",
        find=(
            'forwarded = (\n'
            '            "".join(f", {k}={v!r}" for k, v in keywords.items()) if self.megatron_fallback else ""\n'
            '        )'
        ),
        replace='forwarded = ""',
        tests=("tests/migrate/test_migrate_differential.py::test_the_migrated_function_behaves_as_the_original["
               "megatron-core:megatron.core.distributed.finalize_model_grads."
               "_allreduce_replicated_grads_over_gtp_remat_group[use_mpu_process_groups-shim]-e]",),
    ),
    Mutant(
        name="migrate-shim-escaping-dissolved",
        bug="migrate dissolves a use_mpu_process_groups shim whose collection is passed on or returned: the "
        "callee gets the name of a local the rewrite removed",
        file="pgregistry/migrate/_shims.py",
        find="if node.value == self.local and id(node) not in self.not_uses:",
        replace="if False:",
        tests=("tests/migrate/test_migrate_rewrites.py::test_a_shim_whose_collection_escapes_stays_with_its_reason"
               "[returned]",
               "tests/migrate/test_migrate_rewrites.py::test_a_shim_whose_collection_escapes_stays_with_its_reason"
               "[passed-on]"),
    ),
    Mutant(
        name="migrate-no-upward-threading",
        bug="migrate threads only the functions that read: a read-less caller (MegatronOptimizer.get_grad_norm "
        "above param_is_not_gtp_duplicate) gets no parameter, so no caller above can pass one (issue 40)",
        file="pgregistry/migrate/_engine.py",
        find="upward = thread_upward(\n"
        "            index,\n            contents,\n            {**threaded, **methods},\n            packages,\n"
        "            name,\n            tree_facts.dropping,\n            tree_facts.passed_the_keyword,\n        )",
        replace="upward = Upward()",
        tests=("tests/migrate/test_migrate_upward.py::test_read_less_callers_are_threaded_up_to_the_top",
               "tests/migrate/test_migrate_upward.py::test_a_collection_passed_at_the_top_reaches_the_read",
               "tests/migrate/test_migrate_upward.py::"
               "test_the_upward_closure_does_not_depend_on_skeletons_or_the_split"),
    ),
    Mutant(
        name="migrate-upward-method-not-alike",
        bug="migrate threads a method upward though another def of its name in the tree is not threaded: a "
        "polymorphic call would pass an override the keyword it lacks (issue 40)",
        file="pgregistry/migrate/_upward.py",
        find='if short in of_methods and short not in other_keyword and count == counts.get(short)',
        replace='if short in of_methods and short not in other_keyword',
        tests=("tests/migrate/test_migrate_upward.py::test_read_less_callers_are_threaded_up_to_the_top",),
    ),
    Mutant(
        name="migrate-upward-drops-the-held-collection",
        bug="a method threaded upward only so that every method of its name takes the collection passes its "
        "parameter (None unless given) where its class holds self.pg_collection, which it passed before (issue 40)",
        file="pgregistry/migrate/_plan.py",
        find=(
            'found = (\n'
            '                _collection_in_scope(caller, call.statement, plan.attributes, name)\n'
            '                if caller.upward\n'
            '                else None\n'
            '            )'
        ),
        replace='found = None',
        tests=("tests/migrate/test_migrate_upward.py::test_read_less_callers_are_threaded_up_to_the_top",
               "tests/migrate/test_migrate_upward.py::test_a_collection_passed_at_the_top_reaches_the_read"),
    ),
    Mutant(
        name="migrate-journal-state-guessed",
        bug="an interrupted --write's journal in a state the tool never writes read as 'renaming': a temporary "
        "file it lists replaces the user's file (issue 40: nothing the user wrote is lost)",
        file="pgregistry/migrate/_writing.py",
        find='state, rows = JournalState(record["state"]), record["files"]',
        replace='state, rows = (JournalState.WRITING if record["state"] == "writing" else JournalState.RENAMING), '
        'record["files"]',
        tests=("tests/migrate/test_migrate_writing.py::"
               "test_a_journal_in_a_state_this_tool_never_writes_is_refused_and_nothing_is_renamed",),
    ),
    Mutant(
        name="migrate-virtual-stage-ignored-with-a-collection",
        bug="the fallback helper, given a collection, answers is_pipeline_first/last_stage(ignore_virtual=False, "
        "vp_stage=...) from the collection's pp alone: every virtual stage of the first pipeline stage builds one "
        "layer less (Megatron-LM #3962's get_num_layers_to_build)",
        file="pgregistry/migrate/_fallback_helper.py",
        find='        if not virtual_stage_allows(kind, accessor_keywords.get("vp_stage")):',
        replace="        if False:",
        tests=("tests/migrate/test_migrate_differential.py::test_the_migrated_function_behaves_as_the_original["
               "virtual-stages:virtual_stages.layers.layers_to_build[interleaved]-b]",
               "tests/migrate/test_migrate_differential.py::test_the_migrated_function_behaves_as_the_original["
               "virtual-stages:virtual_stages.layers.layers_to_build[interleaved]-d]",
               "tests/migrate/test_migrate_differential.py::test_the_migrated_function_behaves_as_the_original["
               "virtual-stages:virtual_stages.layers.mtp_num_layers_to_build-b]",
               "tests/migrate/test_migrate_virtual_stages.py::"
               "test_given_a_collection_the_virtual_part_is_the_accessors"),
    ),
    Mutant(
        name="migrate-virtual-keywords-not-passed-on",
        bug="migrate rewrites is_pipeline_first/last_stage(ignore_virtual=False, vp_stage=...) without passing "
        "the two keywords to the fallback helper: with no collection it asks the pipeline stage alone",
        file="pgregistry/migrate/_idioms.py",
        find="if a.keyword is not None and a.keyword.value in (*_FORWARDED, *choice.forwarded)",
        replace="if a.keyword is not None and a.keyword.value in _FORWARDED",
        tests=("tests/migrate/test_migrate_differential.py::test_the_migrated_function_behaves_as_the_original["
               "virtual-stages:virtual_stages.layers.layers_to_build[interleaved]-a]",
               "tests/migrate/test_migrate_differential.py::test_the_migrated_function_behaves_as_the_original["
               "virtual-stages:virtual_stages.layers.layers_to_build[without-vp-stage]-a]",
               "tests/migrate/test_migrate_differential.py::test_the_migrated_function_behaves_as_the_original["
               "virtual-stages:virtual_stages.layers.mtp_on_this_rank-a]",
               "tests/migrate/test_migrate_virtual_stages.py::"
               "test_the_stage_of_the_collections_pp_with_the_virtual_keywords_passed_on"),
    ),
    Mutant(
        name="migrate-gloo-reason-vague",
        bug="migrate leaves a gloo group's read saying only that no field says what the accessor reads, not that "
        "no collection holds gloo groups (Megatron-LM #3349, #3962: get_megatron_optimizer)",
        file="pgregistry/_source/fields.py",
        find="if match is None and _GLOO.fullmatch(accessor):",
        replace="if False:",
        tests=("tests/migrate/test_migrate_gloo_groups.py::test_a_gloo_groups_read_stays_with_the_reason",),
    ),
    Mutant(
        name="migrate-virtual-stage-any-release",
        bug="migrate rewrites ignore_virtual=False stage reads on a Megatron-LM of 2025-04-29 to 2025-05-20, whose "
        "accessors take the virtual stage from the global virtual pipeline rank, not vp_stage=",
        file="pgregistry/migrate/_virtual_stages.py",
        find="return all(defined.get(name) == dump for name, dump in _WANTED.items())",
        replace="return True",
        tests=("tests/migrate/test_migrate_virtual_stages.py::test_the_release_form_is_checked_on_the_trees_parallel_state",
               "tests/migrate/test_migrate_virtual_stages.py::test_the_tool_reads_the_form_of_the_trees_own_release"),
    ),
    Mutant(
        name="migrate-journal-trusted-whatever-it-lists",
        bug="migrate finishes any journal found at the project root: rolling back, it removes every file a row "
        "lists as a temporary one, anywhere on disk, in any mode",
        file="pgregistry/migrate/_writing.py",
        find="files = [_journal_row(row, root) for row in rows]",
        replace='files = [(Path(r["target"]), Path(r["temporary"]), r["old"], r["new"]) for r in rows]',
        tests=("tests/migrate/test_migrate_writing.py::"
               "test_a_journal_listing_files_this_tool_never_writes_is_refused_and_nothing_is_removed",),
    ),
    Mutant(
        name="migrate-drops-the-last-line-ending",
        bug="migrate keeps libcst's render of a file it reads without a final newline: a CR-only file, or one "
        "ending in a comment that ends with a backslash, loses its last line ending outside any rewrite",
        file="pgregistry/migrate/_rewrite.py",
        find="return module.code + self.dropped_ending",
        replace="return module.code",
        tests=("tests/migrate/test_migrate_files.py::test_the_last_line_ending_is_kept_whatever_the_line_endings",),
    ),
    Mutant(
        name="migrate-drops-a-guarded-import",
        bug="migrate drops an import of parallel_state in a try (or with) the rewrite left unused: the handler's "
        "flag (HAVE_MCORE = False) says Megatron-Core is there where it is not",
        file="pgregistry/migrate/_rewrite.py",
        find=" or self.guards and binds_any(original, self.unused)",
        replace="",
        tests=("tests/migrate/test_migrate_side_by_side.py::test_an_import_in_a_try_whose_handler_sets_a_flag_stays",),
    ),
    Mutant(
        name="migrate-drops-an-import-that-fails-without-megatron",
        bug="migrate drops an unguarded import of Megatron-Core the rewrite left unused: without Megatron-Core the "
        "module imports (the helper's own import of parallel_state is guarded), and a function that imported it "
        "inside returns where it raised ModuleNotFoundError",
        file="pgregistry/migrate/_rewrite.py",
        find="if id(original) in self.kept_for_error or self.guards",
        replace="if self.guards",
        tests=(
            "tests/migrate/test_migrate_side_by_side.py::"
            "test_an_import_that_fails_without_megatron_core_still_fails_where_it_did",
        ),
    ),
    Mutant(
        name="migrate-takes-any-import-for-one-failing-alike",
        bug="migrate drops an import of Megatron-Core the rewrite left unused after any import that stays (import "
        "os): without Megatron-Core the module imports where it failed",
        file="pgregistry/migrate/_import_errors.py",
        find="    return kept == package or kept.startswith(package + \".\")\n",
        replace="    return True\n",
        tests=(
            "tests/migrate/test_migrate_side_by_side.py::"
            "test_an_import_that_fails_without_megatron_core_still_fails_where_it_did",
        ),
    ),
    Mutant(
        name="migrate-takes-the-keyword-out-of-kwargs",
        bug="migrate gives def build(**kwargs) the keyword-only pg_collection though a call of the tree passes "
        "pg_collection= into its kwargs: the parameter takes it out of them",
        file="pgregistry/migrate/_plan.py",
        find="if function.node.params.star_kwarg is not None and called_as in facts.passed_the_keyword:",
        replace="if False:",
        tests=(
            "tests/migrate/test_migrate_side_by_side.py::"
            "test_a_function_taking_kwargs_that_a_caller_passes_the_keyword_gets_no_parameter",
        ),
    ),
    Mutant(
        name="migrate-threads-upward-into-kwargs",
        bug="migrate threads upward a read-less def f(**kwargs) whose callers pass pg_collection= into its "
        "kwargs: the new parameter takes it out of them",
        file="pgregistry/migrate/_upward.py",
        find="        or (definition.takes_keywords and name in passed_the_keyword)\n",
        replace="",
        tests=(
            "tests/migrate/test_migrate_side_by_side.py::"
            "test_a_function_taking_kwargs_that_a_caller_passes_the_keyword_gets_no_parameter",
        ),
    ),
    Mutant(
        name="migrate-forwards-the-keyword-out-of-kwargs",
        bug="migrate makes a subclass __init__(self, x, **kwargs) forward pg_collection to its base though the "
        "tree instantiates it passing pg_collection= into its kwargs",
        file="pgregistry/migrate/_inherited.py",
        find="cls.takes_keywords and cls.name in passed_the_keyword",
        replace="False",
        tests=(
            "tests/migrate/test_migrate_side_by_side.py::"
            "test_a_function_taking_kwargs_that_a_caller_passes_the_keyword_gets_no_parameter",
        ),
    ),
    Mutant(
        name="migrate-trusts-a-collection-attribute-set-later",
        bug="migrate reads self.pg_collection as set in every method where __init__ sets it only in a branch, "
        "a setup method sets it, or __init__ calls a method first: AttributeError where the global state was read",
        file="pgregistry/migrate/_plan.py",
        find='if any(not a.method or a.method == "__init__" and a.early for a in assigned):',
        replace="if True:",
        tests=(
            "tests/migrate/test_migrate_side_by_side.py::"
            "test_a_collection_attribute_that_may_not_be_set_yet_is_read_with_getattr",
        ),
    ),
    Mutant(
        name="migrate-trusts-a-collection-attribute-set-in-a-block",
        bug="migrate takes self.pg_collection assigned in a branch of __init__ for set below it: AttributeError "
        "where the branch did not run",
        file="pgregistry/migrate/_plan.py",
        find="index = self.statement[-1] if self._at_the_top_of(function) else -1",
        replace="index = self.statement[-1] if len(self.statement) == 2 else -1",
        tests=(
            "tests/migrate/test_migrate_side_by_side.py::"
            "test_a_collection_attribute_that_may_not_be_set_yet_is_read_with_getattr",
        ),
    ),
    Mutant(
        name="migrate-trusts-a-collection-attribute-set-after-a-method-call",
        bug="migrate takes self.pg_collection set by __init__ after it calls self.build() for set in build, which "
        "then raises AttributeError",
        file="pgregistry/migrate/_plan.py",
        find="early = index >= 0 and function.method_of.name.value not in self.late",
        replace="early = index >= 0",
        tests=(
            "tests/migrate/test_migrate_side_by_side.py::"
            "test_a_collection_attribute_that_may_not_be_set_yet_is_read_with_getattr",
        ),
    ),
    Mutant(
        name="migrate-threads-a-function-calling-vars",
        bug="migrate gives a function that calls vars() or dir() without arguments the collection's parameter: "
        "what they return (its locals) holds it too",
        file="pgregistry/migrate/_plan.py",
        find="            function.names.add(CALLS_LOCALS)  # reads the frame's locals, as locals() does\n",
        replace="            pass\n",
        tests=(
            "tests/migrate/test_migrate_side_by_side.py::test_a_function_calling_vars_or_dir_alone_gets_no_parameter",
        ),
    ),
    Mutant(
        name="migrate-threads-upward-a-function-calling-vars",
        bug="migrate threads upward a function that calls vars() without arguments: what it returns holds the "
        "new parameter",
        file="pgregistry/migrate/_facts.py",
        find='        or function.id in ("vars", "dir")\n        and not call.args\n        and not call.keywords\n',
        replace="",
        tests=(
            "tests/migrate/test_migrate_side_by_side.py::test_a_function_calling_vars_or_dir_alone_gets_no_parameter",
        ),
    ),
    Mutant(
        name="migrate-reads-the-codes-own-group-for-the-global",
        bug="migrate rewrites get_tensor_model_parallel_group() below pgc = ProcessGroupCollection(tp=tp_group) "
        "into a read of pgc: it answers the code's tp_group where the original read the global group",
        file="pgregistry/migrate/_plan.py",
        find='    if not given or not (uses & given or "*" in given):\n',
        replace="    if True:\n",
        tests=(
            "tests/migrate/test_migrate_side_by_side.py::"
            "test_a_read_through_a_local_collection_given_the_codes_own_group_stays",
        ),
    ),
    Mutant(
        name="migrate-takes-a-getters-group-for-the-codes-own",
        bug="migrate leaves a read through pg_collection = ProcessGroupCollection(tp=get_..._group()) as if tp "
        "were the code's own group: a read it could rewrite stays",
        file="pgregistry/migrate/_plan.py",
        find='            and _callee_last_name(argument.value).startswith("get_")\n',
        replace="            and False\n",
        tests=(
            "tests/migrate/test_migrate_side_by_side.py::"
            "test_a_read_through_a_local_collection_given_the_codes_own_group_stays",
        ),
    ),
    Mutant(
        name="migrate-leaves-a-guarded-unused-import-unmarked",
        bug="migrate keeps an import in a try that the rewrite left unused without # noqa: F401: ruff --select F "
        "finds it unused (NeMo 3.0.0: four new findings)",
        file="pgregistry/migrate/_rewrite.py",
        find="return with_noqa_marker(original)  # kept though unused: linters are told",
        replace="return original if self.guards else with_noqa_marker(original)",
        tests=("tests/migrate/test_migrate_side_by_side.py::test_an_import_in_a_try_whose_handler_sets_a_flag_stays",),
    ),
    Mutant(
        name="migrate-kept-import-noqa-misses-f401",
        bug="migrate keeps an import for its error whose line says # noqa: E402 without adding F401: ruff --select F "
        "finds it unused",
        file="pgregistry/migrate/_import_errors.py",
        find='    if codes is not None and "F401" not in codes.group().upper():\n',
        replace="    if False:\n",
        tests=(
            "tests/migrate/test_migrate_side_by_side.py::"
            "test_an_import_that_fails_without_megatron_core_still_fails_where_it_did",
        ),
    ),
    Mutant(
        name="migrate-drops-a-reexported-import",
        bug="migrate drops an import the rewrite left unused that another module imports from this one (from "
        "m import get_x, m.get_x, import *, __all__): that module's import fails",
        file="pgregistry/migrate/_rewrite.py",
        find='if name not in reached and ("*" not in reached or name.startswith("_"))',
        replace="if True",
        tests=(
            "tests/migrate/test_migrate_side_by_side.py::"
            "test_a_name_another_module_imports_from_a_rewritten_one_stays",
        ),
    ),
    Mutant(
        name="migrate-threads-a-function-calling-locals",
        bug="migrate gives a function that calls locals() the collection's parameter: what locals() returns (a "
        "config captured from the arguments) holds it too",
        file="pgregistry/migrate/_plan.py",
        find="    if CALLS_LOCALS in function.names:\n        return LOCALS_REASON\n",
        replace="",
        tests=("tests/migrate/test_migrate_side_by_side.py::test_a_function_that_calls_locals_gets_no_parameter",),
    ),
    Mutant(
        name="migrate-helper-name-shadowed",
        bug="migrate calls the fallback helper by its own name in a file that binds that name (a local pg_size, a "
        "def pg_rank, an imported pg_group): the rewritten read calls the file's, or the file's calls the helper",
        file="pgregistry/migrate/_rewrite.py",
        find="    rewriter = _Rewriter(plan, replace(target, aliases=aliases) if aliases else target, width)",
        replace="    rewriter = _Rewriter(plan, target, width)",
        tests=(
            "tests/migrate/test_migrate_side_by_side.py::"
            "test_a_file_that_binds_a_helpers_name_calls_the_helper_by_another",
        ),
    ),
    Mutant(
        name="migrate-threads-through-a-fixed-wrapper",
        bug="migrate gives the parameter to a function whose decorator's wrapper takes no **kwargs (def "
        "wrapper(x)): every caller holding a collection passes pg_collection= and gets a TypeError",
        file="pgregistry/migrate/_plan.py",
        find="    decorated = _matching_decorator(function.node, tuple(facts.dropping))",
        replace="    decorated = None",
        tests=(
            "tests/migrate/test_migrate_side_by_side.py::"
            "test_a_function_whose_decorator_takes_no_keywords_is_not_passed_one",
        ),
    ),
    Mutant(
        name="migrate-threads-a-name-bound-twice",
        bug="migrate gives the parameter to one def of a name the module binds twice (if HAVE_TE: def f ... else: "
        "def f; f = wrap(f)): callers pass pg_collection= to the other, a TypeError (get_fp8_context without TE)",
        file="pgregistry/migrate/_plan.py",
        find="    if owner in rebound:",
        replace="    if False:",
        tests=(
            "tests/migrate/test_migrate_side_by_side.py::test_a_name_bound_twice_at_module_level_is_not_passed_one",
        ),
    ),
    Mutant(
        name="migrate-reads-a-collection-bound-in-a-block",
        bug="migrate counts a pg_collection bound inside a block of the function (if flag: pg_collection = "
        "build()) as bound above the statements after it: a read there raises UnboundLocalError where the "
        "block did not run, where the original read the global state",
        file="pgregistry/migrate/_plan.py",
        find="        return len(self.statement) == 2 and isinstance(",
        replace="        return len(self.statement) == 2 or isinstance(",
        tests=(
            "tests/migrate/test_migrate_side_by_side.py::"
            "test_a_local_collection_assigned_in_a_block_is_not_read_where_the_block_did_not_run",
        ),
    ),
    Mutant(
        name="allowlist-link-replaced-by-a-copy",
        bug="allowlist update renames the new list over a symbolic link: the link becomes a copy, the file it "
        "named keeps the old list; a link out of the project is written through",
        file="pgregistry/_source/storage.py",
        find="    if path.is_symlink():\n        target = Path(os.path.realpath(path))",
        replace="    if False:\n        target = Path(os.path.realpath(path))",
        tests=(
            "tests/allowlist/test_allowlist_reliability.py::"
            "test_an_allowlist_that_is_a_link_stays_a_link_and_its_file_is_updated",
            "tests/allowlist/test_allowlist_reliability.py::"
            "test_an_allowlist_that_is_a_link_out_of_the_project_is_refused_and_nothing_is_written",
        ),
    ),
    Mutant(
        name="allowlist-key-twice-keeps-the-last",
        bug="a file's entries listed twice in the allowlist (a merge) are read as the last block: a partial "
        "update drops the first block's entries",
        file="pgregistry/allowlist/_ratchet.py",
        find="json.loads(text, object_pairs_hook=_object_of_distinct_keys)",
        replace="json.loads(text)",
        tests=("tests/allowlist/test_allowlist_reliability.py::"
               "test_a_path_listed_twice_is_refused_naming_it_and_no_entry_is_dropped",),
    ),
    Mutant(
        name="fifo-read-blocking",
        bug="a file the tools read (a source, the allowlist, migrate's journal) is opened blocking: a FIFO there "
        "waits for a writer forever",
        file="pgregistry/_source/files.py",
        find='handle = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))',
        replace="handle = os.open(path, os.O_RDONLY)",
        tests=(
            "tests/allowlist/test_allowlist_reliability.py::test_a_fifo_that_replaces_a_file_after_discovery_does_not_block",
            "tests/allowlist/test_allowlist_reliability.py::"
            "test_a_fifo_in_place_of_the_allowlist_or_megatrons_list_is_named_not_waited_on",
            "tests/migrate/test_migrate_cli.py::test_a_fifo_that_replaces_a_file_after_discovery_does_not_block",
        ),
    ),
    Mutant(
        name="unlistable-directory-passed-over",
        bug="a directory the walk cannot list is passed over silently: check judges the tree without its "
        "files, a full update drops their entries",
        file="pgregistry/_source/files.py",
        find="os.walk(target, onerror=_refuse_unlisted)",
        replace="os.walk(target)",
        tests=("tests/allowlist/test_allowlist_reliability.py::"
               "test_a_directory_that_cannot_be_listed_is_named_not_skipped",),
    ),
    Mutant(
        name="frozen-parameter-stepped",
        bug="a parameter with requires_grad=False given to a flat optimizer is stepped with the rest of its buffer: "
        "AdamW's weight decay moves it, where torch's optimizers skip it (no grad)",
        file="pgregistry/optim/_base.py",
        find="            if not param.requires_grad:\n",
        replace="            if False:\n",
        tests=("tests/optim/test_optim_hostile_inputs.py::test_a_frozen_parameter_is_refused_naming_it_not_decayed",),
    ),
    Mutant(
        name="float64-rounded-by-float32-main-copies",
        bug="float32 main copies of a float64 parameter: the optimizer rounds the model's value to float32",
        file="pgregistry/optim/_base.py",
        find="            if torch.promote_types(param.dtype, main_dtype) != main_dtype:\n",
        replace="            if False:\n",
        tests=("tests/optim/test_optim_hostile_inputs.py::"
               "test_float64_parameters_under_float32_main_copies_are_refused_not_rounded",),
    ),
    Mutant(
        name="nan-or-inf-learning-rate-accepted",
        bug="an optimizer's numbers checked as torch's SGD checks them (lr < 0 refused): an lr, weight decay or "
        "momentum of NaN, or an infinite one, turns every parameter into NaN at the first step",
        file="pgregistry/optim/_options.py",
        find="if number >= 0 and math.isfinite(number)",
        replace="if not number < 0",
        tests=tuple(
            f"tests/optim/test_optim_hostile_inputs.py::test_a_bad_option_is_refused_naming_it_before_anything_is_built"
            f"[{case}]"
            for case in ("lr-nan", "lr-inf", "weight-decay-nan", "momentum-nan")
        ),
    ),
    Mutant(
        name="chained-child-counted-twice",
        bug="a ChainedOptimizer given one child twice: its grads counted twice in the norm (sqrt(2) times the "
        "model's) and stepped twice",
        file="pgregistry/optim/_chained.py",
        find="            if again:\n",
        replace="            if False:\n",
        tests=("tests/optim/test_optim_hostile_inputs.py::"
               "test_a_child_chained_twice_or_a_parameter_in_two_children_is_refused_not_counted_twice",),
    ),
    Mutant(
        name="saved-param-group-loaded-unchecked",
        bug="a flat step loads a saved param group as it is: a NaN lr makes every parameter NaN at the next step, "
        "another rule's group (Adam's into an SGD) drives the rule",
        file="pgregistry/optim/_flat_step.py",
        find="        group_faults = self._param_group_faults(groups[0])\n",
        replace="        group_faults: list[str] = []\n",
        tests=tuple(
            "tests/optim/test_optim_hostile_inputs.py::"
            f"test_a_saved_param_group_or_step_out_of_range_is_refused_leaving_the_optimizer_unchanged[{case}]"
            for case in ("lr-nan", "lr-missing", "betas-str")
        ) + ("tests/optim/test_optim_hostile_inputs.py::"
             "test_state_saved_by_another_update_rule_is_refused_naming_what_it_lacks",),
    ),
    Mutant(
        name="dcp-save-overwrites-a-checkpoint",
        bug="save_distributed into a directory holding a checkpoint overwrites it (torch.distributed.checkpoint "
        "does): the earlier checkpoint lost, or half-replaced by a save that fails",
        file="pgregistry/checkpoint/_directory.py",
        find="    if (directory / DCP_METADATA).exists():\n",
        replace="    if False:\n",
        tests=("tests/experts/test_checkpoint_hostile_inputs.py::"
               "test_a_second_save_into_a_checkpoint_or_a_save_into_a_file_is_refused_on_every_rank",),
    ),
    Mutant(
        name="node-of-unchecked",
        bug="node_of divides whatever it is given: node -2 for 8 GPUs per node given as -8, node 1.0 for rank 3.5",
        file="pgregistry/placement.py",
        find='    return non_negative_int(rank, "rank") // positive_int(gpus_per_node, "gpus_per_node")',
        replace="    return rank // gpus_per_node",
        tests=("tests/placement/test_placement_arguments.py::"
               "test_node_of_refuses_what_is_no_rank_or_node_size_instead_of_answering_a_node",),
    ),
    Mutant(
        name="audit-non-finite-spread",
        bug="the replication audit measures a NaN or an infinity by its spread (NaN): identical non-finite grads on "
        "every replica listed as a mismatch, 'are the grads synchronised yet?'",
        file="pgregistry/audit.py",
        find="            values, codes = _finite_and_codes(flat)\n",
        replace="            values, codes = flat, torch.zeros_like(flat)\n",
        tests=("tests/grad_stats/test_audit_non_finite_grads.py::"
               "test_identical_non_finite_grads_are_replicated_and_differing_ones_are_not",),
    ),
    Mutant(
        name="check-config-of-a-dict-agrees",
        bug="check_config given a dict (no size attributes) checks nothing: a config of TP 4 agrees with groups of "
        "one rank",
        file="pgregistry/interop/megatron.py",
        find="    if not any(hasattr(config, attribute) for attribute, *_ in _SIZES):\n",
        replace="    if False:\n",
        tests=("tests/megatron/test_megatron_arguments.py::"
               "test_a_config_without_sizes_or_a_collection_of_neither_package_is_refused",),
    ),
    Mutant(
        name="optimizer-options-not-agreed",
        bug="build_optimizer takes each rank's options as given: replicas given different learning rates step "
        "alike grads into different parameters, and ranks given different 'sharded' wait for each other",
        file="pgregistry/optim/_options.py",
        find="    if values[0] != -values[1]:",
        replace="    if False:",
        tests=("tests/optim/test_optim_hostile_inputs.py::"
               "test_options_that_differ_across_the_ranks_of_one_optimizer_are_refused_on_every_rank",),
    ),
    Mutant(
        name="replicas-of-other-parameters-summed",
        bug="data-parallel replicas holding other parameters (a parameter frozen on one rank, a model built "
        "otherwise) build their optimizers, and their grad buffers, padded alike, are all-reduced as if alike",
        file="pgregistry/optim/_options.py",
        find="        values[2 + index] = max(values[2 + index], int(top != -negated_bottom))\n",
        replace="",
        tests=("tests/optim/test_optim_hostile_inputs.py::"
               "test_replicas_holding_other_parameters_are_refused_on_every_rank",),
    ),
    Mutant(
        name="factory-lr-ignored",
        bug="build_optimizer given a factory and lr=3e-4 steps with the factory's own lr (AdamW's 1e-3), and "
        "momentum given for Adam is dropped, without a word",
        file="pgregistry/optim/_options.py",
        find="    if not ignored:\n        return\n",
        replace="    return\n",
        tests=("tests/optim/test_optim_hostile_inputs.py::"
               "test_an_option_the_rule_does_not_read_is_refused_not_ignored",),
    ),
    Mutant(
        name="grads-read-as-parameters",
        bug="grad_norm given the grads (as Megatron-Core's get_grad_norm_fp32 takes them) reads each grad's own "
        ".grad, None: a norm of 0, a zero count of 0, a clip of nothing, without a word",
        file="pgregistry/grad_stats/_functional.py",
        find="    _refuse_tensors_without_grads(source, owner)\n",
        replace="",
        tests=("tests/grad_stats/test_grads_given_as_parameters.py::"
               "test_grads_or_a_state_dict_given_as_parameters_are_refused_on_every_rank_naming_them",),
    ),
    Mutant(
        name="tensor-in-two-modules-counted-twice",
        bug="a layer shared by two colocated modules is counted in both modules' norms (sqrt(10) for sqrt(6)) and "
        "clipped once per module, by the square of the coefficient",
        file="pgregistry/modules/_stats.py",
        find="    error = _tensor_in_two_modules(checked)\n",
        replace="    error = None\n",
        tests=("tests/modules/test_modules_tensor_in_two_modules.py::"
               "test_a_tensor_in_two_modules_models_is_refused_on_every_rank_naming_it",),
    ),
    Mutant(
        name="modules-clip-replanned",
        bug="the job-wide clip collects the grads again and plans their scaling anew each call "
        "(clip_grads_) instead of scaling through the pieces each module's kept plan read",
        file="pgregistry/modules/_stats.py",
        find="    for read in reads:\n        read.clip_(clipping)\n",
        replace="    clip_grads_([piece for read in reads for piece in read.pieces], max_norm, total)\n",
        tests=("tests/modules/test_modules_kept_plans.py::"
               "test_a_steady_state_job_wide_statistic_walks_no_model_and_a_changed_model_is_replanned",),
    ),
    Mutant(
        name="grad-in-two-modules-clipped-twice",
        bug="two parameters, one in each of two colocated modules' models, holding one grad tensor: the job-wide "
        "clip scales it once per module (by the square of the coefficient), without a word",
        file="pgregistry/modules/_stats.py",
        find="    if clipping and fault is None:\n",
        replace="    if False:\n",
        tests=("tests/modules/test_modules_tensor_in_two_modules.py::"
               "test_a_tensor_in_two_modules_models_is_refused_on_every_rank_naming_it",),
    ),
    Mutant(
        name="data-parallel-random-init-read-by-truth",
        bug="seed_plan(layout, seed, data_parallel_random_init='no') reads the string as true: seeds with the "
        "data-parallel offsets, which a job seeded without them never draws",
        file="pgregistry/rng.py",
        find="    require_layout(layout)\n    require_flag(data_parallel_random_init, \"data_parallel_random_init\")\n"
        "    sizes = layout.axis_sizes()\n    first = layout.rank_range()[0]\n",
        replace="    require_layout(layout)\n    sizes = layout.axis_sizes()\n    first = layout.rank_range()[0]\n",
        tests=("tests/rng/test_rng_hostile_inputs.py::"
               "test_a_data_parallel_random_init_that_is_no_bool_is_refused_not_read_as_true[seed_plan-1]",
               "tests/rng/test_rng_hostile_inputs.py::"
               "test_a_data_parallel_random_init_that_is_no_bool_is_refused_not_read_as_true[check_seed_plan-1]"),
    ),
    Mutant(
        name="replicas-seeded-apart-by-a-truthy-flag",
        bug="model_parallel_manual_seed(seed, pg, data_parallel_random_init='no') seeds each data-parallel replica "
        "with its own offset: replicas initialised apart",
        file="pgregistry/rng.py",
        find="    require_flag(data_parallel_random_init, \"data_parallel_random_init\")\n    fields = seed_fields(",
        replace="    fields = seed_fields(",
        tests=("tests/rng/test_rng_hostile_inputs.py::test_a_data_parallel_random_init_that_is_no_bool_is_refused_"
               "not_read_as_true[model_parallel_manual_seed-1]",),
    ),
    Mutant(
        name="tracker-seeds-of-a-rank-outside-the-group",
        bug="tracker_seeds(seed, tp_rank=-1) (torch's rank of a process outside a group) answers rank 0's "
        "model-parallel seed minus one",
        file="pgregistry/rng.py",
        find="    rank = {name: non_negative_int(value, name) for name, value in ranks.items()}\n",
        replace="    rank = dict(ranks)\n",
        tests=("tests/rng/test_rng_hostile_inputs.py::test_tracker_seeds_refuses_a_rank_or_size_that_is_none"
               "[tp_rank=-1]",),
    ),
    Mutant(
        name="expert-keys-strict-read-by-truth",
        bug="globalize_expert_keys(..., strict=None) renames a partial state dict as strict=False does: 16 experts "
        "given for a model of 8 name rank 1's experts 8-11, without a word",
        file="pgregistry/experts/_keys.py",
        find="    strict = require_flag(strict, \"strict\")\n    renamed = _rename_expert_keys(\n",
        replace="    renamed = _rename_expert_keys(\n",
        tests=("tests/experts/test_experts_keys.py::test_a_strict_that_is_no_bool_is_refused_not_read_by_its_truth"
               "[None]",),
    ),
    Mutant(
        name="one-global-name-for-two-parameters",
        bug="named_global_parameters of chunks given the same layer offset names two parameters alike: an "
        "optimizer's state keyed by global_param_name_fn holds one of them under both",
        file="pgregistry/experts/_names.py",
        find="            if name in holders:\n"
        "                raise _one_name_twice(name, holders[name], (index, local_name))\n",
        replace="",
        tests=("tests/experts/test_experts_names.py::test_two_parameters_given_one_global_name_are_refused_naming_both",),
    ),
    Mutant(
        name="one-experts-name-of-a-wrong-num-experts",
        bug="get_global_unique_param_name with num_experts=16 for a model of 8 at EP 2 names rank 1's local expert 0 "
        "as 8 (4 is right), where named_global_parameters refuses",
        file="pgregistry/experts/_names.py",
        find="                return namer.name_with_its_family(index, local_name)\n",
        replace="                return namer.name(index, local_name)\n",
        tests=("tests/experts/test_experts_names.py::"
               "test_one_experts_name_refuses_a_num_experts_its_chunk_does_not_hold",),
    ),
    Mutant(
        name="meta-grads-read-as-values",
        bug="grad_norm of a model built under torch.device('meta') and never materialised answers a meta tensor "
        "with no value, and clip_grad_norm_ clips nothing, without a word",
        file="pgregistry/grad_stats/_plan.py",
        find="            if grad.is_meta:  # checked once per layout, so a steady-state call pays nothing\n"
        "                raise meta_tensor_error(f\"the grad of {self.names[index]!r}\")\n",
        replace="",
        tests=("tests/grad_stats/test_meta_and_repeated_grads.py::"
               "test_meta_grads_are_refused_on_every_rank_naming_the_parameter_and_the_fix",),
    ),
    Mutant(
        name="meta-grads-in-lists-read-as-values",
        bug="norm_of_grads, zeros_of_grads and clip_grads_ of meta grads answer a meta tensor with no value and "
        "scale nothing, without a word",
        file="pgregistry/grad_stats/_lists.py",
        find="        if not any(device.type == \"meta\" for kinds_of_list in kinds for device, _ in kinds_of_list):\n",
        replace="        if True:\n",
        tests=("tests/grad_stats/test_meta_and_repeated_grads.py::"
               "test_meta_grads_are_refused_on_every_rank_naming_the_parameter_and_the_fix",),
    ),
    Mutant(
        name="tensor-given-twice-scaled-twice",
        bug="clip_grads_ given one tensor twice scales it by the square of the coefficient (0.01 for 0.1 at a norm "
        "of 10), and norm_of_grads counts it twice",
        file="pgregistry/grad_stats/_lists.py",
        find="len(set(map(id, chain.from_iterable(grads)))) == sum(map(len, grads))",
        replace="True",
        tests=("tests/grad_stats/test_meta_and_repeated_grads.py::"
               "test_a_tensor_given_twice_is_refused_not_counted_or_scaled_twice",),
    ),
    Mutant(
        name="grad-shared-by-two-parameters-counted-twice",
        bug="grad_norm of two parameters whose .grad is one tensor (set by hand) counts it twice (20 for the 14.1 "
        "of the distinct grads) and clip_grad_norm_ scales it twice",
        file="pgregistry/grad_stats/_plan.py",
        find="first_holder.setdefault(id(grad), index)) != index:",
        replace="first_holder.setdefault(id(grad), index)) < 0:",
        tests=("tests/grad_stats/test_meta_and_repeated_grads.py::"
               "test_two_parameters_sharing_one_grad_tensor_are_refused_not_counted_twice",),
    ),
    Mutant(
        name="optimizer-of-meta-parameters",
        bug="an optimizer built over a model never materialised from torch.device('meta') has meta flat buffers: "
        "its norm is a meta tensor with no value and its step updates nothing, without a word",
        file="pgregistry/optim/_base.py",
        find="        if devices == {torch.device(\"meta\")}:",
        replace="        if False:",
        tests=("tests/optim/test_optim_hostile_inputs.py::"
               "test_parameters_on_the_meta_device_are_refused_on_every_rank_not_stepped_as_nothing",),
    ),
    Mutant(
        name="optimizer-read-after-a-later-one-took-its-grads",
        bug="a second optimizer built over the same parameters takes their grads into its buffer, and the first "
        "one's norm reads 0.0 (2.83 is right) and its step moves nothing, without a word",
        file="pgregistry/optim/_base.py",
        find="        earlier._give_up_grad_home(param)\n",
        replace="        pass\n",
        tests=("tests/optim/test_optim_hostile_inputs.py::"
               "test_an_optimizer_whose_parameters_a_later_one_took_is_refused_not_read_as_zero_grads",),
    ),
    Mutant(
        name="composite-group-checked-by-size-alone",
        bug="a collection assembled by hand with the dp group as mp (the size TP x PP gives, other ranks) is taken: "
        "the norm sums the data-parallel replicas and misses the TP peer (7.07 and 16.97 for 13)",
        file="pgregistry/collection.py",
        find="        if group is not None:\n            _check_axes_inside(",
        replace="        if False:\n            _check_axes_inside(",
        tests=("tests/core/test_collection_checks.py::"
               "test_a_composite_group_of_the_right_size_but_other_ranks_is_refused_instead_of_a_wrong_norm",),
    ),
    Mutant(
        name="parameters-tied-by-storage-untied",
        bug="two Parameter objects over one tensor (a tie by storage) are copied each to its own place of the flat "
        "buffer: untied without a word, each stepped by its own grad (0.5 and 0.0 where torch's SGD gives -0.5)",
        file="pgregistry/optim/_base.py",
        find="        _refuse_shared_memory(self.params, self.param_name)\n",
        replace="",
        tests=("tests/optim/test_optim_hostile_inputs.py::test_parameters_tied_by_storage_are_refused_not_untied",),
    ),
    Mutant(
        name="grads-overlapping-in-memory-counted-twice",
        bug="grads that are views of one buffer sharing an element (offsets off by one) are read as distinct: a norm "
        "of sqrt(41) for the buffer's 5, the shared element counted twice and scaled twice by a clip",
        file="pgregistry/grad_stats/_plan.py",
        find="        overlap = first_overlap([grads[index] for index in plain])\n        if overlap is not None:",
        replace="        overlap = first_overlap([grads[index] for index in plain])\n        if False:",
        tests=("tests/grad_stats/test_meta_and_repeated_grads.py::"
               "test_grads_overlapping_in_memory_are_refused_not_counted_twice",),
    ),
    Mutant(
        name="one-state-dict-name-for-two-parameters",
        bug="a param_name_fn giving two parameters one name is taken: the state dict, keyed by it, saves the second "
        "one's main copy and state for both and loads it into both",
        file="pgregistry/optim/_base.py",
        find="        if param_name_fn is not None:\n            _refuse_one_name_for_two(",
        replace="        if False:\n            _refuse_one_name_for_two(",
        tests=("tests/optim/test_optim_hostile_inputs.py::"
               "test_a_param_name_fn_giving_two_parameters_one_name_is_refused_not_saved_as_one",),
    ),
    Mutant(
        name="grads-detached-by-model-zero-grad-read-as-zeros",
        bug="the statistics read the flat buffer after model.zero_grad() detached every grad from it: without a "
        "sync_grads (one replica) a norm of 0.0 for 2.83, every step",
        file="pgregistry/optim/_base.py",
        find="naming the parameter.\n        \"\"\"\n        self._check_attached(first_only=True)",
        replace="naming the parameter.\n        \"\"\"\n        self._check_not_taken_over()",
        tests=("tests/optim/test_optim_hostile_inputs.py::"
               "test_grads_model_zero_grad_detached_are_refused_by_the_statistics_and_step_not_read_as_zeros",),
    ),
    Mutant(
        name="grad-assigned-by-hand-to-a-bf16-parameter-left-out",
        bug="a .grad assigned by hand to a bf16 parameter of a mixed-precision optimizer, which its grad hook never "
        "sees, left out of the norm and the step: a norm of 0.0 for 1.41, nothing stepped",
        file="pgregistry/optim/_base.py",
        find="            if param.grad is not None:  # the hook takes every grad backward accumulates",
        replace="            if False:",
        tests=("tests/optim/test_optim_hostile_inputs.py::"
               "test_a_grad_assigned_by_hand_to_a_bf16_parameter_is_refused_not_left_out",),
    ),
    Mutant(
        name="experts-stacked-in-one-tensor-saved-as-one-ranks",
        bug="experts stacked in one parameter (no expert index in the name) checkpointed at EP 2: EP rank 0's "
        "experts kept under the one name, loaded into EP rank 1 too, its own lost",
        file="pgregistry/checkpoint/_by_name.py",
        find='_refuse_experts_named_alike_on_every_ep_rank(params, group_size(collection.get("ep")), owner)',
        replace="_refuse_experts_named_alike_on_every_ep_rank(params, 1, owner)",
        tests=("tests/experts/test_checkpoint_hostile_inputs.py::"
               "test_experts_stacked_in_one_tensor_are_refused_at_ep_above_one_not_saved_as_one_ranks",),
    ),
    Mutant(
        name="tp-pieces-of-other-shapes-gathered",
        bug="a TP-sharded parameter cut 3 and 2 over TP 2 reaches the all-gather joining its pieces: gloo aborts "
        "the process (SIGABRT) in every save",
        file="pgregistry/checkpoint/_by_name.py",
        find="    if model.tp_groups:  # alike on every rank: the layout's sizes",
        replace="    if False:",
        tests=("tests/experts/test_checkpoint_hostile_inputs.py::"
               "test_tp_pieces_of_other_shapes_are_refused_on_every_rank_not_an_abort",),
    ),
    Mutant(
        name="fully-shard-dtensors-checkpointed-as-one-ranks-shard",
        bug="fully_shard's DTensor parameters checkpointed as they are: data-parallel rank 0's shard stored as the "
        "parameter, and the same sharded model loaded other than saved, without a word",
        file="pgregistry/checkpoint/_by_name.py",
        find="    _refuse_dtensors(params, owner)\n",
        replace="",
        tests=("tests/experts/test_checkpoint_hostile_inputs.py::"
               "test_dtensor_parameters_of_fully_shard_are_refused_not_stored_as_one_ranks_shard",),
    ),
    Mutant(
        name="registration-hook-reads-through-getattr",
        bug="the module-registration hook reads the expert mark with getattr: torch.compile's OptimizedModule, "
        "half-built, raises KeyError: '_orig_mod', and no model compiles once pgregistry is imported",
        file="pgregistry/params.py",
        find="    return vars(module).get(_INSIDE_EXPERT_MODULE, False) is True",
        replace="    return getattr(module, _INSIDE_EXPERT_MODULE, False) is True",
        tests=("tests/grad_stats/test_compiled_modules.py::"
               "test_a_compiled_model_builds_keeps_its_roles_and_gives_the_oracles_norm",),
    ),
    Mutant(
        name="commit-over-one-optimizer-instance",
        bug="commit all-reduces over intra_dist_opt alone, one instance of a partial distributed optimizer: with a "
        "rank of the other instance failed, this instance passes it and steps alone",
        file="pgregistry/recovery.py",
        find="    for group in [intra, *inter] if group_size(intra) < span else [intra]:",
        replace="    for group in [intra]:",
        tests=("tests/recovery/test_recovery_checks.py::"
               "test_commit_spans_every_optimizer_instance_so_no_rank_steps_alone",),
    ),
    Mutant(
        name="attachment-lost-by-torch-compile",
        bug="the wrapper chain stops at torch.compile's OptimizedModule (or checkpoint_wrapper): a TP model attached "
        "and then compiled falls back to the global grid, its norm this rank's shard's alone (2.0 for 2.83)",
        file="pgregistry/attachments.py",
        find="        wrapped = next((children[slot] for slot in _WRAPPED_SLOTS if slot in children), None)",
        replace="        wrapped = None",
        tests=("tests/grad_stats/test_compiled_modules.py::"
               "test_a_model_attached_then_compiled_runs_on_its_collection_not_the_global_grid",),
    ),
    Mutant(
        name="clip-argument-refused-before-the-reduction",
        bug="a max_norm or norm_type refused on one rank only raises there before any collective: its peers wait in "
        "the norm's all-reduce until the group's timeout (docs/reliability.md, hostile inputs, fifth round)",
        file="pgregistry/grad_stats/_functional.py",
        find="    try:\n        checked = _check_params_and_plan(params, pg_collection, owner)\n",
        replace="    if given is not None and given.refusal is not None:\n        raise given.refusal\n"
        "    try:\n        checked = _check_params_and_plan(params, pg_collection, owner)\n",
        tests=("tests/grad_stats/test_clip_arguments_agree_across_ranks.py::"
               "test_a_max_norm_refused_on_one_rank_raises_on_every_rank_and_scales_nothing[2.0-stages]",
               "tests/grad_stats/test_clip_arguments_agree_across_ranks.py::"
               "test_a_norm_type_refused_on_one_rank_of_a_norm_leaves_no_peer_waiting[stages]"),
    ),
    Mutant(
        name="clip-arguments-left-out-of-the-verdict",
        bug="ranks given different max_norm values clip by different coefficients, their replicas drifting apart "
        "(docs/reliability.md, hostile inputs, fifth round): every rank carries the same arguments in the verdict",
        file="pgregistry/grad_stats/_arguments.py",
        find="        return agreement_columns(max_norm, self.p, flag, self.statistic, summed, device)\n",
        replace="        return agreement_columns(1.0, 2.0, flag, self.statistic, summed, device)\n",
        tests=("tests/grad_stats/test_clip_arguments_agree_across_ranks.py::"
               "test_different_max_norms_raise_on_every_rank_and_scale_nothing",
               "tests/grad_stats/test_clip_arguments_agree_across_ranks.py::"
               "test_the_reduction_makes_the_norm_nan_on_every_rank_where_the_arguments_differ"),
    ),
    Mutant(
        name="summed-clip-arguments-tested-by-divisibility",
        bug="the summed form's test asks only whether each byte's sum is a multiple of the ranks: two ranks one bit "
        "apart agree, each scaling by its own coefficient",
        file="pgregistry/grad_stats/_arguments.py",
        find="        return squares * self.ranks != sums * sums\n",
        replace="        return sums % self.ranks != 0\n",
        tests=("tests/grad_stats/test_finish_kernel_reads_the_clip_arguments.py::"
               "test_the_summed_form_tells_equal_values_from_any_others_exactly",),
    ),
    Mutant(
        name="norm-type-bytes-unread-by-the-finishing-kernel",
        bug="the finishing kernel reads max_norm's bytes only: GPU ranks clipping with norm types 1 and 3 (rows of one "
        "width) scale by a norm that mixes both",
        file="pgregistry/grad_stats/_triton_kernels.py",
        find="        inside = byte < BYTES  # max_norm's and norm_type's float64 bytes, the flag, the statistic\n",
        replace="        inside = byte < 8  # max_norm's bytes only\n",
        tests=("tests/grad_stats/test_finish_kernel_reads_the_clip_arguments.py::"
               "test_the_kernel_finishes_a_clips_arguments_with_the_torch_paths_bits[max_norm-1-norm-types-2-and-1]",),
    ),
    Mutant(
        name="clip-arguments-unread-by-the-finishing-kernel",
        bug="the finishing kernel (CUDA, the 2-norm with the verdict in its row) leaves the norm finite where the "
        "ranks' max_norm values differ: each GPU rank scales by its own coefficient",
        file="pgregistry/grad_stats/_triton_kernels.py",
        find='            norm = tl.where(disagree, float("nan"), norm)\n',
        replace="            pass\n",
        tests=("tests/grad_stats/test_finish_kernel_reads_the_clip_arguments.py::"
               "test_the_kernel_finishes_a_clips_arguments_with_the_torch_paths_bits",),
    ),
    Mutant(
        name="norm-type-left-out-of-the-clip-agreement",
        bug="replicas clipping with norm types 2 and inf each clip by their own norm, silently",
        file="pgregistry/grad_stats/_arguments.py",
        find="        values = [0.0, max_norm, norm_type, flag, kind, -max_norm, -norm_type, -flag, -kind]\n",
        replace="        values = [0.0, max_norm, 2.0, flag, kind, -max_norm, -2.0, -flag, -kind]\n",
        tests=("tests/grad_stats/test_clip_arguments_agree_across_ranks.py::"
               "test_different_norm_types_raise_on_every_rank_and_scale_nothing[replicas-2.0-inf]",),
    ),
    Mutant(
        name="max-norm-tensor-joins-the-grads-graph",
        bug="a max_norm tensor that requires grad (a parameter, a schedule's output) makes every grad it scales part "
        "of its autograd graph, kept alive and grown at each step (torch's clip runs without grad)",
        file="pgregistry/grad_stats/_arguments.py",
        find="    return max_norm.detach().reshape(()) if isinstance(max_norm, torch.Tensor) else max_norm\n",
        replace="    return max_norm.reshape(()) if isinstance(max_norm, torch.Tensor) else max_norm\n",
        tests=("tests/grad_stats/test_hostile_inputs_sixth_round.py::"
               "test_a_max_norm_that_requires_grad_scales_the_grads_without_joining_its_graph[optimizer]",),
        # clip_grads_ runs without grad since (clip-grads-records-its-scaling): the detach no longer decides it
    ),
    Mutant(
        name="grad-statistics-recorded-by-autograd",
        bug="grads made with create_graph=True give a norm with an autograd graph (torch's get_total_norm and "
        "clip_grad_norm_ run without grad): every logged norm keeps its graph alive",
        file="pgregistry/grad_stats/_functional.py",
        find="@torch.no_grad()\ndef _read_and_reduce(",
        replace="def _read_and_reduce(",
        tests=("tests/grad_stats/test_hostile_inputs_sixth_round.py::"
               "test_grads_made_with_create_graph_give_a_norm_without_a_graph_as_torch",),
    ),
    Mutant(
        name="error-if-nonfinite-string-taken-as-true",
        bug="clip_grad_norm_(..., error_if_nonfinite='False') is true: a non-finite norm raises where the caller "
        "meant to skip the step",
        file="pgregistry/grad_stats/_arguments.py",
        find='    flag_fault = flag_error(error_if_nonfinite, "error_if_nonfinite")\n',
        replace="    flag_fault = None\n",
        tests=("tests/grad_stats/test_hostile_inputs_sixth_round.py::"
               "test_error_if_nonfinite_given_as_a_string_is_refused_on_every_rank_not_taken_as_true",),
    ),
    Mutant(
        name="number-beyond-floats-range-overflows",
        bug="max_norm=10**400 on one rank raised a bare OverflowError there before any collective (float() of a huge "
        "int), its peers waiting in the norm's all-reduce; norm_type=10**400 likewise",
        file="pgregistry/grad_stats/_arguments.py",
        find="        except OverflowError:\n",
        replace="        except ZeroDivisionError:\n",
        tests=("tests/grad_stats/test_hostile_inputs_sixth_round.py::"
               "test_numbers_beyond_floats_range_are_infinities_not_a_bare_overflow_on_one_rank",),
    ),
    Mutant(
        name="clip-disagreement-lost-crossing-optimizer-instances",
        bug="arguments that differ inside one optimizer instance (told by its summed row) are passed on to the other "
        "instances as this rank's value alone: ranks of an instance that agrees clip, the others do not",
        file="pgregistry/grad_stats/_arguments.py",
        find="        unknown = (self.differing() | refused).repeat(2)\n",
        replace="        unknown = refused.repeat(8)\n",
        tests=("tests/grad_stats/test_clip_arguments_agree_across_ranks.py::"
               "test_arguments_that_differ_across_optimizer_instances_raise_on_every_rank[one-rank]",),
    ),
    # migrate7: when the rewrite trusts ``self.pg_collection`` set by ``__init__``.
    Mutant(
        name="migrate-trusts-an-attribute-set-after-super-init",
        bug="a base __init__ reached through super().__init__ calls a method the subclass overrides before the "
        "subclass sets self.pg_collection: the rewritten method reads it unset, AttributeError",
        file="pgregistry/migrate/_init_order.py",
        find='if callee == "super" and not (quiet_super and _super_init_call(root, sub)):',
        replace='if callee == "super" and not _super_init_call(root, sub):',
        tests=("tests/migrate/test_migrate_side_by_side.py::"
               "test_a_collection_attribute_set_after_code_that_may_call_a_reading_method_is_read_with_getattr",),
    ),
    Mutant(
        name="migrate-trusts-an-attribute-a-subclass-may-read-first",
        bug="a subclass __init__ calls a reading method before super().__init__ sets self.pg_collection: "
        "AttributeError in the rewrite",
        file="pgregistry/migrate/_init_order.py",
        find="            return _may_call_back([*init.body[:index], *arguments], self_name, methods, False)\n"
        "    return True",
        replace="            return False\n    return False",
        tests=("tests/migrate/test_migrate_side_by_side.py::"
               "test_a_collection_attribute_set_after_code_that_may_call_a_reading_method_is_read_with_getattr",),
    ),
    Mutant(
        name="migrate-trusts-an-attribute-after-self-is-handed-on",
        bug="__init__ hands self to a helper (or loads a property) that calls a reading method before "
        "self.pg_collection is set: AttributeError in the rewrite",
        file="pgregistry/migrate/_init_order.py",
        find="            return True  # ``self`` handed on",
        replace="            pass",
        tests=("tests/migrate/test_migrate_side_by_side.py::"
               "test_a_collection_attribute_set_after_code_that_may_call_a_reading_method_is_read_with_getattr",),
    ),
    Mutant(
        name="migrate-distrusts-every-base-init",
        bug="every super().__init__ before the assignment counts as calling back, so MegatronModule's subclasses "
        "read self.pg_collection through getattr (sound, but not the least conservative rule)",
        file="pgregistry/migrate/_init_order.py",
        find='QUIET_OUTSIDE = frozenset({"object", "Module", "ABC", "Generic", "Protocol"})',
        replace="QUIET_OUTSIDE = frozenset()",
        tests=("tests/migrate/test_migrate_side_by_side.py::"
               "test_a_collection_attribute_set_after_a_quiet_base_init_is_read_as_set",),
    ),
    Mutant(
        name="migrate-rewrites-a-read-a-handler-may-catch",
        bug="a read inside try/except Exception is rewritten: under -W error its fallback warning is caught there, "
        "the code takes the handler's path unreported (Bridge's preprocess_packed_batch loads images on every stage)",
        file="pgregistry/migrate/_plan.py",
        find="    caught = calls_a_handler_may_catch(module_syntax)",
        replace="    caught = frozenset()",
        tests=("tests/migrate/test_migrate_side_by_side.py::"
               "test_a_read_whose_try_may_catch_the_fallback_warning_stays",),
    ),
    Mutant(
        name="migrate-trusts-a-declaration-without-a-value",
        bug="pg_collection: ProcessGroupCollection alone in a plain class body counts as set: a method reads "
        "self.pg_collection __init__ never set, AttributeError where the original read parallel_state",
        file="pgregistry/migrate/_plan.py",
        find="            and _declaration_binds(value, self.classes[-1])\n",
        replace="",
        tests=("tests/migrate/test_migrate_side_by_side.py::"
               "test_a_collection_declared_without_a_value_in_a_plain_class_is_read_with_getattr",),
    ),
    # hostile8: an optimizer's clip_grad_norm carries its arguments in the verdict, as the functional clip does.
    Mutant(
        name="optim-clip-refuses-an-argument-before-the-reduction",
        bug="optimizer.clip_grad_norm(-1.0) on one rank raises there before the norm's all-reduce: its peers wait "
        "in it until the group's timeout",
        file="pgregistry/optim/_base.py",
        find="error_if_nonfinite=error_if_nonfinite)\n",
        replace="error_if_nonfinite=error_if_nonfinite)\n"
        "    if given.refusal is not None:\n        raise given.refusal\n",
        tests=("tests/optim/test_optim_clip_arguments_agree.py::"
               "test_a_max_norm_refused_on_one_rank_raises_on_every_rank_and_scales_nothing[2.0-stages]",),
    ),
    Mutant(
        name="optim-clip-leaves-its-arguments-out-of-the-verdict",
        bug="ranks given different max_norm values to optimizer.clip_grad_norm clip by different coefficients: "
        "the replicas drift apart, no rank told",
        file="pgregistry/optim/_base.py",
        find="reread=read_shares, given=given)",
        replace="reread=read_shares)",
        tests=("tests/optim/test_optim_clip_arguments_agree.py::"
               "test_different_max_norms_raise_on_every_rank_and_scale_nothing[2.0-stages]",),
    ),
    Mutant(
        name="optim-clip-does-not-read-the-disagreement",
        bug="ranks given different max_norm values to optimizer.clip_grad_norm scale nothing, their norm NaN, "
        "without a word on the CPU where the verdict is read for free",
        file="pgregistry/grad_stats/_reductions.py",
        find="    _raise_disagreement(reduced, given, owner, error_if_nonfinite is True)\n",
        replace="    pass\n",
        tests=("tests/optim/test_optim_clip_arguments_agree.py::"
               "test_different_max_norms_raise_on_every_rank_and_scale_nothing[inf-replicas]",),
    ),
    Mutant(
        name="modules-optimizer-floats-a-norm-type-beyond-float",
        bug="MultiModuleOptimizer.clip_grad_norm(norm_type=10**400) on one rank: float() raises a bare OverflowError "
        "there before any collective, its peers wait in the modules' reductions",
        file="pgregistry/modules/_optimizer.py",
        find="p = 2.0 if bad_p is not None else norm_type_as_float(norm_type)",
        replace="p = 2.0 if bad_p is not None else float(norm_type)",
        tests=("tests/modules/test_modules_numbers_beyond_float.py::"
               "test_a_norm_type_beyond_float_on_one_rank_raises_on_every_rank",),
    ),
    Mutant(
        name="modules-stats-float-a-norm-type-beyond-float",
        bug="pgregistry.modules.grad_norm(norm_type=10**400): float() raises a bare OverflowError on every rank "
        "instead of the max-norm",
        file="pgregistry/modules/_stats.py",
        find="    p = norm_type_as_float(norm_type)\n",
        replace="    p = float(norm_type)\n",
        tests=("tests/modules/test_modules_numbers_beyond_float.py::"
               "test_a_norm_type_beyond_float_is_the_max_norm_as_the_oracle",),
    ),
    Mutant(
        name="norm-of-grads-records-a-graph",
        bug="norm_of_grads of grads made with create_graph=True returns a norm with an autograd graph, kept alive "
        "by every logged norm (torch's get_total_norm runs without grad)",
        file="pgregistry/grad_stats/_lists.py",
        find="@torch.no_grad()\ndef norm_of_grads(",
        replace="def norm_of_grads(",
        tests=("tests/grad_stats/test_list_paths_without_a_graph.py::"
               "test_grads_with_a_graph_give_a_norm_and_a_scaling_without_one_as_torch",),
    ),
    Mutant(
        name="clip-grads-records-its-scaling",
        bug="clip_grads_ of grads made with create_graph=True records its in-place scaling in their graph: a "
        "gradient penalty through them is scaled too, unlike torch's",
        file="pgregistry/grad_stats/_lists.py",
        find="@torch.no_grad()\ndef clip_grads_(",
        replace="def clip_grads_(",
        tests=("tests/grad_stats/test_list_paths_without_a_graph.py::"
               "test_grads_with_a_graph_give_a_norm_and_a_scaling_without_one_as_torch",),
    ),
    Mutant(
        name="compiled-check-skips-the-grads-address",
        bug="the compiled steady-state check takes a grad re-pointed at other storage (set_, .data =) for the "
        "planned one: the read launches over memory the grad no longer holds",
        file="pgregistry/grad_stats/_steady_checks.cpp",
        find="!grad.has_storage() ||\n        reinterpret_cast<int64_t>(grad.data_ptr()) != rows[2 * index + 1]",
        replace="!grad.has_storage()",
        tests=("tests/grad_stats/test_compiled_checks_agree_with_python.py::"
               "test_the_compiled_checks_answer_as_the_python_ones[a-grad-re-pointed-at-other-storage]",
               "tests/grad_stats/test_grad_stats_kept_plan.py::"
               "test_a_grad_moved_in_place_and_requires_grad_toggled_are_seen[compiled]"),
    ),
    Mutant(
        name="compiled-check-misses-a-parameter-removed-at-the-end",
        bug="the compiled parameter-set check compares the held parameters only as far as the modules' dictionaries "
        "go: the last parameter deleted, the kept plan still reads its grad",
        file="pgregistry/grad_stats/_steady_checks.cpp",
        find="  return at == count;\n}",
        replace="  return true;\n}",
        tests=("tests/grad_stats/test_compiled_checks_agree_with_python.py::"
               "test_the_compiled_checks_answer_as_the_python_ones[the-last-parameter-deleted]",
               "tests/grad_stats/test_grad_stats_kept_plan.py::"
               "test_a_parameter_removed_or_added_at_the_end_of_the_parameter_set_is_seen[compiled]"),
    ),
    Mutant(
        name="compiled-check-skips-the-roleless-parameters",
        bug="the compiled roles check does not look at parameters whose attributes held no role: a role set on one "
        "later (Megatron-Core sets them as attributes) leaves the plan counting it as before",
        file="pgregistry/grad_stats/_steady_checks.cpp",
        find="  for (const py::handle dict : roleless) {",
        replace="  for (const py::handle dict : py::list()) {",
        tests=("tests/grad_stats/test_compiled_checks_agree_with_python.py::"
               "test_the_compiled_checks_answer_as_the_python_ones[a-role-on-a-parameter-without-one]",
               "tests/grad_stats/test_grad_stats_kept_plan.py::"
               "test_a_role_set_as_an_attribute_is_seen_whatever_the_parameter_held_before[compiled]"),
    ),
    Mutant(
        name="compiled-facts-take-every-grad-for-contiguous",
        bug="the compiled piece facts say every grad is contiguous: a grad restrided at its address keeps the "
        "kernel's plan for contiguous memory",
        file="pgregistry/grad_stats/_steady_checks.cpp",
        find="py::bool_(tensor.is_contiguous())",
        replace="py::bool_(true)",
        tests=("tests/grad_stats/test_compiled_checks_agree_with_python.py::"
               "test_the_compiled_piece_facts_are_the_python_ones[True]",),
    ),
    Mutant(
        name="plain-norm-reads-no-disagreement",
        bug="grad_norm given norm types that differ across the ranks of its reduction (1 and 3, 2 and inf) returns "
        "a NaN norm, or a norm of neither, without a word; a peer of a rank that refused its norm_type gets NaN",
        file="pgregistry/grad_stats/_functional.py",
        find="        check_arguments_after(reduced, given, owner)\n",
        replace="        if given.refusal is not None:\n            raise given.refusal\n",
        tests=("tests/grad_stats/test_norm_types_and_clips_that_differ_across_ranks.py::"
               "test_norm_types_that_differ_raise_on_every_rank",
               "tests/grad_stats/test_norm_types_and_clips_that_differ_across_ranks.py::"
               "test_a_norm_type_refused_on_one_rank_of_a_plain_norm_is_named_on_its_peer"),
    ),
    Mutant(
        name="inf-norm-peaks-summed-in-one-column",
        bug="every rank puts its inf-norm share in the first peak column: the rows' SUM adds the ranks' maxima "
        "instead of gathering them, an inf-norm above every grad",
        file="pgregistry/grad_stats/_reductions.py",
        find="        row[_RANGED_WIDTH + _rank_in(group)] = stacked[:, _NORM].amax()\n",
        replace="        row[_RANGED_WIDTH] = stacked[:, _NORM].amax()\n",
        tests=("tests/grad_stats/test_norm_types_and_clips_that_differ_across_ranks.py::test_agreeing_norm_types_give_the_oracle[inf]",),
    ),
    Mutant(
        name="plain-norm-carries-max-norm-one",
        bug="a call without a clip carries max_norm 1.0 in its row: grad_norm_and_zeros(max_norm=1.0 if rank == 0 "
        "else None) clips on rank 0 alone, without a word",
        file="pgregistry/grad_stats/_arguments.py",
        find="        max_norm = self.max_norm if self.clip else 0.0\n",
        replace="        max_norm = self.max_norm if self.clip else 1.0\n",
        tests=("tests/grad_stats/test_norm_types_and_clips_that_differ_across_ranks.py::"
               "test_a_clip_on_one_rank_beside_a_plain_norm_raises_on_every_rank_and_scales_nothing",),
    ),
    Mutant(
        name="optimizer-statistics-read-no-disagreement",
        bug="an optimizer's get_grad_norm (a grad buffer's grad_norm) on a peer of a rank that refused its "
        "norm_type returns NaN without a word",
        file="pgregistry/optim/_grad_statistics.py",
        find="        check_arguments_after(reduced, given, f\"{type(self).__name__}'s grad norm\")\n",
        replace="        if given.refusal is not None:\n            raise given.refusal\n",
        tests=("tests/optim/test_optim_norm_type_refused_on_one_rank.py::"
               "test_a_norm_type_refused_on_one_rank_leaves_its_peer_an_error_not_a_wait",),
    ),
    Mutant(
        name="norm-of-grads-refuses-before-the-reduction",
        bug="norm_of_grads refuses a norm_type on its rank before the reduction: its peers wait in the all-reduce "
        "until the group's timeout",
        file="pgregistry/grad_stats/_lists.py",
        find="    given = arguments_of_call(norm_type, None, clip=False)  # refused after the reduction\n",
        replace="    given = arguments_of_call(norm_type, None, clip=False)\n"
        "    if given.refusal is not None:\n        raise given.refusal\n",
        tests=("tests/grad_stats/test_norm_types_and_clips_that_differ_across_ranks.py::"
               "test_the_list_path_tells_norm_types_that_differ_and_a_refusal_on_every_rank",),
    ),
    Mutant(
        name="fsdp-block-carries-no-arguments",
        bug="the block of DTensor pieces summed over a data-parallel field carries no arguments: ranks sharded "
        "over it given 2 and inf take their own shard's statistics for the norm, without a word",
        file="pgregistry/grad_stats/_reductions.py",
        find="        if given is not None and group_size(first.group) > 1:  # the arguments ride in it too\n",
        replace="        if False:\n",
        tests=("tests/dtensor/test_dtensor_norm_types_that_differ.py::"
               "test_norm_types_that_differ_over_an_fsdp_shard_raise_on_every_rank",),
    ),
    Mutant(
        name="migrate-none-group-made-somewhere-taken-as-off",
        bug="a Megatron-Core collection's None embedding, inter-instance or hierarchical CP group (a group "
        "Megatron-Core did not make on this rank) is read as an axis that is off: None, where the accessor raised, "
        "and a collective given it runs over the whole world",
        file="pgregistry/migrate/_fallback_helper.py",
        find="        return (held and group is not None), group",
        replace="        return held, group",
        tests=(
            "tests/migrate/test_fallback_helper.py::"
            "test_the_helper_reads_the_collections_field_else_exactly_what_the_accessor_returns",
            "tests/migrate/test_migrate_generated.py::test_generated_programs_behave_as_their_originals",
        ),
    ),    Mutant(
        name="compiled-facts-read-every-grad-as-float32",
        bug="the compiled piece facts give every grad the dtype float32: a grad made float64 (or bf16) at a planned "
        "float32 grad's address keeps the kinds, and is read at float32 offsets",
        file="pgregistry/grad_stats/_steady_checks.cpp",
        find="torch::getTHPDtype(tensor.scalar_type())",
        replace="torch::getTHPDtype(at::kFloat)",
        tests=(
            "tests/grad_stats/test_compiled_checks_agree_with_python.py::"
            "test_the_compiled_piece_facts_are_the_python_ones",
            "tests/grad_stats/test_grad_stats_kept_plan.py::"
            "test_a_new_grad_of_another_dtype_or_shape_is_planned_in_full[compiled-dtype]",
            "tests/grad_stats/test_fused_stats.py::"
            "test_a_grad_of_another_dtype_at_the_planned_address_is_read_in_its_dtype",
        ),
    ),
    Mutant(
        name="compiled-kind-facts-skip-the-shape",
        bug="the compiled kind facts give no shape: new grads of another trailing shape at new addresses keep the "
        "host blocks, which concatenate small grads by trailing shape",
        file="pgregistry/grad_stats/_steady_checks.cpp",
        find="    facts.append(shape_of(tensor));",
        replace="    facts.append(py::none());",
        tests=(
            "tests/grad_stats/test_compiled_checks_agree_with_python.py::"
            "test_the_compiled_piece_facts_are_the_python_ones",
            "tests/grad_stats/test_grad_stats_kept_plan.py::"
            "test_a_new_grad_of_another_dtype_or_shape_is_planned_in_full[compiled-shape]",
        ),
    ),
    Mutant(
        name="compiled-moved-kinds-skip-the-sizes",
        bug="the compiled check of the moved grads' kinds compares their devices and number of dims only: a new grad "
        "of another shape of as many dims at a new address keeps the host blocks planned for the old shape",
        file="pgregistry/grad_stats/_steady_checks.cpp",
        find="      if (size != sizes[dim]) {",
        replace="      if (size != sizes[dim] && false) {",
        tests=(
            "tests/grad_stats/test_compiled_checks_agree_with_python.py::"
            "test_the_compiled_moved_kinds_are_the_python_ones",
            "tests/grad_stats/test_grad_stats_kept_plan.py::"
            "test_a_new_grad_of_another_trailing_shape_with_as_many_dims_is_planned_in_full[compiled]",
        ),
    ),
    Mutant(
        name="error-if-nonfinite-left-out-of-the-verdict",
        bug="error_if_nonfinite=True on one rank only: a non-finite norm raises there and is returned on the others, "
        "a finite one goes unremarked (docs/reliability.md, hostile inputs, ninth round)",
        file="pgregistry/grad_stats/_arguments.py",
        find="    raises = clip and refusal is None and error_if_nonfinite is True\n",
        replace="    raises = False\n",
        tests=(
            "tests/grad_stats/test_error_if_nonfinite_that_differs_across_ranks.py::"
            "test_error_if_nonfinite_that_differs_raises_naming_it_on_every_rank_and_scales_nothing",
        ),
    ),
    Mutant(
        name="error-if-nonfinite-unread-by-the-finishing-kernel",
        bug="the finishing kernel (CUDA, the 2-norm with the verdict in its row) reads the two float64 arguments' "
        "bytes only: GPU ranks given error_if_nonfinite True and False keep a finite norm, each deciding alone",
        file="pgregistry/grad_stats/_triton_kernels.py",
        find="        inside = byte < BYTES  # max_norm's and norm_type's float64 bytes, the flag, the statistic\n",
        replace="        inside = byte < 16\n",
        tests=(
            "tests/grad_stats/test_finish_kernel_reads_the_clip_arguments.py::"
            "test_the_kernel_finishes_a_clips_arguments_with_the_torch_paths_bits[flags-differ]",
        ),
    ),
    Mutant(
        name="compiled-build-keeps-a-dead-builders-lock",
        bug="a process that took torch's build lock and died while building leaves it: the next builder, holding "
        "the flock, hands it to torch's load, which waits on it without end at the first grad statistic",
        file="pgregistry/grad_stats/_compiled.py",
        find="            torch_lock.unlink()\n",
        replace="            pass\n",
        tests=(
            "tests/grad_stats/test_compiled_checks_modes.py::"
            "test_a_lock_left_by_a_builder_that_died_is_removed_and_the_build_completes",
        ),
    ),
    Mutant(
        name="compiled-build-takes-no-flock",
        bug="a builder that does not wait for the flock takes a live build's torch lock for a dead one, removes it "
        "and builds into the same folder at once",
        file="pgregistry/grad_stats/_compiled.py",
        find="            fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)\n",
        replace="            pass\n",
        tests=(
            "tests/grad_stats/test_compiled_checks_modes.py::"
            "test_a_live_builder_is_waited_for_and_its_library_imported",
        ),
    ),
    Mutant(
        name="migrate-any-handler-leaves-the-read",
        bug="every read inside a try is left as it is, also where no handler around it can catch the fallback "
        "warning (except AssertionError): the program behaves as before, reading the global grid, so only a check "
        "of each read's treatment sees it",
        file="pgregistry/migrate/_caught.py",
        find="    return any(_may_name_a_warning_class(last_name(n)) for n in names)",
        replace="    return True",
        tests=("tests/migrate/test_migrate_generated.py::test_generated_programs_behave_as_their_originals",),
    ),
    Mutant(
        name="migrate-remat-dp-never-from-the-collection",
        bug="a read of the data-parallel group with GTP remat (get_data_parallel_rank() and the like) is answered "
        "from the collection's dp only where the collection's gtp_remat is None, not where it has one rank: it "
        "falls back, and given another grid's collection reads the global one; the whole-program excuse of mode d "
        "hid it (such a program warns)",
        file="pgregistry/migrate/_fallback_helper.py",
        find="    if has_remat and (remat is None or remat.size() == 1):  # then dp spans the very same ranks",
        replace="    if has_remat and remat is None:  # then dp spans the very same ranks",
        tests=("tests/migrate/test_migrate_generated.py::test_generated_programs_behave_as_their_originals",),
    ),
    Mutant(
        name="stale-build-example",
        bug="build's docstring example shows the data-parallel size of its former 8-rank world (4) for the 4 ranks "
        "it builds",
        file="pgregistry/registry.py",
        find="        (2, 2, 4)\n",
        replace="        (2, 4, 4)\n",
        tests=(
            "tests/core/test_doctests.py::"
            "test_the_examples_that_need_a_world_print_what_they_show_on_every_rank[4]",
        ),
    ),
    Mutant(
        name="stale-recover-example",
        bug="recover's docstring example keeps training on the old collection (no pg = recovered.collection)",
        file="pgregistry/recovery.py",
        find="            pg = recovered.collection  # rebuild the optimizer and the data shards on it\n",
        replace="",
        tests=(
            "tests/recovery/test_recovery_examples.py::"
            "test_recover_docstring_example_leaves_the_survivor_on_the_smaller_world",
        ),
    ),
    Mutant(
        name="stale-checkpoint-example",
        bug="load_rank_files' docstring example loads the model alone: the optimizer's state is lost",
        file="pgregistry/checkpoint/_rank_files.py",
        find='        load_rank_files("ckpt/step-100", model, optimizer)\n',
        replace='        load_rank_files("ckpt/step-100", model)\n',
        tests=(
            "tests/core/test_checkpoint_docstring_examples.py::"
            "test_the_checkpoint_examples_load_what_they_saved[save_rank_files-load_rank_files-False]",
        ),
    ),
    Mutant(
        name="stale-modules-checkpoint-example",
        bug="pgregistry.modules.load_checkpoint's docstring example loads the models alone: the "
        "optimizer's state is lost",
        file="pgregistry/modules/_checkpoint.py",
        find='        load_checkpoint("ckpt/step-100", models_here, modules, optimizer)\n',
        replace='        load_checkpoint("ckpt/step-100", models_here, modules)\n',
        tests=(
            "tests/modules/test_modules_checkpoint_examples.py::"
            "test_the_modules_checkpoint_examples_load_what_they_saved",
        ),
    ),
    Mutant(
        name="stale-adopt-example",
        bug="registry.adopt's docstring example adopts nothing, yet shows the build reusing "
        "Megatron-Core's TP communicator",
        file="pgregistry/registry.py",
        find="        >>> adopt([parallel_state.get_tensor_model_parallel_group()])\n",
        replace="",
        tests=(
            "tests/megatron/test_megatron_doctests.py::"
            "test_the_megatron_examples_print_what_they_show_on_every_rank[2]",
        ),
    ),
    Mutant(
        name="torchtitan-experts-left-unmarked",
        bug="mark_torchtitan_experts marks the GroupedExperts module but not its parameters",
        file="pgregistry/interop/torchtitan.py",
        find="            for param in module.parameters(recurse=False):\n                mark_expert(param)\n",
        replace="",
        tests=(
            "tests/torchtitan/test_torchtitan_doctests.py::"
            "test_the_torchtitan_examples_print_what_they_show_on_every_rank",
        ),
    ),
    Mutant(
        name="zero-count-rows-of-their-own-width",
        bug="a zero count alone makes rows [0, zeros] of its own width: count_zeros on one pipeline stage beside "
        "grad_norm on the other aborts gloo (88 vs 8, SIGABRT; docs/reliability.md, ninth round, left as found)",
        file="pgregistry/grad_stats/_reductions.py",
        find="    width = _RANGED_WIDTH + group_size(group)\n",
        replace="    width = 2 if wanted.p is None else _RANGED_WIDTH + group_size(group)\n",
        tests=(
            "tests/grad_stats/test_zero_count_beside_a_norm.py::"
            "test_a_zero_count_beside_a_norm_raises_naming_both_on_every_rank[count_zeros-beside-grad_norm]",
        ),
    ),
    Mutant(
        name="zero-count-carries-no-arguments",
        bug="a zero count alone carries no arguments in its rows while a norm does: their rows differ in width "
        "again, and gloo aborts",
        file="pgregistry/grad_stats/_reductions.py",
        find="        verdict, given = (), ZEROS_ALONE\n",
        replace="        verdict, given = (), None\n",
        tests=(
            "tests/grad_stats/test_zero_count_beside_a_norm.py::"
            "test_a_zero_count_beside_a_norm_raises_naming_both_on_every_rank[grad_norm-beside-count_zeros]",
        ),
    ),
    Mutant(
        name="zero-count-carries-a-norms-arguments",
        bug="a zero count alone carries a plain 2-norm's arguments: beside grad_norm on a peer it agrees, and each "
        "rank returns a sum of the other's statistic, without a word",
        file="pgregistry/grad_stats/_arguments.py",
        find="ZEROS_ALONE: Final = Given(0.0, False, None, None, False, Statistic.ZEROS)\n",
        replace="ZEROS_ALONE: Final = Given(2.0, False, None, None, False, Statistic.NORM)\n",
        tests=(
            "tests/grad_stats/test_zero_count_beside_a_norm.py::"
            "test_a_zero_count_beside_a_norm_raises_naming_both_on_every_rank[zeros_of_grads-beside-norm_of_grads]",
            "tests/grad_stats/test_zero_count_beside_a_norm.py::"
            "test_the_reduction_makes_the_count_minus_one_and_the_norm_nan_where_the_statistics_differ"
            "[zeros-beside-a-norm]",
        ),
    ),
    Mutant(
        name="zero-count-disagreement-unread",
        bug="the entry points of a zero count alone do not read the disagreement on the CPU, where it is free: "
        "count_zeros beside a norm returns -1 without a word",
        file="pgregistry/grad_stats/_reductions.py",
        find="    _raise_disagreement(reduced, ZEROS_ALONE, owner, read)\n",
        replace="    pass\n",
        tests=(
            "tests/grad_stats/test_zero_count_beside_a_norm.py::"
            "test_a_zero_count_beside_a_norm_raises_naming_both_on_every_rank[count_zeros-beside-grad_norm]",
            "tests/grad_stats/test_zero_count_beside_a_norm.py::"
            "test_an_optimizers_zero_count_beside_its_norm_raises_naming_both_on_every_rank",
        ),
    ),
    Mutant(
        name="zero-count-kept-where-the-statistics-differ",
        bug="where the ranks' statistics differ and no rank reads the agreement (a GPU), the zero count is a "
        "plausible number, not -1: a count summed beside another rank's norm goes unseen",
        file="pgregistry/grad_stats/_reductions.py",
        find="    return None if zeros is None else torch.where(disagrees, -1, zeros)\n",
        replace="    return zeros\n",
        tests=(
            "tests/grad_stats/test_zero_count_beside_a_norm.py::"
            "test_the_reduction_makes_the_count_minus_one_and_the_norm_nan_where_the_statistics_differ"
            "[zeros-beside-a-norm]",
        ),
    ),
    Mutant(
        name="zero-count-unread-by-the-finishing-kernel",
        bug="the finishing kernel (CUDA) leaves the zero count as summed where the ranks' statistics differ: a GPU's "
        "count_zeros beside a norm on a peer returns a plausible count",
        file="pgregistry/grad_stats/_triton_kernels.py",
        find="            zeros = tl.where(disagree, -1.0, zeros)\n",
        replace="            pass\n",
        tests=(
            "tests/grad_stats/test_finish_kernel_reads_the_clip_arguments.py::"
            "test_the_kernel_makes_the_zero_count_minus_one_where_the_statistics_differ[zeros-alone-beside-a-norm]",
        ),
    ),
    Mutant(
        name="norm-with-zeros-carries-no-statistic",
        bug="grad_norm_and_zeros carries a plain norm's statistic: beside grad_norm on a peer its zero count lacks "
        "that rank's zeros, without a word",
        file="pgregistry/grad_stats/_arguments.py",
        find="    statistic = Statistic.NORM_AND_ZEROS if zeros else Statistic.NORM\n",
        replace="    statistic = Statistic.NORM\n",
        tests=("tests/grad_stats/test_zero_count_beside_a_norm.py::"
               "test_a_norm_without_its_zero_count_beside_one_with_it_raises_naming_both",),
    ),
    Mutant(
        name="zero-count-peer-unnamed",
        bug="a norm's rank beside a zero count alone is told its norm_type differs (the zero count's 0.0), not "
        "that its peer counts zeros",
        file="pgregistry/grad_stats/_arguments.py",
        find="        alone = (squares - total) / 2\n",
        replace="        alone = 0.0\n",
        tests=(
            "tests/grad_stats/test_zero_count_beside_a_norm.py::"
            "test_a_zero_count_beside_a_norm_raises_naming_both_on_every_rank[count_zeros-beside-grad_norm]",
        ),
    ),
    Mutant(
        name="modules-call-not-agreed",
        bug="pgregistry.modules.count_zeros beside pgregistry.modules.grad_norm is told as a norm_type given on "
        "one rank only, not as two calls",
        file="pgregistry/modules/_stats.py",
        find='    fields = {"call": owner, **describe_modules(modules), **options}\n',
        replace="    fields = {**describe_modules(modules), **options}\n",
        tests=("tests/grad_stats/test_zero_count_beside_a_norm.py::"
               "test_the_modules_zero_count_beside_their_norm_raises_naming_both_calls_on_every_rank",),
    ),
    Mutant(
        name="world-forked-with-the-heap-unfrozen",
        bug="run_world forks its ranks with the caller's objects left to the ranks' collectors: a full collection "
        "in each rank copied the caller's whole heap (2.2 s a rank in tests/demo/test_verify.py's worlds)",
        file="pgregistry/testing/__init__.py",
        find="            with heap_frozen_while_forking():\n                for rank in range(world_size):",
        replace="            if True:\n                for rank in range(world_size):",
        tests=(
            "tests/core/test_testing_harness.py::"
            "test_ranks_are_forked_with_the_callers_objects_frozen_and_the_caller_gets_them_back",
        ),
    ),
    Mutant(
        name="frozen-heap-unfreezes-the-callers-own",
        bug="the heap frozen while forking is unfrozen whatever the caller froze itself: its frozen objects "
        "released to the collector by a run_world",
        file="pgregistry/testing/_frozen_heap.py",
        find="    if gc.get_freeze_count():\n        yield\n        return\n",
        replace="",
        tests=(
            "tests/core/test_testing_harness.py::"
            "test_ranks_are_forked_with_the_callers_objects_frozen_and_the_caller_gets_them_back",
        ),
    ),
    Mutant(
        name="checkpoint-partition-dim-read-unchecked",
        bug="a TP-sharded parameter's partition_dim is taken as given: -1 gathers the right whole but the load "
        "expects the piece's shape and refuses the rank's own checkpoint; a dim the piece lacks fails in torch's "
        "IndexError naming no parameter",
        file="pgregistry/checkpoint/_by_name.py",
        find="            _partition_dim_of(param, name, owner),\n",
        replace="            int(param.partition_dim),  # type: ignore[attr-defined]\n",
        tests=("tests/experts/test_checkpoint_partition_dim.py::"
               "test_a_negative_partition_dim_round_trips_and_a_dim_the_piece_lacks_is_refused_by_name",),
    ),
    Mutant(
        name="carry-into-a-stepped-optimizer",
        bug="carry_optimizer_state(new, old), the arguments swapped, loads the fresh optimizer's empty state into "
        "the one that stepped: its Adam moments and step count gone without a word",
        file="pgregistry/recovery.py",
        find="    _refuse_a_stepped_new(new)\n",
        replace="",
        tests=("tests/recovery/test_carry_arguments_swapped.py::"
               "test_swapped_arguments_are_refused_on_every_rank_and_the_old_state_kept",),
    ),
    Mutant(
        name="checkpoint-factored-state-saved-from-tp-rank-0",
        bug="an optimizer state tensor of a TP-sharded parameter not of its shape (Adafactor's row_var, col_var) "
        "is stored from TP rank 0 as the whole's, and a load gives it to every TP rank",
        file="pgregistry/checkpoint/_by_name.py",
        find="        _refuse_unjoinable_state(states, model, owner)\n",
        replace="",
        tests=("tests/experts/test_checkpoint_factored_state.py::"
               "test_factored_state_of_a_tp_sharded_parameter_is_refused_on_every_rank_not_mixed",),
    ),
    Mutant(
        name="checkpoint-factored-state-given-whole-to-each-piece",
        bug="a stored state tensor of a TP-sharded parameter of neither the whole's shape nor 0-d (Adafactor's "
        "factors saved at TP 1) is given whole to every TP rank's piece on load",
        file="pgregistry/checkpoint/_by_name.py",
        find="            subject, _unjoinable_stored(model, state) + param_state_faults(target, by_param)\n",
        replace="            subject, param_state_faults(target, by_param)\n",
        tests=("tests/experts/test_checkpoint_factored_state.py::"
               "test_factored_state_of_a_tp_sharded_parameter_is_refused_on_every_rank_not_mixed",),
    ),
    Mutant(
        name="refusal-raised-on-the-faulty-ranks-only",
        bug="the one refusal of checkpoints, optimizer loads and carry_optimizer_state raises on the ranks that "
        "found the fault only: their peers go on into the next collective and wait there",
        file="pgregistry/_runtime/agreement.py",
        find="    if faulty:\n        raise naming_peers(faulty)\n",
        replace="",
        tests=(
            "tests/experts/test_checkpoint_strict_loaders.py::"
            "test_rank_files_refuse_another_dtype_on_every_rank_and_cast_with_strict_off",
            "tests/experts/test_one_rank_load_refused_every_rank_unchanged.py::"
            "test_every_rank_names_the_rank_with_the_fault[load_state_dict]",
            "tests/recovery/test_carry_arguments_swapped.py::"
            "test_swapped_arguments_are_refused_on_every_rank_and_the_old_state_kept",
        ),
    ),
    Mutant(
        name="kernel-only-read-drops-the-launch-base",
        bug="a steady call read by the one-read kernel alone is handed each kind's first piece but not its launch's "
        "base, from which the kernel addresses every piece (None there: issue 38's sparse list of pieces)",
        file="pgregistry/grad_stats/_plan.py",
        find="        return self.positions[0], self.positions[self.plan.launch.base]\n",
        replace="        return self.positions[0], self.positions[0]\n",
        tests=(
            "tests/grad_stats/test_kernel_only_steady_reads.py::"
            "test_a_kernel_only_steady_read_gives_the_oracles_answers[norm]",
            "tests/grad_stats/test_kernel_only_steady_reads.py::"
            "test_a_kernel_only_steady_read_gives_the_oracles_answers[zeros]",
            "tests/grad_stats/test_kernel_only_steady_reads.py::"
            "test_a_kernel_only_steady_read_gives_the_oracles_answers[clip-that-scales]",
        ),
    ),
    Mutant(
        name="checkpoint-partition-dims-unlike-across-tp",
        bug="TP ranks giving one parameter other partition_dim values (pieces of one shape) are not refused: the "
        "save stores TP rank 0's join along its own dim, and the load refuses with a shape misfit naming no dim",
        file="pgregistry/checkpoint/_by_name.py",
        find="    return model.sharded[name].dim, str(model.params[name].dtype)\n",
        replace="    return 0, str(model.params[name].dtype)\n",
        tests=("tests/experts/test_checkpoint_pieces_unlike_across_tp.py::"
               "test_tp_ranks_cutting_one_parameter_along_other_dims_are_refused_on_every_rank",),
    ),
    Mutant(
        name="checkpoint-state-unlike-across-tp-unchecked",
        bug="optimizer state of a TP-sharded parameter held unlike by its TP ranks is not compared: a step of 2 on "
        "TP rank 1 is stored as TP rank 0's 1, and state held on some TP ranks only leaves them waiting in "
        "other collectives",
        file="pgregistry/checkpoint/_by_name.py",
        find="    _refuse_state_unlike_across_tp(states, model, owner)\n",
        replace="",
        tests=(
            "tests/experts/test_checkpoint_state_unlike_across_tp.py::"
            "test_a_step_count_unlike_across_tp_ranks_is_refused_on_every_rank_not_taken_from_tp_rank_0",
            "tests/experts/test_checkpoint_state_unlike_across_tp.py::"
            "test_state_held_on_some_tp_ranks_only_is_refused_on_every_rank_not_left_waiting",
        ),
    ),
    Mutant(
        name="checkpoint-state-values-left-out-of-the-tp-digest",
        bug="the TP ranks compare which state keys they hold of a sharded parameter but not the values: a step "
        "count unlike across them is stored as TP rank 0's",
        file="pgregistry/checkpoint/_by_name.py",
        find='            f"{name!r} {key!r} {text}" for name, _, by_key in held for key, text in by_key.items()\n',
        replace='            f"{name!r} {key!r}" for name, _, by_key in held for key, text in by_key.items()\n',
        tests=("tests/experts/test_checkpoint_state_unlike_across_tp.py::"
               "test_a_step_count_unlike_across_tp_ranks_is_refused_on_every_rank_not_taken_from_tp_rank_0",),
    ),
    Mutant(
        name="checkpoint-pieces-dtypes-unlike-across-tp",
        bug="TP ranks holding one parameter's pieces in other dtypes (float32 and float16) reach the all-gather "
        "that joins them, and gloo aborts the process",
        file="pgregistry/checkpoint/_by_name.py",
        find="    return model.sharded[name].dim, str(model.params[name].dtype)\n",
        replace="    return model.sharded[name].dim, \"\"\n",
        tests=("tests/experts/test_checkpoint_pieces_unlike_across_tp.py::"
               "test_tp_ranks_holding_one_parameter_in_other_dtypes_are_refused_on_every_rank_not_an_abort",),
    ),
    Mutant(
        name="optimizer-shards-cut-under-tp",
        bug="sharded optimizer shards under TP are not refused: a TP 1 save loaded at TP 2 gives TP rank 1 the "
        "whole weight's first elements (TP rank 0's rows) as its Adam state, main copy and weights",
        file="pgregistry/checkpoint/_optimizer_shards.py",
        find="    for child in children:\n        group = child.stats_groups.expt_tp if child.expert else "
        "child.stats_groups.tp\n",
        replace="    for child in children[:0]:\n        group = child.stats_groups.expt_tp if child.expert else "
        "child.stats_groups.tp\n",
        tests=("tests/experts/test_optimizer_shards_under_tp.py::"
               "test_optimizer_shards_under_tp_are_refused_on_every_rank_not_cut_from_tp_rank_0s_elements",),
    ),
    Mutant(
        name="checkpoint-names-on-two-stages-unchecked",
        bug="pipeline stages given one layer offset both name their layer layers.0.weight: save_distributed keeps "
        "one stage's under the name and a load gives it to both, the other stage's weights lost",
        file="pgregistry/checkpoint/_by_name.py",
        find="    if twice:\n",
        replace="    if False:\n",
        tests=("tests/experts/test_checkpoint_names_on_two_stages.py::"
               "test_two_stages_naming_one_parameter_are_refused_on_every_rank_not_one_kept_for_both",),
    ),
    Mutant(
        name="checkpoint-tied-copy-named-alike-refused",
        bug="a tied copy marked shared on the last pipeline stage, named as its original, is refused as a name "
        "held by two stages",
        file="pgregistry/checkpoint/_by_name.py",
        find="            if not shared:\n",
        replace="            if True:\n",
        tests=("tests/experts/test_checkpoint_names_on_two_stages.py::"
               "test_two_stages_naming_one_parameter_are_refused_on_every_rank_not_one_kept_for_both",),
    ),
    Mutant(
        name="optimizer-shards-of-another-size-cut",
        bug="load_optimizer_shards cuts the pieces of a parameter saved with more elements: a (6, 2) weight's "
        "shards loaded into a (4, 2) one give it the saved weight's first 8 elements",
        file="pgregistry/checkpoint/_optimizer_shards.py",
        find="        if name in whole and whole[name][\"main\"].numel() != param.numel():\n",
        replace="        if False:\n",
        tests=("tests/experts/test_optimizer_shards_of_another_size.py::"
               "test_shards_of_a_parameter_of_another_size_are_refused_on_every_rank",),
    ),
    Mutant(
        name="optimizer-shards-replicated-over-tp-refused-at-load",
        bug="load_optimizer_shards refuses a parameter replicated over TP as it does a TP-sharded one, though each "
        "TP rank holds it whole and its shards load right",
        file="pgregistry/checkpoint/_optimizer_shards.py",
        find="            if sharded_only and not getattr(param, \"tensor_model_parallel\", False):\n",
        replace="            if False:\n",
        tests=(
            "tests/experts/test_optimizer_shards_under_tp.py::"
            "test_optimizer_shards_under_tp_are_refused_on_every_rank_not_cut_from_tp_rank_0s_elements",
            "tests/core/test_checkpoint_docstring_examples.py::"
            "test_the_checkpoint_examples_load_what_they_saved[save_optimizer_shards-load_optimizer_shards-True]",
        ),
    ),
    Mutant(
        name="checkpoint-tied-copy-written-beside-its-original",
        bug="a tied copy marked shared and named as its original on another pipeline stage (Megatron-Core's "
        "embedding for multi-token prediction) is written by both stages: load_rank_files refuses the files",
        file="pgregistry/checkpoint/_by_name.py",
        find="        if name in self.tied_copies:\n            return False\n",
        replace="",
        tests=("tests/experts/test_checkpoint_names_on_two_stages.py::"
               "test_two_stages_naming_one_parameter_are_refused_on_every_rank_not_one_kept_for_both",),
    ),
    Mutant(
        name="migrate-with-block-imports-dropped-as-unguarded",
        bug="migrate counts only try statements as guards: an import in a with block (suppress(ImportError)) that "
        "the rewrite left unused goes when an import of the same package follows it, so where its name is missing "
        "(an accessor of a later Megatron-Core) the block runs on and its flag says the accessor is there",
        file="pgregistry/migrate/_rewrite.py",
        find="    visit_Try = visit_TryStar = visit_With = enter_guard\n"
        "    leave_Try = leave_TryStar = leave_With = leave_guard\n",
        replace="    visit_Try = visit_TryStar = enter_guard\n    leave_Try = leave_TryStar = leave_guard\n",
        tests=(
            "tests/migrate/test_migrate_side_by_side.py::"
            "test_an_import_in_a_with_block_still_skips_the_rest_of_the_block_where_it_fails",
        ),
    ),
    Mutant(
        name="migrate-match-capture-read-as-parallel-state",
        bug="migrate takes a name a match statement captures (case ps:) for the parallel_state imported as ps: the "
        "read of the user's object becomes a read of the global grid",
        file="pgregistry/migrate/_captures.py",
        find="    return list(_captures_by_scope(syntax, None))\n",
        replace="    return []\n",
        tests=(
            "tests/migrate/test_migrate_differential.py::test_the_migrated_function_behaves_as_the_original["
            "hostile:hostile.shapes.on_a_match_capture-a]",
            "tests/migrate/test_migrate_only_parallel_state.py::"
            "test_names_a_lambda_a_comprehension_or_a_match_binds_are_not_parallel_state",
        ),
    ),
    Mutant(
        name="migrate-one-binding-of-the-alias-decides",
        bug="migrate rewrites a read whose name one import binds to parallel_state and another to a user's module "
        "(if use_fake: from pkg import fake_mpu as mpu / else: from megatron.core import parallel_state as mpu): "
        "the stand-in's answers become the grid's",
        file="pgregistry/migrate/_plan.py",
        find="name is not None and _names_within(imported, m) and len(imported)",
        replace="name is not None and len(imported)",
        tests=(
            "tests/migrate/test_migrate_differential.py::test_the_migrated_function_behaves_as_the_original["
            "hostile:hostile.shapes.on_a_fallback_import[stand-in]-a]",
            "tests/migrate/test_migrate_side_by_side.py::"
            "test_a_name_bound_to_another_module_than_megatron_cores_parallel_state_is_not_read_as_it",
        ),
    ),
    Mutant(
        name="migrate-any-parallel-state-module-read-as-megatron-cores",
        bug="migrate, under the default names, rewrites reads of vLLM's or Apex's parallel_state into reads of "
        "Megatron-Core's, which the fallback helper reads: another module's globals",
        file="pgregistry/migrate/_plan.py",
        find="    if not bound or bound & set(_MEGATRON_STATE):\n",
        replace="    if True:\n",
        tests=(
            "tests/migrate/test_migrate_side_by_side.py::"
            "test_a_name_bound_to_another_module_than_megatron_cores_parallel_state_is_not_read_as_it",
            "tests/migrate/test_migrate_only_parallel_state.py::"
            "test_under_the_default_names_another_module_named_parallel_state_is_not_megatron_cores",
        ),
    ),
    Mutant(
        name="migrate-module-own-accessor-read-as-parallel-states",
        bug="migrate takes a module's own def of an accessor's name (get_tensor_model_parallel_rank over a star "
        "import of parallel_state) for parallel_state's: the fork's answer becomes the grid's",
        file="pgregistry/migrate/_plan.py",
        find="defined = heads & _module_level_definitions(module_syntax) if ambiguous else set()",
        replace="defined: set[str] = set()",
        tests=(
            "tests/migrate/test_migrate_differential.py::test_the_migrated_function_behaves_as_the_original["
            "hostile:hostile.overrides.own_and_star_ranks-a]",
            "tests/migrate/test_migrate_only_parallel_state.py::"
            "test_a_modules_own_definition_of_an_accessors_name_is_not_parallel_states",
        ),
    ),
)


# ---------------------------------------------------------------------------------------------------- the list


def stale(mutants: Sequence[Mutant], root: Path) -> list[str]:
    """What no longer holds of ``mutants`` in the tree at ``root``: a missing file, a snippet not found exactly
    once, a listed test whose file or function is gone, a name used twice."""
    problems = []
    names = [m.name for m in mutants]
    problems += [f"mutant name {name!r} is used twice" for name in sorted({n for n in names if names.count(n) > 1})]
    for mutant in mutants:
        path = root / mutant.file
        if not path.is_file():
            problems.append(f"{mutant.name}: {mutant.file} does not exist")
        else:
            count = path.read_text(encoding="utf-8").count(mutant.find)
            if count != 1:
                problems.append(f"{mutant.name}: its snippet occurs {count} times in {mutant.file}, not once")
        if not mutant.tests:
            problems.append(f"{mutant.name}: no test is listed to catch it")
        problems += [f"{mutant.name}: {problem}" for test in mutant.tests if (problem := _missing_test(test, root))]
    return problems


def _missing_test(node_id: str, root: Path) -> str | None:
    """Why ``node_id`` names no test function under ``root`` (None when it does): checked from the file's ``ast``,
    without collecting it."""
    file, _, function = node_id.partition("::")
    function = function.partition("[")[0]
    path = root / file
    if not path.is_file():
        return f"test file {file} does not exist"
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    defined = {node.name for node in tree.body if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)}
    return None if function in defined else f"{file} defines no test {function!r}"


# ------------------------------------------------------------------------------------------------ the copy


def copy_repository(repo: Path, destination: Path) -> None:
    """The files git tracks in ``repo`` and those it does not ignore, as they are on disk, into ``destination``."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=repo, capture_output=True, check=True, timeout=60,
    ).stdout.decode()
    for relative in filter(None, listed.split("\0")):
        source = repo / relative
        if source.is_file():  # a tracked file deleted in the working tree, or a submodule, is not copied
            target = destination / relative
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)


@dataclass(frozen=True)
class Outcome:
    """A pytest run: its exit code, the node ids that failed or errored, its output's tail, its duration."""

    returncode: int
    failed: frozenset[str]
    tail: str
    seconds: float


def run_tests(copy: Path, node_ids: Sequence[str], python: str) -> Outcome:
    """Run ``node_ids`` in ``copy`` with ``python -m pytest``, importing the copy's package."""
    environment = {**os.environ, "PYTHONPATH": str(copy), "COLUMNS": "250", "PYTHONDONTWRITEBYTECODE": "1"}
    start = time.monotonic()
    try:
        done = subprocess.run(
            [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfE", *node_ids],
            cwd=copy, env=environment, capture_output=True, text=True, timeout=PYTEST_TIMEOUT_S,
        )
        returncode, output = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as expired:
        returncode, output = -1, f"pytest ran past {PYTEST_TIMEOUT_S} s: {expired.stdout!r}"
    failed = frozenset(
        line.split(" ", 2)[1] for line in output.splitlines() if line.startswith(("FAILED ", "ERROR ")) and " " in line
    )
    return Outcome(returncode, failed, "\n".join(output.strip().splitlines()[-15:]), time.monotonic() - start)


def failed_tests(outcome: Outcome, node_ids: Sequence[str]) -> list[str]:
    """The ids of ``node_ids`` that failed in ``outcome`` (an id without parameters: any of its parameters)."""
    return [
        node_id for node_id in node_ids
        if any(failed == node_id or failed.startswith(node_id + "[") for failed in outcome.failed)
    ]


def _imports_the_copy(copy: Path, python: str) -> bool:
    environment = {**os.environ, "PYTHONPATH": str(copy)}
    done = subprocess.run(
        [python, "-c", "import pgregistry; print(pgregistry.__file__)"],
        cwd=copy, env=environment, capture_output=True, text=True, timeout=60,
    )
    return done.returncode == 0 and Path(done.stdout.strip()).resolve().is_relative_to(copy.resolve())


# ----------------------------------------------------------------------------------------------------- the run


@dataclass(frozen=True)
class Verdict:
    mutant: Mutant
    outcome: Outcome
    failed: tuple[str, ...]

    @property
    def caught(self) -> bool:
        return len(self.failed) == len(self.mutant.tests)


def run(mutants: Sequence[Mutant], repo: Path, python: str, emit: Callable[[str], None] = print) -> int:
    """Check, copy, run the baseline, then every mutant; ``emit`` the table; return the exit code."""
    problems = stale(mutants, repo)
    if problems:
        emit("the mutant list went stale (fix it in scripts/mutants.py):")
        for problem in problems:
            emit(f"  {problem}")
        return 2
    with tempfile.TemporaryDirectory(prefix="pgregistry-mutants-") as temporary:
        copy = Path(temporary) / "repo"
        copy_repository(repo, copy)
        if not _imports_the_copy(copy, python):
            emit(f"{python} does not import the copy's pgregistry with PYTHONPATH={copy}; cannot judge anything")
            return 1
        every_test = list(dict.fromkeys(test for mutant in mutants for test in mutant.tests))
        baseline = run_tests(copy, every_test, python)
        emit(f"baseline: {len(every_test)} tests unmutated, exit {baseline.returncode}, {baseline.seconds:.0f} s")
        if baseline.returncode != 0:
            emit("listed tests fail without any mutant (a red test catches nothing):")
            emit(baseline.tail)
            return 1
        verdicts = []
        for mutant in mutants:
            path = copy / mutant.file
            original = path.read_text(encoding="utf-8")
            path.write_text(original.replace(mutant.find, mutant.replace), encoding="utf-8")
            try:
                outcome = run_tests(copy, mutant.tests, python)
            finally:
                path.write_text(original, encoding="utf-8")
            verdict = Verdict(mutant, outcome, tuple(failed_tests(outcome, mutant.tests)))
            verdicts.append(verdict)
            emit(f"{mutant.name}: {'caught' if verdict.caught else 'SURVIVED'} ({outcome.seconds:.0f} s)")
            if not verdict.caught:
                emit(outcome.tail)
    emit("")
    emit(table(verdicts))
    survived = [v.mutant.name for v in verdicts if not v.caught]
    emit("")
    emit(f"{len(verdicts) - len(survived)} of {len(verdicts)} mutants caught" + (
        f"; SURVIVED: {', '.join(survived)}" if survived else ""
    ))
    return 1 if survived else 0


def table(verdicts: Sequence[Verdict]) -> str:
    rows = [("mutant", "file", "tests failed", "verdict", "seconds", "bug")]
    rows += [
        (
            v.mutant.name, v.mutant.file, f"{len(v.failed)} of {len(v.mutant.tests)}",
            "caught" if v.caught else "SURVIVED", f"{v.outcome.seconds:.0f}", v.mutant.bug,
        )
        for v in verdicts
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    lines = ("  ".join([*(cell.ljust(w) for cell, w in zip(row[:-1], widths, strict=True)), row[-1]]) for row in rows)
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Apply planted bugs to a copy of the repository; each must be caught.")
    parser.add_argument("--only", nargs="+", metavar="NAME", help="run these mutants only")
    parser.add_argument("--list", action="store_true", help="print the mutants and their tests; run nothing")
    args = parser.parse_args(argv)
    chosen = list(MUTANTS)
    if args.only:
        unknown = sorted(set(args.only) - {m.name for m in MUTANTS})
        if unknown:
            parser.error(f"unknown mutant(s) {', '.join(unknown)}; known: {', '.join(m.name for m in MUTANTS)}")
        chosen = [m for m in MUTANTS if m.name in args.only]
    if args.list:
        for mutant in chosen:
            print(f"{mutant.name}: {mutant.bug}\n  {mutant.file}\n" + "".join(f"  {t}\n" for t in mutant.tests))
        return 0
    return run(chosen, REPO, sys.executable)


if __name__ == "__main__":
    sys.exit(main())

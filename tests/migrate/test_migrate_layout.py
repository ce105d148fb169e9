"""Lines the rewrite makes too long are split as black splits them, at the tree's own line length.

The expected texts are black's own output (black 26.10, ``-l 100``) for the same lines: a line the rewrite leaves
too long, or splits otherwise than black, is what a maintainer would have to reformat by hand."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

pytest.importorskip("libcst")

import libcst as cst  # noqa: E402

from pgregistry._source.config import ConfigError  # noqa: E402
from pgregistry.migrate._layout import split_header, split_statement  # noqa: E402
from pgregistry.migrate._style import line_length  # noqa: E402

#: (a line at one indentation level, black's output for it at 100 columns)
BLACK = [
    (
        'tp_group = tp_group if tp_group is not None else pg_group(pg_collection, "tp_cp_something_long_enough")',
        'tp_group = (\n'
        '    tp_group if tp_group is not None else pg_group(pg_collection, "tp_cp_something_long_enough")\n'
        ')',
    ),
    (
        'return pg_rank(pg_collection, "dp_gtp_remat"), pg_read(pg_collection, "pp", "last_stage"), '
        'pg_read(pg_collection, "pp", "next_rank")',
        'return (\n'
        '    pg_rank(pg_collection, "dp_gtp_remat"),\n'
        '    pg_read(pg_collection, "pp", "last_stage"),\n'
        '    pg_read(pg_collection, "pp", "next_rank"),\n'
        ')',
    ),
    (
        'x = pg_group(pg_collection, "tp_cp") if config.tp_only_amax_red else pg_group(pg_collection, "tp_dp_cp")',
        'x = (\n'
        '    pg_group(pg_collection, "tp_cp")\n'
        '    if config.tp_only_amax_red\n'
        '    else pg_group(pg_collection, "tp_dp_cp")\n'
        ')',
    ),
    (
        'return pg_rank(pg_collection_long_name, "tp") == 0 and pg_size(pg_collection_long_name, "cp") == 1 and x',
        'return (\n'
        '    pg_rank(pg_collection_long_name, "tp") == 0\n'
        '    and pg_size(pg_collection_long_name, "cp") == 1\n'
        '    and x\n'
        ')',
    ),
    (
        'self.something_long.call_method(first_argument, pg_group(self.pg_collection, "dp_cp_gtp_remat"), third=3)',
        'self.something_long.call_method(\n'
        '    first_argument, pg_group(self.pg_collection, "dp_cp_gtp_remat"), third=3\n'
        ')',
    ),
    (
        'total = compute_something_long(first_argument, second_argument) + pg_size(self.pg_collection, "tp")',
        'total = compute_something_long(first_argument, second_argument) + pg_size(\n'
        '    self.pg_collection, "tp"\n'
        ')',
    ),
    (
        'mpu_groups = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["ep", "tp", "cp", "expt_tp", '
        '"expt_dp", "expt_dp_gtp_remat", "tp_ep", "tp_cp", "tp_dp_cp"])',
        'mpu_groups = ProcessGroupCollection.use_mpu_process_groups(\n'
        '    required_pgs=[\n'
        + "".join(f'        "{name}",\n' for name in ("ep", "tp", "cp", "expt_tp", "expt_dp", "expt_dp_gtp_remat",
                                                     "tp_ep", "tp_cp", "tp_dp_cp"))
        + '    ]\n'
        ')',
    ),
    (  # two delimiters of the lowest priority: parentheses, though it ends in a call
        'return pg_rank(pg_collection_long_name, "tp") == 0 and first_flag and pg_size(pg_collection, "cp")',
        'return (\n'
        '    pg_rank(pg_collection_long_name, "tp") == 0 and first_flag and pg_size(pg_collection, "cp")\n'
        ')',
    ),
    (
        'return pg_rank(pg_collection_long_name, "tp_cp"), pg_rank(pg_collection_long_name, "tp"), pg_size(x)',
        'return (\n'
        '    pg_rank(pg_collection_long_name, "tp_cp"),\n'
        '    pg_rank(pg_collection_long_name, "tp"),\n'
        '    pg_size(x),\n'
        ')',
    ),
    (
        'value = pg_rank(pg_collection, "dp_gtp_remat") == 0 and pg_read(pg_collection, "pp", "last_stage")',
        'value = pg_rank(pg_collection, "dp_gtp_remat") == 0 and pg_read(\n'
        '    pg_collection, "pp", "last_stage"\n'
        ')',
    ),
]


@pytest.mark.parametrize(("line", "black"), BLACK)
def test_a_statement_is_split_as_black_splits_it(line: str, black: str) -> None:
    statement = cst.parse_statement(f"{line}  # kept\n")
    assert isinstance(statement, cst.SimpleStatementLine)
    split = split_statement(statement, 4, 100, "    ")
    assert cst.Module([split]).code == black + "  # kept\n"


def test_a_nested_conditional_gets_its_own_parentheses_as_black_gives_them() -> None:
    source = textwrap.dedent("""\
        class L:
            def __init__(self, tp_group=None, pg_collection=None):
                self.tp_group = tp_group if tp_group is not None else pg_group(pg_collection, "expt_tp") if self.is_expert else pg_group(pg_collection, "tp")
        """)  # noqa: E501
    method = cst.parse_module(source).body[0].body.body[0]  # type: ignore[attr-defined]
    statement = method.body.body[0]
    assert cst.Module([split_statement(statement, 8, 100, "    ")]).code == (
        "self.tp_group = (\n"
        "    tp_group\n"
        "    if tp_group is not None\n"
        "    else (\n"
        '        pg_group(pg_collection, "expt_tp")\n'
        "        if self.is_expert\n"
        '        else pg_group(pg_collection, "tp")\n'
        "    )\n"
        ")\n"
    )


def test_a_value_in_parentheses_on_its_own_line_is_split_where_it_no_longer_fits() -> None:
    # Megatron-Core's TransformerBlock.forward, once the call passes the collection (black's output)
    statement = cst.parse_statement(
        "outer_quantization_context = (\n"
        "    get_fp8_context(self.config, pg_collection=self.pg_collection) if use_outer_quantization_context "
        "else nullcontext()\n"
        ")\n"
    )
    assert isinstance(statement, cst.SimpleStatementLine)
    assert cst.Module([split_statement(statement, 12, 100, "    ")]).code == (
        "outer_quantization_context = (\n"
        "    get_fp8_context(self.config, pg_collection=self.pg_collection)\n"
        "    if use_outer_quantization_context\n"
        "    else nullcontext()\n"
        ")\n"
    )


def test_a_tuple_with_a_starred_element_is_left() -> None:
    statement = cst.parse_statement(
        'return *leading_values_of_the_tuple, pg_group(pg_collection, "tp"), pg_size(pg_collection, "cp"), x\n')
    assert isinstance(statement, cst.SimpleStatementLine)
    assert split_statement(statement, 4, 100, "    ") is statement


def test_a_line_that_fits_or_spans_lines_already_is_left() -> None:
    for line in ('x = pg_group(pg_collection, "tp")\n', 'x = f(\n    a, pg_group(pg_collection, "tp")\n)\n'):
        statement = cst.parse_statement(line)
        assert isinstance(statement, cst.SimpleStatementLine)
        assert split_statement(statement, 0, 20 if "\n    " in line else 100, "    ") is statement


@pytest.mark.parametrize(("header", "black"), [
    (
        "def is_not_duplicate_with_a_long_name(param, tp_group=None, another_group=None, *, pg_collection=None):",
        "def is_not_duplicate_with_a_long_name(\n"
        "    param, tp_group=None, another_group=None, *, pg_collection=None\n):",
    ),
    (
        "def is_not_duplicate_with_a_longer_name(parameter_one, parameter_two, tp_group=None, another_group=None, *, "
        "pg_collection=None):",
        "def is_not_duplicate_with_a_longer_name(\n"
        "    parameter_one, parameter_two, tp_group=None, another_group=None, *, pg_collection=None\n):",
    ),
    (  # a header split before, whose line of parameters the new one makes too long
        "def get_model_with_a_long_name(\n    tokenizer, prompts=None, tokens_to_generate=None, add_BOS=None, "
        "rank=0, data_parallel=False, *, pg_collection=None\n):",
        "def get_model_with_a_long_name(\n"
        + "".join(f"    {p},\n" for p in ("tokenizer", "prompts=None", "tokens_to_generate=None", "add_BOS=None",
                                         "rank=0", "data_parallel=False", "*", "pg_collection=None"))
        + "):",
    ),
    (
        "def f(parameter_one: int, parameter_two: str = 'x', /, *args: int, keyword: bool = False, "
        "pg_collection=None, **kwargs) -> int:",
        "def f(\n    parameter_one: int,\n    parameter_two: str = 'x',\n    /,\n    *args: int,\n"
        "    keyword: bool = False,\n    pg_collection=None,\n    **kwargs,\n) -> int:",
    ),
])
def test_a_def_line_is_split_as_black_splits_it(header: str, black: str) -> None:
    function = cst.parse_statement(f"@decorated\n{header}\n    pass\n")
    assert isinstance(function, cst.FunctionDef)
    assert cst.Module([split_header(function, 0, 100 if "->" not in header else 60, "    ")]).code == (
        f"@decorated\n{black}\n    pass\n")


@pytest.mark.parametrize(("files", "width"), [
    ({}, 100),
    ({"pyproject.toml": "[tool.ruff]\nline-length = 88\n[tool.black]\nline-length = 79\n"}, 88),
    ({"pyproject.toml": "[tool.black]\nline-length = 79\n"}, 79),
    ({"ruff.toml": "line-length = 110\n", "pyproject.toml": "[tool.black]\nline-length = 79\n"}, 110),
    ({"setup.cfg": "[flake8]\nmax-line-length = 119\n"}, 119),
    ({".flake8": "[flake8]\nmax-line-length = 120\n", "setup.cfg": "[flake8]\nmax-line-length = 119\n"}, 120),
])
def test_the_line_length_is_the_projects(tmp_path: Path, files: dict[str, str], width: int) -> None:
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    assert line_length(tmp_path) == width


def test_a_line_length_that_is_no_number_is_named(tmp_path: Path) -> None:
    (tmp_path / "pyproject.toml").write_text('[tool.ruff]\nline-length = "wide"\n')
    with pytest.raises(ConfigError, match=r"\[tool.ruff\] line-length must be a positive whole number, not 'wide'"):
        line_length(tmp_path)


def test_a_migration_keeps_to_the_trees_line_length(tmp_path: Path) -> None:
    from pgregistry._source.config import PRESETS
    from pgregistry._source.files import SourceFile
    from pgregistry.migrate._engine import Helper, migrate

    source = textwrap.dedent("""\
        from megatron.core import parallel_state as ps


        def shard_the_input_tensor_across_ranks(x, tp_group=None):
            tp_group = tp_group or ps.get_tensor_model_parallel_group()
            return ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
        """)
    (tmp_path / "m.py").write_text(source)
    for width in (79, 100):
        migration = migrate([SourceFile("m.py", tmp_path / "m.py")], PRESETS["megatron"], target="megatron",
                            name="pg_collection", helper=Helper(width=width))
        text = {change.path: change.after.decode() for change in migration.changes}["m.py"]
        assert max(map(len, text.splitlines())) <= width, text
        one_line = "def shard_the_input_tensor_across_ranks(x, tp_group=None, *, pg_collection=None):"
        assert (one_line in text) == (width == 100)


def _migrated(tmp_path: Path, source: str, width: int = 100) -> str:
    from pgregistry._source.config import PRESETS
    from pgregistry._source.files import SourceFile
    from pgregistry.migrate._engine import Helper, migrate

    (tmp_path / "m.py").write_text(source)
    migration = migrate([SourceFile("m.py", tmp_path / "m.py")], PRESETS["megatron"], target="megatron",
                        name="pg_collection", helper=Helper(width=width))
    return {change.path: change.after.decode() for change in migration.changes}["m.py"]


def test_a_conditional_argument_made_too_long_in_a_call_of_one_argument_a_line_is_split_as_black_splits_it(
    tmp_path: Path,
) -> None:
    # Megatron-Bridge 0.6.2's FalconH1 and Wan providers; the argument the author wrote too long stays
    source = textwrap.dedent("""\
        from megatron.core import parallel_state as ps


        class Provider:
            def provide(self, pre_process=None, post_process=None):
                return Model(
                    self,
                    pre_process=ps.is_pipeline_first_stage() if pre_process is None else pre_process,
                    post_process=ps.is_pipeline_last_stage() if post_process is None else post_process,
                    the_authors_long_argument=some_function_of_the_authors(first_argument, second_argument_long),
                )
        """)
    assert textwrap.dedent("""\
        class Provider:
            def provide(self, pre_process=None, post_process=None, *, pg_collection=None):
                return Model(
                    self,
                    pre_process=(
                        pg_read(pg_collection, "pp", "first_stage") if pre_process is None else pre_process
                    ),
                    post_process=(
                        pg_read(pg_collection, "pp", "last_stage") if post_process is None else post_process
                    ),
                    the_authors_long_argument=some_function_of_the_authors(first_argument, second_argument_long),
                )
        """) in _migrated(tmp_path, source)


def test_a_call_argument_made_too_long_in_a_call_of_one_argument_a_line_gets_its_own_lines(tmp_path: Path) -> None:
    # NeMo 3.0.0's MainParamsOptimizerWrapper.__init__, once the call passes the collection (black's output)
    source = textwrap.dedent("""\
        from megatron.core import parallel_state as ps


        def _get_grad_data_group(is_expert):
            if is_expert:
                return ps.get_expert_data_parallel_group()
            return ps.get_data_parallel_group(with_context_parallel=True)


        class Optimizer:
            def __init__(self, param_groups, async_grad_allreduce):
                self.buffers = {}
                if async_grad_allreduce and ps.get_data_parallel_world_size(with_context_parallel=True) > 1:
                    for i, param_group in enumerate(param_groups):
                        if param_group:
                            self.buffers[i] = GradBucket(
                                len(param_group),
                                _get_grad_data_group(param_group.get("is_expert", False)),
                            )
        """)
    assert textwrap.indent(textwrap.dedent("""\
        self.buffers[i] = GradBucket(
            len(param_group),
            _get_grad_data_group(
                param_group.get("is_expert", False), pg_collection=pg_collection
            ),
        )
        """), " " * 20) in _migrated(tmp_path, source)


def test_an_arithmetic_keyword_argument_made_too_long_is_split_at_its_operator_as_black_splits_it(
    tmp_path: Path,
) -> None:
    # megatron-core 0.19.2's DynamicInferenceContext: ``self.round_up_tokens(...) // tp_size`` once it passes the
    # collection; the argument the author wrote too long stays
    source = textwrap.dedent("""\
        from megatron.core import parallel_state as ps


        def round_up_tokens(tokens):
            return tokens * ps.get_tensor_model_parallel_world_size()


        class Context:
            def allocate(self, tp_size):
                if ps.get_tensor_model_parallel_rank() == 0:
                    Dispatcher.allocate_buffers(
                        per_rank_worst_case_token_count=round_up_tokens(self.max_tokens) // tp_size,
                        the_authors_long_argument=some_function_of_the_authors(first_argument, second_argument) // 2,
                    )
        """)
    assert textwrap.indent(textwrap.dedent("""\
        Dispatcher.allocate_buffers(
            per_rank_worst_case_token_count=round_up_tokens(
                self.max_tokens, pg_collection=pg_collection
            )
            // tp_size,
            the_authors_long_argument=some_function_of_the_authors(first_argument, second_argument) // 2,
        )
        """), " " * 12) in _migrated(tmp_path, source)


def test_a_condition_in_parentheses_after_not_made_too_long_is_split_at_its_and_as_black_splits_it(
    tmp_path: Path,
) -> None:
    # megatron-core 0.19.2's two inference model wrappers: ``not (is_pipeline_first_stage(...) and ...)``
    source = textwrap.dedent("""\
        from megatron.core import parallel_state as ps


        def is_first_stage_of_the_pipeline(group):
            return ps.is_pipeline_first_stage(ignore_virtual=True)


        def is_last_stage_of_the_pipeline(group):
            return ps.is_pipeline_last_stage(ignore_virtual=True)


        class Wrapper:
            def prep_model_for_inference(self):
                self.model_is_pipeline_parallel = not (
                    is_first_stage_of_the_pipeline(self.pp_group) and is_last_stage_of_the_pipeline(self.pp_group)
                )
        """)
    assert textwrap.indent(textwrap.dedent("""\
        self.model_is_pipeline_parallel = not (
            is_first_stage_of_the_pipeline(self.pp_group, pg_collection=pg_collection)
            and is_last_stage_of_the_pipeline(self.pp_group, pg_collection=pg_collection)
        )
        """), " " * 8) in _migrated(tmp_path, source)


def test_a_dict_comprehensions_conditional_key_made_too_long_is_split_as_black_splits_it(tmp_path: Path) -> None:
    # megatron-core 0.19.2's DistributedOptimizer: ``(self._param_name(k) if ... else k): v``
    source = textwrap.dedent("""\
        from megatron.core import parallel_state as ps


        class Optimizer:
            def _param_name(self, param):
                return f"{param}-{ps.get_tensor_model_parallel_rank()}"

            def state_dict(self):
                packed_state = {
                    (self._param_name(k) if isinstance(k, torch.Tensor) else k): v
                    for k, v in self.state.items()
                }
                authors_state = {
                    (self.the_authors_own_long_name_of_a_key_function(k) if isinstance(k, torch.Tensor) else k): v
                    for k, v in self.state.items()
                }
                return packed_state, authors_state
        """)
    migrated = _migrated(tmp_path, source)
    assert textwrap.indent(textwrap.dedent("""\
        packed_state = {
            (
                self._param_name(k, pg_collection=pg_collection)
                if isinstance(k, torch.Tensor)
                else k
            ): v
            for k, v in self.state.items()
        }
        """), " " * 8) in migrated
    assert "(self.the_authors_own_long_name_of_a_key_function(k) if isinstance(k, torch.Tensor) else k): v" in migrated


def test_a_call_followed_by_an_empty_call_made_too_long_gets_its_arguments_split_as_black_splits_it(
    tmp_path: Path,
) -> None:
    # megatron-core 0.19.2's get_global_unique_param_name: ``handle_experts_in_state_dict(...).keys()``
    source = textwrap.dedent("""\
        from megatron.core import parallel_state as ps


        def handle_experts_in_state_dict(state_dict, num_experts):
            return {f"{k}-{ps.get_expert_model_parallel_rank()}": v for k, v in state_dict.items()}


        def get_global_unique_param_name(model_chunks, param_name):
            num_experts = model_chunks[0].config.num_moe_experts if model_chunks else None
            param_name = next(iter(handle_experts_in_state_dict({param_name: None}, num_experts).keys()))
            return param_name
        """)
    assert textwrap.indent(textwrap.dedent("""\
        param_name = next(
            iter(
                handle_experts_in_state_dict(
                    {param_name: None}, num_experts, pg_collection=pg_collection
                ).keys()
            )
        )
        """), " " * 4) in _migrated(tmp_path, source)


def test_a_statement_made_too_long_with_its_trailing_comment_is_split_as_black_splits_it(tmp_path: Path) -> None:
    # Megatron-LM d98e8a64dd's GDN context-parallel all-to-all: ``V = _all_to_all_cp2hp(...)  # (l*cp, ...)``
    source = textwrap.dedent("""\
        from megatron.core import parallel_state as ps


        def _all_to_all_cp2hp(tensor, group):
            return tensor * ps.get_context_parallel_world_size()


        class Layer:
            def mix(self, V, K):
                V = _all_to_all_cp2hp(V, self.cp_group)  # (l*cp, b*M, d_inner/cp) the layout after it
                K = _all_to_all_cp2hp(K, self.cp_group)  # short
                return V, K * ps.get_context_parallel_rank()
        """)
    assert textwrap.indent(textwrap.dedent("""\
        V = _all_to_all_cp2hp(
            V, self.cp_group, pg_collection=pg_collection
        )  # (l*cp, b*M, d_inner/cp) the layout after it
        K = _all_to_all_cp2hp(K, self.cp_group, pg_collection=pg_collection)  # short
        """), " " * 8) in _migrated(tmp_path, source)


def test_a_line_of_arguments_made_too_long_by_the_added_comma_gets_one_argument_a_line_as_black_splits_it(
    tmp_path: Path,
) -> None:
    # Megatron-LM d98e8a64dd's GDN hidden-parallel to context-parallel all-to-all; a shorter line keeps its layout
    source = textwrap.dedent("""\
        from megatron.core import parallel_state as ps


        def tensor_a2a_hp2cp(tensor, seq_dim, head_dim, cp_group, redo_attention_load_balancing):
            return tensor * ps.get_context_parallel_world_size()


        def gdn_hp2cp(norm_out, cp_group):
            if cp_group is not None:
                norm_out = tensor_a2a_hp2cp(
                    norm_out, seq_dim=0, head_dim=-1, cp_group=cp_group, redo_attention_load_balancing=False
                )
            return tensor_a2a_hp2cp(
                norm_out, seq_dim=0, head_dim=-1, cp_group=cp_group
            )
        """)
    assert textwrap.indent(textwrap.dedent("""\
            norm_out = tensor_a2a_hp2cp(
                norm_out,
                seq_dim=0,
                head_dim=-1,
                cp_group=cp_group,
                redo_attention_load_balancing=False,
                pg_collection=pg_collection,
            )
        return tensor_a2a_hp2cp(
            norm_out, seq_dim=0, head_dim=-1, cp_group=cp_group,
            pg_collection=pg_collection
        )
        """), " " * 4) in _migrated(tmp_path, source)


def test_a_line_of_arguments_a_rewritten_read_made_too_long_gets_one_argument_a_line_as_black_splits_it(
    tmp_path: Path,
) -> None:
    # megatron-core 0.19.2's LLaVAModel: the read became pg_group(getattr(self, ...), "cp") on a shared argument line
    source = textwrap.dedent("""\
        from megatron.core.parallel_state import get_context_parallel_group


        def get_batch_on_this_cp_rank(batch, is_hybrid_cp, cp_group):
            return batch


        class LLaVAModel:
            def __init__(self, config, pg_collection=None):
                self.helper(config)
                self.pg_collection = pg_collection

            def helper(self, config):
                pass

            def forward(self, batch, packed_seq_params):
                if packed_seq_params is None or packed_seq_params.qkv_format == "sbhd":
                    batch = get_batch_on_this_cp_rank(
                        batch, is_hybrid_cp=False, cp_group=get_context_parallel_group()
                    )
                return batch
        """)
    migrated = _migrated(tmp_path, source)
    assert textwrap.indent(textwrap.dedent("""\
        batch = get_batch_on_this_cp_rank(
            batch,
            is_hybrid_cp=False,
            cp_group=pg_group(getattr(self, "pg_collection", None), "cp"),
        )
        """), " " * 12) in migrated
    assert max(map(len, migrated.splitlines())) <= 100


def test_an_authors_long_condition_the_rewrite_did_not_change_is_left(tmp_path: Path) -> None:
    # the ``if`` and ``while`` lines of a rewritten function are split only where the rewrite changed them
    source = textwrap.dedent("""\
        from megatron.core import parallel_state as ps


        def f(x):
            if some_function_of_the_authors(first_argument_of_it, second_argument_of_it, third_one_of_it_ok):
                return ps.get_tensor_model_parallel_rank()
            while some_function_of_the_authors(first_argument_of_it, second_argument_of_it, third_one_of_it):
                x = ps.get_tensor_model_parallel_world_size()
            return x
        """)
    migrated = _migrated(tmp_path, source)
    arguments = "(first_argument_of_it, second_argument_of_it, third_one_of_it"
    assert f"    if some_function_of_the_authors{arguments}_ok):\n" in migrated
    assert f"    while some_function_of_the_authors{arguments}):\n" in migrated

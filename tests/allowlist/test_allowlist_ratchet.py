"""The allowlist file (strict reading, deterministic writing) and the ratchet's transitions."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fixtures.scan_projects import scan

from pgregistry._source.scanner import FileResult
from pgregistry.allowlist._ratchet import (
    ALLOWLIST_VERSION,
    Allowlist,
    AllowlistError,
    compare_counts,
)


def results(**sources: str) -> list[FileResult]:
    """Scan each keyword's source as the file ``<keyword>.py``."""
    return [scan(source, f"{name}.py") for name, source in sources.items()]


BASE = """
class Model:
    def forward(self):
        return ps.get_tensor_model_parallel_group()

def helper():
    ps.get_data_parallel_rank()
    ps.get_data_parallel_rank()
"""


def test_dumps_is_sorted_versioned_and_byte_stable() -> None:
    one = Allowlist({"b.py": {"z|a|call": 1, "a|b|call": 2}, "a.py": {"<module>|x|reference": 1}})
    two = Allowlist({"a.py": {"<module>|x|reference": 1}, "b.py": {"a|b|call": 2, "z|a|call": 1}})
    text = one.dumps()
    assert text == two.dumps() and text.endswith("}\n")
    payload = json.loads(text)
    assert payload["version"] == ALLOWLIST_VERSION and payload["total"] == 4
    assert list(payload["allowed"]) == ["a.py", "b.py"]
    assert list(payload["allowed"]["b.py"]) == ["a|b|call", "z|a|call"]
    assert Allowlist.loads(text) == two
    assert Allowlist.loads(text).dumps() == text


def test_write_reports_whether_the_bytes_changed(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "allowlist.json"
    allowlist = Allowlist.from_results(results(m=BASE))
    assert allowlist.write(path, None) is True
    before = path.read_bytes()
    assert allowlist.write(path, before) is False
    assert path.read_bytes() == before


MALFORMED = {
    "not JSON": ("{", "malformed allowlist JSON"),
    "a list": ("[]", "must be a JSON object, not list"),
    "no version, Megatron-LM checker format": (
        '{"_comment": "", "allowed": {"a.py": ["12:get_x_group:call"]}, "total": 1}',
        "no 'version' (it looks like the line-number format of Megatron-LM's tool",
    ),
    "no version": ('{"total": 0}', "no 'version'"),
    "future version": ('{"version": 2, "allowed": {}, "total": 0}', "version 2 was written by a newer pgregistry"),
    "version as a string": ('{"version": "1", "allowed": {}, "total": 0}', "unsupported allowlist version '1'"),
    "version as a bool": ('{"version": true, "allowed": {}, "total": 0}', "unsupported allowlist version True"),
    "unknown field": ('{"version": 1, "allowed": {}, "total": 0, "extra": 1}', "unknown allowlist field(s): 'extra'"),
    "allowed not an object": ('{"version": 1, "allowed": [], "total": 0}', "'allowed' must be an object"),
    "entries not an object": ('{"version": 1, "allowed": {"a.py": ["x"]}, "total": 0}', "must be an object"),
    "absolute path": ('{"version": 1, "allowed": {"/a.py": {}}, "total": 0}', "not a project-relative POSIX path"),
    "key without three parts": ('{"version": 1, "allowed": {"a.py": {"f|g": 1}}, "total": 1}', "is not '<scope>|"),
    "empty key part": ('{"version": 1, "allowed": {"a.py": {"f||call": 1}}, "total": 1}', "is not '<scope>|"),
    "zero count": ('{"version": 1, "allowed": {"a.py": {"f|g|call": 0}}, "total": 0}', "not a positive integer"),
    "float count": ('{"version": 1, "allowed": {"a.py": {"f|g|call": 1.5}}, "total": 1}', "not a positive integer"),
    "bool count": ('{"version": 1, "allowed": {"a.py": {"f|g|call": true}}, "total": 1}', "not a positive integer"),
    "wrong total": ('{"version": 1, "allowed": {"a.py": {"f|g|call": 2}}, "total": 1}', "'total' is 1 but"),
    "missing total": ('{"version": 1, "allowed": {}}', "'total' is None but"),
}


@pytest.mark.parametrize("text, message", MALFORMED.values(), ids=MALFORMED.keys())
def test_malformed_allowlists_name_the_problem(text: str, message: str) -> None:
    with pytest.raises(AllowlistError) as error:
        Allowlist.loads(text, "list.json")
    assert str(error.value).startswith("list.json")
    assert message in str(error.value)


def test_missing_allowlist_says_how_to_create_it(tmp_path: Path) -> None:
    with pytest.raises(AllowlistError, match="no such allowlist; create it with `pgregistry allowlist update`"):
        Allowlist.load(tmp_path / "absent.json", "absent.json")


def _transition(before: str, after: str) -> tuple[list[tuple[str, int, int]], list[tuple[str, int, int]]]:
    allowed = Allowlist.from_results(results(m=before))
    comparison = compare_counts(results(m=after), allowed, lambda path: True)
    new = [(item.key, item.allowed, item.found) for item in comparison.new]
    stale = [(item.key, item.allowed, item.found) for item in comparison.stale]
    return new, stale


def test_unchanged_code_passes() -> None:
    assert _transition(BASE, BASE) == ([], [])


def test_shifted_lines_pass() -> None:
    shifted = "import os\n\n# a comment\n\n\n" + BASE.replace("def helper():", "def helper():\n    x = 1\n")
    assert _transition(BASE, shifted) == ([], [])


def test_moved_within_its_scope_passes() -> None:
    moved = BASE.replace(
        "def helper():\n    ps.get_data_parallel_rank()\n    ps.get_data_parallel_rank()\n",
        "def helper():\n    ps.get_data_parallel_rank()\n    for _ in range(3):\n        ps.get_data_parallel_rank()\n",
    )
    assert _transition(BASE, moved) == ([], [])


def test_a_new_read_fails() -> None:
    added = BASE + "\ndef fresh():\n    return mpu.get_context_parallel_group()\n"
    assert _transition(BASE, added) == ([("fresh|get_context_parallel_group|call", 0, 1)], [])


def test_one_more_read_in_an_allowed_scope_fails() -> None:
    added = BASE.replace("def helper():\n", "def helper():\n    ps.get_data_parallel_rank()\n")
    assert _transition(BASE, added) == ([("helper|get_data_parallel_rank|call", 2, 3)], [])


def test_a_removed_read_leaves_a_stale_entry() -> None:
    removed = BASE.replace("    ps.get_data_parallel_rank()\n", "", 1)
    assert _transition(BASE, removed) == ([], [("helper|get_data_parallel_rank|call", 2, 1)])


def test_a_renamed_class_is_reported_as_moved_not_failed() -> None:
    """Megatron-LM: a class renamed turned 11 sites into 11 "new" + 11 "stale"."""
    renamed = BASE.replace("class Model", "class GPTModel")
    comparison = compare_counts(results(m=renamed), Allowlist.from_results(results(m=BASE)), lambda path: True)
    assert comparison.ok
    assert [(m.old_key, m.new_key, m.count) for m in comparison.moves] == [
        (
            "Model.forward|get_tensor_model_parallel_group|call",
            "GPTModel.forward|get_tensor_model_parallel_group|call",
            1,
        )
    ]


def test_a_read_hoisted_into_a_helper_is_moved() -> None:
    hoisted = BASE.replace(
        "def helper():\n    ps.get_data_parallel_rank()\n    ps.get_data_parallel_rank()\n",
        "def _rank():\n    return ps.get_data_parallel_rank()\n\ndef helper():\n    _rank()\n"
        "    ps.get_data_parallel_rank()\n",
    )
    assert _transition(BASE, hoisted) == ([], [])


def test_a_move_beside_a_real_new_read_still_fails_by_exactly_one() -> None:
    renamed_plus_one = BASE.replace("def helper():\n", "def helper2():\n    ps.get_data_parallel_rank()\n")
    comparison = compare_counts(results(m=renamed_plus_one), Allowlist.from_results(results(m=BASE)), lambda path: True)
    assert not comparison.ok and comparison.new_sites == 1
    (item,) = comparison.new
    assert (item.key, item.found, item.allowed, item.moved) == ("helper2|get_data_parallel_rank|call", 3, 0, 2)


def test_a_moved_file_is_moved() -> None:
    """Megatron-LM: training/utils.py moved to training/utils/common_utils.py (15 "new" + 15 "stale")."""
    allowed = Allowlist.from_results(results(utils=BASE))
    moved = [scan(BASE, "utils/common_utils.py")]
    comparison = compare_counts(moved, allowed, lambda path: True)
    assert comparison.ok and sum(m.count for m in comparison.moves) == 3
    # With git's rename detection the scope may change too.
    renamed = [scan(BASE.replace("def helper", "def helper_v2"), "utils/common_utils.py")]
    assert not compare_counts(renamed, allowed, lambda path: True).ok
    assert compare_counts(renamed, allowed, lambda path: True, {"utils.py": "utils/common_utils.py"}).ok


def test_reads_do_not_move_between_unrelated_files() -> None:
    """A read removed from one file and one added to another that happens to have a same-named scope is a
    stale entry and a new read: the old file still exists with other reads, and git saw no rename."""
    allowed = Allowlist.from_results(results(a=BASE, b="def helper():\n    pass\n"))
    removed = BASE.replace("    ps.get_data_parallel_rank()\n", "", 1)
    comparison = compare_counts(
        results(a=removed, b="def helper():\n    ps.get_data_parallel_rank()\n"), allowed, lambda path: True
    )
    assert comparison.moves == () and comparison.new_sites == 1 and len(comparison.stale) == 1


def test_a_changed_form_is_a_new_read_and_a_stale_entry() -> None:
    changed = BASE.replace("return ps.get_tensor_model_parallel_group()", "return ps.get_tensor_model_parallel_group")
    new, stale = _transition(BASE, changed)
    assert [key for key, _, _ in new] == ["Model.forward|get_tensor_model_parallel_group|reference"]
    assert [key for key, _, _ in stale] == ["Model.forward|get_tensor_model_parallel_group|call"]


def test_a_deleted_file_leaves_stale_entries_only_where_the_scan_covers() -> None:
    allowed = Allowlist.from_results(results(m=BASE, gone=BASE))
    current = results(m=BASE)
    everywhere = compare_counts(current, allowed, lambda path: True)
    assert {item.path for item in everywhere.stale} == {"gone.py"}
    assert sum(item.allowed - item.found for item in everywhere.stale) == 3
    assert compare_counts(current, allowed, lambda path: path == "m.py").ok


def test_new_read_lists_every_site_of_its_key() -> None:
    allowed = Allowlist.from_results(results(m=BASE))
    added = BASE.replace("def helper():\n", "def helper():\n    ps.get_data_parallel_rank()\n")
    (item,) = compare_counts(results(m=added), allowed, lambda path: True).new
    assert [site.line for site in item.sites] == [7, 8, 9]


def test_merge_replaces_only_covered_paths() -> None:
    allowed = Allowlist({"a/x.py": {"f|g|call": 1}, "b/y.py": {"f|g|call": 2}})
    scanned = Allowlist({"a/z.py": {"h|g|call": 1}})
    merged = allowed.merge_scanned(scanned, lambda path: path.startswith("a/"))
    assert merged.entries == {"b/y.py": {"f|g|call": 2}, "a/z.py": {"h|g|call": 1}}


def test_an_extracted_nested_function_is_moved() -> None:
    nested = "def outer():\n    def inner():\n        return ps.get_data_parallel_group()\n    return inner()\n"
    extracted = "def inner():\n    return ps.get_data_parallel_group()\n\ndef outer():\n    return inner()\n"
    comparison = compare_counts(results(m=extracted), Allowlist.from_results(results(m=nested)), lambda path: True)
    assert comparison.ok
    assert [(m.old_key, m.new_key) for m in comparison.moves] == [
        ("outer.inner|get_data_parallel_group|call", "inner|get_data_parallel_group|call")
    ]

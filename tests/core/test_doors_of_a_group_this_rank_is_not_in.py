"""A door's read of a group this rank is in none of (``NOT_MEMBER``) names the field and what to test first.

A middle pipeline stage holds no embedding, so it is in no ``embd`` group: ``pg_rank(pg, "embd")`` (what
``pgregistry migrate`` writes for ``parallel_state.get_embedding_group`` reads) failed there with ``AttributeError:
'NotMember' object has no attribute 'rank'``, from inside the helper that reads a group. A 3-stage gloo world.
"""

from __future__ import annotations

from typing import Any

from pgregistry import registry
from pgregistry.collection import NOT_MEMBER
from pgregistry.doors import pg_group, pg_rank, pg_read, pg_size
from pgregistry.layout import ParallelLayout
from pgregistry.testing import run_world


def _reads_of_the_embedding_groups() -> dict[str, Any]:
    collection = registry.build(ParallelLayout(num_ranks=3, pp=3))
    out: dict[str, Any] = {}
    for field in ("embd", "pos_embd"):
        out[f"{field} group is NOT_MEMBER"] = pg_group(collection, field) is NOT_MEMBER
        reads = {
            "rank": lambda field=field: pg_rank(collection, field),
            "size": lambda field=field: pg_size(collection, field),
            "global_ranks": lambda field=field: pg_read(collection, field, "global_ranks"),
        }
        for kind, read in reads.items():
            try:
                out[f"{field} {kind}"] = read()
            except ValueError as error:
                out[f"{field} {kind}"] = f"ValueError: {error}"
    return out


def test_a_read_of_a_group_this_rank_is_in_none_of_names_the_field_and_the_test_to_make() -> None:
    outs = run_world(3, _reads_of_the_embedding_groups, timeout=60.0)
    # Megatron-Core's rank sets: embd holds the first and last stages, pos_embd the first.
    members = {"embd": [0, 2], "pos_embd": [0]}
    for rank, out in enumerate(outs):
        for field, ranks in members.items():
            assert out[f"{field} group is NOT_MEMBER"] == (rank not in ranks), (rank, field)
            if rank in ranks:
                assert out[f"{field} rank"] == ranks.index(rank) and out[f"{field} size"] == len(ranks)
                assert out[f"{field} global_ranks"] == ranks
                continue
            for kind in ("rank", "size", "global_ranks"):
                assert out[f"{field} {kind}"] == (
                    f"ValueError: {__name__}._reads_of_the_embedding_groups reads the {kind} of the {field!r} "
                    f"group, but this rank belongs to no {field!r} group (NOT_MEMBER: a pipeline stage holding no "
                    f"embedding is in no embedding group); test pg_group(pg_collection, {field!r}) is NOT_MEMBER "
                    "first, where Megatron-Core's code tests is_rank_in_embedding_group()"
                ), (rank, field, kind, out)

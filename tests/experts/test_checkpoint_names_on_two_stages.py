"""Pipeline stages holding a parameter of one global name are refused on every rank; one stage's was kept for both.

Two stages given one layer offset (``layer_offset`` 0 on both, where the second starts at layer 1) both name their
layer ``layers.0.weight``. ``save_distributed`` kept one stage's tensor under the name and a load gave it to both
(stage 1's weights came back as stage 0's, without a word); ``save_rank_files`` wrote both, and its load refused
the files as storing a key twice. A load with the wrong offsets and ``strict=False`` gave stage 1 stage 0's layer.
A tied copy marked ``shared`` may carry its original's name (Megatron-Core's last stage holds
``embedding.word_embeddings.weight`` for multi-token prediction): only its original's stage writes it, where both
did and ``load_rank_files`` refused the files. 2 gloo ranks, PP 2; the oracle is what each stage holds."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from checkpoint_support import LOAD, SAVE
from fixtures.errors import value_error_of
from torch import nn

from pgregistry import ParallelLayout, attach, build
from pgregistry.params import mark_shared
from pgregistry.testing import run_world


def _stage(offsets: tuple[int, int], value: float, *, tied: bool = False) -> nn.Module:
    """This stage's one layer, filled with ``value + stage``; a tied ``embedding`` of 7s on both, if ``tied``."""
    stage = torch.distributed.get_rank()
    model = nn.Module()
    model.layers = nn.ModuleList([nn.Linear(2, 2, bias=False)])
    model.layer_offset = offsets[stage]
    with torch.no_grad():
        model.layers[0].weight.fill_(value + stage)
    if tied:
        model.embedding = nn.Parameter(torch.full((2,), 7.0))
        if stage == 1:
            mark_shared(model.embedding)
    attach(model, build(ParallelLayout(num_ranks=2, pp=2)))
    return model


def _layer_of(model: nn.Module) -> list[list[float]]:
    return model.layers[0].weight.tolist()


def _one_offset_on_both(directory: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for fmt in SAVE:
        out[f"save {fmt}"] = value_error_of(lambda fmt=fmt: SAVE[fmt](f"{directory}/{fmt}-alike", _stage((0, 0), 1)))
        out[f"written {fmt}"] = sorted(p.name for p in Path(directory, f"{fmt}-alike").glob("*"))
        SAVE[fmt](f"{directory}/{fmt}", _stage((0, 1), 1.0))
        misnamed = _stage((0, 0), -1.0)
        out[f"load {fmt}"] = value_error_of(
            lambda fmt=fmt, misnamed=misnamed: LOAD[fmt](f"{directory}/{fmt}", misnamed, strict=False)
        )
        out[f"kept {fmt}"] = _layer_of(misnamed)
        loaded = _stage((0, 1), -1.0)
        LOAD[fmt](f"{directory}/{fmt}", loaded)  # the control: offsets right
        out[f"loaded {fmt}"] = _layer_of(loaded)
        SAVE[fmt](f"{directory}/{fmt}-tied", _stage((0, 1), 1.0, tied=True))
        tied = _stage((0, 1), -1.0, tied=True)
        with torch.no_grad():
            tied.embedding.zero_()
        LOAD[fmt](f"{directory}/{fmt}-tied", tied)
        out[f"tied {fmt}"] = tied.embedding.tolist()
    return out


def test_two_stages_naming_one_parameter_are_refused_on_every_rank_not_one_kept_for_both(tmp_path: Path) -> None:
    for stage, out in enumerate(run_world(2, _one_offset_on_both, str(tmp_path), timeout=60.0)):
        for fmt in SAVE:
            for step, owner in (("save", SAVE[fmt].__name__), ("load", LOAD[fmt].__name__)):
                assert out[f"{step} {fmt}"] == (
                    f"{owner}: the pipeline stages of ranks [0, 1] all hold a parameter named 'layers.0.weight' (1 "
                    "such name(s)): a checkpoint stores each global name once, so one stage's would be kept for all. "
                    "Give each pipeline chunk its first global layer index (chunk.layer_offset, or "
                    "layer_offsets=[...]), name every other parameter once over the pipeline, or mark a tied copy "
                    "with pgregistry.params.mark_shared"
                ), (stage, fmt, step, out)
            assert out[f"written {fmt}"] == [], (stage, fmt, out)
            assert out[f"kept {fmt}"] == torch.full((2, 2), -1.0 + stage).tolist(), (stage, fmt, out)
            assert out[f"loaded {fmt}"] == torch.full((2, 2), 1.0 + stage).tolist(), (stage, fmt, out)
            assert out[f"tied {fmt}"] == [7.0, 7.0], (stage, fmt, out)  # written once, by its original's stage

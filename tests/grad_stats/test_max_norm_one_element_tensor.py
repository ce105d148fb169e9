"""A one-element ``max_norm`` tensor of any shape clips as its number does.

Found by a hostile-input audit: the argument check takes a one-element real tensor as a number, but a ``[1]``-shaped
one then made a ``[1]``-shaped coefficient, and ``clip_grad_norm_``, ``clip_grads_`` and an optimizer's
``clip_grad_norm`` raised ``RuntimeError: scalar tensor expected to be 0 dim but it has 1 dimensions`` from the
scaling kernel, after the norm's reduction.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from pgregistry.collection import FIELD_NAMES, ProcessGroupCollection
from pgregistry.grad_stats import CLIP_EPSILON, clip_grad_norm_, clip_grads_, grad_norm_and_zeros

GRADS = ([3.0, 4.0], [1.0, -2.0, 0.0])
ONE_RANK = ProcessGroupCollection(**dict.fromkeys(FIELD_NAMES))


def _params() -> list[nn.Parameter]:
    params = []
    for values in GRADS:
        param = nn.Parameter(torch.zeros(len(values)))
        param.grad = torch.tensor(values)
        params.append(param)
    return params


def _clip_grad_norm(params: list[nn.Parameter], max_norm: torch.Tensor) -> None:
    clip_grad_norm_(params, max_norm, ONE_RANK)  # type: ignore[arg-type]


def _grad_norm_and_zeros(params: list[nn.Parameter], max_norm: torch.Tensor) -> None:
    grad_norm_and_zeros(params, ONE_RANK, max_norm=max_norm)  # type: ignore[arg-type]


def _clip_grads(params: list[nn.Parameter], max_norm: torch.Tensor) -> None:
    norm = torch.cat([torch.tensor(values, dtype=torch.float64) for values in GRADS]).norm()
    clip_grads_([param.grad for param in params if param.grad is not None], max_norm, norm)  # type: ignore[arg-type]


@pytest.mark.parametrize("clip", [_clip_grad_norm, _grad_norm_and_zeros, _clip_grads])
@pytest.mark.parametrize("max_norm", [torch.tensor([1.0]), torch.tensor([[1.0]]), torch.tensor(1.0)])
def test_a_one_element_max_norm_clips_as_the_float64_oracle(
    clip: Callable[[list[nn.Parameter], torch.Tensor], None], max_norm: torch.Tensor
) -> None:
    flat = torch.cat([torch.tensor(values, dtype=torch.float64) for values in GRADS])
    coefficient = min(1.0, 1.0 / (float(flat.norm()) + CLIP_EPSILON))
    params = _params()
    clip(params, max_norm)
    for param, values in zip(params, GRADS, strict=True):
        assert param.grad is not None
        torch.testing.assert_close(param.grad, (torch.tensor(values, dtype=torch.float64) * coefficient).float())

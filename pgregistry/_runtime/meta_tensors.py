"""Tensors on the ``meta`` device, refused where their values would be read.

A model built under ``torch.device("meta")`` (to be sharded or loaded later) and never materialised
has parameters, and after a backward pass grads, with shapes but no values: a norm of them is a meta
tensor with no value, a clip scales nothing, an optimizer steps nothing, and none of them says so.
Torch-free (the caller reads ``is_meta``).
"""

from __future__ import annotations

__all__ = ["meta_tensor_error"]


def meta_tensor_error(what: str, before: str = "the backward pass") -> ValueError:
    """The error for ``what``, a tensor on the meta device, to be materialised before ``before``.

    ``what`` names the tensor as the message's subject (``"the grad of 'weight'"``)."""
    return ValueError(
        f"{what} is on the meta device: it has a shape but no values, so nothing can be computed "
        "from it (was the model built under torch.device('meta') and never materialised?); "
        "materialise the model with model.to_empty(device=...) and initialise its parameters "
        f"(e.g. each module's reset_parameters(), or load a checkpoint) before {before}"
    )

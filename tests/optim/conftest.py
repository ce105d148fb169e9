"""Shared set-up of the optimizer tests."""

# torch.optim imports torch._dynamo the first time an optimizer is built (~3 s). Importing it here, in the parent,
# lets every forked rank inherit it instead of importing it once per rank per world.
import torch._dynamo  # noqa: F401

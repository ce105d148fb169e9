"""Hostile shapes of downstream trees (Megatron-LM forks, NeMo-style code): aliases, closures, match statements,
imports that bind the name of ``parallel_state`` to something else."""

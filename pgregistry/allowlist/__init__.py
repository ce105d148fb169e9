"""The allowlist ratchet: find every read of global process-group state, fail CI on new ones, shrink only.

``pgregistry allowlist check|update|stats`` scans Python sources with :mod:`ast` (never importing them, never
importing torch) and compares what it finds with a committed allowlist keyed by file, enclosing scope and
accessor, so edits that only move code do not disturb it. The modules:

- :mod:`~pgregistry.allowlist._config`: what counts as a read, the presets, and the ``[tool.pgregistry.allowlist]``
  table;
- :mod:`~pgregistry.allowlist._scanner`: one source file to its sites (pure, no I/O);
- :mod:`~pgregistry.allowlist._files`: which files a run covers;
- :mod:`~pgregistry.allowlist._engine`: scanning many files, in parallel and through the cache;
- :mod:`~pgregistry.allowlist._cache`: results keyed by content hash;
- :mod:`~pgregistry.allowlist._ratchet`: the allowlist file and the comparison with a scan;
- :mod:`~pgregistry.allowlist._moves`: stale and new entries paired as reads moved by a refactor;
- :mod:`~pgregistry.allowlist._baseline`: what a git revision tells (renames, added sites, the tree then);
- :mod:`~pgregistry.allowlist._storage`: atomic writes and the update lock;
- :mod:`~pgregistry.allowlist._fixes`: each accessor's replacement from the collection;
- :mod:`~pgregistry.allowlist._megatron_list`: importing Megatron-LM's line-keyed allowlist;
- :mod:`~pgregistry.allowlist._report`: text, JSON and GitHub-annotation output;
- :mod:`~pgregistry.allowlist._cli`: the ``allowlist`` sub-command.

``pgregistry migrate``, which rewrites the reads this package finds, is its own package:
:mod:`pgregistry.migrate`.

This package root imports nothing, so ``import pgregistry.allowlist`` stays as cheap as ``import pgregistry``.
"""

__all__: list[str] = []

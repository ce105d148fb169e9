"""Reading a source tree: what the ``allowlist`` ratchet and ``pgregistry migrate`` read alike.

The reads the ratchet counts are the reads the migration rewrites, so both take them from here,
never from each other. The modules:

- :mod:`~pgregistry._source.config`: what counts as a read, the presets, and the
  ``[tool.pgregistry.allowlist]`` table (the settings of both commands);
- :mod:`~pgregistry._source.options`: the command-line options that choose those settings, for both
  commands;
- :mod:`~pgregistry._source.scanner`: one source file to its sites and their families (pure, no
  I/O);
- :mod:`~pgregistry._source.files`: which files a run covers;
- :mod:`~pgregistry._source.engine`: scanning many files, in parallel and through the cache;
- :mod:`~pgregistry._source.processes`: forked children and their pipes (the scan's, and
  ``migrate``'s phases');
- :mod:`~pgregistry._source.cache`: scan results keyed by content hash;
- :mod:`~pgregistry._source.storage`: atomic writes and the lock beside a file;
- :mod:`~pgregistry._source.fields`: each accessor's replacement from the collection (the field
  table).

Torch-free, and libcst-free: ``python -m pgregistry.allowlist`` runs with the standard library
alone.
"""

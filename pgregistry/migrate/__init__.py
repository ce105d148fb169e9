"""``pgregistry migrate``: rewrite reads of global process-group state into reads of a collection.

Built on the scanner and field table it shares with the allowlist ratchet
(:mod:`pgregistry._source`): the reads the ratchet counts are the reads this package rewrites.
libcst (the ``migrate`` extra) is imported by the modules below only, so ``import
pgregistry.migrate`` stays as cheap as ``import pgregistry``. The modules, in the order a run uses
them:

- :mod:`~pgregistry.migrate._links`: which files a run reads and may rewrite, once each;
- :mod:`~pgregistry.migrate._engine`: the run over a tree (scan, plan, rewrite, compile-check),
  split across cores, its progress on stderr (:mod:`~pgregistry.migrate._progress`);
- :mod:`~pgregistry.migrate._phases`: work in two phases across processes, with one exchange between
  them;
- :mod:`~pgregistry.migrate._skeleton`: the part of a file libcst parses, and a statement's lines
  and span;
- :mod:`~pgregistry.migrate._tree`: what the whole tree says about its functions and collections,
  learned first (the classes whose ``__init__`` may call a method before it sets its collection:
  :mod:`~pgregistry.migrate._init_order`);
- :mod:`~pgregistry.migrate._facts`: what the rules decided between the two phases, read once from
  each file, with what its module-level imports bind (:mod:`~pgregistry.migrate._imports`);
- :mod:`~pgregistry.migrate._upward`: the read-less functions that call a threaded one, threaded
  too; :mod:`~pgregistry.migrate._inherited`: subclasses inheriting or forwarding to a threaded
  ``__init__``; :mod:`~pgregistry.migrate._spec_fields`: modules built from a spec's fields;
- :mod:`~pgregistry.migrate._megatron_release`: which Megatron-Core the migrated code runs against
  (its field table, the getters its shims call; whether its pipeline-stage accessors are those the
  fallback helper reproduces: :mod:`~pgregistry.migrate._virtual_stages`);
- :mod:`~pgregistry.migrate._plan`: each read's way (collection in scope, threaded, fallback, left)
  and which calls pass a collection (a read a handler around it may catch the warning of stays:
  :mod:`~pgregistry.migrate._caught`; so does one on a name a ``match`` captures:
  :mod:`~pgregistry.migrate._captures`);
- :mod:`~pgregistry.migrate._shims`: which ``use_mpu_process_groups`` shims become the reads of
  their fields;
- :mod:`~pgregistry.migrate._idioms`: what a read becomes in each target's code (a call of the
  fallback helper);
- :mod:`~pgregistry.migrate._fallback_helper`: that helper, as written into a migrated tree;
- :mod:`~pgregistry.migrate._helper_file`: its text for the code's release, and where it goes;
- :mod:`~pgregistry.migrate._rewrite`: the libcst transformer, imports added and pruned (those
  that fail where their package is missing kept: :mod:`~pgregistry.migrate._import_errors`);
- :mod:`~pgregistry.migrate._layout` and :mod:`~pgregistry.migrate._style`: lines kept to the tree's
  length;
- :mod:`~pgregistry.migrate._writing`: checked, atomic writes; :mod:`~pgregistry.migrate._diff`: a
  change as a unified diff, in time linear in the file;
- :mod:`~pgregistry.migrate._report`: what a run did, per family of reads.

The command itself is :mod:`pgregistry.cli._migrate`.
"""

__all__: list[str] = []

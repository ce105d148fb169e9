"""``pgregistry allowlist check|update|stats|import``: the ratchet's own command line.

See :mod:`pgregistry.allowlist._cli`.

The allowlist sub-package owns its parser so that it also runs alone, as ``python -m
pgregistry.allowlist`` (torch-free); this module only puts it in the command table.
"""

from __future__ import annotations

from pgregistry.allowlist._cli import add_command

__all__ = ["add_command"]

"""``python -m pgregistry.allowlist check|update|stats``: the allowlist command alone, importing
nothing of pgregistry beyond the package root and this sub-package (so it never imports torch)."""

import sys

from pgregistry.allowlist import main

sys.exit(main())

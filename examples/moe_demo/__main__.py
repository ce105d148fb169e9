"""``python -m examples.moe_demo`` (what ``make demo`` runs), from the repository root."""

import sys

from examples.moe_demo.job import main

sys.exit(main())

"""``python -m pgregistry`` runs the command line (used under ``torchrun -m pgregistry verify``)."""

import sys

from pgregistry.cli import main

sys.exit(main())

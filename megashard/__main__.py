"""``python -m megashard`` runs the same command line as the ``megashard`` script."""
import sys

from .cli import main

sys.exit(main())

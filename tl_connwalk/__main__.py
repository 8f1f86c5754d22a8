"""``python -m tl_connwalk`` runs the command line."""

import sys

from tl_connwalk.cli import main

sys.exit(main())

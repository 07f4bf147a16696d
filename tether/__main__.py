"""``python -m tether``: the ``tether`` command (tests and the commands that start sidecars use this form)."""

import sys

from tether.cli.main import main

sys.exit(main())

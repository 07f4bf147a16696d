"""``python -m cli``: the ``tether`` command (tests and the commands that start sidecars use this form)."""

import sys

from cli.main import main

sys.exit(main())

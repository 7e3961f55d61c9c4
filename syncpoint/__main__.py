"""``python -m syncpoint``: the ``syncpoint`` command line."""

import sys

from syncpoint.orchestrator.cli import main

sys.exit(main())

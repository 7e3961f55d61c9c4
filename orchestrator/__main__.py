import sys

from syncpoint.orchestrator.cli import main

sys.exit(main())

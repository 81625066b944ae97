"""``python -m kvbridge eval|demo``: the same as the ``kvbridge`` command."""
import sys

from kvbridge.cli import main

sys.exit(main())

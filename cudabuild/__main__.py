"""`python -m cudabuild ...`: the same command as the `cudabuild` console script (see cli.py)."""

import sys

from cudabuild.cli import main

sys.exit(main())

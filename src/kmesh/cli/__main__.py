"""`python -m kmesh.cli ...`: the `kmesh` command (how engines and tests start its processes)."""

import sys

from kmesh.cli import main

sys.exit(main())

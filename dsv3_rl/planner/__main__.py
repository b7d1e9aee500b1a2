"""``python -m dsv3_rl.planner`` -> :func:`dsv3_rl.planner.cli.main`."""

import sys

from dsv3_rl.planner.cli import main

sys.exit(main())

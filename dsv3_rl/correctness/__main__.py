"""``python -m dsv3_rl.correctness``: see :mod:`dsv3_rl.correctness.cli`."""

import sys

from dsv3_rl.correctness.cli import main

sys.exit(main())

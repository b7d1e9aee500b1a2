import sys

from dsv3_rl.launch.cli import main

sys.exit(main())

"""Seed-compatible entry point:

    python toolkits/verl_data_preprocessing/gsm8k.py --input_dir DIR --local_dir OUT

Thin wrapper over `dsv3_rl.data.gsm8k` (same options; `-h` lists them). Works from a checkout
without `pip install -e .` by putting the repository root on sys.path.
"""

import os
import sys

try:
    import dsv3_rl  # noqa: F401
except ImportError:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from dsv3_rl.data.gsm8k import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())

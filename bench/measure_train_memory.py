#!/usr/bin/env python
"""Measure the peak memory of real megatron-core training steps of a DeepSeek-V3-shaped proxy.

The measurement lives in the package (:mod:`dsv3_rl.planner.measure`, where the planner's tests see it);
this is its command line. See that module for what runs and what each row records.

    python bench/measure_train_memory.py                   # the built-in GPU set (CUDA)
    python bench/measure_train_memory.py --set cpu-smoke   # tiny, runs on CPU in seconds
    python bench/measure_train_memory.py --list
"""

import sys

from dsv3_rl.planner.measure import main

if __name__ == "__main__":
    sys.exit(main())

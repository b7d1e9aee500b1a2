#!/usr/bin/env python3
"""Seed-compatible entry point for DeepSeek-V3's FP8 -> BF16 cast (same flags as DeepSeek's script).

    python toolkits/model_checkpoints_convertor/deepseek/fp8_cast_bf16.py \
        --input-fp8-hf-path /path/DeepSeek-V3-0324 --output-bf16-hf-path /path/DeepSeek-V3-0324-bf16

Thin wrapper over ``python -m dsv3_rl.checkpoint.fp8 cast`` (streaming, parallel, resumable, bit-exact,
config fixed for Megatron/verl); every option of that command is accepted too (``--keep-mtp``,
``--device``, ``--workers``, ...). See docs/checkpoint-preparation.md.
"""

import sys

try:
    from dsv3_rl.checkpoint.fp8 import main
except ImportError as e:  # not installed: the package is the one place the code lives
    sys.exit(f"error: cannot import dsv3_rl ({e}); install this repo first: pip install -e . (or make setup)")

if __name__ == "__main__":
    sys.exit(main(["cast", *sys.argv[1:]]))

"""Checkpoint preparation for DeepSeek-V3: FP8 <-> BF16 cast (``fp8``), config fix-ups (``hf_config``).

    python -m dsv3_rl.checkpoint.fp8 cast IN_FP8 OUT_BF16
    python -m dsv3_rl.checkpoint.hf_config CKPT_DIR

See docs/checkpoint-preparation.md.
"""

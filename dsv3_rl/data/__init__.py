"""Math dataset preparation for verl GRPO: MATH-lighteval and GSM8K -> verl's RL parquet schema.

Entry points: ``python -m dsv3_rl.data.math_lighteval``, ``python -m dsv3_rl.data.gsm8k``,
``python -m dsv3_rl.data.cli`` (``dsv3-prep-data``). See docs/data-and-reward.md.
"""

from dsv3_rl.data.common import DataPrepError, validate_rl_parquet

__all__ = ["DataPrepError", "validate_rl_parquet"]

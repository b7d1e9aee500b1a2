"""verl custom reward for MATH and GSM8K: pass this file to verl.

    reward.custom_reward_function.path=toolkits/reward/math_reward.py
    reward.custom_reward_function.name=compute_score
    # optional: +reward.custom_reward_function.reward_kwargs.timeout=5.0
    #           +reward.custom_reward_function.reward_kwargs.format_score=0.1

verl loads this file by path (``verl.utils.import_utils.load_module``), so it only re-exports
``dsv3_rl.reward.math_reward``; when the package is not installed it falls back to the
repository this file lives in. Returns ``{"score", "acc", "pred"}``; see docs/data-and-reward.md.
"""

import os
import sys

try:
    import dsv3_rl.reward.math_reward as _impl
except ImportError:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    import dsv3_rl.reward.math_reward as _impl

compute_score = _impl.compute_score

__all__ = ["compute_score"]

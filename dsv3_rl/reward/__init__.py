"""Rule-based math reward for verl (MATH, GSM8K) with a hard per-call time limit.

``dsv3_rl.reward.math_reward.compute_score`` is verl's custom-reward signature; the file
``toolkits/reward/math_reward.py`` re-exports it for ``custom_reward_function.path``.
See docs/data-and-reward.md.
"""

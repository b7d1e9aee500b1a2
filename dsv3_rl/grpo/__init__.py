"""GRPO of DeepSeek-V3 through verl's ``main_ppo``: recipes as data, the CPU demo runner, self-checks.

``python -m dsv3_rl.grpo demo`` runs the CPU recipe end to end (see docs/grpo-demo.md).
"""

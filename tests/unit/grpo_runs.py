"""What the GRPO e2e runs of the test suite share (test_grpo_learning.py, test_algorithm_demos.py)."""

from __future__ import annotations


def ends_only(steps: int) -> str:
    """verl ``trainer`` keys (YAML flow mapping, without braces) of a test run of STEPS steps: validation before
    training and after the last step only (the learning check compares the first with the last), and one checkpoint,
    after the last step (the checks reload it). The demo presets validate every 2 steps and checkpoint every 4: each
    validation costs ~4 s and each save ~2 s on 2 cores, for nothing a test asserts (issue 28)."""
    return f"total_training_steps: {steps}, test_freq: {steps}, save_freq: {steps}"

"""What the GRPO e2e runs of the test suite share (test_grpo_learning.py, test_algorithm_demos.py)."""

from __future__ import annotations


def ends_only(steps: int) -> str:
    """verl ``trainer`` keys (YAML flow mapping, without braces) of a test run of STEPS steps: validation before
    training and after the last step only (the learning check compares the first with the last), and one checkpoint,
    after the last step (the checks reload it). The demo presets validate every 2 steps and checkpoint every 4: each
    validation costs ~4 s and each save ~2 s on 2 cores, for nothing a test asserts (issue 28)."""
    return f"total_training_steps: {steps}, test_freq: {steps}, save_freq: {steps}"


#: pipeline parallel 2 (tp1 pp2 ep1; the demo is TP2 x EP2): the layout of the DAPO demo's CI run, which is also the
#: R3-at-PP2 run (test_algorithm_demos.py): vLLM's routes replayed on the initial weights and after each update and
#: weight sync, on both pipeline stages
PP2_LAYOUT = {"tp": 1, "pp": 2, "ep": 1, "etp": 1, "sp": False}

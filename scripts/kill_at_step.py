"""kill -9 one process of a running GRPO launch once a step is logged (fault drills on a real run, GPU or CPU).

    python scripts/kill_at_step.py LOG_DIR STEP [--pattern EngineCore] [--timeout 1800]

Waits until LOG_DIR/metrics.jsonl has a training step >= STEP, then sends SIGKILL to the first process of the
launch's current main_ppo attempt (its run marker, LOG_DIR/.dsv3-launch.json) whose command line matches PATTERN
(a regex: EngineCore = a vLLM engine, WorkerDict = a trainer worker). Prints one line: what was killed, at which
step. Exit 2 when nothing matching is found in time."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from dsv3_rl.launch import monitor  # noqa: E402


def last_step(metrics: Path) -> int:
    try:
        lines = metrics.read_text().splitlines()
    except OSError:
        return 0
    steps = [json.loads(x).get("step", 0) for x in lines if x.strip().startswith("{")]
    return max(steps, default=0)


def victims(log_dir: Path, pattern: str) -> list[int]:
    try:
        rid = json.loads((log_dir / ".dsv3-launch.json").read_text()).get("run_id")
    except (OSError, ValueError):
        return []
    return monitor.run_processes_matching(rid, pattern)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("log_dir", type=Path)
    p.add_argument("step", type=int)
    p.add_argument("--pattern", default="EngineCore")
    p.add_argument("--timeout", type=float, default=1800)
    a = p.parse_args()
    deadline = time.monotonic() + a.timeout
    while time.monotonic() < deadline:
        s = last_step(a.log_dir / "metrics.jsonl")
        if s >= a.step:
            v = victims(a.log_dir, a.pattern)
            if v:
                os.kill(v[0], signal.SIGKILL)
                print(f"[kill_at_step] killed {a.pattern} pid {v[0]} after step {s} was logged", flush=True)
                return 0
        time.sleep(0.5)
    print(f"error: no process matching {a.pattern!r} after step {a.step} within {a.timeout:.0f} s", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())

"""Run ``main_ppo`` on one node under watch: full log to a file, one progress line per GRPO step on the
console, a real wall-clock limit, and a teardown that leaves no Ray or vLLM process behind.

* The child runs in its own process session with a run marker in its environment (``DSV3_RUN_ID``); Ray's
  own daemons (GCS, raylet, workers) inherit it, so the teardown finds every process of the run, also
  those Ray started in sessions of their own, and stops them TERM first, KILL after a grace period.
* Its output goes to ``LOG_DIR/main_ppo.log`` (ANSI colour codes removed); the console gets our progress
  lines (from verl's file logger, :class:`dsv3_rl.grpo.progress.MetricsFollower`) and, on failure, the
  log's last lines.
* The limit is checked once a second whatever the child prints: a silent hang is stopped too.
* SIGINT/SIGTERM to the launcher stop the run the same way and say how to resume.
* Peak memory is the largest sum of the proportional set size (PSS) over the run's processes, sampled
  every 2 s: shared pages (torch, vLLM libraries) count once, not once per process.
"""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import subprocess
import threading
import time
import uuid
from pathlib import Path

RUN_ID_ENV = "DSV3_RUN_ID"
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


@dataclasses.dataclass
class RunResult:
    code: int
    """main_ppo's exit status; 124 when the limit stopped it, 128+signal when the launcher was interrupted"""
    seconds: float
    peak_pss_bytes: int
    peak_at_s: float = 0.0
    """seconds into the run when the peak was sampled"""
    reason: str = ""
    """'timeout', 'interrupted' or '' (it ended by itself)"""
    run_id: str = ""
    """the run marker (``DSV3_RUN_ID``) its processes carried"""


def run_ids() -> set[str]:
    """The run markers of every live process that carries one."""
    key, out = f"{RUN_ID_ENV}=".encode(), set()
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/environ", "rb") as f:
                    out.update(i[len(key):].decode() for i in f.read().split(b"\0") if i.startswith(key))
            except OSError:
                continue
    return out


def run_processes(run_id: str) -> list[int]:
    """PIDs of live processes whose environment carries ``DSV3_RUN_ID=run_id`` (this process excluded)."""
    needle = f"{RUN_ID_ENV}={run_id}".encode()
    me, out = os.getpid(), []
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == me:
            continue
        try:
            with open(f"/proc/{d}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    out.append(int(d))
        except OSError:
            continue
    return out


def pss_bytes(pids: list[int]) -> int:
    """Sum of the proportional set size of PIDS (``/proc/PID/smaps_rollup``); vanished processes count 0."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                for line in f:
                    if line.startswith("Pss:"):
                        total += int(line.split()[1]) * 1024
                        break
        except (OSError, ValueError):
            continue
    return total


def stop_run(proc: subprocess.Popen, run_id: str, grace_s: float = 15.0) -> None:
    """TERM the child's session and every process carrying the run marker, then KILL what is left."""
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
        for pid in run_processes(run_id):
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if proc.poll() is not None and not run_processes(run_id):
                return
            time.sleep(0.2)
    proc.poll()


def _pump(stream, log_path: Path) -> None:
    with open(log_path, "a", encoding="utf-8", errors="replace") as log:
        for line in stream:
            log.write(_ANSI.sub("", line))
            log.flush()


def run_watched(argv: list[str], env: dict[str, str], *, log_path: Path, metrics_path: Path, total_steps: int,
                timeout_s: float | None, say=print) -> RunResult:
    """Run ARGV (main_ppo) to the end, the limit or an interrupt; see the module doc."""
    from dsv3_rl.grpo.progress import MetricsFollower, progress_line

    run_id = uuid.uuid4().hex
    env = {**env, RUN_ID_ENV: run_id}
    log_path.parent.mkdir(parents=True, exist_ok=True)
    follower = MetricsFollower(metrics_path)
    stop = {"signal": None}

    def on_signal(signum, frame):
        stop["signal"] = signum

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    t0 = time.monotonic()
    peak, peak_at, last_sample = 0, 0.0, 0.0
    reason = ""
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            bufsize=1, start_new_session=True, errors="replace")
    pump = threading.Thread(target=_pump, args=(proc.stdout, log_path), daemon=True)
    pump.start()
    try:
        while True:
            for rec in follower.poll():
                say(progress_line(rec, total_steps))
            now = time.monotonic()
            if now - last_sample >= 2.0:
                pss = pss_bytes([proc.pid, *run_processes(run_id)])
                if pss > peak:
                    peak, peak_at = pss, now - t0
                last_sample = now
            if proc.poll() is not None:
                break
            if stop["signal"] is not None:
                reason = "interrupted"
                break
            if timeout_s is not None and now - t0 > timeout_s:
                reason = "timeout"
                break
            time.sleep(1.0)
    finally:
        if proc.poll() is None or run_processes(run_id):
            stop_run(proc, run_id)
        pump.join(timeout=10)
        for s, h in old.items():
            signal.signal(s, h)
    for rec in follower.flush():
        say(progress_line(rec, total_steps))
    if reason == "timeout":
        code = 124
    elif reason == "interrupted":
        code = 128 + int(stop["signal"])
    else:
        code = proc.returncode
    return RunResult(code=code, seconds=time.monotonic() - t0, peak_pss_bytes=peak, peak_at_s=peak_at, reason=reason,
                     run_id=run_id)

"""One chain of real runs of the demo preset that serves two e2e tests (issue 28: Ray + vLLM + Megatron start-up
paid three times for both): issue 29's faults (tests/unit/test_launch_faults.py) and the interrupted-and-resumed run
(tests/unit/test_grpo_learning.py). The demo preset (verl main_ppo, Ray, Megatron TP2 x EP2 on gloo, vLLM-CPU) cut
to STEPS = 8 steps with a checkpoint every 2 (the short preset's training, so the resumed steps compare with the
sound run) and ``run.max_restarts: 2``:

invocation 1 (watched; both tests)
  ``kill -9`` of one trainer worker (``ray::WorkerDict``) while it writes step 4's checkpoint (issue 41: its save
  child is orphaned, Ray reports nothing; the vanished-process watch sees the loss) -> restart 1 resumes at step 2,
  the partial save set aside; once step K = 6 is checkpointed and logged, SIGTERM to the launcher: it stops the run
  and says how to resume (resume test);
invocation 2 (the same command; both tests)
  half of step 6's model shard cut off first: the resume names the file and the tensor and falls back to step 4
  (test_launch_faults); steps 5-6 are the resumed steps the resume test compares with the sound run; steps 7-8
  follow and every check passes, the learning gate over all 8 steps included.

The third fault of issue 29, a killed vLLM engine, is planted in the one-step-off demo's run
(tests/unit/test_algorithm_demos.py, the other e2e lane) since 2026-12-07: before, it was a second restart here and
the chain had five start-ups (a third invocation resumed the SIGTERM'd one), the longest e2e lane of CI (docs/ci-history.md,
"fifth session"). Each test asserts its own points on the record (:class:`Chain`); the chain runs once per pytest
session (``fault_chain`` fixture, tests/conftest.py). The one-step-off demo's killed engine uses this module's
watched launch (``watched_launch``, ``kill9``, ``RunMarkers``)."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

from dsv3_rl.launch import ckpt, monitor
from grpo_runs import launch_env

REPO = Path(__file__).resolve().parents[2]
LAUNCHER = REPO / "examples" / "deepseek_v3" / "run_mcore_deepseek_verl.sh"
STEPS, SAVE = 8, 2
K = 6  #: the checkpoint the SIGTERM'd invocation 1 leaves last; invocation 2 finds it damaged
FALLBACK = K - SAVE  #: invocation 2 resumes here, step K's checkpoint being damaged
NAME = "tiny_cpu_faults"


@dataclasses.dataclass
class Chain:
    ckpt: Path
    logs: Path
    first: str
    """invocation 1's output (stdout + stderr): the killed worker's restart, then the SIGTERM"""
    first_rc: int
    events: list[str]
    saved_after_sigterm: list[int]
    """the global_step_N directories left after invocation 1"""
    leftover: set[str]
    """run markers of the chain with processes still alive after invocation 1"""
    shard: Path
    """the model shard of step K that was cut short before invocation 2"""
    second: subprocess.CompletedProcess
    """invocation 2: the same command again"""
    run_ids: set[str]
    """the run marker of every main_ppo attempt of the chain (``RunMarkers``): its processes, and no other run's"""
    engine_processes: dict[str, int]
    """vLLM processes of the run when the trainer worker was killed (every process up): ``{"EngineCore": n,
    "VLLM::Worker": n}`` (the CPU presets' one-process executor: no worker beside an EngineCore)"""


def _pids(pattern: str, run_id: str | None) -> list[int]:
    return monitor.run_processes_matching(run_id, pattern)


def _run_id(log_dir: Path) -> str | None:
    try:
        return json.loads((log_dir / ".dsv3-launch.json").read_text()).get("run_id")
    except (OSError, ValueError):
        return None


def watched_pid(run_id: str | None, name: str) -> int | None:
    """One process of the run that the launcher watches as NAME or NAME... (``WorkerDict``, ``EngineCore``, ``raylet``:
    monitor.watched_processes, which leaves out a worker's forked checkpoint-save child), or None."""
    return next((p for p, n in monitor.watched_processes(run_id or "").items() if n.startswith(name)), None)


def kill9(pattern: str, log_dir: Path) -> int:
    """kill -9 the first process of the current attempt whose command line matches PATTERN."""
    victims = _pids(pattern, _run_id(log_dir))
    assert victims, f"no process matching {pattern!r} in the run"
    os.kill(victims[0], signal.SIGKILL)
    return victims[0]


class RunMarkers(threading.Thread):
    """Collects the run marker of every main_ppo attempt the launcher records in LOG_DIR/.dsv3-launch.json (each
    attempt gets its own; an attempt lasts a minute or more, the file is read every 0.2 s). The chain's
    no-process-left checks ask for these runs' processes only: another run on the machine (the other e2e lane)
    is not the chain's to judge, and no environment entry is on every process of a run (Ray starts some of them
    without the launcher's LOG_DIR)."""

    def __init__(self, log_dir: Path):
        super().__init__(daemon=True)
        self.log_dir, self.seen, self.done = log_dir, set(), threading.Event()

    def run(self):
        while not self.done.wait(0.2):
            rid = _run_id(self.log_dir)
            if rid:
                self.seen.add(rid)

    def alive(self) -> set[str]:
        """the markers seen so far with a process still carrying them"""
        return {r for r in self.seen if monitor.run_processes(r)}


def watched_launch(cmd: list[str], env: dict[str, str]):
    """Start CMD; returns (proc, its output lines as they come, wait_for(pred), seen(text, after))."""
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []

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

    proc.reader = t
    return proc, lines, wait_for, seen


def finish_launch(proc, timeout: float) -> None:
    try:
        proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.reader.join(timeout=10)


def run_chain(tmp: Path, work: Path) -> Chain:
    """The chain's runs under TMP (checkpoints, logs, its preset); WORK holds the converted model and the prepared
    data, which the session's other GRPO runs share (tests/conftest.py ``grpo_work``)."""
    preset = tmp / f"{NAME}.yaml"
    preset.write_text(f"extends: {REPO / 'examples/deepseek_v3/presets/tiny_cpu.yaml'}\n"
                      "run: {max_restarts: 2}\n"
                      f"verl: {{trainer: {{total_training_steps: {STEPS}, save_freq: {SAVE}, max_actor_ckpt_to_keep: 2}}}}\n")
    logs, ck = tmp / "logs", tmp / "ckpt"
    env = launch_env(work, ck, logs)
    cmd = ["bash", str(LAUNCHER), "--preset", str(preset), "--quiet"]
    markers = RunMarkers(logs)
    markers.start()
    try:
        events: list[str] = []
        log = Path(os.environ.get("DSV3_FAULT_LOG", tmp / "faults.log"))

        # invocation 1: a trainer worker while it writes step 4's checkpoint (global_step_4/ there, the tracker still
        # at step 2: its forked save child lives on; issue 41's hang); SIGTERM once step K is checkpointed again and
        # logged (a step's line is printed once the next step's record is there: step K+1 is being trained)
        proc, lines, wait_for, seen = watched_launch(cmd, env)
        try:
            wait_for(lambda: seen(f"step {SAVE}/{STEPS}"))
            engines = {p: len(_pids(p, _run_id(logs))) for p in ("EngineCore", "VLLM::Worker")}
            wait_for(lambda: (ck / f"global_step_{2 * SAVE}").is_dir() and ckpt.tracker_step(ck) == SAVE)
            worker = watched_pid(_run_id(logs), "WorkerDict")  # the worker, not its save child
            assert worker, f"no ray::WorkerDict in the run (its processes: {_pids('.', _run_id(logs))})"
            os.kill(worker, signal.SIGKILL)
            events.append(f"killed ray::WorkerDict pid {worker} while global_step_{2 * SAVE} was being written")
            wait_for(lambda: seen("RESTART 1/2"))
            mark = len(lines)
            wait_for(lambda: seen(f"step {K}/{STEPS}", mark) and ckpt.tracker_step(ck) == K)
            proc.send_signal(signal.SIGTERM)
            events.append(f"SIGTERM to the launcher (pid {proc.pid}) during step {K + 1}")
        finally:
            finish_launch(proc, 120)
        first, first_rc = "".join(lines), proc.returncode
        leftover = markers.alive()
        saved = sorted(int(p.name.split("_")[-1]) for p in ck.glob("global_step_*") if p.name.split("_")[-1].isdigit())
        log.write_text(first + "\n" + "\n".join(events) + "\n")

        # invocation 2: step K's checkpoint damaged, then the same command again
        shard = sorted((ck / f"global_step_{K}" / "actor" / "model" / "dist_ckpt").glob("*.distcp"))[0]
        data = shard.read_bytes()
        shard.write_bytes(data[: len(data) // 2])
        events.append(f"truncated {shard} to {len(data) // 2} of {len(data)} bytes")
        second = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
        with open(log, "a") as f:
            f.write(f"\n===== {events[-1]}; the same command again =====\n{second.stdout}{second.stderr}")
        return Chain(ck, logs, first, first_rc, events, saved, leftover, shard, second, markers.seen, engines)
    finally:
        markers.done.set()  # also when an invocation's assertion failed

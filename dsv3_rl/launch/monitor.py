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
* A lost process (:data:`LOST_PATTERNS`: a Ray actor or worker died, the vLLM engine died, an OOM kill, the
  node's Ray went away) is recognised in the log as it is written: ``RunResult.lost`` says which process, and a
  run that idles after it (vLLM's ``EngineDeadError`` leaves the trainer waiting for ever) is stopped after
  ``LOST_GRACE_S`` instead of at ``run.timeout_s`` (GPU presets have none). The launcher decides to restart
  (:mod:`dsv3_rl.launch.train`).
* A process of the run that vanishes (:data:`WATCHED`: a trainer worker, a vLLM engine, the raylet or GCS) is a
  lost process even when nothing says so in the log: a worker killed during a checkpoint save leaves its forked save
  child holding its sockets and Ray never reports the death. The RESTART line names the process that vanished.
* A stall watchdog: once a step is logged, no new metrics for :func:`stall_bound` seconds (a multiple of the
  longest step measured, at least :data:`STALL_MIN_S`) ends the attempt as lost; the bound is in the progress line.
* A run that fails while it starts Ray or vLLM (:data:`START_FAILED`: "The current node timed out during startup",
  ...) is a lost start: the launcher retries it with a fresh cluster (``RunResult.reason == "lost"``).
* Peak memory is the largest sum of the proportional set size (PSS) over the run's processes, sampled
  every :data:`PSS_EVERY_S`: shared pages (torch, vLLM libraries) count once, not once per process.
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

from dsv3_rl.procs import processes_with

RUN_ID_ENV = "DSV3_RUN_ID"
#: seconds between two PSS samples. Reading /proc/PID/smaps_rollup walks every mapping of the process: ~0.29 s of
#: CPU for the ~30 processes of a CPU run (measured 2026-11-27, 2 cores), 14% of a core at the 2 s it was; the
#: resident memory of a run changes over steps, not seconds
PSS_EVERY_S = 10.0
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")

NODE_RAY = "the node's Ray"
"""how a lost raylet or GCS is named (LOST_PATTERNS, :func:`vanished_name`); the launcher treats such a loss before an
attempt trains a step as a failed start"""
OOM = "a process killed for lack of memory (OOM)"
"""how a process killed by Ray's memory monitor or the kernel's OOM killer is named (LOST_PATTERNS)"""
#: log lines that say a process of the run was lost (not a bug of the run itself): (pattern, which process)
LOST_PATTERNS = (
    (re.compile(r"EngineDeadError|Engine core proc \S+ died|EngineCore\S* (?:died|encountered a fatal error)"),
     "the vLLM engine (EngineCore)"),
    # (not "OOM killer": Ray's text for any dead worker lists it among the possible causes)
    (re.compile(r"killed due to the node running low on memory|Out of memory: Killed process|"
                r"Worker exit type: NODE_OUT_OF_MEMORY", re.I), OOM),
    (re.compile(r"The actor is dead because its worker process has died|ActorDiedError|ActorUnavailableError|"
                r"RayActorError|Worker exit type: SYSTEM_ERROR"), "a Ray worker"),
    (re.compile(r"GCS has been down|Failed to connect to GCS|raylet (?:has )?died|node .* has been marked dead", re.I),
     f"{NODE_RAY} (GCS/raylet)"),
)
#: lines of a run that failed while Ray or vLLM started (a loaded machine right after a teardown): a lost start
START_FAILED = re.compile(r"The current node timed out during startup|Failed to (?:start|connect to) the GCS|"
                          r"ray\.init\(\) .*timed out|Timed out (?:waiting|while waiting) for .*(?:raylet|GCS|node)|"
                          r"Failed to register worker .* to Raylet|ConnectionError: .*(?:raylet|GCS)", re.I)
#: processes of a run whose disappearance is a loss (patterns on the process's argv[0], which Ray and vLLM set to
#: the process title; group: its name). Never on the whole command line: every Ray worker, the idle ones that come
#: and go included, has ``--raylet-name=.../sockets/raylet`` among its arguments (a first version took them for
#: the raylet: measured on the real run, 2026-11-28)
WATCHED = (re.compile(r"^ray::(WorkerDict|TaskRunner\w*)"), re.compile(r"^(EngineCore\w*)|^VLLM::(EngineCore\w*)"),
           re.compile(r"/(raylet)$"), re.compile(r"/(gcs_server)$"))
STALL_MIN_S = 600.0
"""the least stall bound, seconds (a checkpoint save or a validation pass may take several steps' time)"""
STALL_FACTOR = 5.0
"""the stall bound is this many times the longest step measured"""
VANISH_MIN_AGE_S = 5.0
"""a watched process counts as vanished only once it was seen alive this long (a short-lived fork or a process
between fork and exec is not the run's; a missed loss is still caught by Ray's log line or the stall watchdog)"""
#: Ray's memory monitor: the node's memory when it killed, and its "Top 10 memory users" rows (pid, GB, command)
_OOM_NODE = re.compile(r"was ([\d.]+ ?GB) used / ([\d.]+ ?GB) limit")
_OOM_TOP = re.compile(r"^\s*(\d+)\t([\d.]+)\t(\S+)")
_CLASS = re.compile(r"class_name: (?:\S*\.)?(\w+)")  # Ray's ActorDiedError names the dead actor's class
_WHO = (re.compile(r"ray::(\w+)"), re.compile(r"(EngineCore\w*)"), re.compile(r"\bpid[=: ]+(\d+)", re.I))
#: Ray's prefix of a forwarded line names the process that *printed* it (the driver reporting a dead worker)
_RAY_PREFIX = re.compile(r"^\((?:\w+) pid=\d+(?:, ip=[\d.]+)?\)\s*")
DETAIL_LINES = 150
"""lines after a lost-process line searched for the process's class name and pid (Ray prints them below it)"""
LOST_GRACE_S = 30.0
"""seconds a run may go on after a lost-process line before it is stopped (it usually exits by itself)"""


#: lines that match a pattern above but report a deterministic failure (a bug or a config error, not a lost process)
NOT_LOST = re.compile(r"error raised in its creation task|ValueError|AssertionError|KeyError|TypeError")


def _who(line: str) -> tuple[list[str], list[str], list[str]]:
    """(actor class names, other process names, pids) a log line mentions, Ray's reporter prefix left out."""
    line = _RAY_PREFIX.sub("", line)
    found = [m.group(1) for r in _WHO if (m := r.search(line))]
    return [m.group(1) for m in _CLASS.finditer(line)], [w for w in found if not w.isdigit()], \
        [w for w in found if w.isdigit()]


class LostProcess:
    """The first lost-process line of a log (:data:`LOST_PATTERNS`) and the name and pid Ray prints below it."""

    def __init__(self):
        self.what: str | None = None
        self.classes: list[str] = []
        self.names: list[str] = []
        self.pids: list[str] = []
        self.after = 0
        self.node_mem: tuple[str, str] | None = None  # OOM: (used, limit) as Ray printed them
        self.top: tuple[str, str, str] | None = None  # OOM: the largest memory user (pid, GB, command)

    def feed(self, line: str) -> bool:
        """Read one log line; True when it is the first lost-process line."""
        if self.what is None:
            if NOT_LOST.search(line):
                return False
            what = next((w for pat, w in LOST_PATTERNS if pat.search(line)), None)
            if what is None:
                return False
            self.what, self.after = what, DETAIL_LINES
        elif self.after > 0:
            self.after -= 1
        else:
            return False
        if self.what == OOM:
            if self.node_mem is None and (m := _OOM_NODE.search(line)):
                self.node_mem = (m.group(1), m.group(2))
            if self.top is None and (m := _OOM_TOP.match(line)):
                self.top = (m.group(1), m.group(2), m.group(3).split(".")[0])
        classes, names, pids = _who(line)
        self.classes += [n for n in classes if n not in self.classes]
        self.names += [n for n in names if n not in self.what and n not in self.names]
        self.pids += [p for p in pids if p not in self.pids]
        return self.after == DETAIL_LINES

    def __str__(self) -> str:
        if self.what is None:
            return ""
        if self.what == OOM and (self.node_mem or self.top):  # Ray's memory monitor: the node and its largest user
            parts = [f"node {self.node_mem[0]} used of {self.node_mem[1]}"] if self.node_mem else []
            parts += [f"largest {self.top[2]} pid {self.top[0]} {self.top[1]} GB"] if self.top else []
            return f"{self.what[:-1]}: {', '.join(parts)})"
        extra = ", ".join((self.classes or self.names)[:1] + [f"pid {p}" for p in self.pids[:1]])
        if not extra:
            return self.what
        return f"{self.what[:-1]}, {extra})" if self.what.endswith(")") else f"{self.what} ({extra})"


def stall_bound(step_seconds: list[float]) -> float | None:
    """Seconds without new metrics after which an attempt is stalled: STALL_FACTOR x the longest step measured, at
    least STALL_MIN_S; None before any step was measured (the start-up is bounded by ``run.timeout_s`` alone)."""
    if not step_seconds:
        return None
    return max(STALL_MIN_S, STALL_FACTOR * max(step_seconds))


def _title(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace").strip()
    except OSError:
        return None


def _watched_name(title: str | None) -> str | None:
    for pat in WATCHED:
        m = pat.search(title or "")
        if m:
            return next(g for g in m.groups() if g)
    return None


def parent_pid(pid: int) -> int | None:
    """The parent of PID (/proc/PID/stat), or None when PID is gone."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def watched_processes(run_id: str) -> dict[int, str]:
    """``{pid: name}`` of the run's processes whose loss ends an attempt (:data:`WATCHED`). A fork of a watched
    process (same title as its parent: a checkpoint save child, which exits when the save is done) is not one: the
    real run of 2026-11-28 took such a child's normal exit for a lost worker."""
    out = {}
    for pid in run_processes(run_id):
        name = _watched_name(_title(pid))
        if name is None:
            continue
        ppid = parent_pid(pid)
        if ppid is not None and _watched_name(_title(ppid)) == name:
            continue
        out[pid] = name
    return out


def _gone(pid: int) -> bool:
    """PID no longer exists, or is a zombie (killed, not yet reaped by its parent)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (OSError, IndexError):
        return True


class Vanished:
    """The watched processes of one attempt (:func:`watched_processes`, polled); :meth:`poll` returns one that
    vanished, conservatively: it was seen alive for :data:`VANISH_MIN_AGE_S` and its pid no longer exists (or is a
    zombie). A process that is still there under another title (it exec'd: a fork running a tool) is dropped, not
    lost: a false loss costs a restart and, at the same step twice, the run (judged deterministic)."""

    def __init__(self, run_id: str):
        self.run_id, self.seen = run_id, {}  # pid -> (name, first seen, last seen)

    def poll(self, now: float) -> tuple[int, str] | None:
        alive = watched_processes(self.run_id)
        lost = None
        for pid, (name, first, last) in list(self.seen.items()):
            if pid in alive:
                continue
            del self.seen[pid]
            if lost is None and last - first >= VANISH_MIN_AGE_S and _gone(pid):
                lost = (pid, name)
        for pid, name in alive.items():
            first = self.seen[pid][1] if pid in self.seen and self.seen[pid][0] == name else now
            self.seen[pid] = (name, first, now)
        return lost


def vanished_name(name: str, pid: int) -> str:
    """The lost-process words for a watched process that vanished."""
    if name.startswith("EngineCore"):
        return f"the vLLM engine ({name}, pid {pid})"
    if name in ("raylet", "gcs_server"):
        return f"{NODE_RAY} ({name}, pid {pid})"
    return f"a Ray worker ({name}, pid {pid})"


def lost_process(line: str) -> str | None:
    """Which process one log line says was lost ("a Ray worker (WorkerDict, pid 123)"), or None."""
    lp = LostProcess()
    return str(lp) if lp.feed(line) else None


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
    lost: str = ""
    """the lost process the log named first (:func:`lost_process`), '' if none"""
    lost_at_s: float | None = None
    """seconds into the run when that line was written"""
    step_at_s: dict = dataclasses.field(default_factory=dict)
    """``{step: seconds into the run when its metrics were logged}``"""


def run_ids(env_entry: str | None = None) -> set[str]:
    """The run markers of every live process that carries one; with ENV_ENTRY (``"LOG_DIR=/path"``), of the processes
    whose environment also has that exact entry: the runs of one work or log directory, not every run on the machine
    (another launch, or a test beside this one, has its own)."""
    key, out = f"{RUN_ID_ENV}=".encode(), set()
    want = env_entry.encode() if env_entry is not None else None
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/environ", "rb") as f:
                    entries = f.read().split(b"\0")
            except OSError:
                continue
            if want is None or want in entries:
                out.update(i[len(key):].decode() for i in entries if i.startswith(key))
    return out


def run_processes(run_id: str) -> list[int]:
    """PIDs of live processes whose environment carries ``DSV3_RUN_ID=run_id`` (this process excluded)."""
    return processes_with(f"{RUN_ID_ENV}={run_id}")


def run_processes_matching(run_id: str | None, pattern: str) -> list[int]:
    """PIDs of RUN_ID's live processes whose command line matches the regex PATTERN (fault drills: the tests' fault
    chain, scripts/kill_at_step.py); none without a run id."""
    out = []
    for pid in run_processes(run_id) if run_id else []:
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if re.search(pattern, cmd):
            out.append(pid)
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


def stop_run(proc: subprocess.Popen | None, run_id: str, grace_s: float = 15.0) -> None:
    """TERM the child's session and every process carrying the run marker, then KILL what is left.
    PROC None: only the marked processes (an orphaned run whose launcher is gone)."""
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        try:
            if proc is not None:
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
            if (proc is None or proc.poll() is not None) and not run_processes(run_id):
                return
            time.sleep(0.2)
    if proc is not None:
        proc.poll()


def _pump(stream, log_path: Path, lost: dict | None = None, t0: float = 0.0) -> None:
    tracker = LostProcess()
    with open(log_path, "a", encoding="utf-8", errors="replace") as log:
        for line in stream:
            line = _ANSI.sub("", line)
            log.write(line)
            log.flush()
            if lost is None or lost.get("closed"):
                continue
            if tracker.feed(line):
                lost.update(at=time.monotonic() - t0, line=line.strip()[:300])
            if tracker.what is not None:
                if not lost.get("vanished"):
                    lost["what"] = str(tracker)
                elif tracker.what == OOM:  # the process seen vanishing first was the memory monitor's victim
                    first = lost.setdefault("vanished_what", lost["what"])
                    lost["what"] = f"{tracker}; {first} went first"
            elif "start" not in lost and START_FAILED.search(line):
                lost["start"] = line.strip()[:200]


def run_watched(argv: list[str], env: dict[str, str], *, log_path: Path, metrics_path: Path, total_steps: int,
                timeout_s: float | None, say=print, run_id: str | None = None, on_poll=None,
                lost_grace_s: float | None = None, step_seconds: list[float] | None = None) -> RunResult:
    """Run ARGV (main_ppo) to the end, the limit, a lost process or an interrupt; see the module doc.
    ON_POLL() is called about once a second while it runs (the launcher writes checkpoint manifests there)."""
    from dsv3_rl.grpo.progress import MetricsFollower, progress_line

    run_id = run_id or uuid.uuid4().hex
    lost_grace_s = LOST_GRACE_S if lost_grace_s is None else lost_grace_s
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
    lost: dict = {}
    step_at: dict[int, float] = {}
    pump = threading.Thread(target=_pump, args=(proc.stdout, log_path, lost, t0), daemon=True)
    pump.start()
    step_s = list(step_seconds or [])
    watched = Vanished(run_id)
    last_progress, last_size = time.monotonic(), -1
    try:
        while True:
            for rec in follower.poll():
                step_at[int(rec.get("step", 0))] = time.monotonic() - t0
                if isinstance(rec.get("timing_s/step"), (int, float)) and rec["timing_s/step"] > 0:
                    step_s.append(float(rec["timing_s/step"]))
                b = stall_bound(step_s)
                say(progress_line(rec, total_steps) + (f"  (stall limit {b:.0f}s)" if b else ""))
            if on_poll is not None:
                on_poll()
            now = time.monotonic()
            try:
                size = metrics_path.stat().st_size
            except OSError:
                size = -1
            if size != last_size:
                last_size, last_progress = size, now
            # the end: verl logged its last step (pending in the follower until the run ends) and now shuts its
            # workers down: a worker that vanishes from here on is the teardown, not a loss (the clean-clone CI of
            # 2026-12-07: the DAPO demo's WorkerDicts gone 30 s before main_ppo exited, "lost during step 7")
            done = (follower.newest_step or 0) >= total_steps
            if proc.poll() is None and not lost.get("what") and not done:
                gone = watched.poll(now)
                if gone is not None and proc.poll() is None:
                    pid, name = gone
                    lost.update(what=vanished_name(name, pid), at=now - t0, vanished=True,
                                line=f"{name} pid {pid} vanished (no log line said so)")
            bound = stall_bound(step_s) if step_at else None
            if bound is not None and not lost.get("what") and now - last_progress > bound:
                lost.update(what=f"the run, stalled (no new metrics for {bound:.0f}s, its stall limit)",
                            at=now - t0, stalled=True)
                reason = "lost"
                break
            if now - last_sample >= PSS_EVERY_S:
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
            if lost.get("what") and now - t0 - lost["at"] > lost_grace_s:
                reason = "lost"  # e.g. EngineDeadError: the trainer waits for an engine that is gone
                break
            time.sleep(1.0)
    finally:
        if proc.poll() is None:  # we stop it: the teardown's own messages (killed actors) are not the cause
            lost["closed"] = True
        if proc.poll() is None or run_processes(run_id):
            stop_run(proc, run_id)
        pump.join(timeout=10)
        for s, h in old.items():
            signal.signal(s, h)
    for rec in follower.flush():
        step_at[int(rec.get("step", 0))] = time.monotonic() - t0
        say(progress_line(rec, total_steps))
    if lost.get("what") and reason == "" and proc.returncode != 0:
        reason = "lost"
    if not lost.get("what") and lost.get("start") and reason == "" and proc.returncode != 0 and not step_at:
        lost["what"] = f"a failed start of Ray or vLLM ({lost['start'][:120]})"  # a lost start: retried
        reason = "lost"
    if reason == "timeout":
        code = 124
    elif reason == "interrupted":
        code = 128 + int(stop["signal"])
    else:
        code = proc.returncode
    if reason == "lost" and code == 0:
        code = 1
    return RunResult(code=code, seconds=time.monotonic() - t0, peak_pss_bytes=peak, peak_at_s=peak_at, reason=reason,
                     run_id=run_id, lost=lost.get("what", ""), lost_at_s=lost.get("at"), step_at_s=step_at)

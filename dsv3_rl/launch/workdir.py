"""Who owns a run directory: one live launcher per LOG_DIR, and a finished run belongs to the settings that made it.

* :class:`RunLock`: ``LOG_DIR/.dsv3-launch.lock``, an ``fcntl`` lock held by the launcher while it runs, and
  ``LOG_DIR/.dsv3-launch.json`` beside it with the launcher's pid and the run marker (``DSV3_RUN_ID``) of its current main_ppo attempt. A second launcher in the
  same LOG_DIR is refused while the first lives. When the lock is free but its file names a run whose processes
  still live (the launcher was ``kill -9``'d: main_ppo and Ray train on as orphans), those are stopped, saying so,
  before anything starts: two runs never write the same checkpoints.
* :func:`identity` / :func:`identity_mismatch`: ``CKPT_DIR/dsv3-run.json`` records the preset and the verl overrides
  of the run that wrote the checkpoints; another preset or other overrides in that directory are refused
  (naming the differing keys), except the step budget (``trainer.total_training_steps``, ``total_epochs``), which a
  rerun may raise to continue the run, and the paths (a moved or copied run directory resumes).
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from pathlib import Path

from dsv3_rl.errors import Dsv3Error
from dsv3_rl.fs import write_json_atomic

LOCK = ".dsv3-launch.lock"
"""the flock'd file (never replaced: a lock lives on its inode)"""
RECORD = ".dsv3-launch.json"
"""the live launcher's pid, preset and current run marker (replaced atomically)"""
IDENTITY = "dsv3-run.json"
#: overrides a rerun may change without making it another run
CONTINUABLE = ("trainer.total_training_steps", "trainer.total_epochs")


class RunDirBusy(Dsv3Error, RuntimeError):
    """Another launcher runs in this LOG_DIR, or the directory holds another run."""


class RunLock:
    def __init__(self, log_dir: Path, preset: str, say=print):
        self.path = Path(log_dir) / LOCK
        self.record = Path(log_dir) / RECORD
        self.preset, self.say = preset, say
        self.fd: int | None = None

    def _read(self) -> dict:
        try:
            return json.loads(self.record.read_text() or "{}")
        except (OSError, ValueError):
            return {}

    def acquire(self) -> RunLock:
        from dsv3_rl.launch import monitor

        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            rec = self._read()
            raise RunDirBusy(f"another launcher (pid {rec.get('pid', '?')}, preset {rec.get('preset', '?')}, since "
                             f"{rec.get('started', '?')}) is running in {self.path.parent}; wait for it, stop it "
                             f"(kill {rec.get('pid', 'PID')}: it tears its run down), or use another WORK_DIR") from None
        self.fd = fd
        rec = self._read()
        rid = rec.get("run_id")
        if rid:
            orphans = monitor.run_processes(rid)
            if orphans:
                self.say(f"an earlier run in {self.path.parent} (launcher pid {rec.get('pid', '?')} is gone) still has "
                         f"{len(orphans)} process(es) running (main_ppo, Ray): stopping them before this run starts")
                monitor.stop_run(None, rid)
        self.update(run_id=None)
        return self

    def update(self, run_id: str | None) -> None:
        write_json_atomic(self.record, {"pid": os.getpid(), "preset": self.preset, "run_id": run_id,
                                      "started": time.strftime("%Y-%m-%dT%H:%M:%S")}, indent=None)

    def release(self) -> None:
        if self.fd is not None:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def _defining(ovs: list[str]) -> list[str]:
    """OVS without the step budget (:data:`CONTINUABLE`) and the paths (``run.PATH_KEYS``: a moved run is the same)."""
    from dsv3_rl.launch.run import PATH_KEYS

    return [o for o in ovs if o.split("=", 1)[0].lstrip("+~") not in (*CONTINUABLE, *PATH_KEYS)]


def identity(launch) -> dict:
    """The preset and the verl overrides that define the run (the step budget and the paths excluded)."""
    ovs = _defining([*launch.overrides, *launch.user])
    return {"preset": launch.preset.name, "preset_file": str(launch.preset.path), "overrides": ovs}


def has_run(ckpt_dir: Path, log_dir: Path) -> bool:
    from dsv3_rl.launch import ckpt

    return bool(ckpt.step_dirs(ckpt_dir)) or ckpt.tracker_step(ckpt_dir) is not None or (Path(log_dir) / "report.json").is_file()


def identity_mismatch(launch) -> str | None:
    """Why CKPT_DIR belongs to another run (preset or overrides), or None."""
    paths = launch.paths
    f = Path(paths.ckpt) / IDENTITY
    if not f.is_file() or not has_run(paths.ckpt, paths.logs):
        return None
    try:
        old = json.loads(f.read_text())
    except (OSError, ValueError):
        return None
    new = identity(launch)
    where = f"{paths.ckpt} (and {paths.logs})"
    if old.get("preset") != new["preset"]:
        return (f"{where} holds a run of preset {old.get('preset')!r}, not {new['preset']!r}: use another WORK_DIR "
                f"(or CKPT_DIR and LOG_DIR), or remove that run")
    a, b = dict(_kv(_defining(old.get("overrides") or []))), dict(_kv(new["overrides"]))  # an older record: paths in
    diff = [f"{k}: {a.get(k, '(unset)')} -> {b.get(k, '(unset)')}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
    if diff:
        return (f"{where} holds a run of preset {new['preset']!r} with other settings ({'; '.join(diff[:4])}"
                f"{f'; +{len(diff) - 4} more' if len(diff) > 4 else ''}): use another WORK_DIR, or remove that run")
    return None


def _kv(ovs: list[str]):
    for o in ovs:
        k, _, v = o.partition("=")
        yield k.lstrip("+~"), v


def record_identity(launch) -> None:
    write_json_atomic(Path(launch.paths.ckpt) / IDENTITY, identity(launch), indent=1)

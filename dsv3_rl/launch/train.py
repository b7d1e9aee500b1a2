"""The training step of a single-node launch: resume bookkeeping, the watched ``main_ppo`` run, then the
run's self-checks, plots and one summary line.

* Resume: verl (``trainer.resume_mode=auto``) resumes from ``CKPT_DIR/latest_checkpointed_iteration.txt``.
  verl's file logger truncates ``metrics.jsonl`` when it starts, so before a resumed attempt the launcher
  keeps the previous file as ``metrics.attempt-N.jsonl`` (the checks and plots read all attempts, a step
  logged twice counts once, the later one). A run that starts fresh (no checkpoint) removes the metrics of
  an earlier attempt first: two runs are never mixed.
* Restarts: a run that lost a process (:func:`dsv3_rl.launch.monitor.lost_process`) is torn down and started
  again with ``resume_mode=auto`` up to ``run.max_restarts`` times; the same loss at the same step twice is
  deterministic and ends the run. Each restart is a progress line and an entry of report.json's ``run.restarts``
  (cause, step, steps repeated, time lost). Before every attempt the checkpoints are verified
  (:func:`dsv3_rl.launch.ckpt.prepare_resume`); while it runs each new checkpoint gets its manifest.
* The finish line: a rerun of a finished run (checkpoint at the last step, report.json of the same run) prints the
  saved checks and summary without starting Ray; the s/step of a summary are those of this invocation's steps.
* Checks (presets with a ``checks:`` section, :mod:`dsv3_rl.grpo.checks`) go to ``LOG_DIR/report.json``;
  ``reward.png`` and ``consistency.png`` (:func:`dsv3_rl.grpo.progress.write_plots`) to LOG_DIR.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import re
import threading
import time
import uuid

from dsv3_rl.launch import ckpt, monitor
from dsv3_rl.fs import write_json_atomic

TRACKER = ckpt.TRACKER  # verl's "last complete checkpoint" file under CKPT_DIR
PREFIX = "[dsv3-grpo]"
REPORT = "report.json"


def say(msg: str) -> None:
    print(f"{PREFIX} {msg}", flush=True)


latest_checkpoint = ckpt.tracker_step  # the step of verl's last complete checkpoint under CKPT_DIR, or None


RESUME_FILE = "resume.json"  # LOG_DIR: the checkpoint step the last attempt resumed from


def prepare_metrics(metrics: Path, resume_step: int | None) -> None:
    """Keep an interrupted attempt's metrics for a resumed run (and record where it resumed, in
    ``resume.json`` beside them); drop both for a fresh one."""
    olds = sorted(metrics.parent.glob(f"{metrics.stem}.attempt-*{metrics.suffix}"))
    marker = metrics.parent / RESUME_FILE
    if resume_step is None:
        for p in [*olds, metrics, marker]:
            p.unlink(missing_ok=True)
        return
    if metrics.is_file():
        os.replace(metrics, metrics.with_name(f"{metrics.stem}.attempt-{len(olds) + 1}{metrics.suffix}"))
    write_json_atomic(marker, {"resumed_from": resume_step}, indent=None)


def resumed_from(metrics: Path) -> int | None:
    """The step the last attempt resumed from (``resume.json``), None for a run that never resumed."""
    try:
        return int(json.loads((metrics.parent / RESUME_FILE).read_text())["resumed_from"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _select(cfg, key, default=None):
    from omegaconf import OmegaConf

    v = OmegaConf.select(cfg, key, default=default)
    return default if v is None else v


class _Manifests:
    """Writes ``dsv3-manifest.json`` into each checkpoint once verl's tracker names it (polled once a second by the
    watched run; the digests are computed in a thread, so progress lines and limits are not held up)."""

    def __init__(self, ckpt_dir: Path, mode: str, attempt: str = ""):
        self.ckpt_dir, self.mode, self.done = Path(ckpt_dir), mode, set()
        self.threads: list[threading.Thread] = []
        self.attempt = attempt  # the saves this attempt begins are recorded as this run's own (ckpt.record_saves)
        self.dirs = ckpt.step_inodes(self.ckpt_dir)  # before the attempt starts

    def __call__(self) -> None:
        if self.attempt:
            try:
                self.dirs = ckpt.record_saves(self.ckpt_dir, self.dirs, self.attempt)
            except OSError as e:  # the ledger only decides between deleting and moving aside a partial save
                say(f"could not record the saves of this attempt in {self.ckpt_dir / ckpt.SAVES}: {e}")
        n = ckpt.tracker_step(self.ckpt_dir)
        if self.mode == "off" or n is None or n in self.done:
            return
        d = self.ckpt_dir / f"global_step_{n}"
        self.done.add(n)
        if d.is_dir() and not (d / ckpt.MANIFEST).is_file():
            t = threading.Thread(target=self._write, args=(d,), daemon=True)
            t.start()
            self.threads.append(t)

    def _write(self, d: Path) -> None:
        try:
            ckpt.write_manifest(d, digests=self.mode == "digests")
        except Exception as e:  # noqa: BLE001 - a checkpoint removed meanwhile: the resume verifies its structure
            say(f"no manifest for {d}: {type(e).__name__}: {e}")

    def finish(self) -> None:
        """The last checkpoint's manifest too, and wait for all of them."""
        self()
        for t in self.threads:
            t.join()


def _cause_key(lost: str, step: int) -> tuple[str, int]:
    return re.sub(r"\d+s\b", "Ns", re.sub(r"pid \d+", "pid", lost)), step


DEFAULT_START_RETRIES = 2
"""``run.max_start_retries`` unless the preset says: a failed start (Ray or vLLM failing to come up, the node's Ray gone
before the attempt trains a step: a loaded machine) is retried this often per invocation, on its own budget: the
restarts of ``run.max_restarts`` are for processes lost while the run trains (stop 47's CI: a fault chain whose two
planted losses had used both restarts ended on a raylet that gave up starting)"""

START_RETRY_WAIT_S = 10.0
"""seconds a retry after a failed start waits once the old cluster's processes are gone (a loaded machine)"""


def _time_lost(fail: dict, nxt_start: float, nxt: monitor.RunResult, step_s: dict[int, float]) -> float:
    """Wall seconds between the failed attempt reaching its last logged step and the next attempt reaching the same
    point again (its start-up, the repeated steps and the teardown of the failed one)."""
    last = fail["last_step"]
    t1 = fail["t_last"]
    if last in nxt.step_at_s:
        return nxt_start + nxt.step_at_s[last] - t1
    later = sorted(k for k in nxt.step_at_s if k > last)
    if later:  # it resumed at `last`: its first new step, less that step's own duration
        k = later[0]
        return nxt_start + nxt.step_at_s[k] - step_s.get(k, 0.0) - t1
    return nxt_start + nxt.seconds - t1


def run_single_node(launch, env: dict[str, str]) -> int:
    from dsv3_rl.launch import workdir

    paths = launch.paths
    paths.logs.mkdir(parents=True, exist_ok=True)
    with workdir.RunLock(paths.logs, launch.preset.name, say=say) as lock:
        done = finished(launch)
        if done is not None:
            return done
        return _run_attempts(launch, env, lock)


#: what the checks after the run import (the checkpoint reload into a TP1 model, the plots): imported in a thread
#: while main_ppo runs, where this process only waits, instead of after it (~5 s on 2 cores; issue 28)
AFTER_RUN_IMPORTS = ("megatron.core.dist_checkpointing", "megatron.core.models.gpt", "transformers",
                     "matplotlib.pyplot")


def _warm_imports(names=AFTER_RUN_IMPORTS) -> threading.Thread:
    def run():
        import importlib

        for name in names:
            try:
                importlib.import_module(name)
            except Exception:  # noqa: BLE001  (the checks import it again and report what fails, in their words)
                pass

    t = threading.Thread(target=run, name="dsv3-warm-imports", daemon=True)
    t.start()
    return t


def _run_attempts(launch, env: dict[str, str], lock) -> int:
    from dsv3_rl.grpo import checks as checks_mod, progress
    from dsv3_rl.grpo.progress import write_plots
    from dsv3_rl.launch import workdir

    _warm_imports()

    paths, preset = launch.paths, launch.preset
    total = int(_select(launch.cfg, "trainer.total_training_steps", 0) or 0)
    metrics = Path(env.get("VERL_FILE_LOGGER_PATH") or paths.logs / "metrics.jsonl")
    log = paths.logs / "main_ppo.log"
    resume_mode = str(_select(launch.cfg, "trainer.resume_mode", "auto"))
    max_restarts = int(preset.run.get("max_restarts", 0) or 0)
    max_start_retries = int(preset.run.get("max_start_retries", DEFAULT_START_RETRIES))
    verify_mode = str(preset.run.get("verify_checkpoints", "digests"))
    keep = _select(launch.cfg, "trainer.max_actor_ckpt_to_keep", None)
    metrics.parent.mkdir(parents=True, exist_ok=True)
    timeout = preset.run.get("timeout_s")
    restarts: list[dict] = []  # lost processes (run.max_restarts)
    start_retries: list[dict] = []  # failed starts (run.max_start_retries): their own budget
    pending: dict | None = None  # the restart whose time lost is measured by the next attempt
    this_steps: set[int] = set()
    t_run0 = time.monotonic()
    resume0 = None
    gave_up = ""  # the one-line cause when a lost process ends the run
    while True:
        resume = None
        if resume_mode != "disable":
            resume = ckpt.prepare_resume(paths.ckpt, keep=keep if isinstance(keep, int) else None, mode=verify_mode,
                                         say=say)
        if pending is not None and resume is not None and resume not in _logged(metrics):
            # the lost process struck between verl's save of step K and its metrics line: redo K from the checkpoint
            # before, so that the run's record (and the learning gate) has every step (at most save_freq steps)
            aside = ckpt.move_aside(paths.ckpt / f"global_step_{resume}", "unlogged")
            say(f"step {resume} was checkpointed but its metrics were never logged (the run was lost in between): "
                f"redoing it from the checkpoint before, so that every step is in the run's record (the checkpoint "
                f"is kept, moved aside to {aside.name})")
            resume = ckpt.prepare_resume(paths.ckpt, keep=None, mode=verify_mode, say=say)
        if resume is None or not (paths.ckpt / workdir.IDENTITY).is_file():  # a fresh run, or one from before
            workdir.record_identity(launch)
        if pending is None:
            resume0 = resume
        prepare_metrics(metrics, resume)
        if resume is not None:
            left = f"steps {resume + 1}..{total} remain" if resume < total else "all steps are done: verl only loads it"
            say(f"resuming from {paths.ckpt}/global_step_{resume} (verl trainer.resume_mode={resume_mode}); {left}")
        if pending is not None:
            pending["resumed_from"] = resume
            pending["steps_repeated"] = max(0, pending.pop("trained") - (resume or 0))
        say(f"running verl main_ppo: {total} GRPO steps{f', limit {timeout:.0f}s' if timeout else ''}"
            f"{f', restart {len(restarts)}/{max_restarts}' if restarts else ''}"
            f"{f', start retry {len(start_retries)}/{max_start_retries}' if start_retries else ''}; full log {log}")
        with open(log, "a" if resume is not None or restarts or start_retries else "w") as f:  # a resumed attempt continues the log
            f.write(f"\n===== {PREFIX} attempt: {' '.join(launch.argv[:4])} ... (resume from step {resume}) =====\n")
        run_id = uuid.uuid4().hex
        lock.update(run_id=run_id)
        t_att = time.monotonic()
        manifests = _Manifests(paths.ckpt, verify_mode, attempt=run_id)
        if resume is not None and resume >= total and set(range(1, total + 1)) <= _logged(metrics):
            say(f"every step up to {total} is trained, checkpointed and logged: main_ppo is not started")
            res = monitor.RunResult(code=0, seconds=0.0, peak_pss_bytes=0)
        else:
            measured = [float(r["timing_s/step"]) for r in _read_quiet(metrics, every_attempt=True)
                        if isinstance(r.get("timing_s/step"), (int, float)) and r["timing_s/step"] > 0]
            res = monitor.run_watched(launch.argv, env, log_path=log, metrics_path=metrics, total_steps=total,
                                      timeout_s=timeout, say=print, run_id=run_id, on_poll=manifests,
                                      step_seconds=measured)
        manifests.finish()
        lock.update(run_id=None)
        this_steps |= {k for k in res.step_at_s if k > (resume or 0)}  # a resumed attempt logs step K's validation
        step_s = {r["step"]: float(r.get("timing_s/step") or 0.0) for r in _read_quiet(metrics)}
        if pending is not None:
            pending["time_lost_s"] = round(_time_lost(pending, t_att, res, step_s), 1)
            retried = any(pending is r for r in start_retries)
            say(f"{'start retry' if retried else 'restart'} {len(start_retries if retried else restarts)}: "
                f"{pending['steps_repeated']} step(s) repeated, "
                f"{pending['time_lost_s']:.0f}s lost (from reaching step {pending['last_step']} to reaching it again)")
            pending = None
        gib = res.peak_pss_bytes / 2**30
        say(f"main_ppo finished in {res.seconds:.0f}s (exit {res.code}{', ' + res.reason if res.reason else ''}); "
            f"peak memory {gib:.1f} GiB at {res.peak_at_s:.0f}s (PSS summed over the run's processes)")
        if (startup := progress.startup_line(log)) is not None:  # where the start-up went (issue 28)
            print(startup, flush=True)
        if res.reason == "lost":
            last = max([k for k in res.step_at_s if k > 0], default=resume or 0)
            lost = res.lost
            if lost.startswith(monitor.NODE_RAY) and last <= (resume or 0):
                # the node's own Ray gone before this attempt trained a step: its raylet gave up starting (it aborts
                # when its agents' port files take > 15 s, a loaded machine; docs/ci-history.md "2026-12-07"): a failed start,
                # retried like one, naming the process (the 2026-12-07 clean-clone CI: "raylet lost during step 7")
                lost = f"a failed start of Ray or vLLM ({lost} lost)"
            start_failed = lost.startswith("a failed start")
            cause = f"{lost} {'before' if start_failed else 'lost during'} step {last + 1}"
            entry = {"cause": cause, "step": last + 1, "last_step": last, "at_s": round(res.lost_at_s or 0, 1),
                     "t_last": t_att + (res.step_at_s.get(last) or 0.0),
                     "trained": max(last, ckpt.tracker_step(paths.ckpt) or 0)}  # a step saved but not logged too
            again = not start_failed and any(_cause_key(r["cause"], r["step"]) == _cause_key(cause, last + 1)
                                             for r in restarts)  # a start fails by the machine's state: retried
            # a failed start is the machine's state, not the run's: its own budget, never a restart's (docs/ci.md)
            used, budget, key = ((start_retries, max_start_retries, "max_start_retries") if start_failed
                                 else (restarts, max_restarts, "max_restarts"))
            if again:
                res.reason, why = "deterministic", "the same loss at the same step as before: not restarting"
            elif len(used) >= budget:
                why = f"no {'start retry' if start_failed else 'restart'} left (run.{key}={budget})"
            else:
                used.append(entry)
                pending = entry
                say(f"{'START RETRY' if start_failed else 'RESTART'} {len(used)}/{budget}: {cause}; the run was torn "
                    f"down, starting it again from its last complete checkpoint"
                    f"{' (run.max_restarts is not used)' if start_failed else ''}")
                if start_failed:
                    _wait_cluster_gone(res.run_id)
                continue
            lines = log.read_text(errors="replace").splitlines()[-15:]
            print("\n".join(lines), flush=True)
            say(f"main_ppo lost a process: {cause}; {why}")
            gave_up = f"{cause}; {why}"
        break
    res.seconds = time.monotonic() - t_run0
    if res.reason == "interrupted":
        done = latest_checkpoint(paths.ckpt)
        where = f"from {paths.ckpt}/global_step_{done}" if done is not None else "from the start (no checkpoint was complete)"
        say(f"interrupted: run the same command again to resume {where}")
        return res.code
    if res.code != 0 and res.reason not in ("lost", "deterministic"):
        lines = log.read_text(errors="replace").splitlines()[-40:]
        why = f"stopped at its limit of {timeout:.0f}s (run.timeout_s)" if res.reason == "timeout" else f"failed (exit {res.code})"
        say(f"main_ppo {why}; last lines of {log}:")
        print("\n".join(lines), flush=True)
        errs = [ln.strip() for ln in lines if re.search(r"\b\w*(?:Error|Exception)\b", ln)]
        gave_up = f"main_ppo {why}" + (f": {errs[-1][:160]}" if errs else "")  # the cause, in the summary line
        if "No space left on device" in "\n".join(lines) or _disk_full(paths.ckpt):
            say(f"the disk of {paths.ckpt} is full (no space left on device): free space and run the same command "
                f"again; the incomplete checkpoint is removed then, the last complete one is used")
    steps = []
    try:
        steps = checks_mod.read_run_metrics(metrics)
    except checks_mod.CheckError as e:
        say(f"no metrics: {e}")
    plots = write_plots(steps, paths.logs, _dense_layers(paths), _plot_title(launch)) if steps else []
    run_info = {"seconds": round(res.seconds, 1), "peak_pss_gib": round(res.peak_pss_bytes / 2**30, 2),
                "peak_at_s": round(res.peak_at_s, 1), "resumed_from": resume0,
                "restarts": [{k: v for k, v in r.items() if k != "t_last"} for r in restarts],
                "start_retries": [{k: v for k, v in r.items() if k != "t_last"} for r in start_retries],
                "steps_this_invocation": sorted(this_steps)}
    report = None
    if preset.checks is not None and res.code == 0:
        report = _checks(launch, metrics, total, run_info)
        print(report.render(), flush=True)
    ok = res.code == 0 and (report is None or report.ok)
    line = summary(preset.name, ok, steps, report, res, total, this_steps=this_steps,
                   cause=gave_up, restarts=len(restarts), start_retries=len(start_retries))
    if report is None:
        write_json_atomic(paths.logs / REPORT, {"ok": ok, "checks": [], "steps": steps,
                                                "run": {**run_info, "summary": line}}, default=str, ensure_ascii=True)
    else:
        _add_summary(paths.logs / REPORT, line)
    say(f"logs: {log} | metrics: {metrics} | report: {paths.logs / REPORT} | "
        f"plots: {', '.join(map(str, plots)) or 'n/a'} | checkpoint: {paths.ckpt}")
    say(line)
    return 0 if ok else 1


def _wait_cluster_gone(run_id: str, limit_s: float = 60.0) -> None:
    """Before a retry after a failed start: wait for every process of the failed attempt to be gone (its Ray ports
    and sockets with them), then START_RETRY_WAIT_S more, so that the fresh cluster does not start into the old."""
    t0 = time.monotonic()
    while monitor.run_processes(run_id) and time.monotonic() - t0 < limit_s:
        time.sleep(1.0)
    left = len(monitor.run_processes(run_id))
    say(f"retrying the start with a fresh Ray cluster in {START_RETRY_WAIT_S:.0f}s (the failed attempt's processes: "
        f"{'all gone' if not left else f'{left} still there after {limit_s:.0f}s'})")
    time.sleep(START_RETRY_WAIT_S)


def _logged(metrics: Path) -> set[int]:
    """The training steps whose metrics are in METRICS or an earlier attempt's file."""
    from dsv3_rl.grpo import checks as checks_mod

    try:
        return {s["step"] for s in checks_mod.training_steps(checks_mod.read_run_metrics(metrics))}
    except (checks_mod.CheckError, KeyError, ValueError):
        return set()


def _disk_full(path: Path) -> bool:
    from dsv3_rl.errors import free_bytes

    try:
        return free_bytes(path) < (16 << 20)
    except OSError:
        return False


def _read_quiet(metrics: Path, every_attempt: bool = False) -> list[dict]:
    from dsv3_rl.grpo import checks as checks_mod

    try:
        return checks_mod.read_run_metrics(metrics) if every_attempt else checks_mod.read_metrics(metrics)
    except (checks_mod.CheckError, KeyError, ValueError):
        return []


def _add_summary(report: Path, line: str) -> None:
    rec = json.loads(report.read_text())
    rec.setdefault("run", {})["summary"] = line
    write_json_atomic(report, rec, default=str, ensure_ascii=True)


def finished(launch) -> int | None:
    """A finished run of these settings (its checkpoint at the last step, its report.json written after it):
    print the saved checks and summary and return the exit status, without starting Ray or vLLM; else None."""
    from dsv3_rl.launch import workdir

    paths = launch.paths
    total = int(_select(launch.cfg, "trainer.total_training_steps", 0) or 0)
    rep = paths.logs / REPORT
    step = ckpt.tracker_step(paths.ckpt)
    if step is None or step < total or not rep.is_file() or workdir.identity_mismatch(launch):
        return None
    if rep.stat().st_mtime < (paths.ckpt / TRACKER).stat().st_mtime:
        return None
    try:
        rec = json.loads(rep.read_text())
        line = rec["run"]["summary"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(rep.stat().st_mtime))
    say(f"this run is complete: {paths.ckpt}/global_step_{step} is its last step ({total}); nothing to train "
        f"(Ray and vLLM not started). Saved result of {when} ({rep}):")
    for c in rec.get("checks") or []:
        print(f"  [{'PASS' if c.get('ok') else 'FAIL'}] {c.get('name')}: {c.get('detail')}", flush=True)
    say(f"{line}  [finished {when}; to train again use another WORK_DIR or remove {paths.ckpt}]")
    return 0 if rec.get("ok") else 1


def _checks(launch, metrics: Path, total: int, run_info: dict | None = None):
    import logging
    import warnings

    from dsv3_rl.grpo import checks as checks_mod

    paths = launch.paths
    initial = paths.mcore if launch.preset.weights.get("dist_ckpt") else None
    logging.getLogger("megatron").setLevel(logging.ERROR)
    with warnings.catch_warnings():  # megatron/torch dist-checkpoint deprecation noise while reloading
        warnings.simplefilter("ignore")
        from dsv3_rl.recipes import algorithms  # off-policy staleness check (issue 27)

        tolerances = {**(launch.preset.checks or {}), "router_replay": launch.preset.router_replay,
                      "trainer_mode": launch.preset.trainer_mode, "off_policy": launch.preset.off_policy,
                      "algorithm": launch.preset.algorithm,
                      "samples_per_step": algorithms.samples_per_step(launch.cfg, launch.preset.trainer_mode)}
        report = checks_mod.check_run(metrics, total, initial, paths.ckpt, paths.hf, tolerances,
                                      resumed_from(metrics))
    out = paths.logs / "report.json"
    write_json_atomic(out, {**report.to_json(), "run": run_info or {}}, default=str, ensure_ascii=True)
    return report


def _plot_title(launch) -> str:
    """The reward plot's title: the preset's algorithm, and its trainer mode when not sync."""
    p = launch.preset  # (a stand-in preset without the keys: the Preset defaults, sync GRPO)
    algorithm, trainer_mode = getattr(p, "algorithm", "grpo"), getattr(p, "trainer_mode", "sync")
    mode = "" if trainer_mode == "sync" else f" ({trainer_mode.replace('_', '-')})"
    return f"{algorithm.upper()}{mode} reward per step"


def _dense_layers(paths) -> int:
    """DeepSeek-V3's leading dense layers (``first_k_dense_replace`` of the run's HF config; 0 if unknown)."""
    from dsv3_rl.convert.weights import load_hf_config
    from dsv3_rl.errors import Dsv3Error

    try:
        return int(load_hf_config(Path(paths.hf)).get("first_k_dense_replace", 0) or 0)
    except (Dsv3Error, OSError):
        return 0


def check_finished(launch) -> int:
    """The checks, plots and summary of a finished run again (``dsv3-launch check --preset NAME``; node 0 of a
    multi-node run after main_ppo). They run in this process as one process: the job's rendezvous variables
    (PAI-DLC's WORLD_SIZE = pods) are out of ``os.environ`` meanwhile, or the checkpoint reload's torch.distributed
    init would wait for the job's other ranks (2026-12-07: "environment variable MASTER_PORT expected")."""
    from dsv3_rl.launch.stages import JOB_RENDEZVOUS_VARS

    saved = {k: os.environ.pop(k) for k in JOB_RENDEZVOUS_VARS if k in os.environ}
    try:
        return _check_finished(launch)
    finally:
        os.environ.update(saved)


def _check_finished(launch) -> int:
    from dsv3_rl.grpo import checks as checks_mod
    from dsv3_rl.grpo.progress import write_plots

    paths = launch.paths
    metrics = Path(launch.env.get("VERL_FILE_LOGGER_PATH") or paths.logs / "metrics.jsonl")
    total = int(_select(launch.cfg, "trainer.total_training_steps", 0) or 0)
    steps = checks_mod.read_run_metrics(metrics)
    plots = write_plots(steps, paths.logs, _dense_layers(paths), _plot_title(launch))
    report = _checks(launch, metrics, total) if launch.preset.checks is not None else None
    if report is not None:
        print(report.render(), flush=True)
    ok = report is None or report.ok
    say(f"metrics: {metrics} | plots: {', '.join(map(str, plots))}")
    say(summary(launch.preset.name, ok, steps, report, None, total))
    return 0 if ok else 1


def summary(name: str, ok: bool, steps: list[dict], report, res: monitor.RunResult | None, total: int,
            this_steps: set[int] | None = None, cause: str = "", restarts: int = 0, start_retries: int = 0) -> str:
    """The one summary line. Seconds per step are those of THIS_STEPS (the steps this invocation trained; all
    logged steps when None, for ``dsv3-launch check``), never an earlier invocation's as this one's."""
    from dsv3_rl.grpo import checks as checks_mod

    train = checks_mod.training_steps(steps)
    first, last = checks_mod.learning_summary(steps)
    vals = [v for v in (checks_mod.val_reward(s) for s in steps) if v is not None]
    timed = [s for s in train if this_steps is None or s["step"] in this_steps]
    times = [s.get("timing_s/step") for s in timed if isinstance(s.get("timing_s/step"), (int, float))]
    gaps = [s.get(checks_mod.PROB_DIFF_MEAN) for s in train if isinstance(s.get(checks_mod.PROB_DIFF_MEAN), (int, float))]
    parts = [f"GRPO {name} {'PASSED' if ok else 'FAILED'}: {len(train)}/{total} steps"
             + (f" in {res.seconds:.0f}s" if res is not None else "")]
    if cause:
        parts.append(cause)
    if restarts:
        parts.append(f"{restarts} restart(s)")
    if start_retries:
        parts.append(f"{start_retries} start retry(s)")
    if times:
        parts.append(f"{sum(times) / len(times):.1f} s/step" + ("" if this_steps is None or len(timed) == len(train)
                                                                 else f" (the {len(timed)} steps of this invocation)"))
    elif this_steps is not None and train:
        parts.append("no step trained by this invocation")
    if first is not None:
        parts.append(f"reward {first:.3f} -> {last:.3f} (first/last 3 steps)")
    if len(vals) >= 2:
        parts.append(f"val {vals[0]:.3f} -> {vals[-1]:.3f}")
    if gaps:
        parts.append(f"mean|p_vllm-p_mcore| <= {max(gaps):.2g}")
    if res is not None:
        parts.append(f"peak mem {res.peak_pss_bytes / 2**30:.1f} GiB")
    if report is not None:
        parts.append(f"checks {sum(c.ok for c in report.checks)}/{len(report.checks)}")
    return ", ".join(parts)


if __name__ == "__main__":  # pragma: no cover
    sys.exit("use python -m dsv3_rl.launch run")

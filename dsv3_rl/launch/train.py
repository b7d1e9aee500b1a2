"""The training step of a single-node launch: resume bookkeeping, the watched ``main_ppo`` run, then the
run's self-checks, plots and one summary line.

* Resume: verl (``trainer.resume_mode=auto``) resumes from ``CKPT_DIR/latest_checkpointed_iteration.txt``.
  verl's file logger truncates ``metrics.jsonl`` when it starts, so before a resumed attempt the launcher
  keeps the previous file as ``metrics.attempt-N.jsonl`` (the checks and plots read all attempts, a step
  logged twice counts once, the later one). A run that starts fresh (no checkpoint) removes the metrics of
  an earlier attempt first: two runs are never mixed.
* Checks (presets with a ``checks:`` section, :mod:`dsv3_rl.grpo.checks`) go to ``LOG_DIR/report.json``;
  ``reward.png`` and ``consistency.png`` (:func:`dsv3_rl.grpo.progress.write_plots`) to LOG_DIR.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from dsv3_rl.launch import monitor
from dsv3_rl.fs import write_json_atomic

TRACKER = "latest_checkpointed_iteration.txt"  # verl's "last complete checkpoint" file under CKPT_DIR
PREFIX = "[dsv3-grpo]"


def say(msg: str) -> None:
    print(f"{PREFIX} {msg}", flush=True)


def latest_checkpoint(ckpt_dir: Path) -> int | None:
    """The step of verl's last complete checkpoint under CKPT_DIR (its tracker file), or None."""
    try:
        text = (Path(ckpt_dir) / TRACKER).read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


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


def run_single_node(launch, env: dict[str, str]) -> int:
    from dsv3_rl.grpo import checks as checks_mod
    from dsv3_rl.grpo.progress import write_plots

    paths, preset = launch.paths, launch.preset
    total = int(_select(launch.cfg, "trainer.total_training_steps", 0) or 0)
    metrics = Path(env.get("VERL_FILE_LOGGER_PATH") or paths.logs / "metrics.jsonl")
    log = paths.logs / "main_ppo.log"
    resume_mode = str(_select(launch.cfg, "trainer.resume_mode", "auto"))
    resume = latest_checkpoint(paths.ckpt) if resume_mode != "disable" else None
    paths.logs.mkdir(parents=True, exist_ok=True)
    metrics.parent.mkdir(parents=True, exist_ok=True)
    prepare_metrics(metrics, resume)
    if resume is not None:
        left = f"steps {resume + 1}..{total} remain" if resume < total else "all steps are done: verl only loads it"
        say(f"resuming from {paths.ckpt}/global_step_{resume} (verl trainer.resume_mode={resume_mode}); {left}")
    timeout = preset.run.get("timeout_s")
    say(f"running verl main_ppo: {total} GRPO steps{f', limit {timeout:.0f}s' if timeout else ''}; "
        f"full log {log}")
    with open(log, "a" if resume is not None else "w") as f:  # a resumed attempt continues the log
        f.write(f"\n===== {PREFIX} attempt: {' '.join(launch.argv[:4])} ... (resume from step {resume}) =====\n")
    res = monitor.run_watched(launch.argv, env, log_path=log, metrics_path=metrics, total_steps=total,
                              timeout_s=timeout, say=print)
    gib = res.peak_pss_bytes / 2**30
    say(f"main_ppo finished in {res.seconds:.0f}s (exit {res.code}{', ' + res.reason if res.reason else ''}); "
        f"peak memory {gib:.1f} GiB at {res.peak_at_s:.0f}s (PSS summed over the run's processes)")
    if res.reason == "interrupted":
        done = latest_checkpoint(paths.ckpt)
        where = f"from {paths.ckpt}/global_step_{done}" if done is not None else "from the start (no checkpoint was complete)"
        say(f"interrupted: run the same command again to resume {where}")
        return res.code
    if res.code != 0:
        lines = log.read_text(errors="replace").splitlines()[-40:]
        why = f"stopped at its limit of {timeout:.0f}s (run.timeout_s)" if res.reason == "timeout" else f"failed (exit {res.code})"
        say(f"main_ppo {why}; last lines of {log}:")
        print("\n".join(lines), flush=True)
    steps = []
    try:
        steps = checks_mod.read_run_metrics(metrics)
    except checks_mod.CheckError as e:
        say(f"no metrics: {e}")
    plots = write_plots(steps, paths.logs, _dense_layers(paths)) if steps else []
    report = None
    if preset.checks is not None and res.code == 0:
        report = _checks(launch, metrics, total, {"seconds": round(res.seconds, 1),
                                                  "peak_pss_gib": round(res.peak_pss_bytes / 2**30, 2),
                                                  "peak_at_s": round(res.peak_at_s, 1), "resumed_from": resume})
        print(report.render(), flush=True)
    ok = res.code == 0 and (report is None or report.ok)
    say(f"logs: {log} | metrics: {metrics} | report: {paths.logs / 'report.json' if report else 'n/a'} | "
        f"plots: {', '.join(map(str, plots)) or 'n/a'} | checkpoint: {paths.ckpt}")
    say(summary(preset.name, ok, steps, report, res, total))
    return 0 if ok else 1


def _checks(launch, metrics: Path, total: int, run_info: dict | None = None):
    import logging
    import warnings

    from dsv3_rl.grpo import checks as checks_mod

    paths = launch.paths
    initial = paths.mcore if launch.preset.weights.get("dist_ckpt") else None
    logging.getLogger("megatron").setLevel(logging.ERROR)
    with warnings.catch_warnings():  # megatron/torch dist-checkpoint deprecation noise while reloading
        warnings.simplefilter("ignore")
        tolerances = {**(launch.preset.checks or {}), "router_replay": launch.preset.router_replay}
        report = checks_mod.check_run(metrics, total, initial, paths.ckpt, paths.hf, tolerances,
                                      resumed_from(metrics))
    out = paths.logs / "report.json"
    write_json_atomic(out, {**report.to_json(), "run": run_info or {}}, default=str, ensure_ascii=True)
    return report


def _dense_layers(paths) -> int:
    """DeepSeek-V3's leading dense layers (``first_k_dense_replace`` of the run's HF config; 0 if unknown)."""
    from dsv3_rl.convert.weights import load_hf_config
    from dsv3_rl.errors import Dsv3Error

    try:
        return int(load_hf_config(Path(paths.hf)).get("first_k_dense_replace", 0) or 0)
    except (Dsv3Error, OSError):
        return 0


def check_finished(launch) -> int:
    """The checks, plots and summary of a finished run again (``dsv3-launch check --preset NAME``)."""
    from dsv3_rl.grpo import checks as checks_mod
    from dsv3_rl.grpo.progress import write_plots

    paths = launch.paths
    metrics = Path(launch.env.get("VERL_FILE_LOGGER_PATH") or paths.logs / "metrics.jsonl")
    total = int(_select(launch.cfg, "trainer.total_training_steps", 0) or 0)
    steps = checks_mod.read_run_metrics(metrics)
    plots = write_plots(steps, paths.logs, _dense_layers(paths))
    report = _checks(launch, metrics, total) if launch.preset.checks is not None else None
    if report is not None:
        print(report.render(), flush=True)
    ok = report is None or report.ok
    say(f"metrics: {metrics} | plots: {', '.join(map(str, plots))}")
    say(summary(launch.preset.name, ok, steps, report, None, total))
    return 0 if ok else 1


def summary(name: str, ok: bool, steps: list[dict], report, res: monitor.RunResult | None, total: int) -> str:
    from dsv3_rl.grpo import checks as checks_mod

    train = checks_mod.training_steps(steps)
    first, last = checks_mod.learning_summary(steps)
    vals = [v for v in (checks_mod.val_reward(s) for s in steps) if v is not None]
    times = [s.get("timing_s/step") for s in train if isinstance(s.get("timing_s/step"), (int, float))]
    gaps = [s.get(checks_mod.PROB_DIFF_MEAN) for s in train if isinstance(s.get(checks_mod.PROB_DIFF_MEAN), (int, float))]
    parts = [f"GRPO {name} {'PASSED' if ok else 'FAILED'}: {len(train)}/{total} steps"
             + (f" in {res.seconds:.0f}s" if res is not None else "")]
    if times:
        parts.append(f"{sum(times) / len(times):.1f} s/step")
    if first is not None:
        parts.append(f"reward {first:.3f} -> {last:.3f} (first/last 3 steps)")
    if len(vals) >= 2:
        parts.append(f"val {vals[0]:.3f} -> {vals[-1]:.3f}")
    if gaps:
        parts.append(f"mean|p_vllm-p_mcore| <= {max(gaps):.3f}")
    if res is not None:
        parts.append(f"peak mem {res.peak_pss_bytes / 2**30:.1f} GiB")
    if report is not None:
        parts.append(f"checks {sum(c.ok for c in report.checks)}/{len(report.checks)}")
    return ", ".join(parts)


if __name__ == "__main__":  # pragma: no cover
    sys.exit("use python -m dsv3_rl.launch run")

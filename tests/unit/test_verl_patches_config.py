"""verl 0.9.1 patches for DeepSeek-V3 (patches/verl/0.9.1/0001-*): verl's own
``hf_to_mcore_config_dpskv3`` on the real 671B config and the tiny preset, against the project's
mapping; its pristine version (the planted fault) loses yarn and group-limited routing.

And verl's run-time megatron monkeypatch (``verl.models.mcore.patch.apply_patch``, called by
``hf_to_mcore_config_dpskv3`` and ``megatron_utils``): on megatron-core 0.16.1 it replaces
``MultiLatentAttention.forward`` but not ``MLASelfAttention.get_query_key_value_tensors`` (verl only
swaps that in for megatron < 0.13), so our megatron patch 0003 (rope-key gradient summed over TP)
stays in force. Shown by TP2 grads == TP1 grads through verl's patched forward, and a twin with
patch 0003 reversed that must fail.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from dsv3_rl.backends import BASELINE_TAG, git, load_lock
from dsv3_rl.ports import free_port

REPO = Path(__file__).resolve().parents[2]
VERL = load_lock()["verl"]
MCORE = load_lock()["megatron-core"]
# a backend that is not there FAILS, never skips (issue 18): `make setup` fetches, patches and installs it
for _b in (VERL, MCORE):
    assert _b.path().exists(), f"{_b.path()} is missing: {_b.name} is not fetched; run `make setup`"

# DeepSeek-V3 / V3-0324 / R1 config.json as published (hub format: rope_scaling + rope_theta), as the
# FP8 -> BF16 cast leaves it (no quantization_config) and with num_nextn_predict_layers=0, which
# verl's own assertion asks for ("MTP is not supported for now").
DSV3_671B = {**{k: v for k, v in json.loads((REPO / "tests" / "assets" / "deepseek_v3_config.json").read_text()).items()
                if k not in ("quantization_config", "auto_map")}, "num_nextn_predict_layers": 0}

# Fields owned by the model mapping (dsv3_rl.models.config_map); verl sets the engine ones.
MAPPED = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups", "layernorm_epsilon",
          "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim", "qk_layernorm",
          "rope_type", "rotary_base", "rotary_scaling_factor", "original_max_position_embeddings", "beta_fast",
          "beta_slow", "mscale", "mscale_all_dim", "num_moe_experts", "moe_router_topk", "moe_ffn_hidden_size",
          "moe_shared_expert_intermediate_size", "moe_layer_freq", "moe_router_score_function",
          "moe_router_enable_expert_bias", "moe_router_topk_scaling_factor", "moe_router_num_groups",
          "moe_router_group_topk", "moe_router_bias_update_rate", "moe_router_load_balancing_type",
          "moe_aux_loss_coeff", "moe_router_dtype", "add_bias_linear", "gated_linear_unit", "normalization")


@pytest.fixture
def megatron_single():
    """Megatron parallel state for one process; verl's apply_patch() monkeypatches are undone after."""
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention, MultiLatentAttention

    from dsv3_rl.models.config_map import Parallel
    from dsv3_rl.mcore import runtime

    saved_env = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    saved = (MultiLatentAttention.forward, MLASelfAttention.get_query_key_value_tensors)
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    # one process, no TCP rendezvous (a 'free' port can be taken by a parallel test run)
    torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    runtime.init_distributed(Parallel())
    try:
        yield
    finally:
        MultiLatentAttention.forward, MLASelfAttention.get_query_key_value_tensors = saved
        runtime.destroy()
        for k, v in saved_env.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)


def hf_config_from_json(tmp_path: Path, cfg: dict):
    from transformers import AutoConfig

    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return AutoConfig.from_pretrained(tmp_path)


def verl_dpskv3(hf_config, **overrides):
    from verl.models.mcore.config_converter import hf_to_mcore_config_dpskv3

    return hf_to_mcore_config_dpskv3(hf_config, torch.bfloat16, **overrides)


def test_verl_dpskv3_config_real_671b(megatron_single, tmp_path):
    tc = verl_dpskv3(hf_config_from_json(tmp_path, DSV3_671B))
    from dsv3_rl.models.config_map import hf_to_mcore_kwargs

    # the project's mapping of the hub config (pinned field by field in test_config_map.py), and verl's
    # engine settings kept
    ref = hf_to_mcore_kwargs(DSV3_671B, dtype=torch.bfloat16)
    want = {**{k: ref[k] for k in MAPPED}, "mtp_num_layers": 0, "moe_grouped_gemm": True, "variable_seq_lengths": True,
            "bias_activation_fusion": True}
    assert want["num_layers"] == DSV3_671B["num_hidden_layers"] and want["moe_router_group_topk"] == DSV3_671B["topk_group"]
    got = {k: getattr(tc, k) for k in want}
    assert got == want, {k: (got[k], want[k]) for k in want if got[k] != want[k]}


def test_verl_dpskv3_config_tiny_matches_mapping(megatron_single):
    from dsv3_rl.models.config_map import Parallel, RouterSettings, hf_to_mcore_kwargs
    from dsv3_rl.models.presets import hf_config

    cfg = hf_config("tiny")
    cfg.architectures = ["DeepseekV3ForCausalLM"]
    tc = verl_dpskv3(cfg)
    ref = hf_to_mcore_kwargs(cfg, Parallel(), RouterSettings(), torch.bfloat16)
    diff = {k: (getattr(tc, k), ref[k]) for k in MAPPED if getattr(tc, k) != ref[k]}
    assert not diff, diff
    assert (tc.moe_router_num_groups, tc.moe_router_group_topk, tc.rotary_scaling_factor) == (4, 2, 4.0)
    # RL router settings are explicit choices: override_transformer_config still wins
    tc = verl_dpskv3(cfg, moe_router_bias_update_rate=1e-3)
    assert tc.moe_router_bias_update_rate == 1e-3


def test_verl_dpskv3_config_refuses_what_megatron_cannot_express(megatron_single, tmp_path):
    from dsv3_rl.models.config_map import UnsupportedConfigError

    bad = dict(DSV3_671B, topk_group=2)  # 8 // 2 = 4 per group: megatron's group score differs from HF's top-2
    with pytest.raises(UnsupportedConfigError, match="topk_group"):
        verl_dpskv3(hf_config_from_json(tmp_path, bad))


def _pristine_config_converter():
    """verl 0.9.1's own config_converter.py, from the pristine baseline, as a module."""
    src = git(VERL.path(), "show", f"{BASELINE_TAG}:verl/models/mcore/config_converter.py").stdout
    spec = importlib.util.spec_from_loader("verl.models.mcore._pristine_config_converter", loader=None)
    mod = importlib.util.module_from_spec(spec)
    mod.__package__ = "verl.models.mcore"
    exec(compile(src, "pristine verl/models/mcore/config_converter.py", "exec"), mod.__dict__)
    return mod


def test_pristine_verl_dpskv3_config_loses_yarn_and_groups(megatron_single, tmp_path):
    """Planted-fault twin: without patch 0001 the same call drops yarn and group routing, and trains the router."""
    tc = _pristine_config_converter().hf_to_mcore_config_dpskv3(hf_config_from_json(tmp_path, DSV3_671B), torch.bfloat16)
    assert (tc.rope_type, tc.rotary_scaling_factor) == ("rope", 1)
    assert (tc.moe_router_num_groups, tc.moe_router_group_topk) == (None, None)
    assert tc.moe_router_bias_update_rate == 0.001 and tc.moe_router_load_balancing_type == "seq_aux_loss"


def test_verl_apply_patch_keeps_megatron_rope_key_fix(megatron_single):
    """On megatron-core 0.16.1 verl swaps in its forward but keeps megatron's (patched)
    get_query_key_value_tensors; if a verl update replaces it too, patch 0003's fix must be carried there."""
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention, MultiLatentAttention
    from verl.models.mcore.patch import apply_patch

    qkv, fwd = MLASelfAttention.get_query_key_value_tensors, MultiLatentAttention.forward
    apply_patch()
    assert MLASelfAttention.get_query_key_value_tensors is qkv
    assert MultiLatentAttention.forward is not fwd and MultiLatentAttention.forward.__module__ == "verl.models.mcore.patch"
    assert "copy_to_tensor_model_parallel_region(k_pos_emb" in __import__("inspect").getsource(qkv)


# --------------------------------------------------------------------------- TP2 grads through verl's apply_patch()

WRAPPER = textwrap.dedent('''\
    import sys

    if __name__ == "__main__":  # megatron's checkpoint writer spawns processes that import this file
        from verl.models.mcore.patch import apply_patch

        apply_patch()
        from megatron.core.transformer.multi_latent_attention import MultiLatentAttention

        assert MultiLatentAttention.forward.__module__ == "verl.models.mcore.patch", "verl's forward is not installed"
        from dsv3_rl.mcore.layout_check import main

        sys.exit(main())
''')


def _layout(cfg: Path, weights: Path, out: Path, args: list[str], nproc: int, script: Path, init: bool = False,
            pythonpath: Path | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(TORCHDYNAMO_DISABLE="1", OMP_NUM_THREADS="1")
    if pythonpath:
        env["PYTHONPATH"] = f"{pythonpath}{os.pathsep}{env.get('PYTHONPATH', '')}"
    # one process: no torchrun (runtime.init_distributed picks its own port for a lone process, which
    # does not reach torchrun's agent store)
    launch = [sys.executable] if nproc == 1 else [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
                                                  f"--master-port={free_port()}"]
    cmd = [*launch, str(script), "--hf-config", str(cfg), "--weights", str(weights), "--out", str(out), *args]
    if init:
        cmd.append("--init")
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900, cwd=REPO)


def _grad_errors(cfg: Path, a: Path, b: Path) -> dict[str, float]:
    from transformers import AutoConfig

    from dsv3_rl.mcore.layout_check import load_full

    hf = AutoConfig.from_pretrained(cfg)
    ga, gb = load_full(hf, a), load_full(hf, b)
    return {k: float((ga[k] - gb[k]).norm() / ga[k].norm().clamp_min(1e-30)) for k in ga}


@pytest.fixture(scope="module")
def verl_ref(tmp_path_factory):
    from dsv3_rl.models.presets import hf_config

    d = tmp_path_factory.mktemp("verl_tp")
    hf_config("tiny").save_pretrained(d / "hf")
    script = d / "with_verl_patch.py"
    script.write_text(WRAPPER)
    r = _layout(d / "hf", d / "weights", d / "tp1", [], 1, script, init=True)
    assert r.returncode == 0, r.stderr[-4000:]
    return d, script


@pytest.mark.slow
def test_verl_apply_patch_tp2_grads_equal_tp1(verl_ref, tmp_path):
    d, script = verl_ref
    r = _layout(d / "hf", d / "weights", tmp_path, ["--layout", "tp=2,etp=1"], 2, script)
    assert r.returncode == 0, r.stderr[-4000:]
    errs = _grad_errors(d / "hf", d / "tp1" / "grads", tmp_path / "grads")
    assert max(errs.values()) < 1e-5, sorted(errs.items(), key=lambda kv: -kv[1])[:5]
    assert any("linear_kv_down_proj" in k for k in errs)


@pytest.mark.slow
def test_verl_apply_patch_planted_fault_rope_key_fix_reverted(verl_ref, tmp_path):
    """Same run with megatron patch 0003 reversed (scratch copy): the rope rows' grads go wrong under verl too."""
    d, script = verl_ref
    from dsv3_rl.patching import lint

    patch = {p.name: p for p in lint(MCORE, headers=False)}["0003-mla-rope-key-grad-sum-over-tp.patch"]
    shutil.copytree(MCORE.path() / "megatron", tmp_path / "tree" / "megatron", ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    r = subprocess.run(["git", "apply", "-R", str(patch.path)], cwd=tmp_path / "tree", capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    r = _layout(d / "hf", d / "weights", tmp_path / "out", ["--layout", "tp=2,etp=1"], 2, script, pythonpath=tmp_path / "tree")
    assert r.returncode == 0, r.stderr[-4000:]
    errs = _grad_errors(d / "hf", d / "tp1" / "grads", tmp_path / "out" / "grads")
    hit = {k: v for k, v in errs.items() if "linear_kv_down_proj" in k}
    assert hit and max(hit.values()) > 1e-3, hit


# ------------------------------------------------------------------ patch 0018: the planted-fault switches

def _plant(monkeypatch, fault: str | None) -> None:
    """DSV3_PLANT_FAULT=FAULT for the test (patch 0018's switches), or unset."""
    if fault is None:
        monkeypatch.delenv("DSV3_PLANT_FAULT", raising=False)
    else:
        monkeypatch.setenv("DSV3_PLANT_FAULT", fault)


def _grpo_advantages(monkeypatch, fault: str | None) -> torch.Tensor:
    """verl's own GRPO advantage (patched core_algos) of two groups of 4 outcome rewards, with DSV3_PLANT_FAULT=FAULT."""
    import numpy as np

    from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage

    _plant(monkeypatch, fault)
    rewards = torch.zeros(8, 5)
    rewards[:, -1] = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0])  # the outcome at each response's end
    mask = torch.ones(8, 5)
    adv, _ = compute_grpo_outcome_advantage(rewards, mask, np.array(["a"] * 4 + ["b"] * 4))
    return adv


def test_flip_advantage_sign_switch_negates_verls_grpo_advantage(monkeypatch):
    """Patch 0018's DSV3_PLANT_FAULT=flip_advantage_sign (the GPU twin of issue 38, `make demo` by hand; its CPU GRPO
    launch left CI on 2026-12-07, docs/ci-history.md "fourth session"): verl's GRPO advantage comes out negated, every token
    of every response; the learning gate's failure on such a run is checked on the recorded demo metrics
    (test_grpo_checks.py, reward_reversed). Twin: another fault's value, or none, leaves the advantage as verl's."""
    plain = _grpo_advantages(monkeypatch, None)
    assert plain.abs().sum() > 0 and plain[0, 0] > 0 > plain[1, 0]  # a winner above its group's mean, a loser below
    assert torch.equal(_grpo_advantages(monkeypatch, "flip_advantage_sign"), -plain)
    assert torch.equal(_grpo_advantages(monkeypatch, "stale_rollout_weights"), plain)  # twin: only its own switch


def _syncs_sent(monkeypatch, fault: str | None, n: int = 3) -> list[int]:
    """The global steps whose weights reach the rollout when verl's own ``ActorRolloutRefWorker.update_weights``
    (patched engine_workers, through its checkpoint-engine path) is called for steps 1..N with DSV3_PLANT_FAULT=FAULT."""
    import asyncio
    from types import SimpleNamespace

    from verl.workers.engine_workers import ActorRolloutRefWorker

    _plant(monkeypatch, fault)
    sent: list[int] = []

    async def send_weights(params, global_steps=None):
        sent.append(global_steps)
        return {"sent": 1.0}

    worker = SimpleNamespace(
        config=SimpleNamespace(rollout=SimpleNamespace(checkpoint_engine=SimpleNamespace(backend="nccl"))),
        checkpoint_engine=SimpleNamespace(send_weights=send_weights),
        actor=SimpleNamespace(engine=SimpleNamespace(get_per_tensor_param=lambda: ({}, None))))
    for step in range(1, n + 1):
        asyncio.run(ActorRolloutRefWorker.update_weights(worker, global_steps=step))
    return sent


def test_stale_rollout_weights_switch_keeps_the_first_sync_only(monkeypatch):
    """Patch 0018's DSV3_PLANT_FAULT=stale_rollout_weights (until 2026-12-07 a CPU GRPO launch of CI's, docs/ci-history.md
    "fifth session"): verl's weight sync reaches the rollout once, at the first call, and never again, so the rollout
    keeps the initial weights; the rollout == trainer check's failure on such a run is checked on the drift measured in
    a real stale run (test_grpo_checks.py, ``rollout_stale``). Twin: another fault's value, or none, syncs every step."""
    assert _syncs_sent(monkeypatch, None) == [1, 2, 3]
    assert _syncs_sent(monkeypatch, "stale_rollout_weights") == [1]
    assert _syncs_sent(monkeypatch, "flip_advantage_sign") == [1, 2, 3]  # twin: only its own switch

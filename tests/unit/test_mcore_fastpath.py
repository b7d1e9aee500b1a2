"""The Transformer-Engine-free fast path of megatron-core (patches 0012 SDPA core attention, 0013
grouped-GEMM experts) on CPU: it is what runs here (no TE), it matches transformers' DeepSeek-V3
and megatron's old paths, checkpoints move between the expert paths, and planted faults fail.

Every scenario runs in a subprocess (tests/unit/mcore_fastpath_scenarios.py) so NVTE_* variables,
monkeypatched faults and reversed-patch trees never leak between tests. The TP/EP/PP layout suite
(tests/unit/test_mcore_patches.py::test_layouts_match_single_process) runs these same paths: on a
machine without TE they are the default.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dsv3_rl.backends import load_lock

MCORE = load_lock()["megatron-core"]
# a backend that is not there FAILS, never skips (issue 18): `make setup` fetches, patches and installs it
assert MCORE.path().exists(), f"{MCORE.path()} is missing: megatron-core is not fetched; run `make setup`"
SCENARIOS = Path(__file__).with_name("mcore_fastpath_scenarios.py")
SDPA_PATCH = "0012-local-attention-sdpa.patch"
GROUPED_PATCH = "0013-moe-sequential-grouped-mm.patch"

FP32_TOL = 1e-5  # HF fp32 vs megatron fp32: reduction order only (measured ~6e-7)
MOE_LAYERS_TINY = 3  # tiny preset: 1 dense + 3 MoE layers


def run(name: str, *args: str, pythonpath: Path | None = None, cwd: Path | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(TORCHDYNAMO_DISABLE="1", OMP_NUM_THREADS="1")
    env.pop("MCORE_SDPA_BACKENDS", None)
    if pythonpath:
        env["PYTHONPATH"] = f"{pythonpath}{os.pathsep}{env.get('PYTHONPATH', '')}"
    r = subprocess.run([sys.executable, str(SCENARIOS), name, *args], capture_output=True, text=True, env=env,
                       timeout=600, cwd=cwd)
    line = next((ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert r.returncode == 0 and line, (r.stdout + r.stderr)[-4000:]
    return json.loads(line[len("RESULT "):])


def test_fast_paths_are_the_default_without_te_and_match_hf():
    """No TE here: SDPA attention and grouped-GEMM experts are selected, and forward and every
    gradient equal transformers' DeepseekV3ForCausalLM (fp32, same weights)."""
    r = run("hf_vs_mcore")
    assert r["paths"]["sdpa"] is True and r["paths"]["grouped"] is True, r["paths"]
    assert "Transformer Engine not installed" in r["paths"]["sdpa_reason"]
    assert r["grouped_calls"] == MOE_LAYERS_TINY, r
    assert r["logits_rel"] < FP32_TOL and r["grad_worst_rel"] < FP32_TOL, r
    assert abs(r["loss_hf"] - r["loss_mcore"]) < 1e-5


@pytest.mark.slow
def test_old_paths_selectable_and_match_hf():
    """attention_backend=unfused and moe_sequential_grouped_mm=False give the matmul+softmax
    attention and the per-expert loop, still equal to transformers."""
    r = run("hf_vs_mcore", "--attention-backend", "unfused", "--grouped", "off")
    assert r["paths"]["sdpa"] is False and r["paths"]["grouped"] is False and r["grouped_calls"] == 0, r
    assert r["logits_rel"] < FP32_TOL and r["grad_worst_rel"] < FP32_TOL, r


@pytest.mark.slow
@pytest.mark.parametrize("fault,where", [("sdpa-scale", "self_attn"), ("grouped-expert-order", "mlp.")])
def test_planted_fault_fails_hf_comparison(fault, where):
    """Twin: SDPA with the plain 1/sqrt(d) scale (no yarn mscale), or grouped GEMM with the
    experts' weights in the wrong order, must break the comparison with transformers."""
    r = run("hf_vs_mcore", "--fault", fault)
    assert r["grad_worst_rel"] > 100 * FP32_TOL, f"planted fault {fault} went unnoticed: {r}"
    assert any(where in k for k in r["grad_rel"]), r["grad_rel"]


@pytest.mark.slow
@pytest.mark.parametrize("dtype,tol", [("fp32", FP32_TOL), ("bf16", 3e-2)])
def test_fast_paths_match_old_paths(dtype, tol):
    """Same weights, fast paths vs unfused attention + per-expert loop: logits and all grads."""
    r = run("paths_equal", "--dtype", dtype)
    assert r["paths"]["sdpa"] and r["paths"]["grouped"] and r["grouped_calls"] == MOE_LAYERS_TINY, r
    assert r["logits_rel"] < tol and r["grad_worst_rel"] < tol, r


def test_attention_sdpa_against_independent_reference():
    """SDPA path vs softmax(q k^T * scale + mask) v: MLA head dims (q/k 24, v 16), a softmax scale
    that is not 1/sqrt(d), causal and padding masks, GQA; dropout active in train only."""
    r = run("attention_unit")
    assert r["sdpa"] is True
    for k in ("causal_rel", "causal_grad_rel", "mask_rel", "gqa_rel", "dropout_eval_rel"):
        assert r[k] < 1e-5, (k, r)
    assert r["dropout_train_rel"] > 0.1, r


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_grouped_experts_match_loop_with_empty_experts(dtype):
    """Hand-made routing with empty experts: grouped GEMM == per-expert loop for outputs, input
    grads and weight grads (torch grouped_mm runs on CPU in torch 2.13; bit-identical there), and
    empty experts get exactly zero weight grads."""
    r = run("experts_unit", "--dtype", dtype)
    assert r["grouped_calls"] == 1, r
    assert r["out_rel"] < 1e-6 and r["dx_rel"] < 1e-6 and r["dw_rel"] < 1e-6, r
    assert r["empty_expert_grads_zero"], r


@pytest.mark.slow
@pytest.mark.parametrize("direction", ["grouped-to-loop", "loop-to-grouped"])
def test_checkpoint_moves_between_expert_paths(tmp_path, direction):
    """A dist checkpoint saved with one expert path loads into the other: identical sharded keys
    (SequentialMLP's per-expert keys, what the converter writes), identical tensors and outputs."""
    r = run("ckpt_roundtrip", "--direction", direction, "--work", str(tmp_path))
    assert r["paths_src"]["grouped"] != r["paths_dst"]["grouped"], r
    assert r["same_sharded_keys"] and r["n_keys"] > 0, r
    assert r["differed_before_load"] and not r["mismatched_after_load"], r
    assert r["output_rel"] < 1e-6, r


def test_sdpa_backends_env_is_validated():
    from megatron.core.transformer import dot_product_attention as D
    import torch

    q = torch.zeros(1, 2, 4, 8)
    os.environ["MCORE_SDPA_BACKENDS"] = "flash,nonsense"
    try:
        with pytest.raises(ValueError, match="unknown backend 'nonsense'"):
            D.sdpa_backend_order(q, False)
        os.environ["MCORE_SDPA_BACKENDS"] = "default"
        assert D.sdpa_backend_order(q, False) is None
        os.environ["MCORE_SDPA_BACKENDS"] = "math,efficient"
        assert [b.name for b in D.sdpa_backend_order(q, False)] == ["MATH", "EFFICIENT_ATTENTION"]
    finally:
        os.environ.pop("MCORE_SDPA_BACKENDS", None)
    assert D.sdpa_backend_order(q, False) is None  # CPU: torch's own order


def test_explicit_sdpa_refuses_unsupported_features():
    from megatron.core.transformer.dot_product_attention import select_sdpa
    from megatron.core.transformer.enums import AttnBackend
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, softmax_type="learnable",
                            attention_backend=AttnBackend.sdpa)
    with pytest.raises(ValueError, match="softmax_type='learnable'"):
        select_sdpa(cfg)
    cfg.attention_backend = AttnBackend.auto  # not explicit: quietly the old path
    assert select_sdpa(cfg) == (False, "SDPA does not support softmax_type='learnable'")
    cfg.softmax_type = "vanilla"
    assert select_sdpa(cfg, window_size=(8, 0))[0] is False


@pytest.mark.slow
@pytest.mark.parametrize("patch,key", [(SDPA_PATCH, "sdpa"), (GROUPED_PATCH, "grouped")])
def test_planted_fault_patch_reverted(tmp_path, patch, key):
    """Twin: with the patch reversed in a scratch copy, the fast path is gone (the old path runs)."""
    from test_mcore_patches import tree_without

    scratch = tree_without(patch, tmp_path / "tree")
    r = run("hf_vs_mcore", pythonpath=scratch)
    assert not r["paths"][key], f"{key} path still selected with {patch} reversed: {r['paths']}"
    if key == "grouped":
        assert r["grouped_calls"] == 0

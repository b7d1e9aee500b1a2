"""GPU numerics of megatron-core's Transformer-Engine-free fast path (patches 0012 SDPA attention,
0013 grouped-GEMM experts) against the old paths and transformers, with planted faults.

    pytest -m gpu tests/gpu/test_mcore_fastpath_gpu.py
    python tests/gpu/test_mcore_fastpath_gpu.py          # same tests without pytest installed

Each check runs tests/unit/mcore_fastpath_scenarios.py in a subprocess with --device cuda, so a
crash in a CUDA kernel fails one test, not the session. On the GPU SDPA picks a fused kernel
(cuDNN on Hopper, see sdpa_backend_order) and grouped GEMM runs torch's CUTLASS grouped_mm, so
these are the kernels the CPU suite cannot exercise.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

try:
    import pytest
except ImportError:  # the GPU box may have no pytest: a minimal stand-in (see __main__ below)
    class _Mark:
        def __getattr__(self, name):
            def deco(*a, **k):
                if a and callable(a[0]) and not k and len(a) == 1:
                    return a[0]
                return lambda f: f
            return deco

    class pytest:  # noqa: N801
        mark = _Mark()

        @staticmethod
        def skip(msg):
            raise RuntimeError(f"SKIP {msg}")

import torch

REPO = Path(__file__).resolve().parents[2]
SCENARIOS = REPO / "tests" / "unit" / "mcore_fastpath_scenarios.py"
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# The MLA shapes of DeepSeek-V3 (q/k 192, v 128, 128 heads) at a moderate length for the
# attention check; a mid-size MoE (hidden 1024, 16 experts of 512, top-8) for the experts.
MLA = ["--heads", "128", "--qk-dim", "192", "--v-dim", "128", "--seq", "1024"]
MOE = json.dumps({"hidden_size": 1024, "moe_intermediate_size": 512, "intermediate_size": 2048,
                  "n_routed_experts": 16, "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4})
BF16_TOL = 3e-2  # bf16 against an fp32 reference (or against the bf16 old path)
FP32_TOL = 2e-5


def run(name: str, *args: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.setdefault("TORCHDYNAMO_DISABLE", "1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    r = subprocess.run([sys.executable, str(SCENARIOS), name, "--device", "cuda", *args], capture_output=True,
                       text=True, env=env, timeout=900)
    line = next((ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert r.returncode == 0 and line, (r.stdout + r.stderr)[-4000:]
    res = json.loads(line[len("RESULT "):])
    print(f"{name} {' '.join(args)}: {json.dumps(res)[:600]}")
    return res


def test_sdpa_matches_unfused_on_gpu():
    """SDPA (fused kernel) with DeepSeek-V3's MLA head dims in bf16 against an fp32 reference of
    the same inputs, forward and input grads; and the tiny shapes in fp32."""
    r = run("attention_unit", "--dtype", "bf16", *MLA)
    assert r["sdpa"] is True and r["finite"], r
    assert r["causal_rel"] < BF16_TOL and r["causal_grad_rel"] < BF16_TOL, r
    assert r["mask_rel"] < BF16_TOL and r["gqa_rel"] < BF16_TOL and r["dropout_eval_rel"] < BF16_TOL, r
    assert r["dropout_train_rel"] > 0.1, r
    old = run("attention_unit", "--dtype", "bf16", "--attention-backend", "unfused", *MLA)
    assert old["sdpa"] is False and old["causal_rel"] < BF16_TOL, old
    r32 = run("attention_unit", "--dtype", "fp32")
    assert r32["causal_rel"] < FP32_TOL and r32["causal_grad_rel"] < FP32_TOL and r32["mask_rel"] < FP32_TOL, r32


def test_grouped_matches_loop_on_gpu():
    """torch grouped_mm (CUTLASS on sm90) against the per-expert loop, bf16, uneven routing with
    empty experts: outputs, input grads, weight grads; empty experts get zero weight grads."""
    r = run("experts_unit", "--dtype", "bf16", "--overrides", MOE)
    if torch.cuda.get_device_capability() < (9, 0) and not r["grouped_calls"]:
        pytest.skip(f"grouped_mm not available on this GPU: {r['probe']}")
    assert r["grouped_calls"] == 1, r
    assert r["out_rel"] < 1e-2 and r["dx_rel"] < 1e-2 and r["dw_rel"] < 1e-2, r
    assert r["empty_expert_grads_zero"], r


def test_fast_paths_match_old_paths_on_gpu():
    """Whole model (tiny, widened MoE) in bf16, calibrated: megatron-core with SDPA + grouped GEMM and
    with its old paths (unfused attention + per-expert loop), each against transformers in fp32 on
    the same weights. bf16 rounding flips a few near-tied top-k choices in a random model (a flipped
    token moves its expert's gradient by O(1)), so absolute bf16 errors say little; the fast paths
    must not be less accurate than the old ones."""
    common = ("--dtype", "bf16", "--overrides", MOE, "--seq", "64")
    fast = run("hf_vs_mcore", *common)
    old = run("hf_vs_mcore", *common, "--attention-backend", "unfused", "--grouped", "off")
    assert fast["paths"]["sdpa"] and fast["paths"]["grouped"] and fast["grouped_calls"] == 3, fast
    assert not old["paths"]["sdpa"] and not old["paths"]["grouped"], old
    assert fast["logits_rel"] <= 1.5 * old["logits_rel"] + 1e-3, (fast, old)
    assert fast["grad_worst_rel"] <= 1.5 * old["grad_worst_rel"] + 1e-2, (fast, old)
    assert abs(fast["loss_mcore"] - fast["loss_hf"]) / abs(fast["loss_hf"]) < 2e-3, fast


def test_hf_vs_mcore_on_gpu():
    """transformers' DeepseekV3ForCausalLM vs megatron-core with the fast paths on the GPU, fp32:
    only the summation order differs (bf16 is judged against the old paths above)."""
    r = run("hf_vs_mcore", "--dtype", "fp32")
    assert r["paths"]["sdpa"] and r["paths"]["grouped"], r
    assert r["logits_rel"] < 1e-4 and r["grad_worst_rel"] < 1e-4, r


def test_planted_faults_fail_on_gpu():
    for fault in ("sdpa-scale", "grouped-expert-order"):
        r = run("hf_vs_mcore", "--dtype", "fp32", "--fault", fault)
        assert r["grad_worst_rel"] > 1e-2, f"planted fault {fault} went unnoticed on the GPU: {r}"


if __name__ == "__main__":
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to run")
        sys.exit(0)
    tests = [(n, f) for n, f in sorted(globals().items()) if n.startswith("test_") and callable(f)]
    failed = []
    for n, f in tests:
        try:
            f()
            print(f"PASS {n}")
        except Exception as e:  # noqa: BLE001
            if str(e).startswith("SKIP"):
                print(f"{e} {n}")
                continue
            failed.append(n)
            print(f"FAIL {n}: {str(e)[:3000]}")
    print(f"test_mcore_fastpath_gpu: {len(tests) - len(failed)}/{len(tests)} passed")
    sys.exit(1 if failed else 0)

"""MLA fused-attention guard (``dsv3_rl.mcore.mla_attention_guard``, hooked into megatron-core by patch 0011): the decision function across TE/cuDNN/GPU
combinations (CPU, no TE needed), its planted-fault twin, and the integration into GPTModel
construction (with the runtime versions faked) plus the twin with the patch reverted."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from dsv3_rl.backends import load_lock

MCORE = load_lock()["megatron-core"]
# a backend that is not there FAILS, never skips (issue 18): `make setup` fetches, patches and installs it
assert MCORE.path().exists(), f"{MCORE.path()} is missing: megatron-core is not fetched; run `make setup`"
PATCH = "0011-mla-fused-attention-guard.patch"


@pytest.fixture(scope="module")
def guard():
    from dsv3_rl.mcore import mla_attention_guard

    return mla_attention_guard


# (te, cudnn, cc, qk, v, dtype, training, requested, user env, fa3) -> backend | "raise:<text>"
CASES = [
    # Hopper, DeepSeek-V3 shapes. torch 2.6 wheels pin cuDNN 9.1.0.70: no MLA backward.
    ("2.7.0", "9.1.0", (9, 0), 192, 128, "bf16", True, "auto", {}, False, "unfused"),
    ("2.7.0", "9.1.0", (9, 0), 192, 128, "bf16", True, "fused", {}, False, "raise:needs cuDNN 9.5+"),
    ("1.12.0", "9.1.0", (9, 0), 192, 128, "bf16", True, "auto", {}, False, "unfused"),  # Pai #551
    ("2.7.0", "9.4.0", (9, 0), 192, 128, "bf16", True, "auto", {}, False, "unfused"),
    ("2.7.0", "9.5.0", (9, 0), 192, 128, "bf16", True, "auto", {}, False, "fused"),
    ("2.7.0", "9.8.0.87", (9, 0), 192, 128, "bf16", True, "fused", {}, False, "fused"),  # the quick-start pin
    ("2.7.0", 90800, (9, 0), 192, 128, "fp16", True, "auto", {}, False, "fused"),
    ("2.7.0", "9.10.0", (9, 0), 192, 128, "bf16", True, "auto", {}, False, "unfused"),  # known SDPA bugs
    ("2.7.0", "9.10.1", (9, 0), 192, 128, "bf16", True, "fused", {}, False, "raise:9.10.0/9.10.1"),
    ("2.7.0", "9.10.2", (9, 0), 192, 128, "bf16", True, "auto", {}, False, "fused"),
    ("2.7.0", "9.11.0", (9, 0), 192, 128, "bf16", True, "auto", {}, False, "fused"),
    ("2.7.0", "9.11.0", (9, 0), 192, 160, "bf16", True, "auto", {}, False, "unfused"),  # 9.11-9.12 bug
    ("2.7.0", "9.13.0", (9, 0), 192, 160, "bf16", True, "auto", {}, False, "fused"),
    # Hopper inference: forward from 9.1, but wrong softmax stats before 9.3
    ("2.7.0", "9.1.0", (9, 0), 192, 128, "bf16", False, "auto", {}, False, "unfused"),
    ("2.7.0", "9.3.0", (9, 0), 192, 128, "bf16", False, "auto", {}, False, "fused"),
    # Ampere: no backward for head dims > 128 in cuDNN; forward from 9.10.2
    ("2.7.0", "9.8.0", (8, 0), 192, 128, "bf16", True, "auto", {}, False, "unfused"),
    ("2.7.0", "9.8.0", (8, 0), 192, 128, "bf16", True, "fused", {}, False, "raise:head dims <= 128 only"),
    ("2.7.0", "9.10.2", (8, 0), 192, 128, "bf16", False, "auto", {}, False, "fused"),
    ("2.7.0", "9.8.0", (8, 6), 192, 128, "bf16", False, "auto", {}, False, "unfused"),
    # Blackwell: backward 192/128 from 9.11
    ("2.7.0", "9.10.2", (10, 0), 192, 128, "bf16", True, "auto", {}, False, "unfused"),
    ("2.7.0", "9.11.0", (10, 0), 192, 128, "bf16", True, "auto", {}, False, "fused"),
    ("2.7.0", "9.11.0", (10, 0), 192, 160, "bf16", True, "auto", {}, False, "unfused"),
    # FlashAttention 3 (Hopper) takes MLA shapes when fused cannot
    ("2.7.0", "9.1.0", (9, 0), 192, 128, "bf16", True, "auto", {}, True, "flash"),
    ("2.7.0", "9.1.0", (9, 0), 192, 128, "bf16", True, "flash", {}, True, "flash"),
    ("2.7.0", "9.8.0", (8, 0), 192, 128, "bf16", True, "flash", {}, True, "raise:FlashAttention 2 does not support"),
    # environment overrides
    ("2.7.0", "9.1.0", (9, 0), 192, 128, "bf16", True, "auto", {"NVTE_FUSED_ATTN": "1"}, False, "raise:NVTE_FUSED_ATTN=1"),
    ("2.7.0", "9.1.0", (9, 0), 192, 128, "bf16", True, "auto", {"NVTE_FUSED_ATTN": "0"}, False, "unfused"),
    ("2.7.0", "9.8.0", (9, 0), 192, 128, "bf16", True, "auto", {"NVTE_FUSED_ATTN": "0"}, False, "unfused"),
    ("2.7.0", "9.1.0", (9, 0), 192, 128, "bf16", True, "auto", {"NVTE_FLASH_ATTN": "0"}, True, "unfused"),
    ("2.7.0", "9.1.0", (9, 0), 192, 128, "bf16", True, "fused", {"MCORE_MLA_ATTENTION_GUARD": "0"}, False, "te"),
    # not affected: other backends, fp32, equal small head dims, no TE
    ("2.7.0", "9.1.0", (9, 0), 192, 128, "bf16", True, "unfused", {}, False, "te"),
    ("2.7.0", "9.1.0", (9, 0), 192, 128, "bf16", True, "local", {}, False, "te"),
    ("2.7.0", "9.1.0", (9, 0), 128, 128, "bf16", True, "fused", {}, False, "te"),
    ("2.7.0", "9.8.0", (9, 0), 192, 128, "fp32", True, "auto", {}, False, "unfused"),
    (None, None, (9, 0), 192, 128, "bf16", True, "auto", {}, False, "none"),
    # TE < 1.10 cannot express MLA at all (one head dim, no softmax scale)
    ("1.9.0", "9.8.0", (9, 0), 192, 128, "bf16", True, "auto", {}, False, "raise:cannot run MLA"),
    # NVTE_FUSED_ATTN=1 inherited from a parent process where megatron's auto mode wrote it (4-GPU correctness
    # workers, 2026-11-26): harmless in fp32, which TE never fuses; an explicit fused request still raises.
    # (Appended at the end: the CI manifest names these cases by position.)
    ("2.7.0", "9.19.0", (9, 0), 24, 16, "fp32", True, "auto", {"NVTE_FUSED_ATTN": "1"}, False, "unfused"),
    ("2.7.0", "9.19.0", (9, 0), 24, 16, "fp32", True, "fused", {}, False, "raise:fp16/bf16 only"),
]


def _run(guard, case):
    te, cudnn, cc, qk, v, dtype, training, requested, env, fa3, _ = case
    return guard.decide_mla_attention_backend(te, cudnn, cc, qk, v, dtype, training=training,
                                              requested=requested, env=env, flash_attn_3=fa3)


def _outcome(guard, case) -> str:
    try:
        return _run(guard, case).backend
    except guard.MLAAttentionBackendError as e:
        return f"raise:{e}"


def _matches(outcome: str, expected: str) -> bool:
    if expected.startswith("raise:"):
        return outcome.startswith("raise:") and expected[len("raise:"):] in outcome
    return outcome == expected


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-cudnn{c[1]}-sm{c[2][0]}{c[2][1]}-{c[3]}/{c[4]}-{c[5]}-"
                                             f"{'train' if c[6] else 'infer'}-{c[7]}-{i}" for i, c in enumerate(CASES)])
def test_decision(guard, case):
    outcome = _outcome(guard, case)
    assert _matches(outcome, case[-1]), f"expected {case[-1]!r}, got {outcome!r}"


def test_messages_name_versions_and_fix(guard):
    with pytest.raises(guard.MLAAttentionBackendError) as e:
        guard.decide_mla_attention_backend("2.7.0", "9.1.0.70", (9, 0), 192, 128, "bf16", requested="fused")
    msg = str(e.value)
    for needle in ("cuDNN 9.1.0", "sm90", "head_dim_qk=192", "head_dim_v=128", "9.5", "nvidia-cudnn-cu12==9.8.0.87",
                   "attention_backend=unfused", "MCORE_MLA_ATTENTION_GUARD=0"):
        assert needle in msg, f"{needle!r} missing from: {msg}"
    d = guard.decide_mla_attention_backend("2.7.0", "9.1.0", (9, 0), 192, 128, "bf16")
    assert d.env == {"NVTE_FUSED_ATTN": "0"} and "cuDNN 9.1.0" in d.warning and "9.8.0.87" in d.warning


def test_version_parsing(guard):
    v = guard._version_tuple
    assert v("9.8.0.87") == (9, 8, 0) and v(90800) == (9, 8, 0) and v(91002) == (9, 10, 2)
    assert v((9, 5)) == (9, 5, 0) and v("2.7.0+abc123") == (2, 7, 0) and v("2.5.0.dev0") == (2, 5, 0)
    assert v(8903) == (8, 9, 3) and v(None) is None


def test_planted_fault_pre_te25_rule_is_caught(guard, monkeypatch):
    """Twin: TE < 2.5's own rule (head dims <= 256 on Hopper from cuDNN 9.1, no training/inference
    distinction, no 9.10.0/9.10.1 exclusion) must fail the case table."""

    def te24_rule(cudnn, cc, qk, v, dtype, training):
        c = guard._version_tuple(cudnn)
        ok = guard._dtype_name(dtype) in ("bf16", "fp16") and tuple(cc) == (9, 0) and c >= (9, 1, 0)
        return ok, "TE 2.4 rule"

    monkeypatch.setattr(guard, "fused_attention_support", te24_rule)
    wrong = [c for c in CASES if not _matches(_outcome(guard, c), c[-1])]
    assert len(wrong) >= 4, f"the weakened rule went unnoticed ({len(wrong)} mismatching cases)"


SCENARIO = textwrap.dedent(r"""
    import os, sys, warnings, json
    os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
    for k in ("NVTE_FUSED_ATTN", "NVTE_FLASH_ATTN", "NVTE_UNFUSED_ATTN"):
        os.environ.pop(k, None)
    cudnn, backend = sys.argv[2], sys.argv[3]
    import torch
    from dsv3_rl.models.presets import hf_config
    from dsv3_rl.models.config_map import Parallel
    from dsv3_rl.mcore import runtime
    from megatron.core.transformer.enums import AttnBackend
    from dsv3_rl.mcore import mla_attention_guard as g  # the guard; patch 0011 adds only megatron's calls to it
    g.runtime_versions = lambda: {"te_version": "2.7.0", "cudnn_version": cudnn,
                                  "compute_capability": (9, 0), "flash_attn_3": False}
    cfg = hf_config("tiny", {"qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128})
    runtime.init_distributed(Parallel())
    out = {}
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        try:
            runtime.build_model(cfg, use_te=False, dtype=torch.bfloat16,
                                config_overrides={"attention_backend": AttnBackend[backend]})
            out["built"] = True
        except Exception as e:
            out["built"] = False
            out["error"] = f"{type(e).__name__}: {e}"
    out["NVTE_FUSED_ATTN"] = os.environ.get("NVTE_FUSED_ATTN")
    out["warnings"] = [str(x.message) for x in w if "MLA attention" in str(x.message)]
    print("RESULT " + json.dumps(out))
""")


def _scenario(tmp_path, cudnn, backend, pythonpath=None):
    import json
    import os
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = tmp_path / "guard_scenario.py"
    script.write_text(SCENARIO)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(TORCHDYNAMO_DISABLE="1", OMP_NUM_THREADS="1")
    if pythonpath:
        env["PYTHONPATH"] = f"{pythonpath}{os.pathsep}{env.get('PYTHONPATH', '')}"
    r = subprocess.run([sys.executable, str(script), str(port), cudnn, backend], capture_output=True, text=True,
                       env=env, timeout=300, cwd=tmp_path)
    line = next((ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert line, r.stderr[-3000:]
    return json.loads(line[len("RESULT "):])


def test_gptmodel_auto_disables_fused_on_old_cudnn(tmp_path):
    out = _scenario(tmp_path, "9.1.0", "auto")
    assert out["built"], out
    assert out["NVTE_FUSED_ATTN"] == "0" and out["warnings"] and "cuDNN 9.1.0" in out["warnings"][0], out


@pytest.mark.slow
def test_gptmodel_fused_request_refused_on_old_cudnn(tmp_path):
    out = _scenario(tmp_path, "9.1.0", "fused")
    assert not out["built"] and "MLAAttentionBackendError" in out["error"] and "9.5" in out["error"], out


@pytest.mark.slow
def test_gptmodel_auto_keeps_fused_on_good_cudnn(tmp_path):
    out = _scenario(tmp_path, "9.8.0", "auto")
    assert out["built"] and out["NVTE_FUSED_ATTN"] == "1" and not out["warnings"], out


@pytest.mark.slow
def test_planted_fault_patch_reverted(tmp_path):
    """Twin: with patch 0011 reversed, the same model builds with fused attention left on."""
    from test_mcore_patches import tree_without

    scratch = tree_without(PATCH, tmp_path / "tree")
    out = _scenario(tmp_path, "9.1.0", "auto", pythonpath=scratch)
    assert out["built"] and out["NVTE_FUSED_ATTN"] == "1", f"reverting {PATCH} did not re-enable fused attention: {out}"

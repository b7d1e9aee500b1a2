"""FP8 rollout weights as a preset option and in the planner (issue 19 item 3: "Presets gain an FP8 rollout
option, dry-run validated; the planner counts FP8 rollout memory"). See docs/planner.md and docs/refit.md.

(a) The planner's FP8 byte count (dsv3_rl.planner.memory.rollout_weight_bytes) against an independent reference:
    the bytes of DeepSeek-V3's main model (61 layers, no MTP) summed from the *observed* names, dtypes and
    shapes of DeepSeek's FP8 release in tests/assets/deepseek_v3_fp8_layout/layout.json (F8: 1 byte per element,
    ``_scale_inv``: 4 bytes per element of its observed shape, BF16: 2, F32: 4), expanded over the release's
    config.json; and for the proxy model, the bytes verl's FP8 export produced on an H100 (docs/results).
    Twins: the same planner code with every tensor of the description FP8, or none, misses it; BF16 misses it.
(b) The preset key ``rollout_quantization``: the 671B FP8 preset dry-runs against verl's real config with
    ``actor_rollout_ref.rollout.quantization=fp8`` composed and the planner counting FP8; a bad value and fp8
    on the CPU preset are one-line errors (exit 2).
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest

from dsv3_rl.recipes import rollout_quantization
from dsv3_rl.recipes.presets import PRESET_DIR, PresetError, load_preset
from dsv3_rl.planner import memory
from dsv3_rl.planner.model import load_model
from dsv3_rl.planner.spec import Options

ASSETS = Path(__file__).resolve().parents[1] / "assets"
LAYOUT = ASSETS / "deepseek_v3_fp8_layout" / "layout.json"
RELEASE_CONFIG = ASSETS / "deepseek_v3_config.json"
BYTES = {"F8_E4M3": 1, "BF16": 2, "F32": 4}
TOL = 1e-4  # relative; the planner leaves out the router's F32 e_score_correction_bias (59 kB of 673 GB)
GB = 1e9


def _reference() -> dict[str, dict[str, float]]:
    """Bytes of the release's main model by kind of tensor (fp8 / scales / other) and by where vLLM keeps it
    (experts / replicated / tp), from the observed shapes only."""
    d = json.loads(LAYOUT.read_text())
    cfg = json.loads(RELEASE_CONFIG.read_text())
    n, dense, experts = cfg["num_hidden_layers"], cfg["first_k_dense_replace"], cfg["n_routed_experts"]
    copies = {None: 1, "all": n, "dense": dense, "moe": n - dense, "mtp": 0}  # main model: no MTP layer
    out = {k: {"experts": 0.0, "replicated": 0.0, "tp": 0.0} for k in ("fp8", "scales", "other")}
    for t in d["tensors"]:
        k = copies[t["layers"]] * (experts if "{E}" in t["name"] else 1)
        leaf = t["name"].split(".")[-2]
        where = ("experts" if ".experts." in t["name"] else
                 "replicated" if leaf in ("q_a_proj", "kv_a_proj_with_mqa", "gate") or "norm" in leaf else "tp")
        if t["dtype"] == "F8_E4M3":
            out["fp8"][where] += k * math.prod(t["observed"])
            out["scales"][where] += k * math.prod(t["scale_observed"]) * BYTES[d["scale_dtype"]]
        else:
            out["other"][where] += k * math.prod(t["observed"]) * BYTES[t["dtype"]]
    return out


def _total(ref) -> float:
    return sum(sum(v.values()) for v in ref.values())


def _per_gpu(ref, tp: int, ep: int) -> float:
    """One vLLM GPU: experts over EP, MLA down-projections / norms / router replicated, the rest over TP."""
    return sum(v["experts"] / ep + v["replicated"] + v["tp"] / tp for v in ref.values())


def _agrees(planner: float, reference: float) -> bool:
    return abs(planner / reference - 1) <= TOL


@pytest.fixture
def dsv3():
    memory.fp8_savings.cache_clear()
    yield load_model("671b")
    memory.fp8_savings.cache_clear()


def test_release_config_is_the_planners_671b(dsv3):
    cfg = json.loads(RELEASE_CONFIG.read_text())
    assert {k: v for k, v in dsv3.to_hf().items() if k in cfg} == {k: cfg[k] for k in dsv3.to_hf() if k in cfg}


def test_fp8_bytes_of_the_671b_model_match_deepseeks_release(dsv3):
    ref = _reference()
    total = _total(ref)
    assert 670 * GB < total < 676 * GB, total  # 673.2 GB (the release, 688.6 GB, adds the MTP layer)
    assert _agrees(memory.rollout_weight_bytes(dsv3, 1, 1, "fp8"), total)
    # per rollout GPU of the 512 x H100 preset (vLLM TP2 DP32, EP64): 18.9 GiB in FP8, 35.9 GiB in BF16
    got = memory.rollout_weight_bytes(dsv3, 2, 64, "fp8")
    assert _agrees(got, _per_gpu(ref, 2, 64)), (got, _per_gpu(ref, 2, 64))
    assert got / 2**30 == pytest.approx(18.93, abs=0.01)
    assert memory.rollout_weight_bytes(dsv3, 2, 64) / 2**30 == pytest.approx(35.93, abs=0.01)
    assert _agrees(memory.rollout_weight_bytes(dsv3, 8, 1, "fp8"), _per_gpu(ref, 8, 8))  # no EP: experts over TP


def test_bf16_bytes_match_the_release_shapes_at_two_bytes(dsv3):
    ref = _reference()
    elems = sum(ref["fp8"].values()) * 2 + sum(ref["other"].values())  # F8 elements at 2 bytes, no scales
    assert _agrees(memory.rollout_weight_bytes(dsv3, 1, 1, "none"), elems)
    assert not _agrees(memory.rollout_weight_bytes(dsv3, 1, 1, "none"), _total(ref))  # BF16 is not the FP8 count


def test_fp8_bytes_of_the_proxy_match_verls_measured_fp8_export():
    """Second reference: what verl's FP8 quantizer (with patch 0030) actually produced for the proxy model on an
    H100 (bench/bench_refit.py --fp8, docs/refit.md): every byte of the exported stream, FP8 weights, fp32 scales
    and BF16 rest. Twin: the BF16 count does not match it."""
    res = json.loads((Path(__file__).resolve().parents[2] / "docs" / "results" / "gpu-2026-11-24-refit" /
                      "refit.json").read_text())
    assert res["preset"] == "proxy" and res["export_fp8"]["fp8_layout_differences"] == 0
    m = load_model("proxy")
    assert _agrees(memory.rollout_weight_bytes(m, 1, 1, "fp8"), res["export_fp8"]["bytes"])
    assert not _agrees(memory.rollout_weight_bytes(m, 1, 1, "none"), res["export_fp8"]["bytes"])
    assert _agrees(memory.rollout_weight_bytes(m, 1, 1, "none"), res["export"]["bytes"])  # and BF16 the BF16 export


@pytest.mark.parametrize("fault", ["all_fp8", "no_fp8"])
def test_planted_fault_wrong_fp8_set_misses_the_reference(dsv3, fault, monkeypatch):
    """Twin: the planner's own code with every tensor of the description FP8 (router, norms, embeddings, lm_head
    too) or none of them does not match the release."""
    from dsv3_rl.refit import fp8_layout

    desc = copy.deepcopy(fp8_layout.load_description())
    for t in desc["tensors"]:
        if fault == "all_fp8" and len(t["shape"]) == 2:  # (1-D tensors cannot carry 2-D block scales)
            t["dtype"] = "F8_E4M3"
        elif fault == "no_fp8":
            t["dtype"] = "BF16"
    monkeypatch.setattr(fp8_layout, "load_description", lambda path=None: desc)
    got = memory.rollout_weight_bytes(dsv3, 1, 1, "fp8")
    assert not _agrees(got, _total(_reference())), got


def test_kv_cache_gets_the_memory_fp8_frees(dsv3):
    from dsv3_rl.planner.spec import GRPOShape, RolloutLayout

    ro = RolloutLayout(tp=2, dp=32, ep=64, gpus=512, gpu_memory_utilization=0.9)
    g = GRPOShape(prompts_per_step=512, n_samples=16)
    bf16, fp8 = (memory.rollout_memory(dsv3, ro, g, Options(rollout_quantization=q), 79.1 * 2**30, 0.0)
                 for q in ("none", "fp8"))
    assert bf16.weights - fp8.weights == pytest.approx(17.0 * 2**30, rel=0.01)
    assert fp8.kv_cache - bf16.kv_cache == pytest.approx(bf16.weights - fp8.weights)
    assert fp8.kv_tokens > 1.5 * bf16.kv_tokens


def test_refit_model_uses_the_same_count(dsv3):
    from dsv3_rl.planner.refit import estimate_refit, rollout_bytes_per_gpu
    from dsv3_rl.planner.spec import GPUS

    assert rollout_bytes_per_gpu(dsv3, 2, 32, True, "fp8") == memory.rollout_weight_bytes(dsv3, 2, 64, "fp8")
    e = estimate_refit(dsv3, GPUS["H100"], 8, 512, tp=2, pp=32, ep=8, etp=1, rollout_tp=2, rollout_dp=32,
                       rollout_ep=True, quantization="fp8")
    assert e.rollout_bytes_per_gpu == memory.rollout_weight_bytes(dsv3, 2, 64, "fp8")


def test_options_refuse_an_unknown_quantization():
    with pytest.raises(ValueError, match=r"options.rollout_quantization='fp4'; allowed: \('none', 'fp8'\)"):
        Options(rollout_quantization="fp4")


def test_dsv3_plan_check_prints_fp8_rollout_weights_and_emits_the_override(capsys):
    from dsv3_rl.planner.cli import main

    args = ["check", "--model", "671b", "--gpu", "H100", "--nodes", "64", "--prompts", "512", "--n", "16",
            "--mini-batch", "128", "--max-tokens-per-gpu", "10240", "--layout",
            "tp=2,pp=32,ep=8,etp=1,pipeline_layout=Et|(tt|)*30L,recompute=selective,"
            "recompute_modules=core_attn:mla_up_proj:layernorm:moe:mlp",
            "--rollout", "tp=2,dp=32,ep=64,gpus=512,gpu_memory_utilization=0.9"]  # the 512 x H100 preset's layouts
    main(args + ["--set", "rollout_quantization=fp8"])
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("rollout per GPU:"))
    assert "weights 18.9 (FP8 as DeepSeek's release + scales; BF16 35.9)" in line, line
    assert "refit estimate (FP8 rollout weights): sharded" in out
    assert "  actor_rollout_ref.rollout.quantization=fp8" in out.splitlines()
    main(args)  # twin: the default is BF16, and nothing is emitted
    out = capsys.readouterr().out
    assert "weights 35.9 (BF16)" in next(x for x in out.splitlines() if x.startswith("rollout per GPU:"))
    assert "quantization" not in out
    assert main(args + ["--set", "rollout_quantization=fp4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "rollout_quantization='fp4'" in err[0] and "'none', 'fp8'" in err[0], err


# ------------------------------------------------------------------------------------------- (b) presets


def test_fp8_preset_is_the_512_preset_plus_fp8():
    base, fp8 = load_preset("671b_512xH100"), load_preset("671b_512xH100_fp8")
    assert base.rollout_quantization == "none" and fp8.rollout_quantization == "fp8"
    for k in ("model", "hardware", "layout", "rollout", "router", "verl", "router_replay", "rollout_correction"):
        assert getattr(fp8, k) == getattr(base, k), k
    assert rollout_quantization.verl_tree("fp8") == {"actor_rollout_ref": {"rollout": {"quantization": "fp8"}}}
    assert rollout_quantization.verl_tree("none") == {}


def _preset(tmp: Path, base: str, body: str) -> Path:
    p = tmp / "p.yaml"
    p.write_text(f"extends: {PRESET_DIR / base}\n{body}")
    return p


@pytest.mark.parametrize("base,body,match", [
    ("671b_512xH100.yaml", "rollout_quantization: fp4\n",
     r"rollout_quantization='fp4'; did you mean 'fp8'\? \(allowed: none, fp8;"),
    ("671b_512xH100.yaml", "rollout_quantization: true\n", r"rollout_quantization=True .*allowed: none, fp8"),
    ("tiny_cpu.yaml", "rollout_quantization: fp8\n", r"rollout_quantization=fp8 on a CPU preset .*needs a CUDA device"),
    ("671b_512xH100.yaml", "planner: {rollout_quantization: fp8}\n", r"planner.rollout_quantization: set the preset's"),
])
def test_bad_values_are_one_line_errors(tmp_path, base, body, match):
    with pytest.raises(PresetError, match=match) as e:
        load_preset(_preset(tmp_path, base, body))
    assert "\n" not in str(e.value)
    assert load_preset(_preset(tmp_path, base, "rollout_quantization: none\n")).rollout_quantization == "none"  # twin


def test_launcher_exits_2_with_one_error_line(tmp_path, capsys):
    from dsv3_rl.launch.cli import main

    assert main(["--preset", str(_preset(tmp_path, "tiny_cpu.yaml", "rollout_quantization: fp8\n")), "--dry-run"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "rollout_quantization=fp8" in err[0], err


from test_launch_dryrun import dsv3_config_only, environ_for  # noqa: E402,F401  (the config-only 671B checkpoint)


@pytest.mark.slow
def test_fp8_preset_dry_runs_with_fp8_composed_and_planned(tmp_path, dsv3_config_only, monkeypatch):  # noqa: F811
    """verl's real config composes ``rollout.quantization=fp8`` and the launcher's planner check counts FP8;
    twin: the BF16 preset composes null and plans BF16."""
    import dsv3_rl.planner as planner
    from dsv3_rl.launch import run as launch_run
    from omegaconf import OmegaConf

    seen = []
    real = planner.check_layout

    def spy(*a, **kw):
        seen.append(a[4].rollout_quantization)
        return real(*a, **kw)

    monkeypatch.setattr(planner, "check_layout", spy)
    got = {}
    for name in ("671b_512xH100_fp8", "671b_512xH100"):
        launch = launch_run.resolve(name, [], environ_for(name, tmp_path, dsv3_config_only))
        assert launch.errors == [], "\n".join(map(str, launch.errors))
        assert any(f.check == "planner" and f.message.startswith("fits") for f in launch.findings)
        got[name] = (OmegaConf.select(launch.cfg, "actor_rollout_ref.rollout.quantization"),
                     "actor_rollout_ref.rollout.quantization=fp8" in launch.argv)
    assert got == {"671b_512xH100_fp8": ("fp8", True), "671b_512xH100": (None, False)}
    assert seen == ["fp8", "none"]

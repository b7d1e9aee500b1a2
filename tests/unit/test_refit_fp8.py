"""FP8 rollout weights in DeepSeek's own format (dsv3_rl.refit.fp8_layout, verl patch 0030).

The reference is a header-level description of DeepSeek's FP8 release (tests/assets/deepseek_v3_fp8_layout,
README there says where it comes from); verl's FP8 quantizer (rollout.quantization=fp8) must produce exactly
that set and layout from our HF-named BF16 export, and the FP8 weights must dequantize (with our FP8 cast)
to within FP8 rounding of the BF16 weights. See docs/refit.md.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
from pathlib import Path

import pytest
import torch

from dsv3_rl.refit.fp8_layout import (
    dequant_errors,
    layout_differences,
    load_description,
    reference_layout,
    scale_shape,
    shape_of,
    stream_layout,
)

ASSETS = Path(__file__).resolve().parents[1] / "assets"
RELEASE_CONFIG = json.loads((ASSETS / "deepseek_v3_config.json").read_text())


def test_description_matches_release_config_and_counts():
    d = load_description()
    for t in d["tensors"]:
        shape = shape_of(t["shape"], RELEASE_CONFIG)
        assert list(shape) == t["observed"], t["name"]
        if t["dtype"] == "F8_E4M3":
            assert list(scale_shape(shape)) == t["scale_observed"], t["name"]
        else:
            assert "scale_observed" not in t, t["name"]
    ref = reference_layout(RELEASE_CONFIG)
    assert len(ref) == d["totals"]["tensors"] == 91991
    assert sum(n.endswith("_scale_inv") for n in ref) == d["totals"]["scale_inv"] == 45808
    moe = sorted({int(n.split(".")[2]) for n in ref if ".mlp.experts." in n})
    assert [moe[0], moe[-1]] == d["totals"]["moe_layers"]


def test_description_agrees_with_our_fp8_release_writer():
    """Our mini-model writer's "fp8-release" format (what the FP8 cast reads) has the same layout, MTP included."""
    from dsv3_rl.checkpoint.fp8_kernels import scale_shape as our_scale_shape
    from dsv3_rl.minimodel.mini_model import tensor_specs
    from dsv3_rl.models.presets import preset_kwargs

    cfg = preset_kwargs("tiny", {"num_nextn_predict_layers": 1})
    ours = {}
    for s in tensor_specs(cfg, mtp_layers=1):
        if s.kind == "linear":
            ours[s.name] = ("F8_E4M3", s.shape)
            ours[s.name + "_scale_inv"] = ("F32", tuple(our_scale_shape(s.shape)))
        else:
            ours[s.name] = ("F32" if s.kind == "bias" else "BF16", s.shape)
    assert layout_differences(reference_layout(cfg), ours) == []


def _bf16_names(ref):
    """The BF16 export of the same model: every tensor of the release, FP8 ones in BF16, no scales."""
    return {n: ("BF16" if d == "F8_E4M3" else d, s) for n, (d, s) in ref.items() if not n.endswith("_scale_inv")}


def _apply_rule(should_quantize, bf16):
    out = {}
    for n, (d, s) in bf16.items():
        if should_quantize(n):
            out[n] = ("F8_E4M3", s)
            out[n + "_scale_inv"] = ("F32", scale_shape(s))
        else:
            out[n] = (d, s)
    return out


def test_verl_fp8_rule_matches_deepseek_release():
    """verl's name rule (patched by 0030) picks exactly the release's FP8 weights of the full DeepSeek-V3."""
    from verl.utils.fp8_utils import FP8QuantizerHelper

    ref = reference_layout(RELEASE_CONFIG)
    helper = FP8QuantizerHelper({"weight_block_size": [128, 128]})
    assert layout_differences(ref, _apply_rule(helper.should_quantize_param, _bf16_names(ref))) == []


def _pristine_fp8_utils():
    from dsv3_rl.backends import BASELINE_TAG, git, load_lock

    src = git(load_lock()["verl"].path(), "show", f"{BASELINE_TAG}:verl/utils/fp8_utils.py").stdout
    spec = importlib.util.spec_from_loader("verl.utils._pristine_fp8_utils", loader=None)
    mod = importlib.util.module_from_spec(spec)
    mod.__package__ = "verl.utils"
    mod.__file__ = "pristine verl/utils/fp8_utils.py"
    exec(compile(src, "pristine verl/utils/fp8_utils.py", "exec"), mod.__dict__)
    return mod


def test_pristine_verl_fp8_rule_leaves_mla_projections_bf16():
    """Planted-fault twin: without patch 0030 the same check fails, on the MLA projections."""
    ref = reference_layout(RELEASE_CONFIG)
    helper = _pristine_fp8_utils().FP8QuantizerHelper({"weight_block_size": [128, 128]})
    diffs = layout_differences(ref, _apply_rule(helper.should_quantize_param, _bf16_names(ref)), limit=0)
    assert diffs, "the pristine rule should not match DeepSeek's release"
    projections = {d.split(" ")[1].split(".")[4] for d in diffs if d.startswith("missing")}
    assert projections == {"q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj"}


# ------------------------------------------------- the FP8 export itself (verl's quantizer, our dequant)

CFG = dict(
    __import__("dsv3_rl.models.presets", fromlist=["preset_kwargs"]).preset_kwargs(
        "tiny", {"hidden_size": 320, "q_lora_rank": 200, "kv_lora_rank": 136, "moe_intermediate_size": 160,
                 "intermediate_size": 400}))  # dims off the 128 grid: padded edge blocks


def _bf16_export(seed=0):
    """HF-named BF16 tensors of the model as our verl export produces them (names/shapes of the HF checkpoint:
    tests/unit/test_verl_cpu_megatron.py shows the export equals it); router bias in FP32, values with
    a wide dynamic range so that FP8 subnormals occur."""
    from dsv3_rl.minimodel.mini_model import tensor_specs

    g = torch.Generator().manual_seed(seed)
    out = []
    for s in tensor_specs(CFG):
        x = torch.randn(s.shape, generator=g) * torch.exp(torch.randn(s.shape, generator=g) * 2)
        out.append((s.name, x.to(torch.float32 if s.kind == "bias" else torch.bfloat16)))
    return out


@pytest.fixture
def one_rank(monkeypatch):
    """verl's quantizer asks torch.distributed for its rank (and without a process group silently sends BF16):
    a one-process gloo group; verl's PyTorch kernel (Triton imports here but has no GPU)."""
    import verl.utils.kernel.fp8_kernel as fk

    from dsv3_rl.ports import free_port

    monkeypatch.setattr(fk, "_DISABLE_TRITON_FP8", True)
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    torch.distributed.destroy_process_group()


async def _collect(agen):
    return [x async for x in agen]


def _verl_fp8(stream):
    from verl.utils.fp8_utils import FP8QuantizerHelper

    q = FP8QuantizerHelper({"weight_block_size": [128, 128]})
    return asyncio.run(_collect(q.quant_weights_by_name(iter(stream))))


def test_verl_fp8_export_has_release_layout_and_dequantizes_within_bounds(one_rank):
    bf16 = _bf16_export()
    fp8 = _verl_fp8(bf16)
    assert layout_differences(reference_layout(CFG), stream_layout(fp8)) == []
    assert dequant_errors(fp8, dict(bf16)) == []


def test_fp8_export_planted_faults_fail(one_rank):
    """Twins: a scale of the wrong block, a transposed scale, and verl's silent BF16 fallback are all caught."""
    bf16 = _bf16_export()
    fp8 = dict(_verl_fp8(bf16))
    name = "model.layers.1.mlp.experts.3.down_proj.weight"
    s = fp8[name + "_scale_inv"]
    assert s.shape == (3, 2)
    wrong_block = dict(fp8)
    wrong_block[name + "_scale_inv"] = s.roll(1, dims=0)
    assert [e.split(":")[0] for e in dequant_errors(wrong_block.items(), dict(bf16))] == [name]
    transposed = dict(fp8)
    transposed[name + "_scale_inv"] = s.t().contiguous()
    assert layout_differences(reference_layout(CFG), stream_layout(transposed.items())) == [
        f"{name}_scale_inv: F32 [2, 3], DeepSeek's release has F32 [3, 2]"]


def test_verl_fp8_without_process_group_silently_sends_bf16_and_is_caught(monkeypatch):
    import verl.utils.kernel.fp8_kernel as fk

    monkeypatch.setattr(fk, "_DISABLE_TRITON_FP8", True)
    assert not torch.distributed.is_initialized()
    fp8 = _verl_fp8(_bf16_export())  # verl logs "Failed to quantize" per tensor and yields the BF16 weight
    diffs = layout_differences(reference_layout(CFG), stream_layout(fp8), limit=0)
    assert any(d.startswith("missing model.layers.0.self_attn.q_a_proj.weight_scale_inv") for d in diffs)


# ------------------------------------------------- the vLLM path: what verl's vLLM worker quantizes
# With vLLM, FP8QuantizerHelper (above; the sglang / trtllm rollouts' quantizer) is not used: verl sends BF16 and the
# vLLM worker quantizes each weight whose vLLM module holds an FP8 weight (verl/utils/vllm/vllm_quant_utils.py,
# is_fp8_weight), with the quantization_config verl's vLLM server builds (vllm_async_server._apply_quantization).


def _vllm_fp8_selection(extra_ignored=()):
    """The release's BF16 names (main model, without the MTP layer) each with verl's vLLM-side verdict: vLLM's
    DeepseekV3ForCausalLM of the release config, built on the meta device with verl's FP8 quantization_config
    (plus EXTRA_IGNORED layer prefixes), and verl's is_fp8_weight over every name."""
    import tempfile
    from types import SimpleNamespace

    import verl.workers.rollout.vllm_rollout.vllm_async_server as server
    import vllm.model_executor.layers.quantization.fp8 as vllm_fp8
    from verl.utils.vllm import vllm_quant_utils as quant
    from vllm.config import ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import (destroy_distributed_environment, destroy_model_parallel,
                                  init_distributed_environment, initialize_model_parallel)
    from vllm.model_executor.models.deepseek_v2 import DeepseekV3ForCausalLM

    from dsv3_rl.ports import free_port

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(server, "apply_vllm_quant_patches", lambda: None)  # a process-wide vLLM patch; not needed here
        mp.setenv("VERL_VLLM_FP8_QUANT_ENABLED", "0")  # restored after verl's method sets it
        fake = SimpleNamespace(config=SimpleNamespace(quantization="fp8", qat={}, quantization_config_file=None),
                               model_config=SimpleNamespace(hf_config=SimpleNamespace(**RELEASE_CONFIG)))
        quantization, overrides = server.vLLMHttpServer._apply_quantization(fake)
        # this CPU has no FP8 GEMM kernel for vLLM to pick; the kernel does not change what is FP8
        mp.setattr(vllm_fp8, "init_fp8_linear_kernel", lambda *a, **k: None)
        overrides["quantization_config"]["ignored_layers"] += list(extra_ignored)
        with tempfile.TemporaryDirectory() as d:
            (Path(d) / "config.json").write_text(json.dumps({k: v for k, v in RELEASE_CONFIG.items() if k != "auto_map"}))
            mc = ModelConfig(model=d, skip_tokenizer_init=True, dtype="bfloat16", quantization=quantization,
                             hf_overrides=overrides, enforce_eager=True)
        vc = VllmConfig(model_config=mc)
        with set_current_vllm_config(vc):
            init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                         distributed_init_method=f"tcp://127.0.0.1:{free_port()}")
            try:
                initialize_model_parallel(1, 1)
                with torch.device("meta"):
                    model = DeepseekV3ForCausalLM(vllm_config=vc, prefix="")
            finally:
                destroy_model_parallel()
                destroy_distributed_environment()
    mtp = f"model.layers.{RELEASE_CONFIG['num_hidden_layers']}."
    bf16 = {n: v for n, v in _bf16_names(reference_layout(RELEASE_CONFIG)).items() if not n.startswith(mtp)}
    quant.fp8_state.seen_params.clear()
    quant.fp8_state.fp8_param_names.clear()
    return _apply_rule(lambda n: quant.is_fp8_weight(n, model), bf16), mtp


def test_verl_vllm_fp8_selection_matches_deepseek_release():
    """vLLM path: the weights verl's vLLM worker quantizes (vLLM's own FP8 layers under verl's quantization_config)
    are exactly the release's FP8 set: every MLA projection, dense MLPs, shared and routed experts; router gates
    (vLLM builds them unquantized), embeddings, lm_head and norms stay BF16."""
    got, mtp = _vllm_fp8_selection()
    ref = {n: v for n, v in reference_layout(RELEASE_CONFIG).items() if not n.startswith(mtp)}
    assert layout_differences(ref, got) == []
    assert sum(n.endswith("_scale_inv") for n in got) == 45032  # 45,808 minus the MTP layer's 776


def test_verl_vllm_fp8_selection_check_bites():
    """Planted-fault twin: vLLM building kv_b_proj unquantized (one more ignored layer per decoder layer) fails the
    same check, on exactly those tensors."""
    n_layers = RELEASE_CONFIG["num_hidden_layers"]
    got, mtp = _vllm_fp8_selection([f"model.layers.{i}.self_attn.kv_b_proj" for i in range(n_layers)])
    ref = {n: v for n, v in reference_layout(RELEASE_CONFIG).items() if not n.startswith(mtp)}
    diffs = layout_differences(ref, got, limit=0)
    assert diffs
    assert {d.split(" ")[1].split(":")[0] if d.startswith("missing") else d.split(":")[0] for d in diffs} == (
        {f"model.layers.{i}.self_attn.kv_b_proj.weight" for i in range(n_layers)}
        | {f"model.layers.{i}.self_attn.kv_b_proj.weight_scale_inv" for i in range(n_layers)})

"""Refit of DeepSeek-V3's MTP layer (issue 19 item 5, verl patch 0034).

A tiny DeepSeek-V3 with one MTP layer: a random HF checkpoint with MTP (``model.layers.4.*``, its own
``embed_tokens`` / ``shared_head.head`` equal to the main ones, as in DeepSeek's release) -> our hf->mcore
converter with ``keep_mtp`` -> megatron-core GPTModel with its MTP block -> verl's Megatron export
(``per_tensor_generator`` + ``McoreToHFWeightConverterDpskv3``). The independent references are the HF
checkpoint on disk (read with safetensors) before the update, and after one optimizer step the updated
model saved by megatron and converted to HF by our mcore->hf converter.

Planted faults: the converter with patch 0034 reversed (refuses the model: 61 layers hard-coded), an export
without the MTP layer's embedding/head copies, and a stale MTP export (the one from before the update).
Without MTP the export is exactly what it was before the patch.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dsv3_rl.backends import load_lock

VERL = load_lock()["verl"]
PATCH = "0034-mtp-export.patch"
LAYER_NAME_MAPPING = {"qkv_layer_name": "self_attention.linear_qkv.", "gate_proj_layer_name": "linear_fc1."}


def _pre_patch_module(rel: str, tmp: Path):
    """verl's ``rel`` (e.g. verl/models/mcore/weight_converter.py) as it is without patch 0034: the live file with
    the patch's hunks for it reversed, imported as a sibling module (same package, so relative imports work)."""
    from dsv3_rl.patching import lint

    patch = {p.name: p for p in lint(VERL, headers=False)}[PATCH]
    dst = tmp / rel
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_text((VERL.path() / rel).read_text())
    r = subprocess.run(["git", "apply", "-R", f"--include={rel}", str(patch.path)], cwd=tmp, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert dst.read_text() != (VERL.path() / rel).read_text(), f"patch {PATCH} does not touch {rel}"
    pkg, _, stem = rel[: -len(".py")].replace("/", ".").rpartition(".")
    spec = importlib.util.spec_from_file_location(f"{pkg}.{stem}_pre0034", dst)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def _build(cfg, mtp: bool):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_mtp_block_spec
    from megatron.core.transformer.enums import AttnBackend

    from dsv3_rl.models.config_map import Parallel, gpt_model_kwargs, hf_to_mcore_config

    config = hf_to_mcore_config(cfg, Parallel(), dtype=torch.bfloat16, keep_mtp=mtp, use_cpu_initialization=True,
                                attention_backend=AttnBackend.local)
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
    extra = {"mtp_block_spec": get_gpt_mtp_block_spec(config, spec.layer_specs[-1], use_transformer_engine=False)} if mtp else {}
    return GPTModel(config, spec, pre_process=True, post_process=True, **extra, **gpt_model_kwargs(cfg))


def _export(model, cfg, converter_cls) -> list[tuple[str, torch.Tensor]]:
    from dsv3_rl.refit.verl_export import load

    v = load()
    conv = converter_cls(cfg, model.config)
    return [(n, t.detach().clone()) for n, t in v.per_tensor_generator([model], cfg, conv, model.config, LAYER_NAME_MAPPING)]


def _step(model, cfg) -> None:
    """One SGD step on the LM + MTP loss (megatron-core adds the MTP loss's gradient in backward). megatron-core's
    MTP loss *logger* allocates on ``torch.cuda.current_device()``: it is switched off here (CPU), the loss is not."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, cfg.vocab_size, (2, 16), generator=g)
    pos = torch.arange(16).expand(2, 16)
    labels = torch.roll(tokens, -1, 1)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(MTPLossLoggingHelper, "save_loss_to_tracker", staticmethod(lambda *a, **k: None))
        loss = model(tokens, pos, attention_mask=None, labels=labels).float().mean()
        loss.backward()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1.0)
    opt.step()


def _hf(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def mismatches(exported: list[tuple[str, torch.Tensor]], ref: dict[str, torch.Tensor]) -> list[str]:
    """Names that differ between an export and a reference HF checkpoint: missing, extra, repeated, or other
    values (values compared exactly; megatron's local spec keeps the norms and the expert bias in fp32, an exact
    widening of the checkpoint's bf16)."""
    names = [n for n, _ in exported]
    out = [f"{n}: exported twice" for n in sorted({n for n in names if names.count(n) > 1})]
    out += [f"{n}: not exported" for n in sorted(set(ref) - set(names))]
    out += [f"{n}: not in the checkpoint" for n in sorted(set(names) - set(ref))]
    for n, t in exported:
        if n in ref and (t.shape != ref[n].shape or not torch.equal(t.float(), ref[n].float())):
            out.append(f"{n}: values differ")
    return out


@pytest.fixture(scope="module")
def mtp_run(tmp_path_factory):
    from verl.plugin.platform import platform_manager as pm
    from verl.plugin.platform.platform_cpu import PlatformCPU

    from dsv3_rl.minimodel.mini_model import write_random_hf
    from dsv3_rl.convert.weights import hf_to_mcore, mcore_to_hf
    from dsv3_rl.correctness.assemble import single_process_megatron
    from dsv3_rl.mcore import layout_check
    from dsv3_rl.models.presets import hf_config
    from dsv3_rl.refit.verl_export import load

    d = tmp_path_factory.mktemp("refit_mtp")
    cfg = hf_config("tiny", {"num_nextn_predict_layers": 1})
    hf = write_random_hf(cfg, d / "hf")
    hf_to_mcore(hf, d / "mcore", keep_mtp=True, progress=False)
    pre = _pre_patch_module("verl/models/mcore/weight_converter.py", d / "pre0034").McoreToHFWeightConverterDpskv3
    run: dict = {"hf": hf, "cfg": cfg}
    with pytest.MonkeyPatch.context() as mp, single_process_megatron():
        mp.setenv("VERL_PLATFORM", "cpu")
        mp.setattr(pm, "_current_platform", PlatformCPU())
        conv = load().DeepseekV3Converter
        model = _build(cfg, mtp=True)
        layout_check.load([model], d / "mcore")
        run["before"] = _export(model, cfg, conv)
        try:
            _export(model, cfg, pre)
            run["pre_patch_error"] = None
        except AssertionError as e:
            run["pre_patch_error"] = str(e)
        _step(model, cfg)
        run["after"] = _export(model, cfg, conv)
        layout_check.save([model], d / "mcore_after")
        # without MTP: the same trunk, exported with the patched and with the pre-patch converter
        plain_cfg = hf_config("tiny")
        plain = _build(plain_cfg, mtp=False)
        run["plain"] = _export(plain, plain_cfg, conv)
        run["plain_pre_patch"] = _export(plain, plain_cfg, pre)
    mcore_to_hf(d / "mcore_after", d / "hf_after", hf_dir=hf, progress=False)
    run["hf_after"] = d / "hf_after"
    return run


def test_mtp_export_equals_hf_checkpoint(mtp_run):
    """Names and values of the export == the HF checkpoint the model was loaded from, MTP layer 4 included."""
    ref = _hf(mtp_run["hf"])
    mtp_names = {n for n in ref if n.startswith("model.layers.4.")}
    assert {"model.layers.4.embed_tokens.weight", "model.layers.4.shared_head.head.weight",
            "model.layers.4.eh_proj.weight", "model.layers.4.enorm.weight", "model.layers.4.hnorm.weight",
            "model.layers.4.shared_head.norm.weight", "model.layers.4.self_attn.kv_b_proj.weight",
            "model.layers.4.mlp.experts.7.down_proj.weight"} <= mtp_names
    assert mismatches(mtp_run["before"], ref) == []


def test_mtp_export_without_embedding_and_head_copies_is_caught(mtp_run):
    """Planted fault: the MTP layer exported without its own embed_tokens / shared_head.head."""
    ref = _hf(mtp_run["hf"])
    dropped = [(n, t) for n, t in mtp_run["before"]
               if n not in ("model.layers.4.embed_tokens.weight", "model.layers.4.shared_head.head.weight")]
    assert mismatches(dropped, ref) == ["model.layers.4.embed_tokens.weight: not exported",
                                        "model.layers.4.shared_head.head.weight: not exported"]


def test_pre_patch_converter_refuses_mtp(mtp_run):
    """Planted fault: verl's converter with patch 0034 reversed cannot export this model (61 layers hard-coded)."""
    assert mtp_run["pre_patch_error"] == "only support 61 layers for now"


def test_mtp_export_after_update_is_fresh(mtp_run):
    """After one optimizer step the exported MTP tensors changed and equal the updated model (saved by megatron,
    converted by our mcore->hf converter); the export before the update (a stale MTP export) is caught."""
    before, after = dict(mtp_run["before"]), dict(mtp_run["after"])
    ref = _hf(mtp_run["hf_after"])
    assert mismatches(mtp_run["after"], ref) == []
    changed = {n for n in after if n.startswith("model.layers.4.") and not torch.equal(after[n], before[n])}
    assert {"model.layers.4.eh_proj.weight", "model.layers.4.enorm.weight", "model.layers.4.hnorm.weight",
            "model.layers.4.shared_head.norm.weight", "model.layers.4.shared_head.head.weight",
            "model.layers.4.embed_tokens.weight", "model.layers.4.self_attn.q_a_proj.weight"} <= changed
    stale = [(n, before[n] if n.startswith("model.layers.4.") else t) for n, t in mtp_run["after"]]
    bad = mismatches(stale, ref)
    assert bad and all(b.startswith("model.layers.4.") and b.endswith("values differ") for b in bad)
    assert {f"{n}: values differ" for n in changed} == set(bad)


def test_export_without_mtp_unchanged(mtp_run):
    """Without MTP the export is the pre-patch export: same names in the same order, same values."""
    plain, pre = mtp_run["plain"], mtp_run["plain_pre_patch"]
    assert [n for n, _ in plain] == [n for n, _ in pre]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(plain, pre))
    assert not any(n.startswith("model.layers.4.") for n, _ in plain) and "lm_head.weight" in dict(plain)


def test_verl_dpskv3_config_keeps_mtp(tmp_path):
    """verl's hf_to_mcore_config_dpskv3 builds the MTP layer when the HF config keeps it (verl zeroes
    num_nextn_predict_layers unless model.mtp.enable); with the patch reversed it refuses the config."""
    from transformers import AutoConfig

    from dsv3_rl.correctness.assemble import single_process_megatron
    from dsv3_rl.models.presets import preset_kwargs

    cfg = AutoConfig.for_model("deepseek_v3", **preset_kwargs("tiny", {"num_nextn_predict_layers": 1}))
    pre = _pre_patch_module("verl/models/mcore/config_converter.py", tmp_path)
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention, MultiLatentAttention
    from verl.models.mcore.config_converter import hf_to_mcore_config_dpskv3

    # verl's apply_patch() (called by the converter) monkeypatches megatron's MLA process-wide: undone below
    saved = (MultiLatentAttention.forward, MLASelfAttention.get_query_key_value_tensors)
    try:
        with single_process_megatron():
            assert hf_to_mcore_config_dpskv3(cfg, torch.bfloat16).mtp_num_layers == 1
            cfg.num_nextn_predict_layers = 0
            assert not hf_to_mcore_config_dpskv3(cfg, torch.bfloat16).mtp_num_layers
            cfg.num_nextn_predict_layers = 1
            with pytest.raises(AssertionError, match="MTP is not supported"):
                pre.hf_to_mcore_config_dpskv3(cfg, torch.bfloat16)
    finally:
        MultiLatentAttention.forward, MLASelfAttention.get_query_key_value_tensors = saved


def test_mtp_names_keep_their_number_at_pp2(tmp_path):
    """With two pipeline stages verl's normalize_model_name adds the stage's layer offset to decoder layers; the MTP
    layer (on the last stage) keeps mtp.layers.0, which the converter maps to model.layers.<num_hidden_layers>.
    With the patch reversed it became mtp.layers.2 (planted fault)."""
    from verl.utils.model import normalize_model_name

    from dsv3_rl.models.config_map import Parallel, hf_to_mcore_config
    from dsv3_rl.models.presets import hf_config

    config = hf_to_mcore_config(hf_config("tiny", {"num_nextn_predict_layers": 1}), Parallel(pp=2), keep_mtp=True)
    assert normalize_model_name("decoder.layers.0.mlp.router.weight", 1, None, config) == "decoder.layers.2.mlp.router.weight"
    assert normalize_model_name("mtp.layers.0.enorm.weight", 1, None, config) == "mtp.layers.0.enorm.weight"
    assert normalize_model_name("module.mtp.layers.0.eh_proj.weight", 1, None, config) == "module.mtp.layers.0.eh_proj.weight"
    pre = _pre_patch_module("verl/utils/model.py", tmp_path)
    assert pre.normalize_model_name("mtp.layers.0.enorm.weight", 1, None, config) == "mtp.layers.2.enorm.weight"


def test_mtp_fp8_export_has_release_layout(mtp_run, monkeypatch):
    """rollout.quantization=fp8: the MTP model's export through verl's FP8 quantizer is DeepSeek's FP8 release
    layout with the MTP layer (eh_proj / shared_head / embed_tokens in BF16, its attention and experts FP8); without
    the MTP tensors it is not (twin)."""
    import asyncio

    import verl.utils.kernel.fp8_kernel as fk
    from verl.utils.fp8_utils import FP8QuantizerHelper

    from dsv3_rl.correctness.assemble import single_process_megatron
    from dsv3_rl.models.presets import preset_kwargs
    from dsv3_rl.refit.fp8_layout import layout_differences, reference_layout, stream_layout

    async def collect(stream):
        q = FP8QuantizerHelper({"weight_block_size": [128, 128]})
        return [x async for x in q.quant_weights_by_name(iter(stream))]

    monkeypatch.setattr(fk, "_DISABLE_TRITON_FP8", True)  # Triton imports here but has no GPU
    ref = reference_layout(preset_kwargs("tiny", {"num_nextn_predict_layers": 1}))
    assert "model.layers.4.self_attn.q_a_proj.weight_scale_inv" in ref and "model.layers.4.eh_proj.weight" in ref
    with single_process_megatron():  # verl's quantizer sends BF16 without a process group
        fp8 = asyncio.run(collect(mtp_run["after"]))
        no_mtp = asyncio.run(collect([(n, t) for n, t in mtp_run["after"] if not n.startswith("model.layers.4.")]))
    assert layout_differences(ref, stream_layout(fp8), float_equivalent=True) == []
    diffs = layout_differences(ref, stream_layout(no_mtp), float_equivalent=True, limit=0)
    assert diffs and all(d.startswith("missing model.layers.4.") for d in diffs)


@pytest.fixture(scope="module")
def mtp_dist_ckpt(tmp_path_factory):
    from dsv3_rl.minimodel.mini_model import write_random_hf
    from dsv3_rl.convert.weights import hf_to_mcore
    from dsv3_rl.models.presets import hf_config

    d = tmp_path_factory.mktemp("refit_mtp_verl")
    cfg = hf_config("tiny", {"num_nextn_predict_layers": 1})
    cfg.architectures = ["DeepseekV3ForCausalLM"]  # verl picks its model class by it
    hf = write_random_hf(cfg, d / "hf")
    hf_to_mcore(hf, d / "dist", keep_mtp=True, progress=False)
    return hf, d / "dist"


@pytest.mark.slow  # ~35 s on 2 cores (torchrun)
def test_verl_engine_builds_loads_and_exports_mtp(mtp_dist_ckpt):
    """verl's own path end to end (torchrun, gloo; tests/unit/verl_cpu_export_worker.py): verl's config converter
    keeps the MTP layer, verl's DeepSeek-V3 initializer builds it, verl's dist-checkpoint loader loads our
    converter's checkpoint, and per_tensor_generator exports every tensor of the HF checkpoint, layer 4 (MTP)
    included, bit for bit. (PP2 is not run on CPU: megatron-core's GPTModel syncs the last stage's MTP embedding
    with ``weight.data.cuda()``; the MTP names at PP2 are test_mtp_names_keep_their_number_at_pp2.)"""
    from test_verl_cpu_megatron import _assert_exact, _export

    results = _export(*mtp_dist_ckpt, tp=1, ep=1)["clean"]
    _assert_exact(results)
    ref = _hf(mtp_dist_ckpt[0])
    assert "model.layers.4.shared_head.head.weight" in ref
    assert all(r["n"] == len(ref) for r in results), [(r["rank"], r["n"], len(ref)) for r in results]

"""Presets, the offline tokenizer and the mini-model writer (dsv3_rl.models)."""

import hashlib
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from dsv3_rl.minimodel import mini_model
from dsv3_rl.models import presets, tokenizer
from dsv3_rl.minimodel.mini_model import fuse_experts, tensor_specs, write_mini_model

ASSETS = Path(__file__).resolve().parents[1] / "assets"
HUB_CONFIG = ASSETS / "deepseek_v3_config.json"


def _digest(d: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir()) if p.is_file()}


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory):
    return write_mini_model("tiny", tmp_path_factory.mktemp("m") / "tiny")


@pytest.fixture(scope="module")
def tiny_fp8(tmp_path_factory):
    return write_mini_model("tiny", tmp_path_factory.mktemp("m") / "tiny-fp8", fmt="fp8-release")


# ------------------------------------------------------------------------------------ presets

TINY_EXPECTED = dict(
    hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=4, first_k_dense_replace=1,
    num_attention_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
    v_head_dim=16, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=4, n_group=4, topk_group=2,
    routed_scaling_factor=2.5, norm_topk_prob=True, max_position_embeddings=256, rms_norm_eps=1e-6,
    tie_word_embeddings=False, rope_interleave=True, num_nextn_predict_layers=0,
)
YARN_TINY = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64, beta_fast=32.0, beta_slow=1.0,
                 mscale=1.0, mscale_all_dim=1.0)


def _diff(actual: dict, expected: dict) -> dict:
    return {k: (actual.get(k), v) for k, v in expected.items() if actual.get(k) != v}


def test_preset_names():
    assert presets.list_presets() == ["tiny", "tiny-vllm", "proxy", "proxy_4xH100", "proxy_1xH100", "deepseek-v3"]
    assert presets.resolve("671b") == "deepseek-v3"
    with pytest.raises(KeyError, match="allowed: tiny, tiny-vllm, proxy, proxy_4xH100, proxy_1xH100, deepseek-v3, 671b"):
        presets.resolve("tiny2")


def test_tiny_preset_values():
    k = presets.PRESETS["tiny"]
    assert _diff(k, TINY_EXPECTED) == {}
    assert _diff(k["rope_parameters"], YARN_TINY) == {}
    assert k["vocab_size"] == tokenizer.VOCAB_SIZE
    # planted fault: the comparison must see a one-key change
    assert _diff({**k, "topk_group": 4}, TINY_EXPECTED) == {"topk_group": (4, 2)}


def test_tiny_vllm_preset_values():
    k = presets.PRESETS["tiny-vllm"]
    assert _diff(k, dict(kv_lora_rank=512, qk_rope_head_dim=64, hidden_size=128, num_attention_heads=4,
                         q_lora_rank=64, qk_nope_head_dim=32, v_head_dim=32, max_position_embeddings=1024)) == {}
    assert k["rope_parameters"]["original_max_position_embeddings"] == 256
    for key in ("num_attention_heads", "n_routed_experts", "num_hidden_layers", "intermediate_size",
                "moe_intermediate_size"):
        assert k[key] % 2 == 0, key  # TP2 / EP2 in the CPU demo


def test_proxy_preset_values():
    """DeepSeek-V3's real layer dims (read from the hub config.json asset), fewer layers and experts."""
    k = presets.PRESETS["proxy"]
    hub = json.loads(HUB_CONFIG.read_text())
    dims = ("hidden_size", "num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
            "v_head_dim", "intermediate_size", "moe_intermediate_size", "vocab_size", "num_experts_per_tok",
            "n_shared_experts", "n_group", "topk_group")
    assert _diff(k, {**{d: hub[d] for d in dims}, "num_hidden_layers": 4, "first_k_dense_replace": 1,
                     "n_routed_experts": 16}) == {}


@pytest.mark.parametrize("name", ["tiny", "tiny-vllm", "proxy", "deepseek-v3"])
def test_group_topk_is_two(name):
    # megatron scores a group by its top-(topk/group_topk) experts, HF by its top-2
    k = presets.PRESETS[name]
    assert k["num_experts_per_tok"] // k["topk_group"] == 2 and k["num_experts_per_tok"] % k["topk_group"] == 0


def _normalized_hub(cfg: dict) -> dict:
    cfg = dict(cfg)
    rope = dict(cfg.pop("rope_scaling"))
    rope["rope_type"] = rope.pop("type")
    rope["rope_theta"] = cfg.pop("rope_theta")
    cfg["rope_parameters"] = {k: float(v) if isinstance(v, (int, float)) and k != "original_max_position_embeddings"
                              else v for k, v in rope.items()}
    return cfg


def test_deepseek_v3_preset_matches_the_public_config():
    hub = _normalized_hub(json.loads(HUB_CONFIG.read_text()))
    preset = presets.PRESETS["deepseek-v3"]
    shared = [k for k in preset if k in hub]
    assert len(shared) >= 30
    assert {k: (preset[k], hub[k]) for k in shared if preset[k] != hub[k]} == {}
    # planted fault
    wrong = {**preset, "first_k_dense_replace": 1}
    assert {k for k in shared if wrong[k] != hub[k]} == {"first_k_dense_replace"}


def test_hf_config_round_trip_keeps_yarn(tmp_path):
    from transformers import AutoConfig, DeepseekV3ForCausalLM

    cfg = presets.hf_config("tiny")
    cfg.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["topk_method"] == "noaux_tc" and saved["scoring_func"] == "sigmoid"
    loaded = AutoConfig.from_pretrained(tmp_path)
    assert _diff(loaded.rope_parameters, {**YARN_TINY, "rope_theta": 10000.0}) == {}
    model = DeepseekV3ForCausalLM(loaded)
    assert model.model.layers[1].mlp.gate.e_score_correction_bias.shape == (8,)
    assert model.model.rotary_emb.rope_type == "yarn"


def test_hub_style_config_reads_with_yarn():
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(HUB_CONFIG.parent / "deepseek_v3_config.json")
    rope = cfg.rope_parameters
    assert (rope["rope_type"], rope["factor"], rope["original_max_position_embeddings"]) == ("yarn", 40, 4096)
    assert rope["mscale_all_dim"] == 1.0 and rope["rope_theta"] == 10000
    assert cfg.quantization_config["weight_block_size"] == [128, 128]
    assert cfg.num_nextn_predict_layers == 1 and cfg.topk_method == "noaux_tc"


def test_overrides_must_be_known_keys():
    assert presets.preset_kwargs("tiny", {"num_hidden_layers": 2})["num_hidden_layers"] == 2
    with pytest.raises(KeyError, match="num_layers"):
        presets.preset_kwargs("tiny", {"num_layers": 2})


# ---------------------------------------------------------------------------------- tokenizer


def test_tokenizer_loads_with_deepseek_specials(tiny_hf):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_hf)
    assert len(tok) == tokenizer.VOCAB_SIZE
    assert (tok.bos_token, tok.bos_token_id) == (tokenizer.BOS, 0)
    assert (tok.eos_token, tok.eos_token_id) == (tokenizer.EOS, 1)
    assert (tok.pad_token, tok.pad_token_id) == (tokenizer.PAD, 2)
    for special in tokenizer.SPECIAL_TOKENS:
        assert len(tok(special, add_special_tokens=False).input_ids) == 1, special
    text = "Compute $\\frac{3}{4} + 17^2$. The answer is \\boxed{289.75}."
    ids = tok(text).input_ids
    assert ids[0] == 0 and tok.decode(ids[1:]) == text


def test_chat_template_is_deepseek_style(tiny_hf):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_hf)
    msgs = [{"role": "system", "content": "S1"}, {"role": "system", "content": "S2"},
            {"role": "user", "content": "Q1"}, {"role": "assistant", "content": "A1"},
            {"role": "user", "content": "Q2"}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == ("<｜begin▁of▁sentence｜>S1\n\nS2<｜User｜>Q1<｜Assistant｜>A1<｜end▁of▁sentence｜>"
                    "<｜User｜>Q2<｜Assistant｜>")
    assert not tok.apply_chat_template(msgs, tokenize=False).endswith("<｜Assistant｜>")
    with pytest.raises(Exception, match="unknown chat role"):
        tok.apply_chat_template([{"role": "narrator", "content": "x"}], tokenize=False)


def test_tokenizer_build_is_deterministic(tmp_path):
    a = tokenizer.build_tokenizer(tmp_path / "a")
    b = tokenizer.build_tokenizer(tmp_path / "b")
    assert _digest(a) == _digest(b)
    from transformers import AutoTokenizer

    assert len(AutoTokenizer.from_pretrained(a)) == tokenizer.VOCAB_SIZE  # placeholders fill the vocab


def test_cached_tokenizer_asset_is_small_and_reproducible(tmp_path, shared_data):
    files = [tokenizer.ASSET_DIR / f for f in tokenizer.FILES]
    assert sum(f.stat().st_size for f in files) < 2_000_000
    info = json.loads((tokenizer.ASSET_DIR / "build_info.json").read_text())
    for f in files:
        assert hashlib.sha256(f.read_bytes()).hexdigest() == info["sha256"][f.name], f.name
    rebuilt = tokenizer.build_from_data_dir(tmp_path / "t", shared_data)
    for name in tokenizer.FILES:
        assert (rebuilt / name).read_bytes() == (tokenizer.ASSET_DIR / name).read_bytes(), name


# ------------------------------------------------------------------------------- mini models


def test_from_pretrained_loads_every_key(tiny_hf):
    from transformers import DeepseekV3ForCausalLM

    model, info = DeepseekV3ForCausalLM.from_pretrained(tiny_hf, output_loading_info=True)
    assert not info["missing_keys"]
    assert not info["unexpected_keys"] and not info["mismatched_keys"]
    assert model.dtype == torch.bfloat16
    logits = model(torch.tensor([[0, 5, 9, 300]])).logits
    assert torch.isfinite(logits).all() and 0.01 < logits.float().std() < 10


def test_missing_tensor_is_reported(tiny_hf, tmp_path):
    """Planted fault for the no-missing-keys check: drop one expert weight."""
    import shutil

    from transformers import DeepseekV3ForCausalLM

    from dsv3_rl.checkpoint.safetensors_io import write_tensors

    bad = tmp_path / "bad"
    shutil.copytree(tiny_hf, bad)
    sd = load_file(bad / "model.safetensors")
    del sd["model.layers.0.self_attn.o_proj.weight"]
    write_tensors(bad / "model.safetensors", sd)
    _, info = DeepseekV3ForCausalLM.from_pretrained(bad, output_loading_info=True)
    assert "model.layers.0.self_attn.o_proj.weight" in info["missing_keys"]


def test_hub_layout_and_init(tiny_hf):
    sd = load_file(tiny_hf / "model.safetensors")
    k = presets.PRESETS["tiny"]
    assert set(sd) == {s.name for s in tensor_specs(k)}
    assert "model.layers.1.mlp.experts.7.gate_proj.weight" in sd
    assert not any("gate_up_proj" in n for n in sd)
    assert sd["model.layers.1.mlp.experts.3.down_proj.weight"].shape == (64, 32)
    assert sd["model.layers.0.mlp.gate_proj.weight"].shape == (128, 64)
    assert sd["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"].shape == (40, 64)
    assert sd["model.layers.0.self_attn.q_b_proj.weight"].shape == (4 * 24, 32)
    bias = sd["model.layers.1.mlp.gate.e_score_correction_bias"]
    assert bias.dtype == torch.float32 and (bias != 0).all() and bias.abs().max() < 0.2
    assert torch.equal(sd["model.norm.weight"].float(), torch.ones(64))
    std = sd["model.layers.2.mlp.experts.0.up_proj.weight"].float().std()
    assert 0.015 < std < 0.025
    assert all(t.dtype == torch.bfloat16 for n, t in sd.items() if "e_score" not in n)


def test_fuse_experts_matches_transformers_in_memory_layout(tiny_hf):
    from transformers import DeepseekV3ForCausalLM

    model = DeepseekV3ForCausalLM.from_pretrained(tiny_hf)
    fused = fuse_experts(load_file(tiny_hf / "model.safetensors"), presets.PRESETS["tiny"])
    msd = model.state_dict()
    assert set(fused) == set(msd)
    assert all(torch.equal(fused[n], msd[n]) for n in msd)
    assert msd["model.layers.1.mlp.experts.gate_up_proj"].shape == (8, 64, 64)


def test_deterministic_and_seeded(tmp_path, tiny_hf):
    again = write_mini_model("tiny", tmp_path / "again")
    assert _digest(again) == _digest(tiny_hf)
    other = write_mini_model("tiny", tmp_path / "other", seed=1)
    assert _digest(other)["model.safetensors"] != _digest(tiny_hf)["model.safetensors"]


def test_shards_hold_the_same_tensors(tmp_path, tiny_hf):
    out = write_mini_model("tiny", tmp_path / "sharded", shards=3)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert files == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    merged = {}
    for f in files:
        merged.update(load_file(out / f))
    single = load_file(tiny_hf / "model.safetensors")
    assert set(merged) == set(single) == set(index["weight_map"])
    assert all(torch.equal(merged[n], single[n]) for n in single)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in single.values())


def test_fp32_dtype(tmp_path):
    out = write_mini_model("tiny", tmp_path / "f32", dtype="fp32", overrides={"num_hidden_layers": 2})
    sd = load_file(out / "model.safetensors")
    assert {t.dtype for t in sd.values()} == {torch.float32}
    assert json.loads((out / "config.json").read_text())["dtype"] == "float32"


def test_fp8_release_layout(tiny_fp8):
    cfg = json.loads((tiny_fp8 / "config.json").read_text())
    assert cfg["quantization_config"] == {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                          "weight_block_size": [128, 128]}
    assert cfg["num_nextn_predict_layers"] == 1 and "rope_scaling" in cfg and "rope_parameters" not in cfg
    assert cfg["rope_scaling"]["type"] == "yarn" and cfg["rope_theta"] == 10000.0
    index = json.loads((tiny_fp8 / "model.safetensors.index.json").read_text())["weight_map"]
    files = sorted(set(index.values()))
    assert files == [f"model-0000{i}-of-000004.safetensors" for i in (1, 2, 3, 4)]
    dtypes = {}
    for f in files:
        with safe_open(tiny_fp8 / f, "pt") as h:
            for n in h.keys():
                dtypes[n] = h.get_slice(n).get_dtype()
                assert index[n] == f
    mtp = "model.layers.4"
    for suffix in ("embed_tokens.weight", "enorm.weight", "hnorm.weight", "eh_proj.weight",
                   "shared_head.norm.weight", "shared_head.head.weight", "mlp.experts.7.down_proj.weight",
                   "self_attn.kv_b_proj.weight_scale_inv"):
        assert f"{mtp}.{suffix}" in dtypes, suffix
    assert dtypes[f"{mtp}.eh_proj.weight"] == "BF16" and f"{mtp}.eh_proj.weight_scale_inv" not in dtypes
    assert dtypes["model.layers.1.mlp.experts.0.gate_proj.weight"] == "F8_E4M3"
    assert dtypes["model.layers.1.mlp.experts.0.gate_proj.weight_scale_inv"] == "F32"
    assert dtypes["model.layers.1.mlp.gate.weight"] == "BF16"
    assert dtypes["model.layers.1.mlp.gate.e_score_correction_bias"] == "F32"
    assert dtypes["model.embed_tokens.weight"] == "BF16" and dtypes["lm_head.weight"] == "BF16"
    # every weight sits in the same shard as its scale
    assert all(index[n[: -len("_scale_inv")]] == index[n] for n in index if n.endswith("_scale_inv"))
    # the MTP layer is in the last shard, as in the release
    assert index[f"{mtp}.shared_head.head.weight"] == files[-1]


def test_fp8_release_values_match_the_hf_weights(tiny_fp8, tiny_hf):
    """Same (seed, name) -> same weights in both formats, up to FP8 rounding."""
    from dsv3_rl.checkpoint.fp8_kernels import dequant_reference

    hf = load_file(tiny_hf / "model.safetensors")
    index = json.loads((tiny_fp8 / "model.safetensors.index.json").read_text())["weight_map"]
    fp8 = {}
    for f in set(index.values()):
        fp8.update(load_file(tiny_fp8 / f))
    w = dequant_reference(fp8["model.layers.2.self_attn.o_proj.weight"],
                          fp8["model.layers.2.self_attn.o_proj.weight_scale_inv"]).float()
    ref = hf["model.layers.2.self_attn.o_proj.weight"].float()
    assert (w - ref).abs().max() < 0.07 * ref.abs().max()
    assert torch.equal(fp8["model.embed_tokens.weight"], hf["model.embed_tokens.weight"])


def test_config_only_preset(tmp_path):
    out = write_mini_model("671b", tmp_path / "big")
    assert not list(out.glob("*.safetensors"))
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 61 and cfg["n_routed_experts"] == 256
    assert "quantization_config" not in cfg and cfg["num_nextn_predict_layers"] == 0
    rel = write_mini_model("deepseek-v3", tmp_path / "big-fp8", fmt="fp8-release")
    cfg = json.loads((rel / "config.json").read_text())
    assert cfg["quantization_config"]["quant_method"] == "fp8" and cfg["num_nextn_predict_layers"] == 1


def test_proxy_specs_have_real_dims():
    specs = {s.name: s.shape for s in tensor_specs(presets.PRESETS["proxy"])}
    assert specs["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"] == (576, 7168)
    assert specs["model.layers.0.self_attn.q_b_proj.weight"] == (128 * 192, 1536)
    assert specs["model.layers.0.mlp.down_proj.weight"] == (7168, 18432)
    assert specs["model.layers.3.mlp.experts.15.gate_proj.weight"] == (2048, 7168)
    assert "model.layers.4.input_layernorm.weight" not in specs


def test_cli(tmp_path, capsys):
    assert mini_model.main(["--list"]) == 0
    assert "tiny-vllm" in capsys.readouterr().out
    assert mini_model.main(["nope", str(tmp_path / "x")]) == 2
    assert "allowed: tiny" in capsys.readouterr().err
    assert mini_model.main(["tiny", str(tmp_path / "y"), "--set", "num_hidden_layers=2", "--shards", "2"]) == 0
    assert json.loads((tmp_path / "y" / "config.json").read_text())["num_hidden_layers"] == 2
    assert mini_model.main(["tiny", str(tmp_path / "y")]) == 2  # not empty, no --force
    assert "not empty" in capsys.readouterr().err
    assert mini_model.main(["--model", "tiny", "--out", str(tmp_path / "y"), "--force"]) == 0  # the flag spelling
    assert mini_model.main(["tiny", "--model", "proxy", "--out", str(tmp_path / "z")]) == 2  # twin: two presets
    assert "disagree" in capsys.readouterr().err


def test_failed_overwrite_keeps_the_old_model(tmp_path, tiny_hf):
    import shutil

    out = tmp_path / "keep"
    shutil.copytree(tiny_hf, out)
    before = _digest(out)
    with pytest.raises(ValueError, match="cannot split"):
        write_mini_model("tiny", out, shards=10_000, overwrite=True)
    assert _digest(out) == before
    assert [p.name for p in tmp_path.iterdir()] == ["keep"]  # no temporary directory left

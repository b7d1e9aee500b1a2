"""Config fix-ups (dsv3_rl.checkpoint.hf_config)."""

import json
from pathlib import Path

import pytest

from dsv3_rl.checkpoint import hf_config
from dsv3_rl.checkpoint.hf_config import ConfigError, fix_config

HUB_CONFIG = Path(__file__).resolve().parents[1] / "assets" / "deepseek_v3_config.json"


def hub() -> dict:
    return json.loads(HUB_CONFIG.read_text())


def verl_and_vllm_problems(cfg: dict) -> list[str]:
    """What verl 0.9.1's hf_to_mcore_config_dpskv3 asserts and what vLLM's DeepseekV2MoE reads,
    restated: the acceptance criteria the fix-ups exist for."""
    problems = []
    if cfg.get("num_nextn_predict_layers", 0) != 0:
        problems.append("verl: MTP is not supported for now (num_nextn_predict_layers != 0)")
    if cfg.get("quantization_config"):
        problems.append("verl: quantization is not supported for now (quantization_config)")
    if cfg.get("topk_method") != "noaux_tc":
        problems.append("vllm: no e_score_correction_bias parameter -> KeyError on load")
    if cfg.get("scoring_func", "softmax") != "sigmoid":
        problems.append("vllm: softmax routing")
    return problems


def test_hub_config_fixups():
    cfg = hub()
    assert len(verl_and_vllm_problems(cfg)) == 2  # the check bites on the raw release config
    fixed, changes = fix_config(cfg)
    assert verl_and_vllm_problems(fixed) == []
    assert {c.key for c in changes} == {"quantization_config", "num_nextn_predict_layers", "auto_map"}
    assert "quantization_config" not in fixed and fixed["num_nextn_predict_layers"] == 0
    assert fixed["topk_method"] == "noaux_tc" and fixed["rope_scaling"] == cfg["rope_scaling"]
    assert cfg == hub()  # input untouched
    text = "\n".join(str(c) for c in changes)
    assert 'num_nextn_predict_layers: 1 -> 0' in text and "quantization_config: {" in text and "(removed)" in text


def test_fixed_config_loads_with_yarn(tmp_path):
    from transformers import AutoConfig

    fixed, _ = fix_config(hub())
    (tmp_path / "config.json").write_text(json.dumps(fixed))
    cfg = AutoConfig.from_pretrained(tmp_path)
    assert cfg.rope_parameters["rope_type"] == "yarn" and cfg.rope_parameters["factor"] == 40
    assert cfg.num_nextn_predict_layers == 0 and getattr(cfg, "quantization_config", None) is None
    assert cfg.topk_method == "noaux_tc" and cfg.scoring_func == "sigmoid"


def test_transformers5_written_config_gets_topk_method(tmp_path):
    """transformers 5 writes no topk_method/scoring_func for a config built from its own kwargs."""
    from transformers import DeepseekV3Config

    DeepseekV3Config(num_hidden_layers=2).save_pretrained(tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert "topk_method" not in written and "scoring_func" not in written
    assert "vllm: no e_score_correction_bias parameter -> KeyError on load" in verl_and_vllm_problems(written)
    fixed, changes = fix_config(written, has_score_bias=True)
    assert verl_and_vllm_problems(fixed) == []
    assert {c.key for c in changes} == {"topk_method", "scoring_func"}
    assert "KeyError" in str(next(c for c in changes if c.key == "topk_method"))


def test_keep_mtp_and_auto_map():
    fixed, changes = fix_config(hub(), keep_mtp=True, keep_auto_map=True)
    assert fixed["num_nextn_predict_layers"] == 1 and "auto_map" in fixed
    assert [c.key for c in changes] == ["quantization_config"]


def test_already_fixed_config_has_no_changes():
    fixed, _ = fix_config(hub())
    again, changes = fix_config(fixed)
    assert changes == [] and again == fixed


@pytest.mark.parametrize("mutate, match", [
    (lambda c: c.update(model_type="qwen2", architectures=["Qwen2ForCausalLM"]),
     r"not a DeepSeek-V3-family config \(model_type 'qwen2'.*allowed model_type: deepseek_v3, kimi_k2"),
    (lambda c: c.update(model_type="deepseek_v2", architectures=["DeepseekV2ForCausalLM"]),
     "model_type 'deepseek_v2'"),
    (lambda c: c.pop("kv_lora_rank"), "lacks required keys: kv_lora_rank"),
    (lambda c: c.update(scoring_func="softmax"), "scoring_func 'softmax' is not supported.*allowed: 'sigmoid'"),
])
def test_refuses_non_deepseek_v3(mutate, match):
    cfg = hub()
    mutate(cfg)
    with pytest.raises(ConfigError, match=match):
        fix_config(cfg)


def test_kimi_k2_family_accepted():
    cfg = hub()
    cfg["model_type"] = "kimi_k2"
    fixed, _ = fix_config(cfg)
    assert fixed["model_type"] == "kimi_k2"


@pytest.fixture
def bf16_dir(tmp_path):
    from dsv3_rl.minimodel.mini_model import write_mini_model

    d = write_mini_model("tiny", tmp_path / "m", overrides={"num_hidden_layers": 2})
    cfg = hub()  # a release-style config over BF16 weights: what users get after DeepSeek's own cast
    for k in ("hidden_size", "num_hidden_layers", "vocab_size"):
        cfg[k] = json.loads((d / "config.json").read_text())[k]
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def test_cli_fixes_in_place_then_nothing_left(bf16_dir, capsys):
    assert hf_config.main([str(bf16_dir), "--check"]) == 1
    assert json.loads((bf16_dir / "config.json").read_text())["num_nextn_predict_layers"] == 1  # --check writes nothing
    assert hf_config.main([str(bf16_dir)]) == 0
    out = capsys.readouterr().out
    assert "config: num_nextn_predict_layers: 1 -> 0" in out and "changed 3 key(s)" in out
    assert verl_and_vllm_problems(json.loads((bf16_dir / "config.json").read_text())) == []
    assert hf_config.main([str(bf16_dir), "--check"]) == 0
    assert "already acceptable" in capsys.readouterr().out


def test_cli_output_elsewhere(bf16_dir, tmp_path):
    before = (bf16_dir / "config.json").read_text()
    assert hf_config.main([str(bf16_dir / "config.json"), "--out", str(tmp_path / "fixed.json")]) == 0
    assert (bf16_dir / "config.json").read_text() == before
    assert json.loads((tmp_path / "fixed.json").read_text())["num_nextn_predict_layers"] == 0


def test_cli_refuses_fp8_weights(tmp_path, capsys):
    from dsv3_rl.minimodel.mini_model import write_mini_model

    d = write_mini_model("tiny", tmp_path / "fp8", fmt="fp8-release", overrides={"num_hidden_layers": 2})
    before = (d / "config.json").read_text()
    assert hf_config.main([str(d)]) == 2
    err = capsys.readouterr().err
    assert "weights are still FP8" in err and "dsv3_rl.checkpoint.fp8 cast" in err
    assert (d / "config.json").read_text() == before


def test_cli_errors_name_the_file(tmp_path, capsys):
    assert hf_config.main([str(tmp_path)]) == 2
    assert f"{tmp_path / 'config.json'}: not found" in capsys.readouterr().err
    (tmp_path / "config.json").write_text("{not json")
    assert hf_config.main([str(tmp_path)]) == 2
    assert "not valid JSON" in capsys.readouterr().err
    cfg = hub()
    cfg["model_type"] = "llama"
    cfg["architectures"] = ["LlamaForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert hf_config.main([str(tmp_path)]) == 2
    assert "not a DeepSeek-V3-family config" in capsys.readouterr().err


def test_hub_asset_is_the_public_config():
    cfg = hub()
    # spot values that identify DeepSeek-V3's release config.json
    assert (cfg["num_hidden_layers"], cfg["n_routed_experts"], cfg["vocab_size"], cfg["transformers_version"]) == \
        (61, 256, 129280, "4.33.1")
    assert cfg["rope_scaling"] == {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                                   "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096, "type": "yarn"}

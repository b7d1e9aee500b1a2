"""HF DeepSeek-V3 config -> megatron-core ``MLATransformerConfig`` (``dsv3_rl.models.config_map``).

Every model field is set from the HF config (never from megatron's defaults, several of which are
wrong for other models: ``rotary_scaling_factor=40``, ``mscale_all_dim=0``); what megatron cannot
express is refused naming the key; and routing -- the part where trainer and rollout silently
diverge -- is checked numerically: megatron's router with the mapped settings picks the same experts
with the same weights as transformers' ``DeepseekV3MoE.route_tokens_to_experts`` on DeepSeek-V3's real
sizes, and a mapping without the group limit (verl 0.9.1's) does not.
"""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest
import torch

from dsv3_rl.models.config_map import (
    Parallel,
    RouterSettings,
    UnsupportedConfigError,
    hf_to_mcore_config,
    hf_to_mcore_kwargs,
    moe_layer_pattern,
)

# DeepSeek-V3's config.json as published on the hub (rope_scaling + rope_theta), less quantization_config
# (what the FP8 -> BF16 cast writes).
HUB_CONFIG = Path(__file__).resolve().parents[1] / "assets" / "deepseek_v3_config.json"
DSV3_671B_HUB = {k: v for k, v in json.loads(HUB_CONFIG.read_text()).items() if k != "quantization_config"}

H, ROPE = DSV3_671B_HUB, DSV3_671B_HUB["rope_scaling"]
DENSE = H["first_k_dense_replace"]
# The mapping, HF key -> megatron field, with the values of the hub config (the model facts live in the asset).
EXPECTED_671B = dict(
    num_layers=H["num_hidden_layers"], hidden_size=H["hidden_size"], ffn_hidden_size=H["intermediate_size"],
    num_attention_heads=H["num_attention_heads"], num_query_groups=H["num_key_value_heads"],
    normalization="RMSNorm", layernorm_epsilon=H["rms_norm_eps"], gated_linear_unit=True, add_bias_linear=False,
    add_qkv_bias=False, multi_latent_attention=True, q_lora_rank=H["q_lora_rank"], kv_lora_rank=H["kv_lora_rank"],
    qk_head_dim=H["qk_nope_head_dim"], qk_pos_emb_head_dim=H["qk_rope_head_dim"], v_head_dim=H["v_head_dim"],
    qk_layernorm=True,
    rope_type="yarn", rotary_base=float(H["rope_theta"]), rotary_scaling_factor=float(ROPE["factor"]),
    original_max_position_embeddings=ROPE["original_max_position_embeddings"], beta_fast=float(ROPE["beta_fast"]),
    beta_slow=float(ROPE["beta_slow"]), mscale=ROPE["mscale"], mscale_all_dim=ROPE["mscale_all_dim"], rotary_percent=1.0,
    num_moe_experts=H["n_routed_experts"], moe_router_topk=H["num_experts_per_tok"],
    moe_ffn_hidden_size=H["moe_intermediate_size"],
    moe_shared_expert_intermediate_size=H["n_shared_experts"] * H["moe_intermediate_size"],
    moe_layer_freq=[0] * DENSE + [1] * (H["num_hidden_layers"] - DENSE), moe_router_score_function=H["scoring_func"],
    moe_router_enable_expert_bias=True, moe_router_topk_scaling_factor=H["routed_scaling_factor"],
    moe_router_num_groups=H["n_group"], moe_router_group_topk=H["topk_group"], moe_router_pre_softmax=False,
    moe_router_bias_update_rate=0.0, moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
    moe_router_dtype="fp32",
)


def test_671b_every_model_field(tmp_path):
    kw = hf_to_mcore_kwargs(DSV3_671B_HUB)
    got = {k: kw[k] for k in EXPECTED_671B}
    assert got == EXPECTED_671B, {k: (got[k], v) for k, v in EXPECTED_671B.items() if got[k] != v}
    assert "mtp_num_layers" not in kw  # dropped unless asked
    # twin: the comparison sees a fact that changes (q_lora_rank and kv_lora_rank swapped in the config)
    swapped = hf_to_mcore_kwargs(dict(DSV3_671B_HUB, q_lora_rank=H["kv_lora_rank"], kv_lora_rank=H["q_lora_rank"]))
    assert {k for k in EXPECTED_671B if swapped[k] != EXPECTED_671B[k]} == {"q_lora_rank", "kv_lora_rank"}
    assert hf_to_mcore_kwargs(DSV3_671B_HUB, keep_mtp=True)["mtp_num_layers"] == 1


def test_hub_json_and_transformers5_config_map_the_same(tmp_path):
    """transformers 5 turns rope_scaling + rope_theta into rope_parameters; both forms give one mapping."""
    from transformers import AutoConfig

    (tmp_path / "config.json").write_text(json.dumps(DSV3_671B_HUB))
    cfg = AutoConfig.from_pretrained(tmp_path)
    assert not hasattr(cfg, "rope_theta") or cfg.rope_parameters  # the transformers-5 form
    a, b = hf_to_mcore_kwargs(DSV3_671B_HUB), hf_to_mcore_kwargs(cfg)
    assert {k: v for k, v in a.items() if k != "activation_func"} == {k: v for k, v in b.items() if k != "activation_func"}


def test_megatron_defaults_are_not_relied_on():
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    from dsv3_rl.models.presets import hf_config

    cfg = hf_to_mcore_config(hf_config("tiny"), dtype=torch.float32)
    defaults = MLATransformerConfig.__dataclass_fields__
    assert defaults["rotary_scaling_factor"].default == 40 and cfg.rotary_scaling_factor == 4.0
    assert defaults["mscale_all_dim"].default == 0.0 and cfg.mscale_all_dim == 1.0
    assert defaults["original_max_position_embeddings"].default == 4096 and cfg.original_max_position_embeddings == 64
    assert defaults["q_lora_rank"].default == 512 and cfg.q_lora_rank == 32
    # batched p2p crosses forward/backward messages at PP=2 + VPP (test_correctness_layouts pins it)
    assert defaults["batch_p2p_comm"].default is True and cfg.batch_p2p_comm is False
    plain = dict(DSV3_671B_HUB, rope_scaling=None)
    kw = hf_to_mcore_kwargs(plain)
    assert (kw["rope_type"], kw["rotary_scaling_factor"], kw["mscale"], kw["mscale_all_dim"]) == ("rope", 1.0, 1.0, 0.0)


def test_layouts_build_megatron_configs():
    """The mapping constructs a valid MLATransformerConfig for a 671B training layout (no process group needed)."""
    c = hf_to_mcore_config(DSV3_671B_HUB, Parallel(tp=8, pp=16, ep=64, etp=1, vpp=None))
    assert (c.tensor_model_parallel_size, c.expert_model_parallel_size, c.sequence_parallel) == (8, 64, True)
    assert c.moe_router_num_groups == 8 and c.moe_router_group_topk == 4


def test_moe_layer_pattern():
    assert moe_layer_pattern(DSV3_671B_HUB) == [0, 0, 0] + [1] * 58
    assert moe_layer_pattern(dict(DSV3_671B_HUB, moe_layer_freq=2, num_hidden_layers=6, first_k_dense_replace=1)) == [0, 0, 1, 0, 1, 0]
    assert moe_layer_pattern(dict(DSV3_671B_HUB, n_routed_experts=None, num_hidden_layers=2)) == [0, 0]


@pytest.mark.parametrize("change,key", [
    ({"rope_interleave": False}, "rope_interleave=False"),
    ({"norm_topk_prob": False}, "norm_topk_prob=False"),
    ({"topk_group": 2}, "topk_group=2"),  # 8 // 2 = 4 per group: megatron's group score != HF's top-2
    ({"n_group": 7}, "n_group=7"),
    ({"scoring_func": "softmax"}, "scoring_func='softmax'"),
    ({"topk_method": "greedy"}, "topk_method='greedy'"),
    ({"quantization_config": {"quant_method": "fp8"}}, "quantization_config"),
    ({"tie_word_embeddings": True}, "tie_word_embeddings=True"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"model_type": "deepseek_v2"}, "model_type='deepseek_v2'"),
    ({"rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "mscale_all_dim": 1.0}},
     "mscale_all_dim"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "'linear'"),
])
def test_refuses_what_megatron_cannot_express(change, key):
    with pytest.raises(UnsupportedConfigError) as e:
        hf_to_mcore_kwargs(dict(DSV3_671B_HUB, **change))
    assert key in str(e.value)


def test_overrides_and_router_settings_are_checked():
    with pytest.raises(UnsupportedConfigError, match="not_a_field"):
        hf_to_mcore_kwargs(DSV3_671B_HUB, not_a_field=1)
    with pytest.raises(UnsupportedConfigError, match="aux_loss_coeff"):
        RouterSettings(aux_loss_coeff=1e-3)
    kw = hf_to_mcore_kwargs(DSV3_671B_HUB, router=RouterSettings(bias_update_rate=1e-3, load_balancing_type="seq_aux_loss",
                                                               aux_loss_coeff=1e-4))
    assert (kw["moe_router_bias_update_rate"], kw["moe_router_load_balancing_type"], kw["moe_aux_loss_coeff"]) == (
        1e-3, "seq_aux_loss", 1e-4)


# --------------------------------------------------------------------------- routing, numerically

def _hf_route(cfg: dict, logits: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    me = types.SimpleNamespace(gate=types.SimpleNamespace(e_score_correction_bias=bias), n_group=cfg["n_group"],
                               n_routed_experts=cfg["n_routed_experts"], topk_group=cfg["topk_group"],
                               top_k=cfg["num_experts_per_tok"], norm_topk_prob=cfg["norm_topk_prob"],
                               routed_scaling_factor=cfg["routed_scaling_factor"])
    idx, w = DeepseekV3MoE.route_tokens_to_experts(me, logits.clone())
    return torch.zeros_like(logits).scatter(1, idx, w)


def _megatron_route(kw: dict, logits: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

    probs, _ = topk_routing_with_score_function(
        logits.clone(), kw["moe_router_topk"], use_pre_softmax=kw["moe_router_pre_softmax"],
        num_groups=kw["moe_router_num_groups"], group_topk=kw["moe_router_group_topk"],
        scaling_factor=kw["moe_router_topk_scaling_factor"], score_function=kw["moe_router_score_function"],
        expert_bias=bias)
    return probs


@pytest.fixture(scope="module")
def router_inputs():
    g = torch.Generator().manual_seed(0)
    return torch.randn(4096, 256, generator=g, dtype=torch.float32), 0.3 * torch.randn(256, generator=g)


def test_routing_equals_transformers_on_671b_sizes(router_inputs):
    logits, bias = router_inputs
    ref = _hf_route(DSV3_671B_HUB, logits, bias)
    got = _megatron_route(hf_to_mcore_kwargs(DSV3_671B_HUB), logits, bias)
    assert torch.equal(ref != 0, got != 0)  # same experts, every token
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-7)


def test_routing_without_group_limit_differs(router_inputs):
    """Planted fault: verl 0.9.1's mapping (no moe_router_num_groups/group_topk) routes other experts."""
    logits, bias = router_inputs
    ref = _hf_route(DSV3_671B_HUB, logits, bias)
    kw = dict(hf_to_mcore_kwargs(DSV3_671B_HUB), moe_router_num_groups=None, moe_router_group_topk=None)
    got = _megatron_route(kw, logits, bias)
    frac = ((ref != 0) != (got != 0)).any(dim=1).float().mean().item()
    assert frac > 0.05, f"only {frac:.1%} of tokens route differently"

"""DeepSeek-V3 model facts, as data: HF ``DeepseekV3Config`` kwargs per preset.

Presets (``list_presets()``):

=============  ==========================================================================
tiny           a few MB; runs everywhere (unit tests). vocab = the offline tokenizer's.
tiny-vllm      tiny, but MLA dims vLLM's CPU backend accepts (kv_lora_rank 512, rope 64);
               the CPU GRPO demo serves it with vLLM and trains it with Megatron TP2/EP2.
proxy          DeepSeek-V3's real layer dims with 4 layers (1 dense + 3 MoE), 16 experts.
proxy_4xH100   DeepSeek-V3's real layer dims, 4 layers (1 dense + 3 MoE), 64 experts top-8 in 8 groups
               (top-4 groups): 11.6B params, sized by the planner to fill 4 x H100 80GB for the GRPO
               update bench (docs/planner.md, "Measured against the planner").
proxy_1xH100   the proxy with 3 layers (1 dense + 2 MoE), 16 experts: 4.3B params, sized to fit one GPU's trainer
               with the CPU optimizer in a 128 GiB host (the 4-layer proxy's 106 GiB did not: docs/planner.md,
               "Host memory").
deepseek-v3    the official DeepSeek-V3 config (671B; config only). Alias: 671b.
=============  ==========================================================================

Rope is given in transformers-5 form (``rope_parameters``). Keys DeepSeek's hub config has but
``DeepseekV3Config`` does not declare (``topk_method``, ``scoring_func``, ``num_nextn_predict_layers``,
...) are kept as extra attributes and written to config.json; vLLM needs ``topk_method: noaux_tc``
to create ``e_score_correction_bias`` and ``scoring_func: sigmoid`` (its default is softmax).
"""

from __future__ import annotations

import copy
from typing import Any

from .tokenizer import VOCAB_SIZE as TINY_VOCAB_SIZE

# Keys every preset carries that DeepseekV3Config does not declare (DeepSeek's hub config has them).
_DEEPSEEK_EXTRAS: dict[str, Any] = {
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
    "aux_loss_alpha": 0.001,
    "seq_aux": True,
    "moe_layer_freq": 1,
    "ep_size": 1,
    "num_nextn_predict_layers": 0,
}


def _yarn(factor: float, original: int) -> dict[str, Any]:
    return {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": float(factor),
        "original_max_position_embeddings": original,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    }


_TINY: dict[str, Any] = {
    "vocab_size": TINY_VOCAB_SIZE,
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 4,
    "first_k_dense_replace": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 32,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "num_experts_per_tok": 4,
    "n_group": 4,
    "topk_group": 2,  # num_experts_per_tok / topk_group must be 2 (megatron's group score = HF's top-2)
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
    "hidden_act": "silu",
    "rope_parameters": _yarn(4, 64),
    "rope_interleave": True,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "initializer_range": 0.02,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
    **_DEEPSEEK_EXTRAS,
}

_TINY_VLLM: dict[str, Any] = {
    **_TINY,
    "hidden_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 64,
    "kv_lora_rank": 512,  # vLLM's CPU MLA backend: kv_lora_rank 512 with qk_rope_head_dim 64 only
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 64,
    "v_head_dim": 32,
    "max_position_embeddings": 1024,
    "rope_parameters": _yarn(4, 256),
}

# The official DeepSeek-V3 / V3-0324 / R1 config.json values (tests/assets/deepseek_v3_config.json).
_DEEPSEEK_V3: dict[str, Any] = {
    "vocab_size": 129280,
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "first_k_dense_replace": 3,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "n_group": 8,
    "topk_group": 4,
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
    "hidden_act": "silu",
    "rope_parameters": _yarn(40, 4096),
    "rope_interleave": True,
    "max_position_embeddings": 163840,
    "rms_norm_eps": 1e-6,
    "initializer_range": 0.02,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
    **_DEEPSEEK_EXTRAS,
    "num_nextn_predict_layers": 1,
    "quantization_config": {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [128, 128],
    },
}

_PROXY: dict[str, Any] = {
    **{k: v for k, v in _DEEPSEEK_V3.items() if k != "quantization_config"},
    "num_hidden_layers": 4,
    "first_k_dense_replace": 1,
    "n_routed_experts": 16,
    "num_experts_per_tok": 8,
    "n_group": 8,
    "topk_group": 4,
    "num_nextn_predict_layers": 0,
}

# The model the planner chose for the 4 x H100 GRPO-update bench (issue 25): the proxy with 64 experts, 16 per
# GPU at EP4 (DeepSeek-V3's 256 at EP16), group-limited routing kept at DeepSeek-V3's ratio
# (8 groups of 8 experts, top-4 groups, top-8 experts: num_experts_per_tok / topk_group = 2, what megatron's
# group score computes). 11.6B params (8.5B routed experts), 3.26B activated per token.
_PROXY_4XH100: dict[str, Any] = {
    **_PROXY,
    "n_routed_experts": 64,
}

# The one-GPU whole-step model (preset proxy_1xH100): the proxy less one MoE layer. With param and CPU-optimizer offload
# the trainer keeps ~20 B a parameter in host memory (dsv3_rl.planner.memory.trainer_host_memory); the 4-layer proxy's
# 5.24B came to 101.45 GiB measured and was killed by Ray's memory monitor on a 128 GiB H100 box (2026-12-07).
_PROXY_1XH100: dict[str, Any] = {
    **_PROXY,
    "num_hidden_layers": 3,
}

PRESETS: dict[str, dict[str, Any]] = {
    "tiny": _TINY,
    "tiny-vllm": _TINY_VLLM,
    "proxy": _PROXY,
    "proxy_4xH100": _PROXY_4XH100,
    "proxy_1xH100": _PROXY_1XH100,
    "deepseek-v3": _DEEPSEEK_V3,
}
ALIASES = {"671b": "deepseek-v3"}
# Presets too large to write weights for: mini_model writes their config only.
CONFIG_ONLY = {"deepseek-v3"}


def list_presets() -> list[str]:
    """Preset names (aliases not included)."""
    return list(PRESETS)


def resolve(preset: str) -> str:
    """Canonical preset name; raises KeyError naming the allowed values."""
    name = ALIASES.get(preset, preset)
    if name not in PRESETS:
        allowed = ", ".join(list(PRESETS) + list(ALIASES))
        raise KeyError(f"unknown preset {preset!r} (allowed: {allowed})")
    return name


def preset_kwargs(preset: str, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """A deep copy of the preset's config kwargs, with OVERRIDES applied (keys must already exist); an override
    that makes the config unusable (``hidden_size=-4``) is a ConfigError naming the key (``validate_config``)."""
    from dsv3_rl.models.hf_config_rules import validate_config

    kwargs = copy.deepcopy(PRESETS[resolve(preset)])
    for key, value in (overrides or {}).items():
        if key not in kwargs:
            raise KeyError(f"override {key!r} is not a key of preset {preset!r} (keys: {', '.join(sorted(kwargs))})")
        kwargs[key] = value
    if overrides:
        validate_config(kwargs, f"model preset {preset!r} with overrides {overrides}", require=False)
    return kwargs


def hf_config(preset: str, overrides: dict[str, Any] | None = None):
    """``transformers.DeepseekV3Config`` for PRESET (extra DeepSeek keys kept as attributes)."""
    from transformers import DeepseekV3Config

    return DeepseekV3Config(**preset_kwargs(preset, overrides))

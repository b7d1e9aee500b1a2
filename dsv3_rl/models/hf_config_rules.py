"""DeepSeek-V3's HF ``config.json`` as a model fact: which configs are of the family, which keys every tool reads, and
the sizes, ranges and rope settings the architecture allows (:func:`validate_config`, :func:`check_family`).

Model presets (:mod:`dsv3_rl.models.presets`) check their overrides with it; the checkpoint tools
(:mod:`dsv3_rl.checkpoint.hf_config`: fix-ups, ``dsv3-fix-config``) and the converter check the configs they read.
"""

from __future__ import annotations

import math
from typing import Any

from dsv3_rl.errors import Dsv3Error

FAMILY_MODEL_TYPES = ("deepseek_v3", "kimi_k2")
FAMILY_ARCHITECTURES = ("DeepseekV3ForCausalLM",)
# Keys Megatron's MLA/MoE config (verl's hf_to_mcore_config_dpskv3) and vLLM read without a default.
REQUIRED_KEYS = (
    "hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "intermediate_size",
    "moe_intermediate_size", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
    "n_routed_experts", "n_shared_experts", "num_experts_per_tok", "first_k_dense_replace",
    "routed_scaling_factor", "n_group", "topk_group", "rms_norm_eps",
)


class ConfigError(Dsv3Error, ValueError):
    """The config cannot be made acceptable; the message names the key and the allowed values."""


# Sizes that must be integers >= 1 (and >= 0) when present; REQUIRED_KEYS says which must be present.
POSITIVE_INTS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "intermediate_size",
                 "moe_intermediate_size", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                 "n_group", "topk_group", "num_key_value_heads", "max_position_embeddings", "moe_layer_freq")
NON_NEGATIVE_INTS = ("n_routed_experts", "n_shared_experts", "num_experts_per_tok", "first_k_dense_replace",
                     "num_nextn_predict_layers")
POSITIVE_FLOATS = ("routed_scaling_factor", "rms_norm_eps", "rope_theta")
# transformers' rope initialisers (modeling_rope_utils.ROPE_INIT_FUNCTIONS); "type" is the hub spelling.
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")
CONFIG_DTYPES = ("bfloat16", "float16", "float32")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def validate_config(cfg: dict, where: str = "config.json", *, require: bool = True) -> None:
    """Raise ConfigError unless the sizes of CFG are usable: positive integers, the divisibility and ranges
    the architecture needs, a known rope type with positive parameters, and a floating dtype.
    REQUIRE: the keys every tool reads (REQUIRED_KEYS) must be present; False checks only those present
    (the planner reads fewer)."""
    missing = [k for k in REQUIRED_KEYS if k not in cfg]
    if missing and require:
        raise ConfigError(f"{where}: DeepSeek-V3 config lacks required keys: {', '.join(missing)}")
    for k in POSITIVE_INTS + NON_NEGATIVE_INTS:
        if k not in cfg or (cfg[k] is None and k not in REQUIRED_KEYS):
            continue
        v, low = cfg[k], 1 if k in POSITIVE_INTS else 0
        if not _is_int(v) or v < low:
            raise ConfigError(f"{where}: {k} = {v!r}; expected an integer >= {low}")
    for k in POSITIVE_FLOATS:
        if k not in cfg or (cfg[k] is None and k not in REQUIRED_KEYS):
            continue
        v = cfg[k]
        if not _is_num(v) or v <= 0:
            raise ConfigError(f"{where}: {k} = {v!r}; expected a number > 0")
    q = cfg.get("q_lora_rank")
    if q is not None and (not _is_int(q) or q < 1):
        raise ConfigError(f"{where}: q_lora_rank = {q!r}; expected an integer >= 1 or null (no q compression)")
    if cfg.get("qk_rope_head_dim", 0) % 2:
        raise ConfigError(f"{where}: qk_rope_head_dim = {cfg['qk_rope_head_dim']}; rope needs an even number")
    e, k, g, tg = (cfg.get(x) for x in ("n_routed_experts", "num_experts_per_tok", "n_group", "topk_group"))
    if e and g:
        if e % g:
            raise ConfigError(f"{where}: n_routed_experts = {e} is not divisible by n_group = {g}")
        if tg is not None and tg > g:
            raise ConfigError(f"{where}: topk_group = {tg} exceeds n_group = {g}")
        if k is not None and tg is not None and not 1 <= k <= tg * (e // g):
            raise ConfigError(f"{where}: num_experts_per_tok = {k}; expected 1..{tg * (e // g)} "
                              f"(topk_group * n_routed_experts / n_group)")
    kvh, nh = cfg.get("num_key_value_heads"), cfg.get("num_attention_heads")
    if kvh is not None and nh is not None and nh % kvh:
        raise ConfigError(f"{where}: num_attention_heads = {nh} is not divisible by num_key_value_heads = {kvh}")
    for key in ("rope_parameters", "rope_scaling"):
        rp = cfg.get(key)
        if rp is None:
            continue
        if not isinstance(rp, dict):
            raise ConfigError(f"{where}: {key} = {rp!r}; expected an object")
        rtype = rp.get("rope_type", rp.get("type", "default"))
        if rtype not in ROPE_TYPES:
            raise ConfigError(f"{where}: {key}.rope_type = {rtype!r}; allowed: {', '.join(ROPE_TYPES)}")
        for pk in ("factor", "rope_theta", "original_max_position_embeddings", "beta_fast", "beta_slow"):
            if pk in rp and rp[pk] is not None and (not _is_num(rp[pk]) or rp[pk] <= 0):
                raise ConfigError(f"{where}: {key}.{pk} = {rp[pk]!r}; expected a number > 0")
        for pk in ("mscale", "mscale_all_dim"):
            if pk in rp and rp[pk] is not None and (not _is_num(rp[pk]) or rp[pk] < 0):
                raise ConfigError(f"{where}: {key}.{pk} = {rp[pk]!r}; expected a number >= 0")
    for key in ("torch_dtype", "dtype"):
        dt = cfg.get(key)
        if dt is not None and dt not in CONFIG_DTYPES:
            raise ConfigError(f"{where}: {key} = {dt!r}; allowed: {', '.join(CONFIG_DTYPES)}")


def check_family(cfg: dict, where: str = "config.json") -> None:
    """Raise ConfigError unless CFG is a valid DeepSeek-V3-family config (see validate_config)."""
    mt = cfg.get("model_type")
    archs = cfg.get("architectures") or []
    if mt not in FAMILY_MODEL_TYPES and not any(a in FAMILY_ARCHITECTURES for a in archs):
        raise ConfigError(
            f"{where}: not a DeepSeek-V3-family config (model_type {mt!r}, architectures {archs}); "
            f"allowed model_type: {', '.join(FAMILY_MODEL_TYPES)} or architectures {', '.join(FAMILY_ARCHITECTURES)}"
        )
    validate_config(cfg, where)
    scoring = cfg.get("scoring_func", "sigmoid")
    if scoring != "sigmoid":
        raise ConfigError(f"{where}: scoring_func {scoring!r} is not supported (allowed: 'sigmoid'; "
                          f"Megatron's DeepSeek-V3 converter hard-codes sigmoid routing)")

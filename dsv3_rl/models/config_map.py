"""HF DeepSeek-V3 config -> megatron-core 0.16.1 ``MLATransformerConfig``: the single source of truth.

Every field is mapped explicitly (megatron's defaults such as ``rotary_scaling_factor=40`` and
``mscale_all_dim=0`` are never relied on). What megatron-core cannot express is refused with
:class:`UnsupportedConfigError`, naming the HF key, its value and what would be needed:

* ``rope_interleave=False``: megatron's MLA always applies rope to interleaved (DeepSeek-layout)
  rope dims, which is HF's ``rope_interleave=True``.
* ``norm_topk_prob=False`` with the sigmoid router: megatron always renormalises top-k sigmoid scores.
* group-limited routing whose group score differs from HF's: HF scores a group by the sum of its
  top-2 experts, megatron by the sum of its top ``topk // group_topk`` (equal for DeepSeek-V3:
  8 // 4 = 2), so ``num_experts_per_tok / topk_group`` must be 2.
* yarn with ``mscale_all_dim`` set but ``mscale`` unset, or an explicit ``attention_factor`` that
  differs from the derived one (megatron ties both to ``mscale``/``mscale_all_dim``).

RL router settings are explicit choices (:class:`RouterSettings`), with GRPO-safe defaults:
expert-bias update rate 0 (the bias is part of the policy the rollout engine also uses; updating it
during RL makes trainer and rollout route differently, which Pai-Megatron-Patch and slime avoid
too), no auxiliary load-balancing loss, router math in fp32 (as HF computes it).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
import torch.nn.functional as F
from dsv3_rl.errors import Dsv3Error
from dsv3_rl.layout import Layout

SUPPORTED_MODEL_TYPES = ("deepseek_v3",)
# megatron-core's own jit-fused (torch.compile) kernels, TE-free: what a GPU run of the local spec turns on over
# hf_to_mcore_kwargs' CPU-safe defaults (bench/bench_train_step.py, bench/bench_grpo_update.py)
GPU_FUSIONS = dict(bias_activation_fusion=True, bias_dropout_fusion=True, cross_entropy_loss_fusion=True,
                   cross_entropy_fusion_impl="native")


class UnsupportedConfigError(Dsv3Error, ValueError):
    """The HF config asks for something megatron-core 0.16.1 cannot express."""


@dataclasses.dataclass(frozen=True)
class RouterSettings:
    """Router behaviour during training. Defaults are the GRPO-safe ones."""

    bias_update_rate: float = 0.0
    """``moe_router_bias_update_rate``; 0 freezes ``e_score_correction_bias`` (RL default)."""
    load_balancing_type: str = "none"
    """``moe_router_load_balancing_type``: none | seq_aux_loss | aux_loss | global_aux_loss."""
    aux_loss_coeff: float = 0.0
    router_dtype: str = "fp32"
    """``moe_router_dtype``; HF computes the DeepSeek-V3 router in fp32."""

    def __post_init__(self):
        allowed = ("none", "seq_aux_loss", "aux_loss", "global_aux_loss")
        if self.load_balancing_type not in allowed:
            raise UnsupportedConfigError(f"router load_balancing_type={self.load_balancing_type!r}; allowed: {allowed}")
        if self.load_balancing_type == "none" and self.aux_loss_coeff:
            raise UnsupportedConfigError("router aux_loss_coeff is set but load_balancing_type is 'none'")
        if self.router_dtype not in ("fp32", "fp64"):
            raise UnsupportedConfigError(f"router router_dtype={self.router_dtype!r}; allowed: fp32, fp64")


#: the converter's name for :class:`dsv3_rl.layout.Layout` (one layout type for the whole package)
Parallel = Layout


def _get(cfg: Any, key: str, default: Any = None) -> Any:
    if isinstance(cfg, dict):
        return cfg.get(key, default)
    return getattr(cfg, key, default)


def rope_params(hf_config: Any) -> dict:
    """Normalised rope parameters from a transformers-5 config (``rope_parameters``) or a hub
    config.json (``rope_scaling`` + ``rope_theta``)."""
    rp = _get(hf_config, "rope_parameters")
    if not rp:
        rp = dict(_get(hf_config, "rope_scaling") or {})
        if "type" in rp and "rope_type" not in rp:
            rp["rope_type"] = rp.pop("type")
        rp.setdefault("rope_theta", _get(hf_config, "rope_theta", 10000.0))
    rp = dict(rp)
    rp.setdefault("rope_type", "default")
    if "rope_theta" not in rp:
        rp["rope_theta"] = _get(hf_config, "rope_theta", 10000.0)
    return rp


def _get_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _rope_kwargs(hf_config: Any) -> dict:
    rp = rope_params(hf_config)
    rtype = rp["rope_type"]
    if rtype == "default":
        return dict(rope_type="rope", rotary_base=float(rp["rope_theta"]), rotary_scaling_factor=1.0,
                    mscale=1.0, mscale_all_dim=0.0, rotary_percent=1.0)
    if rtype != "yarn":
        raise UnsupportedConfigError(
            f"rope type {rtype!r} (rope_parameters.rope_type / rope_scaling.type): megatron-core MLA supports 'yarn' and plain rope ('default')")
    if rp.get("partial_rotary_factor", 1.0) != 1.0:
        raise UnsupportedConfigError(f"rope_parameters.partial_rotary_factor={rp['partial_rotary_factor']}: MLA ropes the whole qk_rope_head_dim")
    orig = rp.get("original_max_position_embeddings")
    if orig is None:
        raise UnsupportedConfigError("yarn rope needs rope_parameters.original_max_position_embeddings")
    factor = rp.get("factor")
    if factor is None:  # transformers derives it this way for DeepSeek-V3
        factor = _get(hf_config, "max_position_embeddings") / orig
    mscale, mscale_all_dim = rp.get("mscale"), rp.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        m, mad = float(mscale), float(mscale_all_dim)
    elif not mscale_all_dim:
        # HF: attention factor get_mscale(factor) and no softmax rescale == megatron mscale=1, all_dim=0
        m, mad = 1.0, 0.0
    else:
        raise UnsupportedConfigError(
            f"rope_parameters.mscale_all_dim={mscale_all_dim} with mscale={mscale!r}: transformers then uses "
            f"get_mscale(factor) for the rope attention factor but mscale_all_dim for the softmax scale; "
            f"megatron-core derives both from (mscale, mscale_all_dim). Set mscale explicitly.")
    if rp.get("attention_factor") is not None:
        derived = _get_mscale(factor, m) / _get_mscale(factor, mad)
        if not math.isclose(float(rp["attention_factor"]), derived, rel_tol=1e-9):
            raise UnsupportedConfigError(
                f"rope_parameters.attention_factor={rp['attention_factor']} differs from the value megatron-core "
                f"derives from factor/mscale/mscale_all_dim ({derived}); megatron cannot take it explicitly")
    if rp.get("truncate", True) is not True:
        raise UnsupportedConfigError("rope_parameters.truncate=False: megatron-core always rounds the yarn correction range")
    return dict(
        rope_type="yarn",
        rotary_base=float(rp["rope_theta"]),
        rotary_scaling_factor=float(factor),
        original_max_position_embeddings=int(orig),
        beta_fast=float(rp.get("beta_fast") or 32),
        beta_slow=float(rp.get("beta_slow") or 1),
        mscale=m,
        mscale_all_dim=mad,
        rotary_percent=1.0,
    )


def moe_layer_pattern(hf_config: Any) -> list[int]:
    """megatron ``moe_layer_freq`` list: 0 dense, 1 MoE (HF first_k_dense_replace + moe_layer_freq)."""
    n = _get(hf_config, "num_hidden_layers")
    k = _get(hf_config, "first_k_dense_replace", 0) or 0
    freq = _get(hf_config, "moe_layer_freq", 1) or 1
    if not _get(hf_config, "n_routed_experts"):
        return [0] * n
    return [1 if (i >= k and i % freq == 0) else 0 for i in range(n)]


def validate(hf_config: Any) -> None:
    """Refuse configs megatron-core cannot express exactly. Raises UnsupportedConfigError naming the key."""
    mt = _get(hf_config, "model_type")
    if mt not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedConfigError(f"model_type={mt!r}: this mapping is for {SUPPORTED_MODEL_TYPES}")
    if _get(hf_config, "rope_interleave", True) is not True:
        raise UnsupportedConfigError(
            "rope_interleave=False: megatron-core MLA always de-interleaves the rope dims (DeepSeek layout, "
            "HF rope_interleave=True); such a checkpoint would need its rope rows permuted first")
    if _get(hf_config, "hidden_act", "silu") != "silu":
        raise UnsupportedConfigError(f"hidden_act={_get(hf_config, 'hidden_act')!r}: only silu (SwiGLU) is mapped")
    if _get(hf_config, "attention_bias", False):
        raise UnsupportedConfigError("attention_bias=True: DeepSeek-V3 MLA has no projection biases and none are mapped")
    if _get(hf_config, "tie_word_embeddings", False):
        raise UnsupportedConfigError("tie_word_embeddings=True: DeepSeek-V3 unties embeddings and lm_head")
    if _get(hf_config, "quantization_config"):
        raise UnsupportedConfigError(
            "quantization_config is set: cast the FP8 checkpoint to BF16 first (`python -m dsv3_rl.checkpoint.fp8`)")
    experts = _get(hf_config, "n_routed_experts")
    if experts:
        scoring = _get(hf_config, "scoring_func", "sigmoid")
        if scoring != "sigmoid":
            raise UnsupportedConfigError(f"scoring_func={scoring!r}: the DeepSeek-V3 mapping uses the sigmoid router")
        method = _get(hf_config, "topk_method", "noaux_tc")
        if method not in (None, "noaux_tc"):
            raise UnsupportedConfigError(f"topk_method={method!r}: only 'noaux_tc' (sigmoid + e_score_correction_bias) is mapped")
        topk = _get(hf_config, "num_experts_per_tok")
        if not _get(hf_config, "norm_topk_prob", True) and topk > 1:
            raise UnsupportedConfigError(
                "norm_topk_prob=False with the sigmoid router: megatron-core always renormalises the top-k sigmoid "
                "scores (moe_router_score_function='sigmoid'), so the routed outputs would differ")
        n_group = _get(hf_config, "n_group", 1) or 1
        topk_group = _get(hf_config, "topk_group", 1) or 1
        if n_group > 1:
            if experts % n_group:
                raise UnsupportedConfigError(f"n_routed_experts={experts} is not divisible by n_group={n_group}")
            if topk_group > n_group:
                raise UnsupportedConfigError(f"topk_group={topk_group} > n_group={n_group}")
            if topk % topk_group or topk // topk_group != 2:
                raise UnsupportedConfigError(
                    f"group-limited routing with num_experts_per_tok={topk}, topk_group={topk_group}: transformers scores "
                    f"each group by the sum of its top-2 experts, megatron-core by the sum of its top "
                    f"num_experts_per_tok // topk_group = {topk // topk_group}; they agree only when that is 2 "
                    f"(as for DeepSeek-V3: 8 // 4)")
            if experts // n_group < 2:
                raise UnsupportedConfigError(f"n_routed_experts/n_group={experts // n_group} < 2: a group needs 2 experts for top-2 group scoring")
    _rope_kwargs(hf_config)


def hf_to_mcore_kwargs(
    hf_config: Any,
    parallel: Parallel = Parallel(),
    router: RouterSettings = RouterSettings(),
    dtype: torch.dtype = torch.bfloat16,
    keep_mtp: bool = False,
    **overrides: Any,
) -> dict:
    """Keyword arguments for ``MLATransformerConfig`` (and nothing else). ``overrides`` win, but an
    override that is not an ``MLATransformerConfig`` field is an error."""
    validate(hf_config)
    g = lambda k, d=None: _get(hf_config, k, d)  # noqa: E731
    n_heads = g("num_attention_heads")
    experts = g("n_routed_experts")
    sp = parallel.sp_
    kw: dict[str, Any] = dict(
        # trunk
        num_layers=g("num_hidden_layers"),
        hidden_size=g("hidden_size"),
        ffn_hidden_size=g("intermediate_size"),
        num_attention_heads=n_heads,
        num_query_groups=n_heads,
        normalization="RMSNorm",
        layernorm_epsilon=float(g("rms_norm_eps")),
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        attention_dropout=float(g("attention_dropout", 0.0) or 0.0),
        hidden_dropout=0.0,
        init_method_std=float(g("initializer_range", 0.02)),
        # MLA
        multi_latent_attention=True,
        q_lora_rank=g("q_lora_rank"),
        kv_lora_rank=g("kv_lora_rank"),
        qk_head_dim=g("qk_nope_head_dim"),
        qk_pos_emb_head_dim=g("qk_rope_head_dim"),
        v_head_dim=g("v_head_dim"),
        qk_layernorm=True,  # the q_a / kv_a latent RMSNorms
        # dtype
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        # parallelism
        **parallel.mcore_sizes(),
        sequence_parallel=sp,
        # megatron-core's default batched p2p sends and receives both directions in one
        # batch_isend_irecv; at PP=2 with VPP both peers are the same rank, forward and backward
        # messages cross, and stage 1 computes on the wrong tensors (correctness layout
        # pp2_vpp2_batchp2p FAILs on gloo and NCCL). verl sets False itself; so do we.
        batch_p2p_comm=False,
        # fusions off by default: correct everywhere (CPU, no TE); GPU recipes turn them on explicitly
        apply_rope_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
    )
    kw.update(_rope_kwargs(hf_config))
    if experts:
        n_group = g("n_group", 1) or 1
        kw.update(
            num_moe_experts=experts,
            moe_router_topk=g("num_experts_per_tok"),
            moe_ffn_hidden_size=g("moe_intermediate_size"),
            moe_shared_expert_intermediate_size=(g("n_shared_experts", 0) or 0) * g("moe_intermediate_size") or None,
            moe_layer_freq=moe_layer_pattern(hf_config),
            moe_router_score_function="sigmoid",
            moe_router_enable_expert_bias=True,
            moe_router_topk_scaling_factor=float(g("routed_scaling_factor", 1.0)),
            moe_router_num_groups=n_group if n_group > 1 else None,
            moe_router_group_topk=(g("topk_group") if n_group > 1 else None),
            moe_router_pre_softmax=False,
            moe_router_bias_update_rate=router.bias_update_rate,
            moe_router_load_balancing_type=router.load_balancing_type,
            moe_aux_loss_coeff=router.aux_loss_coeff,
            moe_router_dtype=router.router_dtype,
            moe_token_dispatcher_type=parallel.dispatcher,
            moe_grouped_gemm=False,
            moe_shared_expert_overlap=False,
        )
    mtp = g("num_nextn_predict_layers", 0) or 0
    if keep_mtp and mtp:
        kw.update(mtp_num_layers=mtp, mtp_loss_scaling_factor=0.1)
    if overrides:  # (megatron-core only to check them: the launcher's checks call this without, issue 28)
        from megatron.core.transformer.transformer_config import MLATransformerConfig

        fields = {f.name for f in dataclasses.fields(MLATransformerConfig)}
        unknown = sorted(set(overrides) - fields)
        if unknown:
            raise UnsupportedConfigError(f"override key(s) {unknown} are not MLATransformerConfig fields")
        kw.update(overrides)
    return kw


def hf_to_mcore_config(hf_config: Any, parallel: Parallel = Parallel(), router: RouterSettings = RouterSettings(),
                       dtype: torch.dtype = torch.bfloat16, keep_mtp: bool = False, **overrides: Any):
    """``MLATransformerConfig`` for an HF DeepSeek-V3 config (a transformers config object or a dict)."""
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    return MLATransformerConfig(**hf_to_mcore_kwargs(hf_config, parallel, router, dtype, keep_mtp, **overrides))


def gpt_model_kwargs(hf_config: Any) -> dict:
    """Arguments for ``GPTModel`` besides config and spec (vocab, positions, untied embeddings)."""
    return dict(
        vocab_size=_get(hf_config, "vocab_size"),
        max_sequence_length=_get(hf_config, "max_position_embeddings"),
        position_embedding_type="rope",  # ignored for MLA (attention applies its own yarn rope); as Megatron-LM recipes
        share_embeddings_and_output_weights=False,
    )

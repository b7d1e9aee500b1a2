"""Model facts for the planner, read from an HF DeepSeek-V3 config, and exact parameter counts.

The planner takes every shape from the config object (transformers ``DeepseekV3Config``, a dict,
a ``config.json`` path or a model preset name of :mod:`dsv3_rl.models.presets`, the one place that
holds DeepSeek-V3's facts); nothing about DeepSeek-V3 is hard-coded here.

Parameter counting follows the HF module tree of ``DeepseekV3ForCausalLM`` (what the checkpoint
holds). How megatron-core shards each tensor on a GPU is in :mod:`dsv3_rl.planner.memory`.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Any

from dsv3_rl.models import presets as model_presets

#: The fields read from the HF config (``ModelSpec.from_hf`` fails naming any that is missing).
REQUIRED_KEYS = (
    "num_hidden_layers", "hidden_size", "vocab_size", "num_attention_heads", "kv_lora_rank",
    "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "intermediate_size",
)

@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """The shapes the planner needs (names follow the HF DeepseekV3Config keys)."""

    name: str
    num_layers: int
    hidden: int
    vocab: int
    num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_dim: int
    qk_rope_dim: int
    v_head_dim: int
    dense_ffn: int
    moe_ffn: int
    num_experts: int
    num_shared_experts: int
    topk: int
    first_k_dense: int
    moe_layer_freq: int = 1
    mtp_layers: int = 0
    tie_embeddings: bool = False
    max_position_embeddings: int = 4096

    # --- structure ---
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_dim + self.qk_rope_dim

    @property
    def shared_ffn(self) -> int:
        return self.num_shared_experts * self.moe_ffn

    def is_moe_layer(self, i: int) -> bool:
        """HF: ``n_routed_experts and i >= first_k_dense_replace and i % moe_layer_freq == 0``."""
        return bool(self.num_experts) and i >= self.first_k_dense and i % self.moe_layer_freq == 0

    @property
    def num_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.num_layers))

    @property
    def num_dense_layers(self) -> int:
        return self.num_layers - self.num_moe_layers

    # --- per-module parameter counts (full, unsharded) ---
    def attn_params(self) -> dict[str, int]:
        """MLA tensors of one layer, HF names; the two down projections are what megatron keeps
        replicated across TP (TE spec), the rest is TP-split."""
        h, nh = self.hidden, self.num_heads
        d = {}
        if self.q_lora_rank:
            d["q_a_proj"] = h * self.q_lora_rank
            d["q_a_layernorm"] = self.q_lora_rank
            d["q_b_proj"] = self.q_lora_rank * nh * self.qk_head_dim
        else:
            d["q_proj"] = h * nh * self.qk_head_dim
        d["kv_a_proj_with_mqa"] = h * (self.kv_lora_rank + self.qk_rope_dim)
        d["kv_a_layernorm"] = self.kv_lora_rank
        d["kv_b_proj"] = self.kv_lora_rank * nh * (self.qk_nope_dim + self.v_head_dim)
        d["o_proj"] = nh * self.v_head_dim * h
        d["input_layernorm"] = h
        return d

    def dense_mlp_params(self) -> int:
        return 3 * self.hidden * self.dense_ffn + self.hidden  # gate, up, down + post_attention_layernorm

    def expert_params(self) -> int:
        """One routed expert (gate, up, down)."""
        return 3 * self.hidden * self.moe_ffn

    def moe_nonexpert_params(self) -> int:
        """Router + shared experts + post_attention_layernorm of one MoE layer."""
        return self.num_experts * self.hidden + 3 * self.hidden * self.shared_ffn + self.hidden

    def layer_params(self, i: int) -> int:
        p = sum(self.attn_params().values())
        if self.is_moe_layer(i):
            return p + self.moe_nonexpert_params() + self.num_experts * self.expert_params()
        return p + self.dense_mlp_params()

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    def mtp_layer_params(self, with_embeddings: bool = False) -> int:
        """One MTP module: enorm, hnorm, eh_proj (2h -> h), a MoE decoder layer, shared_head norm;
        the HF checkpoint also stores its own embed_tokens and shared_head.head copy
        (``with_embeddings``), megatron shares them with the main model."""
        h = self.hidden
        p = 2 * h + 2 * h * h + self.layer_params(self.num_layers) + h
        if with_embeddings:
            p += 2 * self.embedding_params
        return p

    @classmethod
    def from_hf(cls, cfg: Any, name: str | None = None) -> ModelSpec:
        g = (lambda k, d=None: cfg.get(k, d)) if isinstance(cfg, dict) else (lambda k, d=None: getattr(cfg, k, d))
        missing = [k for k in REQUIRED_KEYS if g(k) is None]
        if missing:
            raise ValueError(f"model config {name or ''!s} lacks required key(s) {missing}; "
                             f"the planner needs {list(REQUIRED_KEYS)} (an HF DeepseekV3Config)")
        experts = g("n_routed_experts") or 0
        return cls(
            name=name or g("_name_or_path") or g("model_type") or "model",
            num_layers=int(g("num_hidden_layers")),
            hidden=int(g("hidden_size")),
            vocab=int(g("vocab_size")),
            num_heads=int(g("num_attention_heads")),
            q_lora_rank=g("q_lora_rank") or None,
            kv_lora_rank=int(g("kv_lora_rank")),
            qk_nope_dim=int(g("qk_nope_head_dim")),
            qk_rope_dim=int(g("qk_rope_head_dim")),
            v_head_dim=int(g("v_head_dim")),
            dense_ffn=int(g("intermediate_size")),
            moe_ffn=int(g("moe_intermediate_size") or 0),
            num_experts=int(experts),
            num_shared_experts=int(g("n_shared_experts") or 0),
            topk=int(g("num_experts_per_tok") or 0),
            first_k_dense=int(g("first_k_dense_replace") or 0),
            moe_layer_freq=int(g("moe_layer_freq") or 1),
            mtp_layers=int(g("num_nextn_predict_layers") or 0),
            tie_embeddings=bool(g("tie_word_embeddings") or False),
            max_position_embeddings=int(g("max_position_embeddings") or 4096),
        )

    def to_hf(self) -> dict[str, Any]:
        """The HF config keys :meth:`from_hf` reads, back from this spec (for code that expands HF tensor names,
        e.g. :func:`dsv3_rl.refit.fp8_layout.reference_layout`)."""
        return {"num_hidden_layers": self.num_layers, "hidden_size": self.hidden, "vocab_size": self.vocab,
                "num_attention_heads": self.num_heads, "q_lora_rank": self.q_lora_rank,
                "kv_lora_rank": self.kv_lora_rank, "qk_nope_head_dim": self.qk_nope_dim,
                "qk_rope_head_dim": self.qk_rope_dim, "v_head_dim": self.v_head_dim,
                "intermediate_size": self.dense_ffn, "moe_intermediate_size": self.moe_ffn,
                "n_routed_experts": self.num_experts, "n_shared_experts": self.num_shared_experts,
                "num_experts_per_tok": self.topk, "first_k_dense_replace": self.first_k_dense,
                "moe_layer_freq": self.moe_layer_freq, "num_nextn_predict_layers": self.mtp_layers,
                "tie_word_embeddings": self.tie_embeddings, "max_position_embeddings": self.max_position_embeddings}


@dataclasses.dataclass(frozen=True)
class ParamCount:
    total: int            # main model (embeddings, 61 layers, final norm, lm_head), no MTP
    activated: int        # per token: everything but the (num_experts - topk) unused routed experts
    mtp: int              # MTP module(s) as megatron builds them (embedding/head shared)
    mtp_checkpoint: int   # MTP as the HF checkpoint stores it (own embed_tokens + head copies)
    experts: int          # routed-expert params (all layers)
    embeddings: int       # embed_tokens + lm_head

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


@functools.lru_cache(maxsize=64)
def count_params(m: ModelSpec) -> ParamCount:
    layers = sum(m.layer_params(i) for i in range(m.num_layers))
    emb = m.embedding_params * (1 if m.tie_embeddings else 2)
    total = layers + emb + m.hidden  # + final norm
    experts = m.num_moe_layers * m.num_experts * m.expert_params()
    activated = total - m.num_moe_layers * (m.num_experts - m.topk) * m.expert_params()
    mtp = m.mtp_layers * m.mtp_layer_params()
    mtp_ckpt = m.mtp_layers * m.mtp_layer_params(with_embeddings=True)
    return ParamCount(total=total, activated=activated, mtp=mtp, mtp_checkpoint=mtp_ckpt, experts=experts,
                      embeddings=emb)


def preset_names() -> list[str]:
    return sorted(set(model_presets.list_presets()) | set(model_presets.ALIASES))


def _preset_config(name: str) -> dict:
    """Config kwargs of a model preset (without importing transformers)."""
    try:
        return model_presets.preset_kwargs(name)
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}; known: {preset_names()} "
                         f"(or pass an HF config.json path)") from None


def load_model(model: Any) -> ModelSpec:
    """A :class:`ModelSpec` from a ModelSpec, a preset name, a ``config.json`` path (or a folder
    holding one), a dict, or a transformers config object."""
    if isinstance(model, ModelSpec):
        return model
    if isinstance(model, str) and model in _SPEC_CACHE:
        return _SPEC_CACHE[model]
    if isinstance(model, (str, Path)):
        p = Path(model)
        if p.is_dir():
            p = p / "config.json"
        if p.suffix == ".json" or p.exists():
            from dsv3_rl.checkpoint.hf_config import load_config
            from dsv3_rl.models.hf_config_rules import validate_config

            cfg = load_config(p, family=False)  # ConfigError naming the file: missing, not JSON, not an object
            validate_config(cfg, str(p), require=False)  # ConfigError (a ValueError) naming the key
            return ModelSpec.from_hf(cfg, name=str(model))
        spec = ModelSpec.from_hf(_preset_config(str(model)), name=str(model))
        _SPEC_CACHE[str(model)] = spec
        return spec
    return ModelSpec.from_hf(model)


_SPEC_CACHE: dict[str, ModelSpec] = {}

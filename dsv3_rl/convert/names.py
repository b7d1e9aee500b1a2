"""Every DeepSeek-V3 tensor, by name and shape, on both sides: HF (hub layout) and megatron-core.

The megatron side is the *global* (unsharded) tensor under its ``dist_checkpointing`` key, i.e.
what megatron-core's ``sharded_state_dict()`` calls it at any TP/PP/EP/ETP/VPP layout (DeepSeek-V3
has dense and MoE layers, so megatron uses non-homogeneous layer keys with global layer numbers and
no layer axis). One global tensor is what any layout reads its shards from, so a checkpoint written
from this table loads at every layout.

Layout rules (checked against megatron-core 0.16.1's own ``sharded_state_dict()`` by the tests):

* ``linear_fc1`` (dense MLP and shared experts) = ``cat(gate_proj, up_proj)`` along rows. megatron's
  swiglu sharded factory stores the gate half and the up half each sharded over TP, so the global
  tensor is the full gate stacked on the full up, whatever the TP of the model that reads it.
* routed experts: one tensor per layer, ``mlp.experts.experts.linear_fc{1,2}.weight``, shape
  ``[E, ...]``; expert ``e``'s ``linear_fc1`` is ``cat(gate_e, up_e)``.
* ``mlp.router.weight`` = HF ``mlp.gate.weight``; ``mlp.router.expert_bias`` = HF
  ``mlp.gate.e_score_correction_bias``.
* MLA: ``linear_q_down_proj`` = ``q_a_proj``, ``linear_q_up_proj`` = ``q_b_proj`` (per head: nope
  then rope rows, as megatron splits them), ``linear_kv_down_proj`` = ``kv_a_proj_with_mqa``
  (kv_lora_rank rows then the rope rows), ``linear_kv_up_proj`` = ``kv_b_proj`` (per head: k_nope
  then v rows), ``linear_proj`` = ``o_proj``. No permutation: megatron's MLA de-interleaves the
  rope dims exactly like HF with ``rope_interleave=True`` (verified by logits, not by reasoning).
* Norm names differ between megatron's two layer specs. Local spec: ``self_attention.q_layernorm``,
  ``self_attention.kv_layernorm``, ``pre_mlp_layernorm``. Transformer Engine spec: the q/kv latent
  norms are fused into ``linear_q_up_proj.layer_norm_weight`` / ``linear_kv_up_proj.layer_norm_weight``
  and a dense layer's pre-MLP norm into ``mlp.linear_fc1.layer_norm_weight`` (MoE layers keep
  ``pre_mlp_layernorm``). ``spec="both"`` writes both names (a few KB), so one checkpoint loads under
  either spec; readers accept either.
* ``_extra_state`` entries (ShardedObjects, ``None`` = no FP8 metadata) for every linear (and, for
  the TE spec, every norm): the model asks for them when it loads.
* MTP layer ``i`` (HF ``model.layers.{num_hidden_layers + i}``) -> ``mtp.layers.{i}``: ``enorm``,
  ``hnorm``, ``eh_proj`` (same [embedding; hidden] input order), ``shared_head.norm`` ->
  ``final_layernorm``, the transformer layer -> ``transformer_layer.*``. HF's per-MTP-layer
  ``embed_tokens`` and ``shared_head.head`` are megatron's shared embedding / output layer; they must
  equal the main ones (checked when converting).
"""

from __future__ import annotations

import dataclasses
from typing import Any
from collections.abc import Iterator

from dsv3_rl.errors import Dsv3Error

from dsv3_rl.models.config_map import _get

SPECS = ("both", "local", "te")


class MappingError(Dsv3Error, ValueError):
    """A tensor name, shape or layout the DeepSeek-V3 mapping does not accept (the message names it)."""


@dataclasses.dataclass(frozen=True)
class Item:
    """One megatron global tensor and where it comes from in HF.

    kind:
      ``copy``         key = hf[sources[0]]
      ``glu``          key = cat(hf[sources[0]] (gate), hf[sources[1]] (up)), dim 0
      ``experts``      key[e] = hf[sources[e]]
      ``experts_glu``  key[e] = cat(hf[sources[2e]], hf[sources[2e+1]]), dim 0
    """

    key: str
    shape: tuple[int, ...]
    kind: str
    sources: tuple[str, ...]
    aliases: tuple[str, ...] = ()
    """More megatron keys holding the very same tensor (the TE spec's fused-norm names)."""
    layer: str = "model"
    """Grouping for progress/assignment: 'embedding', 'decoder.layers.N', 'mtp.layers.N', 'final'."""

    @property
    def keys(self) -> tuple[str, ...]:
        return (self.key, *self.aliases)

    def hf_views(self) -> Iterator[tuple[str, int | None, int, int]]:
        """(hf name, expert index or None, first row, end row) of this item's global tensor."""
        if self.kind == "copy":
            yield self.sources[0], None, 0, self.shape[0]
        elif self.kind == "glu":
            half = self.shape[0] // 2
            yield self.sources[0], None, 0, half
            yield self.sources[1], None, half, self.shape[0]
        elif self.kind == "experts":
            for e, name in enumerate(self.sources):
                yield name, e, 0, self.shape[1]
        elif self.kind == "experts_glu":
            half = self.shape[1] // 2
            for e in range(self.shape[0]):
                yield self.sources[2 * e], e, 0, half
                yield self.sources[2 * e + 1], e, half, self.shape[1]
        else:  # pragma: no cover - constructed here only
            raise AssertionError(self.kind)


@dataclasses.dataclass(frozen=True)
class ExtraState:
    """A megatron ``_extra_state`` ShardedObject: key, global shape, global offset."""

    key: str
    shape: tuple[int, ...]
    offset: tuple[int, ...]

    @property
    def unique_key(self) -> str:
        return f"{self.key}/shard_{'.'.join(map(str, self.offset))}_{'.'.join(map(str, self.shape))}"


@dataclasses.dataclass
class Plan:
    """The full HF <-> megatron mapping for one config."""

    items: list[Item]
    extra_states: list[ExtraState]
    hf_shapes: dict[str, tuple[int, ...]]
    """Every HF tensor the converter reads (hf->mcore) or writes (mcore->hf), with its shape."""
    hf_ignored: dict[str, str]
    """HF tensors present in a checkpoint that are deliberately not converted -> why."""
    mtp_duplicates: dict[str, str]
    """HF MTP tensors that duplicate a main tensor (name -> main name); must be equal."""
    spec: str

    def item_by_key(self) -> dict[str, Item]:
        return {k: it for it in self.items for k in it.keys}


def _dims(cfg: Any) -> dict[str, int]:
    g = lambda k, d=None: _get(cfg, k, d)  # noqa: E731
    d = dict(
        V=g("vocab_size"), H=g("hidden_size"), I=g("intermediate_size"), L=g("num_hidden_layers"),
        n=g("num_attention_heads"), q_lora=g("q_lora_rank"), kv_lora=g("kv_lora_rank"),
        nope=g("qk_nope_head_dim"), rope=g("qk_rope_head_dim"), v=g("v_head_dim"),
        E=g("n_routed_experts") or 0, Fm=g("moe_intermediate_size") or 0, ns=g("n_shared_experts") or 0,
        mtp=g("num_nextn_predict_layers", 0) or 0,
    )
    missing = [k for k, v in d.items() if v is None and k != "q_lora"]
    if missing:
        raise MappingError(f"HF config lacks {missing} (abbreviations of the DeepSeek-V3 config keys)")
    return d


def _layer(cfg: Any, d: dict[str, int], hf: str, mc: str, moe: bool, spec: str, group: str,
           hf_shapes: dict, items: list, extras: list) -> None:
    """HF layer prefix ``hf`` (``model.layers.3.``) -> megatron prefix ``mc`` (``decoder.layers.3.``)."""
    H, n = d["H"], d["n"]
    te, local = spec in ("te", "both"), spec in ("local", "both")

    def add(key, shape, kind, sources, aliases=(), extra=True):
        items.append(Item(key, tuple(shape), kind, tuple(sources), tuple(aliases), group))
        if extra and key.endswith(".weight") and kind in ("copy", "glu"):
            extras.append(ExtraState(key[: -len("weight")] + "_extra_state", (1,), (0,)))

    def hfw(name, shape):
        hf_shapes[hf + name] = tuple(shape)
        return hf + name

    def norm(local_key, te_key, src, size, te_extra):
        keys = ([local_key] if local else []) + ([te_key] if te and te_key != local_key else [])
        add(mc + keys[0], (size,), "copy", [src], [mc + k for k in keys[1:]], extra=False)
        if te and te_extra:
            extras.append(ExtraState(mc + te_key[: -len("weight")] + "_extra_state", (1,), (0,)))

    norm("input_layernorm.weight", "input_layernorm.weight", hfw("input_layernorm.weight", [H]), H, True)
    q_head = d["nope"] + d["rope"]
    if d["q_lora"]:
        add(mc + "self_attention.linear_q_down_proj.weight", [d["q_lora"], H], "copy",
            [hfw("self_attn.q_a_proj.weight", [d["q_lora"], H])])
        norm("self_attention.q_layernorm.weight", "self_attention.linear_q_up_proj.layer_norm_weight",
             hfw("self_attn.q_a_layernorm.weight", [d["q_lora"]]), d["q_lora"], False)
        add(mc + "self_attention.linear_q_up_proj.weight", [n * q_head, d["q_lora"]], "copy",
            [hfw("self_attn.q_b_proj.weight", [n * q_head, d["q_lora"]])])
    else:
        add(mc + "self_attention.linear_q_proj.weight", [n * q_head, H], "copy",
            [hfw("self_attn.q_proj.weight", [n * q_head, H])])
    kv_a = d["kv_lora"] + d["rope"]
    add(mc + "self_attention.linear_kv_down_proj.weight", [kv_a, H], "copy",
        [hfw("self_attn.kv_a_proj_with_mqa.weight", [kv_a, H])])
    norm("self_attention.kv_layernorm.weight", "self_attention.linear_kv_up_proj.layer_norm_weight",
         hfw("self_attn.kv_a_layernorm.weight", [d["kv_lora"]]), d["kv_lora"], False)
    kv_b = n * (d["nope"] + d["v"])
    add(mc + "self_attention.linear_kv_up_proj.weight", [kv_b, d["kv_lora"]], "copy",
        [hfw("self_attn.kv_b_proj.weight", [kv_b, d["kv_lora"]])])
    add(mc + "self_attention.linear_proj.weight", [H, n * d["v"]], "copy",
        [hfw("self_attn.o_proj.weight", [H, n * d["v"]])])
    post = hfw("post_attention_layernorm.weight", [H])
    if not moe:
        norm("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight", post, H, False)
        I = d["I"]  # noqa: E741
        add(mc + "mlp.linear_fc1.weight", [2 * I, H], "glu",
            [hfw("mlp.gate_proj.weight", [I, H]), hfw("mlp.up_proj.weight", [I, H])])
        add(mc + "mlp.linear_fc2.weight", [H, I], "copy", [hfw("mlp.down_proj.weight", [H, I])])
        return
    norm("pre_mlp_layernorm.weight", "pre_mlp_layernorm.weight", post, H, True)
    E, Fm = d["E"], d["Fm"]
    add(mc + "mlp.router.weight", [E, H], "copy", [hfw("mlp.gate.weight", [E, H])], extra=False)
    add(mc + "mlp.router.expert_bias", [E], "copy", [hfw("mlp.gate.e_score_correction_bias", [E])], extra=False)
    fc1 = []
    fc2 = []
    for e in range(E):
        fc1 += [hfw(f"mlp.experts.{e}.gate_proj.weight", [Fm, H]), hfw(f"mlp.experts.{e}.up_proj.weight", [Fm, H])]
        fc2.append(hfw(f"mlp.experts.{e}.down_proj.weight", [H, Fm]))
    add(mc + "mlp.experts.experts.linear_fc1.weight", [E, 2 * Fm, H], "experts_glu", fc1)
    add(mc + "mlp.experts.experts.linear_fc2.weight", [E, H, Fm], "experts", fc2)
    for fc in ("linear_fc1", "linear_fc2"):
        for e in range(E):
            extras.append(ExtraState(mc + f"mlp.experts.experts.{fc}._extra_state", (E,), (e,)))
    if d["ns"]:
        Fs = d["ns"] * Fm
        add(mc + "mlp.shared_experts.linear_fc1.weight", [2 * Fs, H], "glu",
            [hfw("mlp.shared_experts.gate_proj.weight", [Fs, H]), hfw("mlp.shared_experts.up_proj.weight", [Fs, H])])
        add(mc + "mlp.shared_experts.linear_fc2.weight", [H, Fs], "copy",
            [hfw("mlp.shared_experts.down_proj.weight", [H, Fs])])


def build_plan(hf_config: Any, keep_mtp: bool = False, spec: str = "both") -> Plan:
    """The mapping for ``hf_config`` (a dict or a transformers config).

    ``keep_mtp``: convert the ``num_nextn_predict_layers`` MTP layers (else they are skipped on
    hf->mcore and absent on mcore->hf). ``spec``: which megatron norm names to write
    (``both`` | ``local`` | ``te``, see the module docstring).
    """
    from dsv3_rl.models.config_map import moe_layer_pattern, validate

    if spec not in SPECS:
        raise MappingError(f"spec={spec!r}; allowed: {', '.join(SPECS)}")
    validate(hf_config)
    d = _dims(hf_config)
    V, H = d["V"], d["H"]
    pattern = moe_layer_pattern(hf_config)
    items: list[Item] = []
    extras: list[ExtraState] = []
    hf_shapes: dict[str, tuple[int, ...]] = {}
    ignored: dict[str, str] = {}
    dups: dict[str, str] = {}

    hf_shapes["model.embed_tokens.weight"] = (V, H)
    items.append(Item("embedding.word_embeddings.weight", (V, H), "copy", ("model.embed_tokens.weight",), (), "embedding"))
    for i in range(d["L"]):
        _layer(hf_config, d, f"model.layers.{i}.", f"decoder.layers.{i}.", bool(pattern[i]), spec,
               f"decoder.layers.{i}", hf_shapes, items, extras)
    hf_shapes["model.norm.weight"] = (H,)
    items.append(Item("decoder.final_layernorm.weight", (H,), "copy", ("model.norm.weight",), (), "final"))
    if spec in ("te", "both"):
        extras.append(ExtraState("decoder.final_layernorm._extra_state", (1,), (0,)))
    hf_shapes["lm_head.weight"] = (V, H)
    items.append(Item("output_layer.weight", (V, H), "copy", ("lm_head.weight",), (), "final"))

    for i in range(d["mtp"]):
        hf = f"model.layers.{d['L'] + i}."
        mtp_names: dict[str, tuple[int, ...]] = {}
        mtp_items: list[Item] = []
        mtp_extras: list[ExtraState] = []
        moe = bool(d["E"]) and (d["L"] + i) >= (_get(hf_config, "first_k_dense_replace", 0) or 0)
        _layer(hf_config, d, hf, f"mtp.layers.{i}.transformer_layer.", moe, spec, f"mtp.layers.{i}",
               mtp_names, mtp_items, mtp_extras)
        mc = f"mtp.layers.{i}."
        for name, shape in (("enorm.weight", (H,)), ("hnorm.weight", (H,)), ("shared_head.norm.weight", (H,))):
            mtp_names[hf + name] = shape
            key = mc + ("final_layernorm.weight" if name.startswith("shared_head") else name)
            mtp_items.append(Item(key, shape, "copy", (hf + name,), (), f"mtp.layers.{i}"))
            if spec in ("te", "both"):
                mtp_extras.append(ExtraState(key[: -len("weight")] + "_extra_state", (1,), (0,)))
        mtp_names[hf + "eh_proj.weight"] = (H, 2 * H)
        mtp_items.append(Item(mc + "eh_proj.weight", (H, 2 * H), "copy", (hf + "eh_proj.weight",), (), f"mtp.layers.{i}"))
        mtp_extras.append(ExtraState(mc + "eh_proj._extra_state", (1,), (0,)))
        dup = {hf + "embed_tokens.weight": "model.embed_tokens.weight", hf + "shared_head.head.weight": "lm_head.weight"}
        if keep_mtp:
            hf_shapes.update(mtp_names)
            items += mtp_items
            extras += mtp_extras
            for name, main in dup.items():
                hf_shapes[name] = (V, H)
                dups[name] = main
        else:
            for name in [*mtp_names, *dup]:
                ignored[name] = "MTP layer (dropped; keep it with --keep-mtp)"
    return Plan(items, extras, hf_shapes, ignored, dups, spec)
